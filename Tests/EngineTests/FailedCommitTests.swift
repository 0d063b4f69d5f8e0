import ChatProtocol
import Foundation
import GRDB
import SQLiteStorage
import Testing

@testable import ChatEngine

/// A commit that fails (docs/protocol.md §2 `Internal`; issue 11): every request of the batch
/// gets one answer, nothing of it is seen, what was committed before stays answered, and
/// nobody keeps an identity the store does not have.
@Suite(.serialized) final class FailedCommitTests {
    private func harness() throws -> (EngineHarness, FailingStore) {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        return (try EngineHarness(store: store), store)
    }

    /// Alice ("a") and Bob ("b") in chat 1, which Alice started; Bob's events so far taken.
    private func aliceAndBobInAChat() throws -> (EngineHarness, FailingStore) {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        return (try EngineHarness.aliceAndBobInAChat(on: store), store)
    }

    @Test func everyRequestOfAFailedBatchIsAnsweredOnceAndNothingIsSeen() throws {
        let (h, store) = try aliceAndBobInAChat()
        store.failing.store(true, ordering: .relaxed)
        h.engine.barrier {}  // the batch below is taken whole after this
        for n in 1...5 { h.submit("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"m\#(n)","cookie":"c\#(n)"}}"#) }
        h.submit("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","cookie":"bad"}}"#)  // refused on its own
        h.submit("a", #"{"nonsense":{"cookie":"u"}}"#)  // a decode failure
        let alice = h.typedEvents("a")
        #expect(alice.count == 7, "\(alice)")
        for (n, event) in alice.prefix(6).enumerated() {
            let failed = event.requestFailed
            #expect(failed?.error == .internal)
            #expect(failed?.cookie == (n < 5 ? "c\(n + 1)" : "bad"))
            #expect(failed?.reason.contains("store") == true)
        }
        #expect(alice[6].requestFailed?.error == .unknownRequest)
        #expect(h.events("b") == [], "bob saw events of a batch that was not committed")

        // Space again: the same requests succeed, with the ids the failed ones would have had.
        store.failing.store(false, ordering: .relaxed)
        let again = h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"again"}}"#)
        #expect(again.first?.contains(#""messageId":"2""#) ?? false, "\(again)")
    }

