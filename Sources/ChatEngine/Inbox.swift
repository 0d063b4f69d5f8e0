import Foundation
import Threads

/// Whose turn a work item is taken in: one session's (each session's work stays in its
/// order, and sessions take turns), the engine's own work (one turn for all of it), a
/// wake-up that is nobody's turn, or a marker taken after everything put before it.
enum Turn: Hashable {
    case session(ObjectIdentifier)
    case engine
    case wakeUp
    case last
}

/// The engine's queue of work: many producers (sessions), one consumer (the engine
/// thread), which takes everything waiting at once so that it becomes one batch — in
/// turns, so that a session with much work waiting does not hold another's behind all of
/// it: each session's first item comes first, then each one's second, and so on.
final class Inbox<Item>: Sendable {
    private struct Waiting {
        var items: [Item] = []
        /// How many of `items`, at the front, are taken in the order they are in, not in
        /// turns (`putBack(_:inOrder:)`).
        var inOrder = 0
        /// How many of `items` each turn has (wake-ups and markers not counted).
        var turns: [Turn: Int] = [:]

        mutating func counting(_ items: some Collection<Item>, by turn: (Item) -> Turn, _ change: Int) {
            for item in items {
                let turn = turn(item)
                guard turn != .wakeUp, turn != .last else { continue }
                let count = turns[turn, default: 0] + change
                turns[turn] = count == 0 ? nil : count
            }
        }
    }

    private let waiting = Locked(Waiting())
    private let turn: @Sendable (Item) -> Turn
    /// Whether an item only reads: in its round, it goes before those that may write.
    private let readsOnly: @Sendable (Item) -> Bool

    init(turn: @escaping @Sendable (Item) -> Turn, readsOnly: @escaping @Sendable (Item) -> Bool) {
        self.turn = turn
        self.readsOnly = readsOnly
    }

    func put(_ item: Item) {
        put(contentsOf: CollectionOfOne(item))
    }

    /// Several items at once: `take` gets all or none of them.
    func put(contentsOf newItems: some Collection<Item>) {
        waiting.change {
            $0.items.append(contentsOf: newItems)
            $0.counting(newItems, by: turn, 1)
        }
    }

    /// Puts items taken and not done back in front of everything, in their order: a
    /// batch that ended early leaves them to the next, which takes them in turns again
    /// with what came since; `inOrder`, they are taken in this order (a batch decided
    /// again after a conflict is decided as it was).
    func putBack(_ returned: some Collection<Item>, inOrder: Bool = false) {
        waiting.withLock {
            $0.items.insert(contentsOf: returned, at: 0)
            $0.counting(returned, by: turn, 1)
            $0.inOrder = inOrder ? $0.inOrder + returned.count : 0
        }
    }

    /// Whether work of any turn but `turn` waits (wake-ups do not count): a batch that
    /// took its time then ends (`Engine.turnTime`).
    func holdsWork(besides turn: Turn) -> Bool {
        waiting.withLock { waiting in
            waiting.turns.count > 1 || (waiting.turns.count == 1 && waiting.turns[turn] == nil)
        }
    }

    /// Blocks until there is work (or `waitingAtMost` seconds passed: then it may return
    /// nothing), then takes up to `limit` items, in turns (`inTurns`).
    func take(limit: Int, waitingAtMost seconds: Double? = nil) -> [Item] {
        let (taken, inOrder) = waiting.wait(until: { !$0.items.isEmpty }, deadline: seconds.map { Date(timeIntervalSinceNow: $0) }) {
            waiting in
            let taken: [Item]
            if waiting.items.count <= limit {
                taken = waiting.items
                waiting.items.removeAll(keepingCapacity: true)
                waiting.turns.removeAll(keepingCapacity: true)
            } else {
                taken = Array(waiting.items.prefix(limit))
                waiting.items.removeFirst(limit)
                waiting.counting(taken, by: turn, -1)
            }
            let inOrder = min(waiting.inOrder, taken.count)
            waiting.inOrder -= inOrder
            return (taken, inOrder)
        }
        guard inOrder > 0 else { return inTurns(taken) }
        return Array(taken[..<inOrder]) + inTurns(Array(taken[inOrder...]))
    }

    /// `items` in turns: every turn's first item in the order they came (those that only
    /// read first), then every turn's second, and so on; markers (`Turn.last`) after all
    /// of them, in their order. Each turn's own items keep their order.
    func inTurns(_ items: [Item]) -> [Item] {
        guard items.count > 1 else { return items }
        let turns = items.map(turn)
        guard let first = turns.first(where: { $0 != .wakeUp }), turns.contains(where: { $0 != first && $0 != .wakeUp }) else {
            return items
        }
        var rounds: [Turn: Int] = [:]
        let ranked = turns.enumerated().map { index, turn -> (round: Int, writes: Int, index: Int) in
            switch turn {
            case .last: return (.max, 0, index)
            case .wakeUp: return (0, 1, index)
            default:
                let round = rounds[turn, default: 0]
                rounds[turn] = round + 1
                return (round, readsOnly(items[index]) ? 0 : 1, index)
            }
        }
        return ranked.sorted { ($0.round, $0.writes, $0.index) < ($1.round, $1.writes, $1.index) }.map { items[$0.index] }
    }
}
