import ChatProtocol
import Foundation
import GRDB
import SQLiteStorage
import Storage
import Testing

@testable import ChatEngine

/// The change feed with several processes deciding on one store (`FeedSlots`): each
/// numbers its changes in a slot of its own, and a token holds a position per slot. Two
/// engines on one store that keeps versions are two deciding nodes, in slots 0 and 1.
@Suite(.serialized) final class FeedSlotTests {
    private struct Feed {
        var messages: [String]
        var token: String
        var hasMore: Bool
    }

    /// One `requestListChanges` answer: "id:content" (or "id:tag") of each message changed.
    private func feed(_ h: EngineHarness, _ name: String, since: String?, limit: Int = 100) throws -> Feed {
        let sinceField = since.map { #","since":"\#($0)""# } ?? ""
        let lines = h.send(name, #"{"requestListChanges":{"type":"chatMessage","cookie":"f","limit":\#(limit)\#(sinceField)}}"#)
        let answer = try #require(EngineHarness.typed(lines).compactMap(\.listChanges).first, "\(lines)")
        return Feed(messages: answer.changed.map { "\($0.messageId):\($0.content ?? $0.tag)" }, token: answer.token, hasMore: answer.hasMore)
    }

    private func failure(_ h: EngineHarness, _ name: String, since: String) -> String? {
        let lines = h.send(name, #"{"requestListChanges":{"type":"chatMessage","cookie":"f","since":"\#(since)"}}"#)
        return EngineHarness.typed(lines).compactMap(\.requestFailed).first?.error.rawValue
    }

    private static func send(_ content: String) -> String {
        #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"\#(content)"}}"#
    }

    /// Each node's memory of the chat is made current by a send that conflicts (a node
    /// does not follow the other's commits yet: docs/several-deciding-nodes.md, step 4),
    /// then its feed is read: the other node's changes are in it once, and a token taken
    /// afterwards gives nothing again.
    @Test func aReaderOnOneNodeGetsEveryChangeTheOtherNodeCommittedOnce() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()), versioned: true, numbering: true)
        let nodeA = try EngineHarness.aliceAndBobInAChat(on: store)
        nodeA.send("a", Self.send("one"))
        let start = try feed(nodeA, "a", since: nil)
        // Slot 1 has committed nothing yet: the token is slot 0's plain number.
        #expect(!start.token.contains("."), Comment(rawValue: start.token))

        let nodeB = try EngineHarness(store: store, feedSlot: 1)
        nodeB.connect("b", as: "bob")
        nodeB.send("b", Self.send("from B"))
        // Bob's read mark moves over every message: a range change, in slot 1.
        nodeB.send("b", #"{"chatMessageRead":{"chatId":"1","messageId":"3"}}"#)
        // Node A's send conflicts; it reads the chat again and decides it again (alice,
        // connected to it, now has bob's message delivered: a change in slot 0).
        nodeA.send("a", Self.send("two"))
        #expect(store.conflicts.load(ordering: .relaxed) == 1)

        let onA = try feed(nodeA, "a", since: start.token)
        // Slot 0's changes (message 4, and message 3 delivered to alice, in the order the
        // redo decided them), then slot 1's (bob's read changed each message for alice);
        // message 3, changed in both, once.
        #expect(Set(onA.messages.prefix(2)) == (["3:from B", "4:two"]), "\(onA.messages)")
        #expect(Array(onA.messages.dropFirst(2)) == (["1:Join", "2:one"]))
        #expect(!onA.hasMore)
        #expect(onA.token.split(separator: ".").count == 2, Comment(rawValue: onA.token))
        #expect((try feed(nodeA, "a", since: onA.token).messages) == [])

        nodeB.send("b", Self.send("three"))
        #expect(store.conflicts.load(ordering: .relaxed) == 2)
        // (Bob is connected to node A too: message 4 was delivered to him there.)
        let onB = try feed(nodeB, "b", since: onA.token)
        #expect(onB.messages == ["5:three"])
        #expect((try feed(nodeB, "b", since: onB.token).messages) == [])

        // Paging one at a time from the start: every message once, and the last page's
        // token is where the whole feed is.
        var token = "0"
        var paged: [String] = []
        for _ in 0..<20 {
            let page = try feed(nodeB, "b", since: token, limit: 1)
            paged += page.messages
            token = page.token
            if !page.hasMore { break }
        }
        let whole = try feed(nodeB, "b", since: "0")
        #expect(paged == whole.messages)
        #expect(Set(whole.messages) == (["1:Join", "2:one", "3:from B", "4:two", "5:three"]))
        #expect(token == whole.token)

        // A position past what a slot has committed was never given out.
        let parts = whole.token.split(separator: ".").map { Int64($0)! }
        #expect(parts.count == 2)
        #expect((failure(nodeB, "b", since: "\(parts[0]).\(parts[1] + 1)")) == "InvalidParameter")
        #expect((failure(nodeB, "b", since: "\(parts[0] + 1).\(parts[1])")) == "InvalidParameter")
        #expect(failure(nodeB, "b", since: "\(parts[0]).\(parts[1]).0.0.0.0.0.0.0") == "InvalidParameter")
        #expect(failure(nodeB, "b", since: "\(parts[0]).") == "InvalidParameter")
        #expect(failure(nodeB, "b", since: "\(parts[0]).\(parts[1]).0") == nil)
    }

    /// A read mark moving on node A over many messages (one range change, in slot 0)
    /// whose own latest changes are node B's (slot 1): a reader whose token has slot 1
    /// past those changes still gets each message once, for the mark.
    @Test func aMarkInOneSlotOverMessagesLastChangedInAnotherIsInTheFeed() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()), versioned: true, numbering: true)
        let nodeA = try EngineHarness(store: store)
        nodeA.connect("a", as: "alice")
        nodeA.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        let nodeB = try EngineHarness(store: store, feedSlot: 1)
        nodeB.connect("b", as: "bob")
        let count = Engine.largeRange + 6
        for n in 1...count { nodeB.send("b", Self.send("from B \(n)")) }
        let seen = try feed(nodeB, "b", since: "0", limit: 1000)
        #expect(seen.messages.count == (count + 1))
        // Node A reads the chat again (its send conflicts), then alice reads everything.
        nodeA.send("a", Self.send("from A"))
        nodeA.send("a", #"{"chatMessageRead":{"chatId":"1","messageId":"\(count + 2)"}}"#)
        #expect(
            (try store.rangeChanges(chats: [1], after: 0).map { "\($0.firstId)-\($0.lastId) in slot \(FeedSlots.slot(of: $0.firstSeq))" })
                == (["2-\(count + 2) in slot 0"]))
        // Node B reads the chat again too.
        nodeB.send("b", Self.send("again"))
        let after = try feed(nodeB, "b", since: seen.token, limit: 1000)
        let ids = after.messages.map { Int($0.split(separator: ":")[0])! }
        #expect(ids.sorted() == (Array(2...(count + 3))), "\(after.messages)")

        // From the start, bob's messages are found in both slots (their own changes in 1,
        // the mark in 0): each is given once.
        let whole = try feed(nodeB, "b", since: "0", limit: 1000)
        #expect((whole.messages.map { Int($0.split(separator: ":")[0])! }.sorted()) == (Array(1...(count + 3))))
        // Paged, whatever the page size: every message, and every token taken again.
        for limit in [1, 7, 50] {
            var token = "0"
            var paged: Set<String> = []
            for _ in 0..<(4 * count) {
                let page = try feed(nodeB, "b", since: token, limit: limit)
                #expect(page.messages.count <= limit)
                paged.formUnion(page.messages)
                token = page.token
                if !page.hasMore { break }
            }
            #expect(paged == Set(whole.messages), "pages of \(limit)")
            #expect(token == whole.token, "pages of \(limit)")
        }
    }
}
