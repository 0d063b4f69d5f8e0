import ChatProtocol
import Foundation
import Testing

@testable import ChatEngine

/// Requests whose work grows with what a user has are answered a page per batch, so that
/// none holds the engine from everyone else for long; the session's own answers keep the
/// order of its requests.
@Suite(.serialized) final class PagingTests {
    /// A user in 2,000 chats of 50 got 100,000 participants in one answer, decided in one
    /// batch (150 ms of the engine in a release build, everyone else waiting).
    @Test func theParticipantsOfManyChatsComeAPageAtATimeEachOnceInOrder() throws {
        let h = try EngineHarness(quotas: QuotaLimits(chatsPerMinute: 0))
        h.connect("a", as: "alice")
        for chat in 0..<60 {
            let invitees = (0..<49).map { #"{"userId":"u\#(chat % 7)-\#($0)"}"# }.joined(separator: ",")
            h.send("a", #"{"chatStart":{"cookie":"c\#(chat)","invitees":[\#(invitees)],"subject":"s\#(chat)"}}"#)
        }
        let before = h.deliveries("a")
        h.submitTogether([
            ("a", #"{"requestListAll":{"type":"chatParticipant","cookie":"p"}}"#),
            ("a", #"{"identitiesGet":{"cookie":"after","appUserIds":["alice"]}}"#)
        ])
        let events = h.typedEvents("a")
        let headers = events.filter { if case .listAll = $0 { true } else { false } }
        let chunks = events.compactMap { event -> ListChunkChatParticipant? in
            if case .listChunk(.chatParticipant(let chunk)) = event { chunk } else { nil }
        }
        #expect(headers.count == 1)
        let elements = chunks.flatMap(\.elements)
        #expect(elements.count == (60 * 49))
        #expect(Set(elements.map { "\($0.chatId)/\($0.userUri)" }).count == (60 * 49), "each participant once")
        #expect(chunks.filter { $0.last == true }.count == 1)
        #expect(chunks.last?.last == true)
        #expect(elements.count > Engine.listPage)
        #expect((h.deliveries("a") - before) >= 2, "the list was decided in one batch")
        // The request the session sent after the list is answered after all of it.
        #expect(events.last.map { if case .identities = $0 { true } else { false } } == true, "\(events.last!)")
        let chatOrder = elements.map { Int($0.chatId)! }
        #expect(chatOrder == chatOrder.sorted(), "chats in the order they were started")
    }

    /// Recalling everything one sent loaded every message of theirs at once (limit
    /// Int.max): another user waited a second behind it.
    @Test func recallingEverythingGoesAPageAtATimeAndShredsOnceAtTheEnd() throws {
        let h = try EngineHarness()
        h.connect("a", as: "alice")
        h.connect("b", as: "bob")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"many"}}"#)
        let count = Engine.recallPage * 2 + 100
        for n in 0..<count {
            h.submit("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"m\#(n)"}}"#)
        }
        h.submit("b", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"bob's"}}"#)
        _ = h.events("a")
        _ = h.events("b")
        let before = h.deliveries("b")
        h.submitTogether([
            ("a", #"{"chatMessageDestroy":{"chatId":"1","cookie":"all"}}"#),
            ("a", #"{"identitiesGet":{"cookie":"after","appUserIds":["alice"]}}"#)
        ])
        let alice = h.typedEvents("a")
        let bob = h.typedEvents("b").flatMap(\.messageChanges)
        let recalled = Set(bob.filter { $0.recall != nil }.map(\.messageId))
        #expect(recalled.count == count, "every message of alice's, and only hers, recalled for bob")
        #expect((h.deliveries("b") - before) >= 3, "the recall was decided in fewer batches than pages")
        #expect(!recalled.contains(Int64(count + 2)), "bob's message stays")
        let shreds = alice.filter { $0.addedMessages.first?.tag == "Shred" }
        #expect(shreds.count == 1)
        #expect(alice.last.map { if case .identities = $0 { true } else { false } } == true, "the next request is answered after the Shred")
        #expect(!alice.contains { $0.requestFailed != nil })
    }

    /// Signing in a user with something new in each of 2,000 chats marked every delivery
    /// in one batch (7 to 11 s in the report), the sign-in's own answer waiting for it.
    @Test func deliveriesOfAUserWhoComesOnlineAreMarkedAPageOfChatsAtATime() throws {
        let h = try EngineHarness(quotas: QuotaLimits(chatsPerMinute: 0))
        h.connect("a", as: "alice")
        let chats = Engine.deliveriesPerBatch * 3 + 5
        for chat in 1...chats {
            h.send("a", #"{"chatStart":{"cookie":"c\#(chat)","invitees":[{"userId":"bob"}],"subject":"s\#(chat)"}}"#)
            h.send("a", #"{"chatMessageSend":{"chatId":"\#(chat)","tag":"Text","content":"hi"}}"#)
        }
        _ = h.events("a")
        let before = h.deliveries("a")
        let signIn = h.connect("b", as: "bob")
        #expect(signIn.first?.contains(#""authTokenState","value":"Ok""#) == true, "\(signIn.first ?? "")")
        let delivered = h.typedEvents("a").flatMap(\.messageChanges).filter { $0.state == .value(.delivered) && $0.messageId == 2 }
        #expect(Set(delivered.map(\.chatId)).count == chats, "every chat's message marked delivered, once")
        #expect(delivered.count == chats)
        #expect((h.deliveries("a") - before) >= 4, "the deliveries were marked in one batch")
    }
}
