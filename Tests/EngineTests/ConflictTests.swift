import ChatProtocol
import Foundation
import GRDB
import SQLiteStorage
import Storage
import Testing

@testable import ChatEngine

/// A commit that conflicts (`StoreFailure.Kind.conflict`: another node committed first to
/// a chat the batch changes) is not answered `Internal`: memory is read again from the
/// store and the batch's requests are decided again, in order, each answered once, with
/// nothing of the first decision seen.
@Suite(.serialized) final class ConflictTests {
    private static func send(_ content: String, cookie: String, chat: String = "1") -> String {
        #"{"chatMessageSend":{"chatId":"\#(chat)","tag":"Text","content":"\#(content)","cookie":"\#(cookie)"}}"#
    }

    /// The message ids and contents each `listAdd` of a chat message carries, in order.
    private static func added(_ events: [Event]) -> [String] {
        events.compactMap { event in
            guard let element = event.addedMessages.first, element.tag == "Text" else { return nil }
            return "\(element.messageId):\(element.content ?? "")"
        }
    }

    private static func failures(_ events: [Event]) -> [String] {
        events.compactMap(\.requestFailed).map { "\($0.cookie ?? "-"):\($0.error.rawValue)" }
    }

    private func listed(_ h: EngineHarness, as name: String) -> [String] {
        let lines = h.send(
            name, #"{"requestListMatching":{"type":"chatMessage","cookie":"w","criteria":{"chatId":"1"},"window":{"messageId":1,"before":0,"after":20}}}"#)
        return EngineHarness.typed(lines).flatMap(\.chunkMessages).filter { $0.tag == "Text" }.map { "\($0.messageId):\($0.content ?? "")" }
    }

    /// Two engines on one store are two deciding nodes: a send decided on a chat the other
    /// node has moved on since is decided again, with the next id the store leaves.
    @Test func aSendIntoAChatAnotherNodeChangedIsDecidedAgainOnWhatTheStoreHas() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()), versioned: true)
        let nodeA = try EngineHarness.aliceAndBobInAChat(on: store)
        #expect(Self.added(nodeA.typedEvents("a")) == [])
        #expect(Self.added(nodeA.send("a", Self.send("one", cookie: "1")).map(Self.object)) == ["2:one"])
        let nodeB = try EngineHarness(store: store)
        nodeB.connect("b", as: "bob")
        #expect(Self.added(nodeB.send("b", Self.send("from node B", cookie: "b")).map(Self.object)) == (["3:from node B"]))
        // Node A still has 2 as the chat's last message.
        let alice = nodeA.send("a", Self.send("two", cookie: "2")).map(Self.object)
        #expect(Self.failures(alice) == [], "\(alice)")
        #expect(Self.added(alice) == ["4:two"], "\(alice)")
        #expect(store.conflicts.load(ordering: .relaxed) == 1)
        // Node A read chat 1 again, not its whole directory (once per node, at its start).
        #expect(store.chatLoads.load(ordering: .relaxed) == 1)
        #expect(store.directoryLoads.load(ordering: .relaxed) == 2)
        // Bob on node A sees Alice's message once, with the id it was stored with.
        #expect(Self.added(nodeA.typedEvents("b")) == (["2:one", "4:two"]))
        // Node A read the chat again: it lists node B's message from the store. (Node B
        // does not follow node A's commits yet: docs/several-deciding-nodes.md, step 4.)
        #expect(listed(nodeA, as: "a") == (["2:one", "3:from node B", "4:two"]))
        // And both go on from there.
        #expect(Self.added(nodeA.send("a", Self.send("three", cookie: "3")).map(Self.object)) == ["5:three"])
        #expect(store.conflicts.load(ordering: .relaxed) == 1)
    }

    /// The chatIds of the chats `listAdd`s gave the session.
    private static func startedChats(_ events: [Event]) -> [String] {
        events.compactMap { $0.addedChats.first?.chatId }
    }

    /// Two nodes each start a chat with a user new to both. With numbers from the store
    /// (PostgreSQL's sequences: `ChatStore.takeNumbers`) they take different ones and
    /// neither commit conflicts; numbered from each node's memory, both would take chat 2
    /// and user 3, and node B's commit would conflict and be decided again.
    @Test func nodesTakeNewChatsAndUsersNumbersFromTheStoreWithoutConflicting() throws {
        for numbering in [true, false] {
            let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()), versioned: true, numbering: numbering)
            let nodeA = try EngineHarness.aliceAndBobInAChat(on: store)
            let nodeB = try EngineHarness(store: store)
            nodeB.connect("b", as: "bob")
            let alice = nodeA.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"carol"}],"subject":"on A"}}"#).map(Self.object)
            let bob = nodeB.send("b", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"dave"}],"subject":"on B"}}"#).map(Self.object)
            #expect(Self.startedChats(alice) == ["2"], "\(alice)")
            #expect(Self.startedChats(bob) == ["3"], "\(bob)")
            #expect((Self.failures(alice) + Self.failures(bob)) == [])
            #expect(store.conflicts.load(ordering: .relaxed) == (numbering ? 0 : 1), "numbering: \(numbering)")
            // Alice, bob, carol, dave: four users, each once, whichever node made them.
            let users = try store.loadDirectory().users.map { "\($0.number):\($0.userId)" }
            #expect(users == (["1:alice", "2:bob", "3:carol", "4:dave"]), "numbering: \(numbering)")
            // Taken: alice, bob and chat 1 at node A's start, then a user and a chat each.
            #expect(store.numbersTaken.load(ordering: .relaxed) == (numbering ? 7 : 0))
            // Three new invitees: their numbers are taken at once (and the chat's).
            nodeA.send("a", #"{"chatStart":{"cookie":"t","invitees":[{"userId":"erin"},{"userId":"frank"},{"userId":"grace"}],"subject":"three"}}"#)
            #expect(store.numbersTaken.load(ordering: .relaxed) == (numbering ? 9 : 0))
            #expect((try store.loadDirectory().users.suffix(3).map { "\($0.number):\($0.userId)" }) == (["5:erin", "6:frank", "7:grace"]))
        }
    }

    /// Search rows come from the store a block at a time (four here): two nodes sending
    /// into one chat never give two messages one row, and each node's rows go up.
    @Test func nodesTakeSearchRowsInBlocksNoOtherNodeTakes() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()), versioned: true, numbering: true)
        let nodeA = try EngineHarness.aliceAndBobInAChat(on: store)
        let nodeB = try EngineHarness(store: store)
        nodeB.connect("b", as: "bob")
        var sentBy: [String: String] = [:]
        for n in 1...6 {
            for (node, session) in [(nodeA, "a"), (nodeB, "b")] {
                let content = "\(session)\(n)"
                #expect(Self.failures(node.send(session, Self.send(content, cookie: content)).map(Self.object)) == [])
                sentBy[content] = session
            }
        }
        let rows = try store.messages(chat: 1, in: 1...100).filter { $0.tag == "Text" }
        #expect(rows.count == 12)
        #expect(Set(rows.map(\.searchRow)).count == 12, "\(rows.map(\.searchRow))")
        for session in ["a", "b"] {
            let own = rows.filter { sentBy[$0.content!] == session }.map(\.searchRow)
            #expect(own == own.sorted(), Comment(rawValue: session))
            // Node A's first block was 1...4, node B's 5...8 (its first send conflicted and
            // was decided again: the row it took first is not given again).
            #expect((session == "a" ? 1...4 : 5...8).contains(own.first!), "\(session): \(own)")
        }
    }

    /// Every request of the batch is decided again, in order: each answered once (a line
    /// that is no request too), and a session it authenticated is authenticated once.
    @Test func everyWorkItemOfAConflictingBatchIsDecidedAgainOnceInOrder() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let h = try EngineHarness.aliceAndBobInAChat(on: store)
        h.open("x")
        store.conflictOnce.store(true, ordering: .relaxed)
        h.engine.put(together: [
            h.work("a", Self.send("m1", cookie: "c1")),
            h.work("a", #"{"nonsense":{"cookie":"u"}}"#),
            h.work("b", Self.send("m2", cookie: "c2")),
            h.authentication("x", as: "xavier"),
            h.work("a", Self.send("m3", cookie: "c3")),
            h.work("x", #"{"identitiesGet":{"cookie":"who","appUserIds":["xavier"]}}"#)
        ])
        let alice = h.typedEvents("a")
        let bob = h.typedEvents("b")
        let xavier = h.events("x")
        #expect(store.conflicts.load(ordering: .relaxed) == 1)
        #expect(Self.failures(alice) == ["u:UnknownRequest"], "\(alice)")
        #expect(Self.failures(bob) == [], "\(bob)")
        #expect(Self.added(alice) == (["2:m1", "3:m2", "4:m3"]), "\(alice)")
        #expect(Self.added(bob) == (["2:m1", "3:m2", "4:m3"]), "\(bob)")
        // The decode failure's answer comes between m1's and m2's, where it was sent.
        let order = alice.compactMap { event -> String? in
            if event.requestFailed != nil { return "failed" }
            return Self.added([event]).first
        }
        #expect(order == (["2:m1", "failed", "3:m2", "4:m3"]))
        #expect(
            (xavier.filter { $0.contains(#""authTokenResult""#) || $0.contains(#""setupState""#) && $0.contains("Success") }.count >= 1) == true, "\(xavier)")
        #expect((xavier.filter { $0.contains(#""identities""#) }.count) == 1, "\(xavier)")
        #expect(!xavier.joined().contains("NotAuthenticated"), "\(xavier)")
        #expect(listed(h, as: "a") == (["2:m1", "3:m2", "4:m3"]))
    }

    /// A search commits what its batch decided before it; when that commit conflicts, the
    /// batch is decided again whole, and the search answers once, finding the message.
    @Test func aSearchWhoseCommitConflictedIsAnsweredOnce() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let h = try EngineHarness.withSearchIndex(store)
        h.connect("a", as: "alice")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        store.conflictOnce.store(true, ordering: .relaxed)
        h.engine.put(together: [
            h.work("a", Self.send("findable", cookie: "c1")),
            h.work("a", #"{"search":{"cookie":"q","text":"findable"}}"#),
            h.work("a", Self.send("after", cookie: "c2"))
        ])
        let alice = h.typedEvents("a")
        #expect(store.conflicts.load(ordering: .relaxed) == 1)
        #expect(Self.failures(alice) == [], "\(alice)")
        #expect(Self.added(alice) == (["2:findable", "3:after"]), "\(alice)")
        let results = alice.compactMap(\.searchResult)
        #expect(results.count == 1, "\(alice)")
        #expect(results.first?.messages.map { "\($0.messageId)" } == ["2"])
    }

    /// Conflicting again and again (the chat is that busy on other nodes), the batch is
    /// answered `Internal` once `Engine.maxRedos` conflicts found nothing more to read with
    /// batches of one work item, and nothing of it is kept.
    @Test func aCommitThatKeepsConflictingIsAnsweredInternalOnce() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let h = try EngineHarness.aliceAndBobInAChat(on: store)
        store.conflicting.store(true, ordering: .relaxed)
        let alice = h.send("a", Self.send("busy", cookie: "c1")).map(Self.object)
        #expect(Self.failures(alice) == ["c1:Internal"], "\(alice)")
        #expect(alice.count == 1, "\(alice)")
        // The first conflict read chat 1 again; each after it found nothing more to read:
        // six made batches smaller (4,096 work items a quarter at a time down to one), then
        // `maxRedos` with one item, then the one answered.
        #expect(store.conflicts.load(ordering: .relaxed) == (1 + 6 + Engine.maxRedos + 1))
        #expect(h.events("b") == [])
        store.conflicting.store(false, ordering: .relaxed)
        #expect(Self.added(h.send("a", Self.send("calm", cookie: "c2")).map(Self.object)) == ["2:calm"])
    }

    private static func object(_ line: String) -> Event {
        EngineHarness.typed(line)
    }
}
