import Foundation
import Threads

/// The engine's queue of work: many producers (sessions), one consumer (the engine
/// thread), which takes everything waiting at once so that it becomes one batch (and,
/// while it waits for a commit, takes out the reads it answers at once: `takeOut`).
final class Inbox<Item>: Sendable {
    private let items = Locked<[Item]>([])

    func put(_ item: Item) {
        put(contentsOf: CollectionOfOne(item))
    }

    /// Several items at once: `take` gets all or none of them.
    func put(contentsOf newItems: some Collection<Item>) {
        items.change { $0.append(contentsOf: newItems) }
    }

    /// Puts items taken and not done back in front of everything, in their order (a
    /// batch that is full leaves them to the next).
    func putBack(_ returned: some Collection<Item>) {
        items.withLock { $0.insert(contentsOf: returned, at: 0) }
    }

    /// Takes out, without waiting, the items after the first `examined` that `pick`
    /// chooses, of sessions (`session`: nil for work of no session, never chosen) not in
    /// `blocked`, which holds the sessions with work left in the inbox: what a session
    /// put in keeps its order. `examined` moves past what was looked at (each item is
    /// looked at once) and `blocked` takes the sessions of what is left.
    func takeOut(
        examined: inout Int, blocked: inout Set<ObjectIdentifier>, session: (Item) -> ObjectIdentifier?, pick: (Item) -> Bool
    ) -> [Item] {
        items.withLock { items in
            guard items.count > examined else { return [] }
            var taken: [Item] = []
            var kept: [Item] = []
            for item in items[examined...] {
                let owner = session(item)
                if let owner, !blocked.contains(owner), pick(item) {
                    taken.append(item)
                } else {
                    if let owner { blocked.insert(owner) }
                    kept.append(item)
                }
            }
            if !taken.isEmpty { items.replaceSubrange(examined..., with: kept) }
            examined = items.count
            return taken
        }
    }

    /// Blocks until there is work (or `waitingAtMost` seconds passed: then it may return
    /// nothing), then takes up to `limit` items.
    func take(limit: Int, waitingAtMost seconds: Double? = nil) -> [Item] {
        items.wait(until: { !$0.isEmpty }, deadline: seconds.map { Date(timeIntervalSinceNow: $0) }) { items in
            if items.count <= limit {
                let taken = items
                items.removeAll(keepingCapacity: true)
                return taken
            }
            let taken = Array(items.prefix(limit))
            items.removeFirst(limit)
            return taken
        }
    }
}
