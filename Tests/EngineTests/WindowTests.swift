import ChatProtocol
import Foundation
import Testing

@testable import ChatEngine

/// `requestListMatching` windows (§8) against a brute-force model.
@Suite(.serialized) final class WindowTests {
    /// Messages 1–4 at T−1 and 5–7 at T+1: a window at T has 1–4 before and 5–7 after.
    @Test func aTimestampBetweenMessagesLosesNone() throws {
        let harness = try EngineHarness()
        harness.connect("a", as: "alice")
        harness.connect("b", as: "bob")
        let t: Int64 = 1_700_000_100
        harness.clock.set(t - 1)
        harness.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"w"}}"#)
        for n in 2...4 { harness.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"m\#(n)"}}"#) }
        harness.clock.set(t + 1)
        for n in 5...7 { harness.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"m\#(n)"}}"#) }
        let result = window(harness, #""window":{"timestamp":\#(t),"before":10,"after":10}"#)
        #expect(result.ids == ([1, 2, 3, 4, 5, 6, 7]))
        #expect(result.hasMoreBefore == false)
        #expect(result.hasMoreAfter == false)
        let narrow = window(harness, #""window":{"timestamp":\#(t),"before":1,"after":1}"#)
        #expect(narrow.ids == ([4, 5]))
        #expect(narrow.hasMoreBefore == true)
        #expect(narrow.hasMoreAfter == true)
    }

    struct Message {
        let id: Int64
        let sender: String
        let tag: String
        let timestamp: Int64
        let ref: (tag: String, target: Int64)?
    }

    /// Random chats, anchors (ids and timestamps, present or between messages, before the
    /// first and after the last), criteria, sizes and flags: the engine agrees with a
    /// model that filters every message.
    @Test func windowsAgreeWithABruteForceModel() throws {
        var rng = SeededGenerator(seed: 11)
        for round in 0..<12 {
            // Half the rounds keep no message in memory: every window is read from the store.
            let harness = try EngineHarness(cacheBytes: round.isMultiple(of: 2) ? 0 : Engine.defaultCacheBytes)
            harness.connect("a", as: "alice")
            harness.connect("b", as: "bob")
            var now: Int64 = 1_700_000_000
            harness.clock.set(now)
            harness.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"w"}}"#)
            var messages = [Message(id: 1, sender: "alice", tag: "Join", timestamp: now, ref: nil)]
            let count = Int.random(in: 1...120, using: &rng)
            for _ in 0..<count {
                now += Int64.random(in: 0...2, using: &rng)
                harness.clock.set(now)
                let sender = Bool.random(using: &rng) ? "alice" : "bob"
                let tag = ["Text", "Text", "Note", "Pic"].randomElement(using: &rng)!
                var ref: (tag: String, target: Int64)?
                var refJSON = ""
                let userMessages = messages.filter { $0.tag != "Join" }
                if let target = userMessages.randomElement(using: &rng), Int.random(in: 0..<3, using: &rng) == 0 {
                    ref = (["Thread", "Quote"].randomElement(using: &rng)!, target.id)
                    refJSON = #","ref":[{"tag":"\#(ref!.tag)","messageId":\#(target.id)}]"#
                }
                let session = sender == "alice" ? "a" : "b"
                harness.send(session, #"{"chatMessageSend":{"chatId":"1","tag":"\#(tag)","content":"x"\#(refJSON)}}"#)
                messages.append(Message(id: Int64(messages.count + 1), sender: sender, tag: tag, timestamp: now, ref: ref))
            }
            _ = harness.events("a")
            for _ in 0..<60 {
                var criteria: [String] = []
                var tag: String?
                var notRefTag: String?
                var sender: String?
                var ref: (tag: String, target: Int64)?
                if Int.random(in: 0..<3, using: &rng) == 0 {
                    tag = ["Text", "Note", "Join"].randomElement(using: &rng)!
                    criteria.append(#""tag":"\#(tag!)""#)
                }
                if Int.random(in: 0..<4, using: &rng) == 0 {
                    notRefTag = "Thread"
                    criteria.append(#""notRefTag":"Thread""#)
                }
                if Int.random(in: 0..<4, using: &rng) == 0 {
                    sender = Bool.random(using: &rng) ? "alice" : "bob"
                    criteria.append(#""senderUri":"bbmpim://user/id/\#(sender == "alice" ? 1 : 2)""#)
                }
                if Int.random(in: 0..<5, using: &rng) == 0, let target = messages.randomElement(using: &rng) {
                    ref = (["Thread", "Quote"].randomElement(using: &rng)!, target.id)
                    criteria.append(#""ref":{"tag":"\#(ref!.tag)","messageId":\#(target.id)}"#)
                }
                let before = Int.random(in: 0...8, using: &rng)
                let after = Int.random(in: 0...8, using: &rng)
                let inclusive = Int.random(in: 0..<3, using: &rng) != 0
                let reverse = Int.random(in: 0..<3, using: &rng) == 0
                let byTime = Bool.random(using: &rng)
                let first = messages.first!.timestamp
                let last = messages.last!.timestamp
                let anchorText: String
                // The anchor is the ids [anchorFirst, anchorEnd).
                let anchorFirst: Int64
                let anchorEnd: Int64
                if byTime {
                    let t = Int64.random(in: (first - 2)...(last + 2), using: &rng)
                    anchorText = #""timestamp":\#(t)"#
                    let index = messages.firstIndex { $0.timestamp >= t } ?? messages.count
                    anchorFirst = Int64(index) + 1
                    anchorEnd = index < messages.count && messages[index].timestamp == t ? anchorFirst + 1 : anchorFirst
                } else {
                    let id = Int64.random(in: 1...Int64(messages.count + 2), using: &rng)
                    anchorText = #""messageId":\#(id)"#
                    anchorFirst = id
                    anchorEnd = id + 1
                }
                func matches(_ m: Message) -> Bool {
                    if let tag, m.tag != tag { return false }
                    if notRefTag != nil, m.ref?.tag == "Thread" { return false }
                    if let sender, m.sender != sender { return false }
                    if let ref, !(m.ref?.tag == ref.tag && m.ref?.target == ref.target) { return false }
                    return true
                }
                let matching = messages.filter(matches)
                let older = matching.filter { $0.id < anchorFirst }.map(\.id)
                let newer = matching.filter { $0.id >= anchorEnd }.map(\.id)
                let anchored = matching.filter { $0.id >= anchorFirst && $0.id < anchorEnd }.map(\.id)
                var expected = Array(older.suffix(before)) + (inclusive ? anchored : []) + Array(newer.prefix(after))
                if reverse { expected.reverse() }
                let criteriaText = ([#""chatId":"1""#] + criteria).joined(separator: ",")
                let got = window(
                    harness, #""window":{\#(anchorText),"before":\#(before),"after":\#(after),"inclusive":\#(inclusive),"reverse":\#(reverse)}"#,
                    criteria: criteriaText)
                let context = "criteria {\(criteriaText)} anchor \(anchorText) before \(before) after \(after) inclusive \(inclusive) reverse \(reverse)"
                #expect(got.ids == expected, Comment(rawValue: context))
                #expect(got.hasMoreBefore == (older.count > before), Comment(rawValue: context))
                #expect(got.hasMoreAfter == (newer.count > after), Comment(rawValue: context))
                if got.ids != expected { return }
            }
        }
    }

    struct Window {
        var ids: [Int64] = []
        var hasMoreBefore: Bool?
        var hasMoreAfter: Bool?
    }

    private func window(_ harness: EngineHarness, _ window: String, criteria: String = #""chatId":"1""#) -> Window {
        harness.submit("a", #"{"requestListMatching":{"type":"chatMessage","cookie":"w","criteria":{\#(criteria)},\#(window)}}"#)
        var result = Window()
        // The header, then chunks of the matches, the final one `last` (protocol v2).
        let events = harness.typedEvents("a")
        guard let matching = events.first?.messagesMatching else {
            Issue.record("the answer does not open with listMatching: \(events)")
            return result
        }
        result.hasMoreBefore = matching.hasMoreBefore
        result.hasMoreAfter = matching.hasMoreAfter
        for (index, event) in events.dropFirst().enumerated() {
            guard let chunk = event.messageChunk else {
                Issue.record("unexpected \(event)")
                continue
            }
            #expect(chunk.last == (index == events.count - 2 ? true : nil))
            result.ids += chunk.elements.map(\.messageId)
        }
        return result
    }
}

/// A small deterministic generator (SplitMix64): the same seed, the same chats.
struct SeededGenerator: RandomNumberGenerator {
    private var state: UInt64
    init(seed: UInt64) { state = seed }
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
