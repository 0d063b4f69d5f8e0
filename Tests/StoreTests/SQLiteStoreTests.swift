import Foundation
import GRDB
import Store
import XCTest
@testable import SQLiteStore

final class SQLiteStoreTests: XCTestCase {
    private var directory: URL!

    override func setUpWithError() throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("store-tests-\(UUID())")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
    }

    override func tearDownWithError() throws {
        try? FileManager.default.removeItem(at: directory)
    }

    /// A database the first release wrote (only `v1-users`) opens with today's code: its
    /// users stay, and the later tables arrive empty.
    func testAVersionOneStoreIsMigrated() throws {
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
        let snapshot = try store.loadSnapshot()
        XCTAssertEqual(snapshot.users, [UserRecord(number: 1, userId: "alice", regId: 42), UserRecord(number: 2, userId: "bob", regId: 43)])
        XCTAssertEqual(snapshot.chats, [])
        XCTAssertEqual(snapshot.messages, [])
        // And today's rows can be written into it.
        var batch = StoreBatch()
        batch.chats = [ChatRow(number: 1, subject: "after the upgrade", isOneToOne: false, invitePolicy: "ParticipantsOnly", isDefunct: false, data: nil, lastMessage: 0)]
        try store.commit(batch)
        XCTAssertEqual(try store.loadSnapshot().chats.map(\.subject), ["after the upgrade"])
    }

    /// Every kind of row comes back as it was written, and a row written again replaces it.
    func testRowsRoundTrip() throws {
        let store = try SQLiteStore(writer: DatabaseQueue())
        var batch = StoreBatch()
        batch.newUsers = [UserRecord(number: 1, userId: "alice", regId: 7), UserRecord(number: 2, userId: "bob", regId: 8)]
        batch.chats = [ChatRow(number: 1, subject: "s", isOneToOne: true, invitePolicy: "AdminsOnly", isDefunct: true, data: #"{"k":[1,2]}"#, lastMessage: 2)]
        var starter = MemberRow(chat: 1, user: 1, isActive: true, isAdmin: true, joinedAt: 1, leftAt: nil, isHidden: false, localData: nil,
                                deliveredUpTo: 2, readUpTo: 2)
        starter.privateData = #"{"mine":true}"#
        batch.members = [
            starter,
            MemberRow(chat: 1, user: 2, isActive: false, isAdmin: false, joinedAt: 1, leftAt: 2, isHidden: true, localData: #"{"x":1}"#, deliveredUpTo: 1, readUpTo: 0),
        ]
        var first = MessageRow(chat: 1, id: 1, sender: 1, tag: "Text", content: "héllo ✓", data: #"{"a":null}"#, refs: [], timestamp: 1_700_000_000,
                               isControl: false, neverCountsUnread: false, isRecalled: false, changeSeq: 1, searchRow: 1)
        first.fileName = "a.pdf"
        first.fileBlob = String(repeating: "ab", count: 32)
        first.fileSize = 1234
        first.attachment = "Stored"
        let second = MessageRow(chat: 1, id: 2, sender: 2, tag: "Text", content: nil, data: nil, refs: [RefRow(tag: "Quote", target: 1), RefRow(tag: "Thread", target: 1)],
                                timestamp: 1_700_000_001, isControl: true, neverCountsUnread: true, isRecalled: false, changeSeq: 2, searchRow: 0)
        batch.messages = [first, second]
        var state = MessageUserRow(chat: 1, id: 1, user: 2, localData: #"{"seen":true}"#, isDeleted: false)
        state.fileDownloaded = true
        batch.messageUsers = [state]
        try store.commit(batch)

        let snapshot = try store.loadSnapshot()
        XCTAssertEqual(snapshot.users, batch.newUsers)
        XCTAssertEqual(snapshot.chats, batch.chats)
        XCTAssertEqual(snapshot.members, batch.members)
        XCTAssertEqual(snapshot.messages, batch.messages)
        XCTAssertEqual(snapshot.messageUsers, batch.messageUsers)

        // A recall rewrites the message and drops its references.
        var recalled = second
        recalled.isRecalled = true
        recalled.refs = []
        var again = StoreBatch()
        again.messages = [recalled]
        try store.commit(again)
        XCTAssertEqual(try store.loadSnapshot().messages, [first, recalled])
    }

    /// A file store keeps `synchronous = FULL` after GRDB's WAL set-up lowered it to
    /// NORMAL: every commit is synced before it is announced.
    func testCommitsAreSynced() throws {
        let store = try SQLiteStore(directory: directory)
        XCTAssertEqual(try store.synchronousLevel(), 2)
    }

    /// A second process on the same directory is refused while the first holds it.
    func testOneProcessPerDirectory() throws {
        let first = try SQLiteStore(directory: directory)
        XCTAssertThrowsError(try SQLiteStore(directory: directory)) { error in
            XCTAssertTrue("\(error)".contains("another chatcore process"))
        }
        _ = first
    }
}
