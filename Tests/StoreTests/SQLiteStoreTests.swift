import Foundation
import GRDB
import Storage
import Testing

@testable import SQLiteStorage

@Suite(.serialized) final class SQLiteStoreTests {
    private var directory: URL!

    init() throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("store-tests-\(UUID())")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
    }

    deinit {
        try? FileManager.default.removeItem(at: directory)
    }

    /// A database the first release wrote (only `v1-users`) opens with today's code: its
    /// users stay, and the later tables arrive empty.
    @Test func aVersionOneStoreIsMigrated() throws {
        let path = directory.appendingPathComponent("chatcore.sqlite").path
        do {
            let old = try DatabaseQueue(path: path)
            try SQLiteStore.migrator.migrate(old, upTo: "v1-users")
            try old.write { db in
                try db.execute(sql: "INSERT INTO user (number, userId, regId) VALUES (1, 'alice', 42), (2, 'bob', 43)")
            }
            try old.close()
        }
        let store = try SQLiteStore(directory: directory)
        let directory = try store.loadDirectory()
        #expect(directory.users == ([UserRecord(number: 1, userId: "alice", regId: 42), UserRecord(number: 2, userId: "bob", regId: 43)]))
        #expect(directory.chats == [])
        #expect(directory.counters == StoreCounters())
        // And today's rows can be written into it.
        var batch = StoreBatch()
        batch.directory.newChats = [
            ChatRow(number: 1, subject: "after the upgrade", isOneToOne: false, invitePolicy: "ParticipantsOnly", isDefunct: false, data: nil, lastMessage: 0)
        ]
        try store.commit(batch)
        #expect((try store.loadDirectory().chats.map(\.subject)) == (["after the upgrade"]))
    }

    /// Every kind of row comes back as it was written; a change writes only its columns.
    @Test func rowsRoundTrip() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        var batch = StoreBatch()
        batch.directory.newUsers = [UserRecord(number: 1, userId: "alice", regId: 7), UserRecord(number: 2, userId: "bob", regId: 8)]
        let chat = ChatRow(
            number: 1, subject: "s", isOneToOne: true, invitePolicy: "AdminsOnly", isDefunct: true, data: #"{"k":[1,2]}"#, lastMessage: 2,
            lastActivity: 1_700_000_000)
        batch.directory.newChats = [chat]
        let starter = MemberRow(
            chat: 1, user: 1, isActive: true, isAdmin: true, joinedAt: 1, leftAt: nil, isHidden: false, localData: nil,
            privateData: #"{"mine":true}"#, deliveredUpTo: 2, readUpTo: 2)
        let other = MemberRow(
            chat: 1, user: 2, isActive: false, isAdmin: false, joinedAt: 1, leftAt: 2, isHidden: true, localData: #"{"x":1}"#,
            deliveredUpTo: 1, readUpTo: 0, numUnread: 1)
        batch.directory.members = [starter, other]
        var first = MessageRow(
            chat: 1, id: 1, sender: 1, tag: "Text", content: "héllo ✓", data: #"{"a":null}"#, refs: [], timestamp: 1_700_000_000,
            isControl: false, neverCountsUnread: false, isRecalled: false, changeSeq: 1, searchRow: 1)
        first.attachments.fileName = "a.pdf"
        first.attachments.fileBlob = String(repeating: "ab", count: 32)
        first.attachments.fileSize = 1234
        first.attachments.attachment = "Stored"
        let second = MessageRow(
            chat: 1, id: 2, sender: 2, tag: "Text", content: nil, data: nil, refs: [RefRow(tag: "Quote", target: 1), RefRow(tag: "Thread", target: 1)],
            timestamp: 1_700_000_001, isControl: true, neverCountsUnread: true, isRecalled: false, changeSeq: 2, searchRow: 0)
        batch.newMessages = [first, second]
        batch.refCounts = [
            RefCountRow(chat: 1, target: 1, tag: "Quote", count: 1, newest: 2), RefCountRow(chat: 1, target: 1, tag: "Thread", count: 1, newest: 2)
        ]
        var state = MessageUserRow(chat: 1, id: 1, user: 2, localData: #"{"seen":true}"#, isDeleted: false)
        state.fileDownloaded = true
        batch.privateStates = [state]
        batch.rangeChanges = [RangeChangeRow(chat: 1, firstSeq: 3, firstId: 1, lastId: 2)]
        batch.blobUses = [first.attachments.fileBlob!: 2]
        batch.counters = StoreCounters(changeSeq: 4, searchRow: 1)
        try store.commit(batch)

        let directory = try store.loadDirectory()
        #expect(directory.users == batch.directory.newUsers)
        #expect(directory.chats == [chat])
        #expect(directory.members == ([starter, other]))
        #expect(directory.counters == StoreCounters(changeSeq: 4, searchRow: 1))
        var firstRead = first
        firstRead.refCounts = batch.refCounts
        firstRead.privateStates = [state]
        #expect((try store.messages(chat: 1, in: 1...5)) == ([firstRead, second]))
        #expect((try store.messages(chat: 1, ids: [2])) == [second])
        #expect((try store.rangeChanges(chats: [1, 2], after: 3)) == batch.rangeChanges)
        #expect((try store.rangeChanges(chats: [1], after: 4)) == [])
        #expect((try store.changedMessages(chats: [1], after: 1, limit: 10)) == ([MessageChangeRow(chat: 1, id: 2, changeSeq: 2)]))
        #expect((try store.changedMessages(chats: [2], after: 0, limit: 10)) == [])
        #expect((try store.blobUses(first.attachments.fileBlob!)) == 2)

        // A change writes the columns it names, nothing else; a recall drops references.
        var recalled = second
        recalled.isRecalled = true
        recalled.refs = []
        recalled.changeSeq = 9
        recalled.tag = "Not written"
        var again = StoreBatch()
        again.messageUpdates = [Update(recalled, columns: [.isRecalled, .changeSeq])]
        again.droppedReferences = [(1, 2)]
        again.refCounts = [RefCountRow(chat: 1, target: 1, tag: "Quote", count: 0, newest: 0)]
        again.blobUses = [first.attachments.fileBlob!: -2]
        var readMark = other
        readMark.readUpTo = 2
        readMark.numUnread = 0
        readMark.localData = "not written"
        again.directory.memberUpdates = [Update(readMark, columns: [.readUpTo, .numUnread])]
        try store.commit(again)
        var expected = second
        expected.isRecalled = true
        expected.refs = []
        expected.changeSeq = 9
        #expect((try store.messages(chat: 1, ids: [2])) == [expected])
        #expect((try store.messages(chat: 1, ids: [1]).first?.refCounts) == [batch.refCounts[1]])
        #expect((try store.blobUses(first.attachments.fileBlob!)) == 0)
        var member = other
        member.readUpTo = 2
        member.numUnread = 0
        #expect((try store.loadDirectory().members.last) == member)
    }

    /// The queries the engine asks: matches by tag, reference, sender and without a
    /// reference tag, up and down; the first message of a second; the references left
    /// once some are being recalled.
    @Test func queriesUseWhatTheEngineAsks() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        var batch = StoreBatch()
        batch.directory.newChats = [
            ChatRow(number: 1, subject: "q", isOneToOne: false, invitePolicy: "ParticipantsOnly", isDefunct: false, data: nil, lastMessage: 6)
        ]
        func message(_ id: Int64, sender: Int64, tag: String, at time: Int64, refs: [RefRow] = []) -> MessageRow {
            MessageRow(
                chat: 1, id: id, sender: sender, tag: tag, content: "m\(id)", data: nil, refs: refs, timestamp: time, isControl: false,
                neverCountsUnread: false, isRecalled: false, changeSeq: id, searchRow: 0)
        }
        batch.newMessages = [
            message(1, sender: 1, tag: "Join", at: 10),
            message(2, sender: 1, tag: "Text", at: 10),
            message(3, sender: 2, tag: "Text", at: 12, refs: [RefRow(tag: "Thread", target: 2)]),
            message(4, sender: 2, tag: "Pic", at: 12),
            message(5, sender: 1, tag: "Text", at: 15, refs: [RefRow(tag: "Thread", target: 2)]),
            message(6, sender: 2, tag: "Text", at: 15)
        ]
        try store.commit(batch)
        let all = MessageFilter(firstId: 1)
        #expect((try store.messageIds(chat: 1, matching: all, from: 3, ascending: true, limit: 2)) == ([3, 4]))
        #expect((try store.messageIds(chat: 1, matching: all, from: 3, ascending: false, limit: 5)) == ([3, 2, 1]))
        var text = all
        text.tag = "Text"
        #expect((try store.messageIds(chat: 1, matching: text, from: 6, ascending: false, limit: 10)) == ([6, 5, 3, 2]))
        var thread = all
        thread.referring = RefRow(tag: "Thread", target: 2)
        #expect((try store.messageIds(chat: 1, matching: thread, from: 1, ascending: true, limit: 10)) == ([3, 5]))
        var timeline = text
        timeline.notRefTag = "Thread"
        #expect((try store.messageIds(chat: 1, matching: timeline, from: 1, ascending: true, limit: 10)) == ([2, 6]))
        var bob = all
        bob.sender = 2
        bob.firstId = 4
        #expect((try store.messageIds(chat: 1, matching: bob, from: 1, ascending: true, limit: 10)) == ([4, 6]))
        var recallable = all
        recallable.sender = 1
        recallable.onlyRecallable = true
        #expect((try store.messageIds(chat: 1, matching: recallable, from: 1, ascending: true, limit: 10)) == ([2, 5]))
        #expect((try store.firstMessage(chat: 1, notBefore: 12)) == 3)
        #expect((try store.firstMessage(chat: 1, notBefore: 13)) == 5)
        #expect((try store.firstMessage(chat: 1, notBefore: 16)) == nil)
        #expect((try store.firstMessage(chat: 1, notBefore: 0)) == 1)
        let left = try store.references(chat: 1, to: 2, tag: "Thread", excluding: [5])
        #expect(left.count == 1)
        #expect(left.newest == 3)
    }

    /// A file store keeps `synchronous = FULL` after GRDB's WAL set-up lowered it to
    /// NORMAL: every commit is synced before it is announced.
    @Test func commitsAreSynced() throws {
        let store = try SQLiteStore(directory: directory)
        #expect((try store.synchronousLevel()) == 2)
    }

    /// A second process on the same directory is refused while the first holds it.
    @Test func oneProcessPerDirectory() throws {
        let first = try SQLiteStore(directory: directory)
        do {
            _ = try SQLiteStore(directory: directory)
            Issue.record("expected an error")
        } catch {
            #expect("\(error)".contains("another chatcore process"))
        }
        _ = first
    }

    /// Refilling the search index reads its entries page by page: each page must be a seek
    /// in the search-row index, not a scan and sort of every message (a `?` bound to the
    /// row does not tell SQLite that the partial index applies).
    @Test func searchEntriesAreReadThroughTheirIndex() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        let plan = try store.pool.read { db in
            try Row.fetchAll(db, sql: "EXPLAIN QUERY PLAN " + SQLiteStore.searchEntriesSQL, arguments: [5, 10]).map { $0["detail"] as String }
        }
        #expect(plan == (["SEARCH message USING INDEX message_by_search_row (searchRow>?)"]))
    }

    /// A search checks its hits against the store a page at a time: a look-up by key per
    /// hit, not a scan of the messages or of the user's private states.
    @Test func searchHitsAreCheckedByKey() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        let plan = try store.pool.read { db in
            try Row.fetchAll(db, sql: "EXPLAIN QUERY PLAN " + SQLiteStore.searchableSQL, arguments: ["[[1,2,3]]", 1]).map { $0["detail"] as String }
        }
        #expect(
            plan
                == ([
                    "SCAN h VIRTUAL TABLE INDEX 1:", "SEARCH m USING PRIMARY KEY (chat=? AND id=?)", "CORRELATED SCALAR SUBQUERY 1",
                    "SEARCH u USING PRIMARY KEY (chat=? AND id=? AND user=?)"
                ]))
    }

    /// Search hits the store no longer has as found are left out: a recalled message (its
    /// search row is 0 now), one deleted by the user for themselves, one the store does
    /// not have at all.
    @Test func searchHitsAreCheckedAgainstTheStore() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        var batch = StoreBatch()
        batch.directory.newChats = [
            ChatRow(number: 1, subject: "q", isOneToOne: false, invitePolicy: "ParticipantsOnly", isDefunct: false, data: nil, lastMessage: 3)
        ]
        batch.newMessages = [(1, 1), (2, 0), (3, 3)].map { id, row in
            MessageRow(
                chat: 1, id: id, sender: 1, tag: "Text", content: row == 0 ? nil : "m", data: nil, refs: [], timestamp: 10,
                isControl: false, neverCountsUnread: false, isRecalled: row == 0, changeSeq: id, searchRow: row)
        }
        batch.privateStates = [MessageUserRow(chat: 1, id: 3, user: 7, localData: nil, isDeleted: true)]
        try store.commit(batch)
        let hits = [SearchHit(chat: 1, id: 1, row: 1), SearchHit(chat: 1, id: 2, row: 2), SearchHit(chat: 1, id: 3, row: 3), SearchHit(chat: 1, id: 9, row: 9)]
        #expect((try store.searchable(by: 7, among: hits)) == ([SearchHit(chat: 1, id: 1, row: 1)]))
        #expect((try store.searchable(by: 8, among: hits)) == ([SearchHit(chat: 1, id: 1, row: 1), SearchHit(chat: 1, id: 3, row: 3)]))
        #expect((try store.searchable(by: 8, among: [])) == [])
    }

    /// A page of search entries is bounded by its texts' bytes as well as by their number:
    /// 10,000 entries of 70 KB were one page of 700 MB. The page ends before the entry
    /// that would pass the bound, and always has one entry, however long.
    @Test func searchEntriesArePagedByTheirBytes() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        var batch = StoreBatch()
        batch.directory.newChats = [
            ChatRow(number: 1, subject: "q", isOneToOne: false, invitePolicy: "ParticipantsOnly", isDefunct: false, data: nil, lastMessage: 6)
        ]
        batch.newMessages = (1...6).map { id in
            MessageRow(
                chat: 1, id: id, sender: 1, tag: "Text", content: String(repeating: "é", count: 500), data: nil, refs: [], timestamp: 10,
                isControl: false, neverCountsUnread: false, isRecalled: false, changeSeq: id, searchRow: id)
        }
        try store.commit(batch)
        // 1,000 bytes each (two-byte characters).
        #expect((try store.searchEntries(after: 0, limit: 100, maxBytes: 3_000).map(\.row)) == ([1, 2, 3]))
        #expect((try store.searchEntries(after: 0, limit: 100, maxBytes: 2_999).map(\.row)) == ([1, 2]))
        #expect((try store.searchEntries(after: 3, limit: 100, maxBytes: 10).map(\.row)) == [4])
        #expect((try store.searchEntries(after: 2, limit: 2, maxBytes: 1 << 20).map(\.row)) == ([3, 4]))
        #expect((try store.searchEntries(after: 6, limit: 100, maxBytes: 1 << 20).map(\.row)) == [])
    }

    /// Texts handed to the search index faster than it takes them wait for it past its
    /// backlog limit, instead of piling up in memory: the backlog never exceeds the limit
    /// by more than the batch being handed over, and everything handed over is indexed.
    @Test func theSearchIndexBacklogIsBounded() throws {
        let limit = 1 << 20
        let index = try SQLiteSearchIndex(directory: directory, backlogLimit: limit)
        var row: Int64 = 0
        var largest = 0
        var batchBytes = 0
        for _ in 0..<100 {
            let entries = (0..<200).map { _ in
                row += 1
                return SearchEntry(row: row, chat: 1 + row % 5, id: row, text: "entry \(row) " + String(repeating: "lorem ipsum \(row % 97) ", count: 60))
            }
            batchBytes = SQLiteSearchIndex.bytes(of: entries)
            index.add(entries, removing: [])
            largest = max(largest, index.backlogBytes)
        }
        #expect(largest <= (limit + batchBytes), "the backlog reached \(largest) bytes (limit \(limit), a batch \(batchBytes))")
        try index.waitUntilWritten()
        #expect(index.backlogBytes == 0)
        #expect((try index.indexedUpTo()) == row)
        let hits = try index.searchMessages(containing: "entry \(row) ", chats: [1 + row % 5], belowRow: nil, limit: 10, budget: SearchBudget())
        #expect(hits.map(\.id) == [row])
    }
}
