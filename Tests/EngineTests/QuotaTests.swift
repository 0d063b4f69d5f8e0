import ChatProtocol
import Foundation
import GRDB
import SQLiteStorage
import Storage
import Testing

@testable import ChatEngine

/// What one user may cost the others: the quotas as a part (with a clock the test moves),
/// and through the engine, where a refusal is a `requestFailed` that names its limit.
@Suite(.serialized) final class QuotaTests {
    private final class Clock: @unchecked Sendable {
        var seconds = 0.0
    }

    @Test func aBucketRefusesPastItsBurstSaysWhenToRetryAndRefills() throws {
        let clock = Clock()
        var quotas = Quotas(limits: QuotaLimits(chatsPerMinute: 6), now: { clock.seconds })
        for _ in 0..<6 { try quotas.take(1, of: .chats, by: 1) }
        do {
            _ = try quotas.take(1, of: .chats, by: 1)
            Issue.record("expected an error")
        } catch {
            let refusal = error as! ProtocolError
            #expect(refusal.code == .rateLimited)
            #expect(refusal.reason.contains("--max-chats-per-minute"), Comment(rawValue: refusal.reason))
            #expect(refusal.retryAfterMs == 10_000)
        }
        // Another user is not held by the first one's quota.
        try quotas.take(1, of: .chats, by: 2)
        clock.seconds += 10
        try quotas.take(1, of: .chats, by: 1)
        #expect(throws: (any Error).self) { _ = try quotas.take(1, of: .chats, by: 1) }
        // More than a whole burst at once can never pass: no time to wait is given.
        do {
            _ = try quotas.take(7, of: .chats, by: 3)
            Issue.record("expected an error")
        } catch {
            #expect(((error as! ProtocolError).retryAfterMs) == nil)
        }
    }

    @Test func zeroMeansNoLimitAndSearchesAtOnceAreBounded() throws {
        var quotas = Quotas(limits: QuotaLimits(requestsPerSecond: 0, searchesPerUser: 2, searchesInAll: 3), now: { 0 })
        for _ in 0..<100_000 { try quotas.take(1, of: .requests, by: 1) }
        try quotas.beginSearch(by: 1)
        try quotas.beginSearch(by: 1)
        #expect(throws: (any Error).self) { _ = try quotas.beginSearch(by: 1) }
        try quotas.beginSearch(by: 2)
        #expect(throws: (any Error).self, "three run in all") { _ = try quotas.beginSearch(by: 3) }
        quotas.endSearch(by: 1)
        try quotas.beginSearch(by: 3)
    }

    /// One user made 49,800 users with 200 `chatStart`s of 249 invitees; the users an
    /// invitation makes are counted against its user.
    @Test func invitationsMakeAtMostTheirUsersShareOfNewUsers() throws {
        let h = try EngineHarness(quotas: QuotaLimits(newUsersPerMinute: 500))
        h.connect("a", as: "alice")
        func start(_ round: Int) -> [String] {
            let invitees = (0..<249).map { #"{"userId":"u\#(round)-\#($0)"}"# }.joined(separator: ",")
            return h.send("a", #"{"chatStart":{"cookie":"c\#(round)","invitees":[\#(invitees)],"subject":"s"}}"#)
        }
        #expect(!start(0).joined().contains("RateLimited"))
        #expect(!start(1).joined().contains("RateLimited"))
        let refused = start(2).joined()
        #expect(refused.contains(#""error":"RateLimited""#) && refused.contains("--max-new-users-per-minute"), Comment(rawValue: refused))
        #expect(refused.contains(#""retryAfterMs":"#), Comment(rawValue: refused))
    }

    /// Two user ids can derive one regId (63 bits: a birthday search finds a pair): the
    /// request that would make the second fails, and nothing else in its batch does.
    @Test func aRegIdCollisionFailsOnlyTheRequestThatMeetsIt() throws {
        let database = try DatabaseQueue()
        let store = try SQLiteStore(writer: database)
        try database.write { db in
            try db.execute(sql: #"INSERT INTO user (number, userId, regId) VALUES (1, 'mallory', ?)"#, arguments: [RegId.derive("bob")])
        }
        let h = try EngineHarness(store: store)
        h.connect("a", as: "alice")
        h.connect("c", as: "carol")
        h.send("c", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"alice"}],"subject":"ok"}}"#)
        _ = h.events("a")
        h.submitTogether([
            ("a", #"{"chatStart":{"cookie":"bob","invitees":[{"userId":"bob"}],"subject":"x"}}"#),
            ("c", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"still sent","cookie":"m"}}"#)
        ])
        let alice = h.events("a").joined()
        #expect(alice.contains("chatStartFailed") && alice.contains("regId"), Comment(rawValue: alice))
        #expect(alice.contains("still sent"), "carol's send in the same batch reached alice: \(alice)")
        // Signing in as such an id fails that sign-in alone.
        h.open("b")
        h.engine.put(h.authentication("b", as: "bob"))
        #expect(h.events("b").joined().contains(#""error":"InvalidParameter""#))
        #expect(h.send("c", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"after","cookie":"n"}}"#).joined().contains("Sent"))
    }

    /// Matching takes time linear in the text: a query of 1,022 `a` and `bb` against
    /// 70,000 `a` compared 70 million bytes per candidate.
    @Test func theNeedleIsFoundInLinearTime() {
        let needle = SearchNeedle(String(repeating: "a", count: 1022) + "bb")
        let haystack = "abb" + String(repeating: "a", count: 70_000)
        let started = ContinuousClock.now
        for _ in 0..<20 { #expect(!needle.isFound(in: haystack)) }
        #expect(needle.isFound(in: haystack + "bb"))
        #expect(SearchNeedle("ABAB").isFound(in: "xxabaabab"))
        #expect(!SearchNeedle("abab").isFound(in: "abaab"))
        #expect(SearchNeedle("caf\u{E9}").isFound(in: "Un CAF\u{C9} noir"))
        // Not a timing bar: a guard against going back to quadratic time (seconds).
        #expect((ContinuousClock.now - started) < .seconds(5))
    }
}
