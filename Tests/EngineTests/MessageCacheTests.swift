import XCTest
@testable import Engine

/// The cache of hot messages lets go of what it no longer holds.
final class MessageCacheTests: XCTestCase {
    private func record(_ id: Int64) -> MessageRecord {
        MessageRecord(chat: 1, id: id, sender: 1, tag: "Text", content: String(repeating: "x", count: 100), data: nil, refs: [],
                      timestamp: 0, isControl: false, neverCountsUnread: false, changeSeq: id)
    }

    /// Records dropped by `removeAll` (a failed commit rebuilds memory), by eviction, or with
    /// the cache itself are freed: the list linking them must not keep them alive.
    func testDroppedRecordsAreFreed() {
        weak var evicted: MessageRecord?
        weak var removed: MessageRecord?
        weak var released: MessageRecord?
        do {
            let cache = MessageCache(budget: 0)
            var first: MessageRecord? = record(1)
            evicted = first
            cache.put(first!)
            first = nil
            cache.put(record(2))
            cache.trim()
            XCTAssertNil(evicted, "an evicted record is freed")
            XCTAssertEqual(cache.count, 0)

            let big = MessageCache(budget: 1 << 30)
            for id in Int64(1)...1000 { big.put(record(id)) }
            removed = big.get(chat: 1, id: 500)
            big.removeAll()
            XCTAssertNil(removed, "removeAll frees the records")

            let kept = MessageCache(budget: 1 << 30)
            for id in Int64(1)...200_000 { kept.put(record(id)) }
            released = kept.get(chat: 1, id: 7)
        }
        XCTAssertNil(released, "a cache that goes frees its records (without recursing once per record)")
    }
}
