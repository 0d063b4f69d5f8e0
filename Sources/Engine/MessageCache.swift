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

    /// Bytes the cached records may take (roughly: `MessageRecord.footprint`).
    let budget: Int
    private var nodes: [Key: Node] = [:]
    private var newest: Node?
    private var oldest: Node?
    private(set) var bytes = 0
    /// Records with changes not committed yet, with the latest batch that changed each:
    /// never evicted.
    private var pinned: [Key: Int] = [:]

    init(budget: Int) {
        self.budget = budget
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
        let node = Node(key: key, record: record, size: record.footprint)
        nodes[key] = node
        bytes += node.size
        linkAsNewest(node)
    }

    /// The record has changes the store does not have yet, made by batch `batch`: kept
    /// until `unpin(through:)` that batch.
    func pin(_ record: MessageRecord, batch: Int) {
        let key = Key(chat: record.chat, id: record.id)
        if nodes[key]?.record !== record { put(record) }
        pinned[key] = batch
    }

    /// Batches up to `batch` were committed: what only they changed is no longer pinned
    /// (a later batch being decided while they committed keeps its own). The records
    /// that were (they changed) are measured again.
    func unpin(through batch: Int) {
        pinned = pinned.filter { key, pinnedBy in
            guard pinnedBy <= batch else { return true }
            if let node = nodes[key] {
                let size = node.record.footprint
                bytes += size - node.size
                node.size = size
            }
            return false
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

    func removeAll() {
        nodes.removeAll()
        pinned.removeAll()
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
