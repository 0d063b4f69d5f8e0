import Foundation

/// The engine's queue of work: many producers (sessions), one consumer (the engine
/// thread), which takes everything waiting at once so that it becomes one batch.
final class Inbox<Item>: @unchecked Sendable {
    private let condition = NSCondition()
    private var items: [Item] = []

    func put(_ item: Item) {
        put(contentsOf: CollectionOfOne(item))
    }

    /// Several items at once: `take` gets all or none of them.
    func put(contentsOf newItems: some Collection<Item>) {
        condition.lock()
        items.append(contentsOf: newItems)
        condition.signal()
        condition.unlock()
    }

    /// Puts items taken and not done back in front of everything, in their order (a
    /// batch that is full leaves them to the next).
    func putBack(_ returned: some Collection<Item>) {
        condition.lock()
        items.insert(contentsOf: returned, at: 0)
        condition.unlock()
    }

    /// Blocks until there is work (or `waitingAtMost` seconds passed: then it may return
    /// nothing), then takes up to `limit` items.
    func take(limit: Int, waitingAtMost seconds: Double? = nil) -> [Item] {
        condition.lock()
        defer { condition.unlock() }
        if let seconds {
            let deadline = Date(timeIntervalSinceNow: seconds)
            while items.isEmpty && condition.wait(until: deadline) {}
        } else {
            while items.isEmpty { condition.wait() }
        }
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
