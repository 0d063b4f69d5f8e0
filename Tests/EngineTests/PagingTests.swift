import Foundation
import Testing

@testable import ChatEngine

/// Requests whose work grows with what a user has are answered a page per batch, so that
/// none holds the engine from everyone else for long; the session's own answers keep the
/// order of its requests.
@Suite(.serialized) final class PagingTests {
    private static func objects(_ lines: [String]) -> [[String: Any]] {
        lines.map { try! JSONSerialization.jsonObject(with: Data($0.utf8)) as! [String: Any] }
    }

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
        let events = Self.objects(h.events("a"))
        let headers = events.filter { $0["listAll"] != nil }
        let chunks = events.compactMap { $0["listChunk"] as? [String: Any] }
        #expect(headers.count == 1)
        let elements = chunks.flatMap { $0["elements"] as! [[String: Any]] }
        #expect(elements.count == (60 * 49))
        #expect(Set(elements.map { "\($0["chatId"]!)/\($0["userUri"]!)" }).count == (60 * 49), "each participant once")
        #expect((chunks.filter { $0["last"] as? Bool == true }.count) == 1)
        #expect((chunks.last?["last"] as? Bool) == true)
        #expect(elements.count > Engine.listPage)
        #expect((h.deliveries("a") - before) >= 2, "the list was decided in one batch")
        // The request the session sent after the list is answered after all of it.
        #expect((events.last?["identities"]) != nil, "\(events.last!)")
        let chatOrder = elements.map { Int($0["chatId"] as! String)! }
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
        let alice = Self.objects(h.events("a"))
        let bob = Self.objects(h.events("b")).flatMap { event -> [[String: Any]] in
            ((event["listChange"] as? [String: Any])?["elements"] as? [[String: Any]]) ?? []
        }
        let recalled = Set(bob.filter { $0["recall"] != nil }.map { $0["messageId"] as! String })
        #expect(recalled.count == count, "every message of alice's, and only hers, recalled for bob")
        #expect((h.deliveries("b") - before) >= 3, "the recall was decided in fewer batches than pages")
        #expect(!(recalled.contains(String(count + 2))), "bob's message stays")
        let shreds = alice.filter { (($0["listAdd"] as? [String: Any])?["elements"] as? [[String: Any]])?.first?["tag"] as? String == "Shred" }
        #expect(shreds.count == 1)
        #expect((alice.last?["identities"]) != nil, "the next request is answered after the Shred")
        #expect(!(alice.contains { $0["requestFailed"] != nil }))
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
        let delivered = Self.objects(h.events("a")).flatMap { event -> [[String: Any]] in
            ((event["listChange"] as? [String: Any])?["elements"] as? [[String: Any]]) ?? []
        }.filter { $0["state"] as? String == "Delivered" && $0["messageId"] as? String == "2" }
        #expect(Set(delivered.map { $0["chatId"] as! String }).count == chats, "every chat's message marked delivered, once")
        #expect(delivered.count == chats)
        #expect((h.deliveries("a") - before) >= 4, "the deliveries were marked in one batch")
    }
}
