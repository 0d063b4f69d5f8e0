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
    /// Records with changes not committed yet: never evicted.
    private var pinned: Set<Key> = []

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

    /// The record has changes the store does not have yet: kept until `unpinAll`.
    func pin(_ record: MessageRecord) {
        let key = Key(chat: record.chat, id: record.id)
        if nodes[key]?.record !== record { put(record) }
        pinned.insert(key)
    }

    /// Everything was committed (or memory was rebuilt): nothing is pinned. The records
    /// that were (they changed) are measured again.
    func unpinAll() {
        for key in pinned {
            guard let node = nodes[key] else { continue }
            let size = node.record.footprint
            bytes += size - node.size
            node.size = size
        }
        pinned.removeAll(keepingCapacity: true)
    }

    /// Evicts the least recently used records until the budget holds (pinned ones stay).
    func trim() {
        var node = oldest
        while bytes > budget, let current = node {
            node = current.newer
            guard !pinned.contains(current.key) else { continue }
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
