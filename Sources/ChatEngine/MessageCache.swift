import CMalloc

/// The messages the engine keeps in memory: the most recently used ones, up to a budget
/// of bytes (`--cache-mb`), never one with changes the store does not have yet
/// (engine thread only).
///
/// It is trimmed only between work items, so that a request sees one record per message
/// for as long as it runs.
final class MessageCache {
    struct Key: Hashable {
        let chat: Int64
        let id: Int64
    }

    private final class Node {
        let key: Key
        let record: MessageRecord
        var size: Int
        // `nodes` alone owns the nodes (a node in the list is always in it): strong links
        // would make a cycle that leaks every record when the cache is dropped, and a
        // chain whose release recurses once per node.
        unowned(unsafe) var newer: Node?
        unowned(unsafe) var older: Node?

        init(key: Key, record: MessageRecord, size: Int) {
            self.key = key
            self.record = record
            self.size = size
        }
    }

    /// Bytes the cached records may take with their place in the cache: each counts its
    /// `MessageRecord.footprint` and `entryBytes`.
    let budget: Int
    private var nodes: [Key: Node] = [:]
    private var newest: Node?
    private var oldest: Node?
    private(set) var bytes = 0
    /// Records with changes not committed yet, with the latest batch that changed each:
    /// never evicted.
    private var pinned: [Key: Int] = [:]
    /// The keys each batch pinned, oldest batch first: what `unpin(through:)` looks at,
    /// so that it costs what those batches changed, not what every batch in flight did
    /// (it used to filter all of `pinned` for each commit: 7% of the engine thread).
    private var pinnedBy: [(batch: Int, keys: [Key])] = []

    init(budget: Int) {
        self.budget = budget
    }

    /// What a record's place in the cache takes: its node, and its key and node in the
    /// table (whose buckets are between 3/8 and 3/4 full: twice the entry on average).
    static let entryBytes =
        Heap.bytes(ofObject: Node(key: Key(chat: 0, id: 0), record: MessageRecord.sample, size: 0))
        + 2 * (MemoryLayout<Key>.stride + MemoryLayout<Node>.stride)

    /// What a cached record counts against the budget now.
    private static func size(of record: MessageRecord) -> Int {
        record.footprint + entryBytes
    }

    var count: Int { nodes.count }

    func get(chat: Int64, id: Int64) -> MessageRecord? {
        guard let node = nodes[Key(chat: chat, id: id)] else { return nil }
        moveToNewest(node)
        return node.record
    }

    /// Adds a record (a newer one for the same message replaces it).
    func put(_ record: MessageRecord) {
        let key = Key(chat: record.chat, id: record.id)
        if let existing = nodes[key] {
            unlink(existing)
            bytes -= existing.size
        }
        let node = Node(key: key, record: record, size: MessageCache.size(of: record))
        nodes[key] = node
        bytes += node.size
        linkAsNewest(node)
    }

    /// The record has changes the store does not have yet, made by batch `batch` (the
    /// batch being decided, the newest): kept until `unpin(through:)` that batch.
    func pin(_ record: MessageRecord, batch: Int) {
        let key = Key(chat: record.chat, id: record.id)
        if nodes[key]?.record !== record { put(record) }
        guard pinned.updateValue(batch, forKey: key) != batch else { return }
        if pinnedBy.last?.batch == batch {
            pinnedBy[pinnedBy.count - 1].keys.append(key)
        } else {
            pinnedBy.append((batch, [key]))
        }
    }

    /// Batches up to `batch` were committed: what only they changed is no longer pinned
    /// (a later batch being decided while they committed keeps its own). The records
    /// that were (they changed) are measured again.
    func unpin(through batch: Int) {
        while let first = pinnedBy.first, first.batch <= batch {
            pinnedBy.removeFirst()
            for key in first.keys {
                // Pinned again by a later batch: that one keeps it.
                guard let pinnedBy = pinned[key], pinnedBy <= batch else { continue }
                pinned[key] = nil
                if let node = nodes[key] {
                    let size = MessageCache.size(of: node.record)
                    bytes += size - node.size
                    node.size = size
                }
            }
        }
    }

    /// Evicts the least recently used records until the budget holds (pinned ones stay).
    func trim() {
        var node = oldest
        while bytes > budget, let current = node {
            node = current.newer
            guard pinned[current.key] == nil else { continue }
            unlink(current)
            nodes[current.key] = nil
            bytes -= current.size
        }
    }

    /// Forgets the records of these chats, pinned or not (memory of them is read again).
    func remove(chats: Set<Int64>) {
        var node = oldest
        while let current = node {
            node = current.newer
            guard chats.contains(current.key.chat) else { continue }
            forget(current)
        }
    }

    /// Forgets these records of `chat`, pinned or not.
    func remove(chat: Int64, ids: Set<Int64>) {
        for id in ids {
            if let node = nodes[Key(chat: chat, id: id)] { forget(node) }
        }
    }

    /// Takes `node`'s record out of the cache, pinned or not.
    private func forget(_ node: Node) {
        unlink(node)
        nodes[node.key] = nil
        pinned[node.key] = nil
        bytes -= node.size
    }

    func removeAll() {
        nodes.removeAll()
        pinned.removeAll()
        pinnedBy.removeAll()
        newest = nil
        oldest = nil
        bytes = 0
    }

    private func moveToNewest(_ node: Node) {
        guard newest !== node else { return }
        unlink(node)
        linkAsNewest(node)
    }

    private func linkAsNewest(_ node: Node) {
        node.older = newest
        node.newer = nil
        newest?.newer = node
        newest = node
        if oldest == nil { oldest = node }
    }

    private func unlink(_ node: Node) {
        node.newer?.older = node.older
        node.older?.newer = node.newer
        if newest === node { newest = node.older }
        if oldest === node { oldest = node.newer }
        node.newer = nil
        node.older = nil
    }
}

/// What values take from the heap, as malloc hands it out: the cache counts these, so that
/// `--cache-mb` is what the records it keeps really take (their texts included).
enum Heap {
    /// A block asked for `size` bytes: glibc's malloc adds a word and rounds up to 16
    /// (32 at least).
    static func bytes(ofAllocation size: Int) -> Int {
        max(32, (size + 8 + 15) & ~15)
    }

    /// A string's text: nothing when it is kept inline (up to 15 bytes of UTF-8), else its
    /// storage (a 32-byte header, the bytes and a NUL).
    static func bytes(of string: String?) -> Int {
        guard let count = string?.utf8.count, count > 15 else { return 0 }
        return bytes(ofAllocation: 32 + count + 1)
    }

    /// An array's storage: a 32-byte header, then the elements.
    static func bytes(ofArray count: Int, stride: Int) -> Int {
        bytes(ofAllocation: 32 + count * stride)
    }

    /// A dictionary's storage: a header, a power of two of buckets at most 3/4 full, each
    /// with room for a key and a value, and a bit per bucket.
    static func bytes(ofTable count: Int, stride: Int) -> Int {
        var buckets = 1
        while buckets * 3 < count * 4 { buckets <<= 1 }
        return bytes(ofAllocation: 72 + buckets * stride + (buckets + 63) / 64 * 8)
    }

    /// An object as allocated (its class's instance size, rounded by malloc).
    static func bytes(ofObject object: AnyObject) -> Int {
        let address = Unmanaged.passUnretained(object).toOpaque()
        #if canImport(Darwin)
            return malloc_size(address)
        #else
            return malloc_usable_size(address) + 8
        #endif
    }
}
