import Foundation
import GRDB
import SQLiteStorage
import Testing

@testable import ChatEngine

/// Two commits in flight (`ChatStore.commitsInFlight`, PostgreSQL's): the engine hands a
/// batch over while the one before it is still committing. Events still come in commit
/// order, a batch may change what the batch before it inserted, and when a commit fails
/// the batch behind it fails with it, although its own commit would have gone through.
@Suite(.serialized) final class CommitsInFlightTests {
    private func aliceAndBobInAChat() throws -> (EngineHarness, FailingStore) {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()), commitsInFlight: 2)
        return (try EngineHarness.aliceAndBobInAChat(on: store), store)
    }

    /// Holds the commit of `first`, submits `next`, waits until the engine has handed
    /// `next`'s commit over too (both in flight), runs `whileBoth`, then lets them go.
    private func commitBehind(
        _ first: [(String, String)], then next: [(String, String)], in h: EngineHarness, store: FailingStore,
        whileBoth: () -> Void = {}
    ) {
        let begun = store.commitsBegun.load(ordering: .relaxed)
        store.holding.store(true, ordering: .relaxed)
        h.submitTogether(first)
        store.held.wait()
        store.holding.store(false, ordering: .relaxed)
        h.submitTogether(next)
        let deadline = Date().addingTimeInterval(10)
        while store.commitsBegun.load(ordering: .relaxed) < begun + 2 && Date() < deadline { Thread.sleep(forTimeInterval: 0.01) }
        #expect(store.commitsBegun.load(ordering: .relaxed) == (begun + 2), "the next batch was not handed over while the first committed")
        whileBoth()
        store.release.signal()
    }

    @Test func aBatchChangesWhatTheBatchInFlightBeforeItInsertedAndEventsKeepTheirOrder() throws {
        let (h, store) = try aliceAndBobInAChat()
        // The first batch makes a chat (and its members, and a Join message); the next,
        // decided on top of it, posts into it: it must update those rows, not insert them again.
        commitBehind(
            [("a", #"{"chatStart":{"cookie":"new","invitees":[{"userId":"bob"}],"subject":"second"}}"#)],
            then: [("a", #"{"chatMessageSend":{"chatId":"2","tag":"Text","content":"into it","cookie":"m"}}"#)],
            in: h, store: store)
        let alice = h.events("a")
        #expect(store.failedCommits.load(ordering: .relaxed) == 0)
        let started = alice.firstIndex { $0.contains(#""type":"chat""#) && $0.contains(#""cookie":"new""#) }
        let posted = alice.firstIndex { $0.contains(#""content":"into it""#) && $0.contains(#""cookie":"m""#) }
        #expect(started != nil, "\(alice)")
        #expect(posted != nil, "\(alice)")
        if let started, let posted { #expect(started < posted, "the later batch's events came first: \(alice)") }
        #expect(!alice.joined().contains("requestFailed"), "\(alice)")
        // The store has both: the chat's last message is the one posted.
        let listed = h.send("a", #"{"requestListElements":{"type":"chat","cookie":"l","elements":[{"chatId":"2"}]}}"#).joined()
        #expect(listed.contains(#""lastMessage":2"#), Comment(rawValue: listed))
        let again = h.send("a", #"{"chatMessageSend":{"chatId":"2","tag":"Text","content":"third"}}"#)
        #expect(again.first?.contains(#""messageId":"3""#) ?? false, "\(again)")
    }

    /// Alice's "first" (c1) as one batch; then Alice's "second" (c2) and Bob's "third" (c3).
    private static let first = [("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"first","cookie":"c1"}}"#)]
    private static let secondAndThird = [
        ("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"second","cookie":"c2"}}"#),
        ("b", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"third","cookie":"c3"}}"#)
    ]

    @Test func aBatchBehindACommitThatFailsFailsWithItAndNothingOfEitherIsSeen() throws {
        let (h, store) = try aliceAndBobInAChat()
        commitBehind(
            Self.first, then: Self.secondAndThird, in: h, store: store,
            // Only the first commit fails: the one behind it would go through.
            whileBoth: { store.failOnce.store(true, ordering: .relaxed) })
        FailedCommitTests.assertFirstSecondAndThirdFailedTogether(h, store)
    }

    /// The commit in flight conflicts (another node committed to the chat first): the batch
    /// behind it fails with it, and both are decided again, in order, each request answered
    /// once, as if nothing had happened.
    @Test func batchesBehindACommitThatConflictsAreDecidedAgainInOrder() throws {
        let (h, store) = try aliceAndBobInAChat()
        commitBehind(
            Self.first, then: Self.secondAndThird, in: h, store: store,
            whileBoth: { store.conflictOnce.store(true, ordering: .relaxed) })
        let alice = h.events("a")
        let bob = h.events("b")
        #expect(store.conflicts.load(ordering: .relaxed) == 1)
        #expect(!((alice + bob).contains { $0.contains("requestFailed") }), "\(alice) \(bob)")
        for events in [alice, bob] {
            let sent = events.filter { $0.contains(#""listAdd""#) && $0.contains(#""type":"chatMessage""#) }
            #expect(sent.count == 3, "\(events)")
            for (n, content) in ["first", "second", "third"].enumerated() {
                #expect(sent[n].contains(#""messageId":"\#(n + 2)""#) && sent[n].contains(#""content":"\#(content)""#), Comment(rawValue: sent[n]))
            }
        }
    }

    /// A batch that changes nothing (a read-only request), decided while a commit is in
    /// flight, is not committed: its counters are that commit's. It was, for the counters
    /// alone, once for every such batch (an idle deciding node wakes up every few
    /// milliseconds to follow the others, each time a batch).
    @Test func aBatchThatChangesNothingBehindACommitInFlightIsNotCommitted() throws {
        let (h, store) = try aliceAndBobInAChat()
        let begun = store.commitsBegun.load(ordering: .relaxed)
        h.decideWhileCommitting(Self.first, in: store, then: [("b", #"{"identitiesGet":{"cookie":"who","appUserIds":["alice"]}}"#)])
        let bob = h.events("b")
        #expect(bob.contains { $0.contains(#""cookie":"who""#) }, "\(bob)")
        #expect(store.commitsBegun.load(ordering: .relaxed) == (begun + 1), "one commit, the send's")
    }
}