    /// After a failed commit memory is read back from the store; while the store cannot be
    /// read (PostgreSQL restarting: a connection it closed, found before its close was), the
    /// engine tries again for a while instead of stopping the service at once.
    @Test func memoryIsReadBackAfterAFailedCommitWhenTheFirstReadsFail() throws {
        let (h, store) = try aliceAndBobInAChat()
        store.failOnce.store(true, ordering: .relaxed)
        store.readsFailing.store(3, ordering: .relaxed)
        let failed = h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"lost","cookie":"l"}}"#)
        #expect(failed.first?.contains(#""error":"Internal""#) ?? false, "\(failed)")
        #expect(store.readsFailing.load(ordering: .relaxed) == 0, "memory was read back after the failing reads")
        #expect(h.engine.storeFailure == nil, "the service stops")
        let again = h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"again"}}"#)
        #expect(again.first?.contains(#""messageId":"2""#) ?? false, "\(again)")
        #expect(h.events("b").joined().contains(#""content":"again""#))
    }

    @Test func answersCommittedBeforeTheFailureStand() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let h = try EngineHarness.withSearchIndex(store)
        h.connect("a", as: "alice")
        h.connect("b", as: "bob")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        // One batch: a send, a search (which commits what came before it), another send;
        // the batch's last commit fails.
        store.successesFirst.store(1, ordering: .relaxed)
        store.failing.store(true, ordering: .relaxed)
        h.engine.barrier {}
        h.submit("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"kept"}}"#)
        h.submit("a", #"{"search":{"cookie":"q","text":"kept"}}"#)
        h.submit("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"lost","cookie":"l"}}"#)
        let events = h.events("a")
        #expect(events.first?.contains(#""content":"kept""#) ?? false, "the committed send lost its answer: \(events)")
        #expect((events.filter { $0.contains(#""requestFailed""#) }.count) == 2, "\(events)")
        #expect(!(events.contains { $0.contains(#""content":"lost""#) }))
        store.failing.store(false, ordering: .relaxed)
        let listed = h.send(
            "a", #"{"requestListMatching":{"type":"chatMessage","cookie":"w","criteria":{"chatId":"1"},"window":{"messageId":1,"before":0,"after":10}}}"#)
        #expect(listed.joined().contains(#""content":"kept""#))
        #expect(!listed.joined().contains(#""content":"lost""#))
    }

    /// The engine decides the next batch while one is being committed: when that commit
    /// fails, the next batch, decided on memory that held the failed changes, fails too,
    /// although its own commit would have succeeded.
    @Test func aBatchDecidedWhileTheOneBeforeFailedToCommitFailsWithIt() throws {
        let (h, store) = try aliceAndBobInAChat()
        h.decideWhileCommitting(
            [("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"first","cookie":"c1"}}"#)], in: store,
            // Only the commit in flight fails: the next one would go through.
            whileHeld: { store.failOnce.store(true, ordering: .relaxed) },
            then: [
                ("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"second","cookie":"c2"}}"#),
                ("b", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"third","cookie":"c3"}}"#)
            ])
        Self.assertFirstSecondAndThirdFailedTogether(h, store)
    }

    /// After Alice's "first" (c1) failed to commit and Alice's "second" (c2) and Bob's
    /// "third" (c3) were decided behind it: one commit failed, each of the three got one
    /// Internal answer and nothing else was seen, and nothing of them is remembered (the
    /// next message takes the id the first had: the chat's Join is 1) or stored.
    static func assertFirstSecondAndThirdFailedTogether(_ h: EngineHarness, _ store: FailingStore, sourceLocation: SourceLocation = #_sourceLocation) {
        let alice = h.typedEvents("a")
        let bob = h.typedEvents("b")
        #expect(store.failedCommits.load(ordering: .relaxed) == 1, sourceLocation: sourceLocation)
        #expect(
            alice.compactMap { $0.requestFailed?.cookie } == (["c1", "c2"]), "\(alice)", sourceLocation: sourceLocation)
        #expect(bob.compactMap { $0.requestFailed?.cookie } == ["c3"], "\(bob)", sourceLocation: sourceLocation)
        #expect((alice.count + bob.count) == 3, "events of batches that were not committed were seen: \(alice) \(bob)", sourceLocation: sourceLocation)
        let again = h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"again"}}"#)
        #expect(again.first?.contains(#""messageId":"2""#) ?? false, "\(again)", sourceLocation: sourceLocation)
        let listed = h.send(
            "a", #"{"requestListMatching":{"type":"chatMessage","cookie":"w","criteria":{"chatId":"1"},"window":{"messageId":1,"before":0,"after":10}}}"#
        ).joined()
        #expect(listed.contains(#""content":"again""#), Comment(rawValue: listed), sourceLocation: sourceLocation)
        for lost in ["first", "second", "third"] {
            #expect(!listed.contains(#""content":"\#(lost)""#), Comment(rawValue: listed), sourceLocation: sourceLocation)
        }
    }

    @Test func aSessionAuthenticatedByAFailedBatchIsNotAuthenticated() throws {
        let (h, store) = try harness()
        h.connect("a", as: "alice")
        store.failing.store(true, ordering: .relaxed)
        let refused = h.connect("x", as: "xavier")
        #expect(refused.count == 1)
        #expect(refused[0].contains(#""request":"authToken""#) && refused[0].contains(#""error":"Internal""#), "\(refused)")
        store.failing.store(false, ordering: .relaxed)
        // The next new user takes the number the failed one did not keep...
        h.connect("y", as: "yvonne")
        let seen = h.send("a", #"{"identitiesGet":{"cookie":"who","appUserIds":["yvonne","xavier"]}}"#)
        #expect(
            seen
                == ([
                    #"{"identities":{"cookie":"who","result":"Success","info":[{"appUserId":"yvonne","regId":"\#(RegId.derive("yvonne"))","uri":"bbmpim://user/id/2"}]}}"#
                ]))
        // ...and the session of the failed authentication is nobody.
        let answer = h.send("x", #"{"identitiesGet":{"cookie":"i","appUserIds":["xavier"]}}"#)
        #expect(answer.joined().contains("NotAuthenticated"), "\(answer)")
    }
}

/// Memory after a failed commit: only what the commit changed is read again.
extension FailedCommitTests {
    /// Alice in chat 1 with Bob and chat 2 with Carol; a send into chat 1 fails. Only chat
    /// 1 is read again (not the whole directory), chat 2 is as it was, and chat 1 goes on
    /// from what the store has.
    @Test func aFailedCommitReadsOnlyTheChatsItChangedAgain() throws {
        let (h, store) = try aliceAndBobInAChat()
        h.connect("c", as: "carol")
        h.send("a", #"{"chatStart":{"cookie":"s2","invitees":[{"userId":"carol"}],"subject":"g"}}"#)
        h.send("a", #"{"chatMessageSend":{"chatId":"2","tag":"Text","content":"to carol"}}"#)
        let loads = store.directoryLoads.load(ordering: .relaxed)
        store.failOnce.store(true, ordering: .relaxed)
        let failed = h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"lost","cookie":"l"}}"#)
        #expect(failed.count == 1 && failed[0].contains(#""error":"Internal""#), "\(failed)")
        #expect(store.directoryLoads.load(ordering: .relaxed) == loads, "the whole directory was read again")
        #expect(store.chatLoads.load(ordering: .relaxed) == 1)
        let one = h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"kept"}}"#)
        #expect(one.first?.contains(#""messageId":"2""#) ?? false, "\(one)")
        let two = h.send("a", #"{"chatMessageSend":{"chatId":"2","tag":"Text","content":"again"}}"#)
        #expect(two.first?.contains(#""messageId":"3""#) ?? false, "\(two)")
        let chats = h.send("a", #"{"requestListAll":{"type":"chat","cookie":"all"}}"#).joined()
        #expect(chats.contains(#""chatId":"1""#) && chats.contains(#""chatId":"2""#), Comment(rawValue: chats))
    }

    /// A message recalled by a commit that failed is not recalled: its record, changed in
    /// memory, is read again (not kept from the cache).
    @Test func aMessageChangedByAFailedCommitIsAsTheStoreHasIt() throws {
        let (h, store) = try aliceAndBobInAChat()
        h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"kept"}}"#)
        store.failOnce.store(true, ordering: .relaxed)
        let failed = h.send("a", #"{"chatMessageDestroy":{"chatId":"1","messageId":2,"cookie":"d"}}"#)
        #expect(failed.count == 1 && failed[0].contains(#""error":"Internal""#), "\(failed)")
        let listed = h.send("a", #"{"requestListElements":{"type":"chatMessage","cookie":"m","elements":[{"chatId":"1","messageId":"2"}]}}"#).joined()
        #expect(listed.contains(#""content":"kept""#), Comment(rawValue: listed))
        #expect(!listed.contains("Recalled"), Comment(rawValue: listed))
    }

    /// A chat started by a commit that failed is not remembered: the next chat takes its
    /// number, and nobody is in the failed one.
    @Test func aChatStartedByAFailedCommitLeavesItsNumberFree() throws {
        let (h, store) = try aliceAndBobInAChat()
        store.failOnce.store(true, ordering: .relaxed)
        let failed = h.send("a", #"{"chatStart":{"cookie":"lost","invitees":[{"userId":"bob"}],"subject":"lost"}}"#)
        #expect(failed.count == 1 && failed[0].contains(#""error":"Internal""#), "\(failed)")
        #expect(store.chatLoads.load(ordering: .relaxed) == 1)
        let started = h.send("a", #"{"chatStart":{"cookie":"s2","invitees":[{"userId":"bob"}],"subject":"kept"}}"#).joined()
        #expect(started.contains(#""chatId":"2""#) && started.contains(#""subject":"kept""#), Comment(rawValue: started))
        let chats = h.send("b", #"{"requestListAll":{"type":"chat","cookie":"all"}}"#).joined()
        #expect(!chats.contains(#""subject":"lost""#), Comment(rawValue: chats))
        #expect(!chats.contains(#""chatId":"3""#), Comment(rawValue: chats))
    }

    /// A commit that made a user fails: the whole directory is read again (users are not
    /// read one by one), and the next new user takes the number.
    @Test func aFailedCommitThatMadeAUserReadsEverythingAgain() throws {
        let (h, store) = try harness()
        h.connect("a", as: "alice")
        let loads = store.directoryLoads.load(ordering: .relaxed)
        store.failOnce.store(true, ordering: .relaxed)
        h.connect("x", as: "xavier")
        #expect(store.directoryLoads.load(ordering: .relaxed) == (loads + 1))
        #expect(store.chatLoads.load(ordering: .relaxed) == 0)
    }
}
