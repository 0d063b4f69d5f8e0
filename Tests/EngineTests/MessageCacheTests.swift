import CMalloc
import GRDB
import SQLiteStorage
import Storage
import Testing

@testable import ChatEngine

#if canImport(Glibc)
    import Glibc
#endif

/// The cache of hot messages lets go of what it no longer holds.
@Suite(.serialized) final class MessageCacheTests {
    private func record(_ id: Int64) -> MessageRecord {
        MessageRecord(
            chat: 1, id: id, sender: 1, tag: "Text", content: String(repeating: "x", count: 100), data: nil, refs: [],
            timestamp: 0, isControl: false, neverCountsUnread: false, changeSeq: id)
    }

    /// Records dropped by `removeAll` (a failed commit rebuilds memory), by eviction, or with
    /// the cache itself are freed: the list linking them must not keep them alive.
    @Test func droppedRecordsAreFreed() {
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
            #expect(evicted == nil, "an evicted record is freed")
            #expect(cache.count == 0)

            let big = MessageCache(budget: 1 << 30)
            for id in Int64(1)...1000 { big.put(record(id)) }
            removed = big.get(chat: 1, id: 500)
            big.removeAll()
            #expect(removed == nil, "removeAll frees the records")

            let kept = MessageCache(budget: 1 << 30)
            for id in Int64(1)...200_000 { kept.put(record(id)) }
            released = kept.get(chat: 1, id: 7)
        }
        #expect(released == nil, "a cache that goes frees its records (without recursing once per record)")
    }

    /// A record stays while the batch that changed it last is not committed: a batch
    /// committed before it does not let it go.
    @Test func aRecordIsPinnedUntilTheBatchThatChangedItLastIsCommitted() {
        let cache = MessageCache(budget: 0)
        let first = record(1)
        let second = record(2)
        cache.pin(first, batch: 1)
        cache.pin(second, batch: 1)
        cache.pin(second, batch: 2)
        cache.unpin(through: 1)
        cache.trim()
        #expect(cache.get(chat: 1, id: 1) == nil)
        #expect(cache.get(chat: 1, id: 2) === second)
        cache.unpin(through: 2)
        cache.trim()
        #expect(cache.count == 0)
    }

    /// One commit can settle several batches at once (`unpin(through:)` a later one): what
    /// each of them pinned goes, what a batch after them pinned again stays, and a record
    /// that grew while pinned counts its new size once let go.
    @Test func unpinningThroughABatchLetsGoOfEveryBatchBeforeIt() {
        let records = (Int64(1)...4).map(record)
        let pins: [(record: MessageRecord, batch: Int)] = [(records[0], 1), (records[1], 2), (records[2], 2), (records[3], 3), (records[2], 4)]
        let cache = MessageCache(budget: 1 << 30)
        for pin in pins { cache.pin(pin.record, batch: pin.batch) }
        let before = cache.bytes
        records[1].content = String(repeating: "y", count: 5000)
        cache.unpin(through: 3)
        #expect(cache.bytes > (before + 4000), "the grown record is measured again")
        let budget = MessageCache(budget: 0)
        for pin in pins { budget.pin(pin.record, batch: pin.batch) }
        budget.unpin(through: 3)
        budget.trim()
        #expect(budget.count == 1)
        #expect(budget.get(chat: 1, id: 3) === records[2], "pinned by batch 4, which is not committed")
        budget.unpin(through: 4)
        budget.trim()
        #expect(budget.count == 0)
    }

    /// With no cache at all, the batch decided while the one before it is committed reads
    /// that batch's messages from memory (the store does not have them yet), and a query
    /// the store answers waits for the commit.
    @Test func theNextBatchSeesWhatIsBeingCommitted() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let h = try EngineHarness(store: store, cacheBytes: 0)
        h.connect("a", as: "alice")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        h.decideWhileCommitting(
            [("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"first","cookie":"c1"}}"#)], in: store,
            then: [
                ("a", #"{"requestListElements":{"type":"chatMessage","elements":[{"chatId":"1","messageId":"2"}],"cookie":"read"}}"#),
                (
                    "a",
                    #"{"requestListMatching":{"type":"chatMessage","cookie":"query","criteria":{"chatId":"1","tag":"Text"},"window":{"messageId":1,"before":0,"after":10}}}"#
                )
            ])
        let events = h.events("a")
        let read = events.filter { $0.contains(#""cookie":"read""#) }.joined()
        #expect(read.contains(#""content":"first""#), "\(events)")
        let query = events.filter { $0.contains(#""cookie":"query""#) }.joined()
        #expect(query.contains(#""content":"first""#), "\(events)")
        #expect(!(events.contains { $0.contains("requestFailed") }), "\(events)")
    }

    /// A message the next batch changed stays in memory when the batch before it is
    /// committed in its midst (a query waits for that commit): the store does not have the
    /// change yet, so a later request of the batch must still read it from memory.
    @Test func aChangeOfTheNextBatchOutlivesTheCommitOfTheOneBefore() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let h = try EngineHarness(store: store, cacheBytes: 0)
        h.connect("a", as: "alice")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"one"}}"#)
        h.send("a", #"{"chatStart":{"cookie":"t","invitees":[{"userId":"carol"}],"subject":"two"}}"#)
        h.decideWhileCommitting(
            [
                ("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"first","cookie":"c1"}}"#),
                ("a", #"{"chatMessageSend":{"chatId":"2","tag":"Text","content":"other","cookie":"c2"}}"#)
            ], in: store,
            then: [
                ("a", #"{"chatMessageSend":{"chatId":"1","tag":"Text","content":"second","cookie":"c3"}}"#),
                (
                    "a",
                    #"{"requestListMatching":{"type":"chatMessage","cookie":"query","criteria":{"chatId":"2","tag":"Text"},"window":{"messageId":1,"before":0,"after":10}}}"#
                ),
                ("a", #"{"requestListElements":{"type":"chatMessage","elements":[{"chatId":"1","messageId":"3"}],"cookie":"read"}}"#)
            ])
        let events = h.events("a")
        #expect(events.filter { $0.contains(#""cookie":"query""#) }.joined().contains(#""content":"other""#), "\(events)")
        #expect(events.filter { $0.contains(#""cookie":"read""#) }.joined().contains(#""content":"second""#), "\(events)")
        #expect(!(events.contains { $0.contains("requestFailed") }), "\(events)")
    }

    #if os(Linux)
        /// `--cache-mb` is what the cached records really take from the heap, texts, references
        /// and private states included, not a fraction of it: messages read as from the store
        /// (each row with its own texts) fill a cache, and the heap grows by what it counts.
        @Test(
            .disabled(
                if: ["__asan_init", "__tsan_init"].contains(where: { (name: String) in dlsym(nil, name) != nil }),
                "a sanitizer's allocator (make asan, make tsan) keeps a heap of its own, which the C library does not count"))
        func theBudgetCountsWhatTheRecordsReallyTakeFromTheHeap() throws {
            func row(_ id: Int64) -> MessageRow {
                let words = String(repeating: "word \(id) ", count: Int(id % 40))
                var row = MessageRow(
                    chat: 1 + id % 7, id: id, sender: 1 + id % 3, tag: id.isMultiple(of: 9) ? "PictureMessage" : "Text",
                    content: "message \(id): " + words, data: id.isMultiple(of: 4) ? #"{"kind":"note \#(id)","n":\#(id)}"# : nil,
                    refs: id.isMultiple(of: 5) ? [RefRow(tag: "Quote", target: id - 1)] : [], timestamp: 1_700_000_000 + id,
                    isControl: false, neverCountsUnread: false, isRecalled: false, changeSeq: id, searchRow: id)
                if id.isMultiple(of: 6) {
                    row.refCounts = [RefCountRow(chat: row.chat, target: id, tag: "Quote", count: 1, newest: id + 1)]
                    row.privateStates = [
                        MessageUserRow(
                            chat: row.chat, id: id, user: 2, localData: #"{"pinned":true,"note":"for later \#(id)"}"#,
                            isDeleted: false)
                    ]
                }
                return row
            }
            func heap() -> Int {
                let info = mallinfo2()
                return Int(info.uordblks + info.hblkhd)
            }
            let before = heap()
            let cache = MessageCache(budget: 1 << 40)
            for id in Int64(1)...50_000 { cache.put(MessageRecord(row(id), storing: false)) }
            let taken = heap() - before
            let ratio = Double(cache.bytes) / Double(taken)
            #expect((0.85...1.15).contains(ratio), "the cache counts \(cache.bytes) bytes for \(taken) taken from the heap (\(ratio))")
            withExtendedLifetime(cache) {}
        }
    #endif
}
