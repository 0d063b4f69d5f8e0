import Foundation
import Threads

/// The engine's queue of work: many producers (sessions), one consumer (the engine
/// thread), which takes everything waiting at once so that it becomes one batch.
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
