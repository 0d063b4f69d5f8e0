import Testing

@testable import ChatEngine

/// The inbox alone: what the engine takes out of it while it waits for a commit (reads it
/// answers at once) keeps each session's order.
@Suite struct InboxTests {
    /// A work item of session `session` (nil: of none), named for the test.
    struct Item: Equatable, Sendable {
        let session: Int?
        let name: String
    }

    static func owner(_ item: Item) -> ObjectIdentifier? {
        item.session.map { ObjectIdentifier(Owners.all[$0]) }
    }

    /// Objects standing for sessions (an `ObjectIdentifier` needs one).
    final class Owners: Sendable {
        static let all = (0..<4).map { _ in Owners() }
    }

    @Test func readsAreTakenOutOnlyWithNothingOfTheirSessionLeftBeforeThem() {
        let inbox = Inbox<Item>()
        inbox.put(contentsOf: [
            Item(session: 1, name: "send"), Item(session: 1, name: "read"), Item(session: 2, name: "read"),
            Item(session: nil, name: "read"), Item(session: 3, name: "read"), Item(session: 3, name: "read"),
            Item(session: 2, name: "send"), Item(session: 2, name: "read")
        ])
        var examined = 0
        var blocked: Set<ObjectIdentifier> = []
        let taken = inbox.takeOut(examined: &examined, blocked: &blocked, session: Self.owner) { $0.name == "read" }
        // Session 1's read is behind its send, and so is session 2's second read; session
        // 3's two reads are taken in their order.
        #expect(taken == [Item(session: 2, name: "read"), Item(session: 3, name: "read"), Item(session: 3, name: "read")])
        #expect(examined == 5)

        // Each item is looked at once: what came later is, what was left is not.
        inbox.put(Item(session: 0, name: "read"))
        inbox.put(Item(session: 1, name: "read"))
        let later = inbox.takeOut(examined: &examined, blocked: &blocked, session: Self.owner) { $0.name == "read" }
        #expect(later == [Item(session: 0, name: "read")], "session 1 has work before it")
        #expect(examined == 6)
        #expect(
            inbox.take(limit: 10) == [
                Item(session: 1, name: "send"), Item(session: 1, name: "read"), Item(session: nil, name: "read"),
                Item(session: 2, name: "send"), Item(session: 2, name: "read"), Item(session: 1, name: "read")
            ])
    }

    @Test func nothingChosenLeavesTheInboxAsItWas() {
        let inbox = Inbox<Item>()
        inbox.put(contentsOf: [Item(session: 1, name: "send"), Item(session: 2, name: "send")])
        var examined = 0
        var blocked: Set<ObjectIdentifier> = []
        #expect(inbox.takeOut(examined: &examined, blocked: &blocked, session: Self.owner) { _ in false }.isEmpty)
        #expect(examined == 2)
        #expect(inbox.take(limit: 10) == [Item(session: 1, name: "send"), Item(session: 2, name: "send")])
    }
}
