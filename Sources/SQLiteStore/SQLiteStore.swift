import Foundation
import GRDB
import Store

#if canImport(Glibc)
import Glibc
#endif

/// `ChatStore` on one SQLite file (WAL, synchronous=FULL) through GRDB.
///
/// The data directory holds `chatcore.sqlite` and a `lock` file: one process at a time
/// may serve a directory, because the engine keeps state in memory.
public final class SQLiteStore: ChatStore {
    public let directory: URL?
    private let pool: any DatabaseWriter
    private let lockDescriptor: Int32?

    public struct OpenError: Error, CustomStringConvertible {
        public let description: String
    }

    public init(directory: URL) throws {
        self.directory = directory
        do {
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        } catch {
            throw OpenError(description: "cannot create the data directory \(directory.path): \(error.localizedDescription)")
        }
        let lockPath = directory.appendingPathComponent("lock").path
        let descriptor = open(lockPath, O_RDWR | O_CREAT | O_CLOEXEC, 0o644)
        guard descriptor >= 0 else {
            throw OpenError(description: "cannot open \(lockPath): \(String(cString: strerror(errno)))")
        }
        guard flock(descriptor, LOCK_EX | LOCK_NB) == 0 else {
            close(descriptor)
            throw OpenError(description: "another chatcore process is serving \(directory.path) (its lock file is held)")
        }
        lockDescriptor = descriptor

        var configuration = Configuration()
        configuration.label = "chatcore"
        let path = directory.appendingPathComponent("chatcore.sqlite").path
        do {
            pool = try DatabasePool(path: path, configuration: configuration)
            try SQLiteStore.prepare(pool, name: path)
        } catch let error as OpenError {
            close(descriptor)
            throw error
        } catch {
            close(descriptor)
            throw OpenError(description: "cannot open the store \(path): \(error)")
        }
    }

    /// A store on a database the caller opened (tests: an in-memory `DatabaseQueue`, or
    /// a writer that fails on purpose). No lock file is taken.
    public init(writer: any DatabaseWriter) throws {
        directory = nil
        lockDescriptor = nil
        pool = writer
        try SQLiteStore.prepare(writer, name: writer.path)
    }

    deinit {
        if let lockDescriptor { close(lockDescriptor) }
    }

    /// The writer's `PRAGMA synchronous` now (2: FULL).
    func synchronousLevel() throws -> Int? {
        try pool.writeWithoutTransaction { try Int.fetchOne($0, sql: "PRAGMA synchronous") }
    }

    /// Every commit must be synced before its `Sent` is announced: `synchronous = FULL`
    /// makes SQLite sync the WAL at each commit. It is set here, after opening, because
    /// GRDB's WAL set-up (`Database.setUpWALMode`, run by `DatabasePool.init` after
    /// `prepareDatabase`) lowers it to NORMAL, which syncs only at checkpoints.
    static func prepare(_ writer: any DatabaseWriter, name: String) throws {
        let level = try writer.writeWithoutTransaction { db in
            try db.execute(sql: "PRAGMA synchronous = FULL")
            return try Int.fetchOne(db, sql: "PRAGMA synchronous")
        }
        guard level == 2 else {
            throw OpenError(description: "the store \(name) does not keep synchronous = FULL (it reads \(level.map(String.init) ?? "nothing"))")
        }
        try SQLiteStore.migrator.migrate(writer)
        let check = try writer.read { db in try String.fetchOne(db, sql: "PRAGMA quick_check") }
        guard check == "ok" else {
            throw OpenError(description: "the store \(name) is damaged (quick_check: \(check ?? "no answer")); restore it from a backup or move it away")
        }
    }

    /// Named, append-only migrations: never edit one that has shipped, add the next.
    static var migrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        migrator.registerMigration("v1-users") { db in
            try db.create(table: "user") { table in
                table.column("number", .integer).primaryKey()
                table.column("userId", .text).notNull().unique()
                table.column("regId", .integer).notNull().unique()
            }
        }
        migrator.registerMigration("v2-chats") { db in
            try db.execute(sql: """
                CREATE TABLE chat (
                    number INTEGER PRIMARY KEY,
                    subject TEXT NOT NULL,
                    isOneToOne INTEGER NOT NULL,
                    invitePolicy TEXT NOT NULL,
                    isDefunct INTEGER NOT NULL,
                    data TEXT,
                    lastMessage INTEGER NOT NULL
                );
                CREATE TABLE member (
                    chat INTEGER NOT NULL,
                    user INTEGER NOT NULL,
                    isActive INTEGER NOT NULL,
                    isAdmin INTEGER NOT NULL,
                    joinedAt INTEGER NOT NULL,
                    leftAt INTEGER,
                    isHidden INTEGER NOT NULL,
                    localData TEXT,
                    deliveredUpTo INTEGER NOT NULL,
                    readUpTo INTEGER NOT NULL,
                    PRIMARY KEY (chat, user)
                ) WITHOUT ROWID;
                CREATE INDEX member_by_user ON member(user);
                CREATE TABLE message (
                    chat INTEGER NOT NULL,
                    id INTEGER NOT NULL,
                    sender INTEGER NOT NULL,
                    tag TEXT NOT NULL,
                    content TEXT,
                    data TEXT,
                    timestamp INTEGER NOT NULL,
                    isControl INTEGER NOT NULL,
                    neverCountsUnread INTEGER NOT NULL,
                    isRecalled INTEGER NOT NULL,
                    changeSeq INTEGER NOT NULL,
                    PRIMARY KEY (chat, id)
                ) WITHOUT ROWID;
                CREATE INDEX message_by_change ON message(chat, changeSeq);
                CREATE TABLE message_ref (
                    chat INTEGER NOT NULL,
                    source INTEGER NOT NULL,
                    tag TEXT NOT NULL,
                    target INTEGER NOT NULL,
                    PRIMARY KEY (chat, source, tag)
                ) WITHOUT ROWID;
                CREATE INDEX message_ref_by_target ON message_ref(chat, target, tag, source);
                CREATE TABLE message_user (
                    chat INTEGER NOT NULL,
                    id INTEGER NOT NULL,
                    user INTEGER NOT NULL,
                    localData TEXT,
                    isDeleted INTEGER NOT NULL,
                    PRIMARY KEY (chat, id, user)
                ) WITHOUT ROWID;
                """)
        }
        migrator.registerMigration("v3-search") { db in
            // A message's row in the search index (SQLiteSearchIndex, its own file). It
            // grows with every message: newest first is row order.
            try db.execute(sql: """
                ALTER TABLE message ADD COLUMN searchRow INTEGER NOT NULL DEFAULT 0;
                WITH ordered AS (
                    SELECT chat, id, ROW_NUMBER() OVER (ORDER BY timestamp, chat, id) AS row FROM message
                    WHERE content IS NOT NULL AND isRecalled = 0
                      AND tag NOT IN ('Join', 'Leave', 'Subject', 'Gap', 'Shred', 'Clear', 'Admin', 'Remove')
                )
                UPDATE message SET searchRow = (SELECT row FROM ordered WHERE ordered.chat = message.chat AND ordered.id = message.id)
                WHERE EXISTS (SELECT 1 FROM ordered WHERE ordered.chat = message.chat AND ordered.id = message.id);
                """)
        }
        migrator.registerMigration("v4-attachments") { db in
            try db.execute(sql: """
                ALTER TABLE message ADD COLUMN thumbName TEXT;
                ALTER TABLE message ADD COLUMN thumbBlob TEXT;
                ALTER TABLE message ADD COLUMN fileName TEXT;
                ALTER TABLE message ADD COLUMN fileBlob TEXT;
                ALTER TABLE message ADD COLUMN fileSize INTEGER;
                ALTER TABLE message ADD COLUMN attachment TEXT;
                ALTER TABLE message_user ADD COLUMN thumbDetached INTEGER NOT NULL DEFAULT 0;
                ALTER TABLE message_user ADD COLUMN fileDownloaded INTEGER NOT NULL DEFAULT 0;
                """)
        }
        migrator.registerMigration("v5-private-data") { db in
            try db.execute(sql: "ALTER TABLE member ADD COLUMN privateData TEXT")
        }
        migrator.registerMigration("v6-endpoints") { db in
            try db.execute(sql: """
                CREATE TABLE endpoint (
                    id INTEGER PRIMARY KEY,
                    user INTEGER NOT NULL,
                    description TEXT NOT NULL,
                    nickname TEXT NOT NULL,
                    isLegacyDelegate INTEGER NOT NULL,
                    ordinal INTEGER NOT NULL
                );
                CREATE INDEX endpoint_by_user ON endpoint(user, ordinal);
                """)
        }
        return migrator
    }

    public func loadSnapshot() throws -> StoreSnapshot {
        try pool.read { db in
            var snapshot = StoreSnapshot()
            snapshot.users = try Row.fetchAll(db, sql: "SELECT number, userId, regId FROM user ORDER BY number").map {
                UserRecord(number: $0["number"], userId: $0["userId"], regId: $0["regId"])
            }
            snapshot.endpoints = try Row.fetchAll(db, sql: "SELECT * FROM endpoint ORDER BY ordinal").map {
                EndpointRow(id: $0["id"], user: $0["user"], description: $0["description"], nickname: $0["nickname"],
                            isLegacyDelegate: $0["isLegacyDelegate"], ordinal: $0["ordinal"])
            }
            snapshot.chats = try Row.fetchAll(db, sql: "SELECT * FROM chat ORDER BY number").map {
                ChatRow(number: $0["number"], subject: $0["subject"], isOneToOne: $0["isOneToOne"], invitePolicy: $0["invitePolicy"],
                        isDefunct: $0["isDefunct"], data: $0["data"], lastMessage: $0["lastMessage"])
            }
            snapshot.members = try Row.fetchAll(db, sql: "SELECT * FROM member ORDER BY chat, user").map {
                var member = MemberRow(chat: $0["chat"], user: $0["user"], isActive: $0["isActive"], isAdmin: $0["isAdmin"], joinedAt: $0["joinedAt"],
                                       leftAt: $0["leftAt"], isHidden: $0["isHidden"], localData: $0["localData"],
                                       deliveredUpTo: $0["deliveredUpTo"], readUpTo: $0["readUpTo"])
                member.privateData = $0["privateData"]
                return member
            }
            var refs: [Int64: [Int64: [RefRow]]] = [:]
            let refRows = try Row.fetchCursor(db, sql: "SELECT chat, source, tag, target FROM message_ref ORDER BY chat, source, tag")
            while let row = try refRows.next() {
                refs[row["chat"], default: [:]][row["source"], default: []].append(RefRow(tag: row["tag"], target: row["target"]))
            }
            let messages = try Row.fetchCursor(db, sql: """
                SELECT chat, id, sender, tag, content, data, timestamp, isControl, neverCountsUnread, isRecalled, changeSeq, searchRow,
                       thumbName, thumbBlob, fileName, fileBlob, fileSize, attachment
                FROM message ORDER BY chat, id
                """)
            while let row = try messages.next() {
                let chat: Int64 = row[0]
                let id: Int64 = row[1]
                var message = MessageRow(
                    chat: chat, id: id, sender: row[2], tag: row[3], content: row[4], data: row[5],
                    refs: refs[chat]?[id] ?? [], timestamp: row[6], isControl: row[7], neverCountsUnread: row[8],
                    isRecalled: row[9], changeSeq: row[10], searchRow: row[11])
                message.thumbName = row[12]
                message.thumbBlob = row[13]
                message.fileName = row[14]
                message.fileBlob = row[15]
                message.fileSize = row[16]
                message.attachment = row[17]
                snapshot.messages.append(message)
            }
            snapshot.messageUsers = try Row.fetchAll(db, sql: "SELECT * FROM message_user").map {
                var row = MessageUserRow(chat: $0["chat"], id: $0["id"], user: $0["user"], localData: $0["localData"], isDeleted: $0["isDeleted"])
                row.thumbDetached = $0["thumbDetached"]
                row.fileDownloaded = $0["fileDownloaded"]
                return row
            }
            return snapshot
        }
    }

    public func commit(_ batch: StoreBatch) throws {
        guard !batch.isEmpty else { return }
        do {
            try write(batch)
        } catch let error as DatabaseError {
            switch error.resultCode.primaryResultCode {
            case .SQLITE_FULL: throw StoreFailure(.full, "the disk is full (\(error.message ?? "SQLITE_FULL"))")
            case .SQLITE_IOERR: throw StoreFailure(.io, "an I/O error (\(error.message ?? "SQLITE_IOERR"), extended code \(error.extendedResultCode.rawValue))")
            default: throw StoreFailure(.other, "\(error)")
            }
        }
    }

    private func write(_ batch: StoreBatch) throws {
        try pool.write { db in
            for user in batch.newUsers {
                try db.execute(sql: "INSERT INTO user (number, userId, regId) VALUES (?, ?, ?)", arguments: [user.number, user.userId, user.regId])
            }
            for endpoint in batch.endpoints {
                try db.execute(sql: """
                    INSERT OR REPLACE INTO endpoint (id, user, description, nickname, isLegacyDelegate, ordinal) VALUES (?, ?, ?, ?, ?, ?)
                    """, arguments: [endpoint.id, endpoint.user, endpoint.description, endpoint.nickname, endpoint.isLegacyDelegate, endpoint.ordinal])
            }
            for id in batch.removedEndpoints {
                try db.execute(sql: "DELETE FROM endpoint WHERE id = ?", arguments: [id])
            }
            if !batch.chats.isEmpty {
                let statement = try db.cachedStatement(sql: """
                    INSERT OR REPLACE INTO chat (number, subject, isOneToOne, invitePolicy, isDefunct, data, lastMessage)
                    VALUES (?, ?, ?, ?, ?, ?, ?)
                    """)
                for chat in batch.chats {
                    try statement.execute(arguments: [chat.number, chat.subject, chat.isOneToOne, chat.invitePolicy, chat.isDefunct, chat.data, chat.lastMessage])
                }
            }
            if !batch.members.isEmpty {
                let statement = try db.cachedStatement(sql: """
                    INSERT OR REPLACE INTO member (chat, user, isActive, isAdmin, joinedAt, leftAt, isHidden, localData, deliveredUpTo, readUpTo,
                                                   privateData)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    """)
                for member in batch.members {
                    try statement.execute(arguments: [member.chat, member.user, member.isActive, member.isAdmin, member.joinedAt, member.leftAt,
                                                      member.isHidden, member.localData, member.deliveredUpTo, member.readUpTo, member.privateData])
                }
            }
            if !batch.messages.isEmpty {
                let insert = try db.cachedStatement(sql: """
                    INSERT OR REPLACE INTO message (chat, id, sender, tag, content, data, timestamp, isControl, neverCountsUnread, isRecalled,
                                                    changeSeq, searchRow, thumbName, thumbBlob, fileName, fileBlob, fileSize, attachment)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    """)
                let insertRef = try db.cachedStatement(sql: "INSERT OR IGNORE INTO message_ref (chat, source, tag, target) VALUES (?, ?, ?, ?)")
                let clearRefs = try db.cachedStatement(sql: "DELETE FROM message_ref WHERE chat = ? AND source = ?")
                for message in batch.messages {
                    try insert.execute(arguments: [message.chat, message.id, message.sender, message.tag, message.content, message.data,
                                                   message.timestamp, message.isControl, message.neverCountsUnread, message.isRecalled, message.changeSeq,
                                                   message.searchRow, message.thumbName, message.thumbBlob, message.fileName, message.fileBlob,
                                                   message.fileSize, message.attachment])
                    // References only ever go away (a recall); they are never edited.
                    if message.refs.isEmpty {
                        if message.isRecalled { try clearRefs.execute(arguments: [message.chat, message.id]) }
                    } else {
                        for ref in message.refs {
                            try insertRef.execute(arguments: [message.chat, message.id, ref.tag, ref.target])
                        }
                    }
                }
            }
            if !batch.messageUsers.isEmpty {
                let statement = try db.cachedStatement(sql: """
                    INSERT OR REPLACE INTO message_user (chat, id, user, localData, isDeleted, thumbDetached, fileDownloaded)
                    VALUES (?, ?, ?, ?, ?, ?, ?)
                    """)
                for row in batch.messageUsers {
                    try statement.execute(arguments: [row.chat, row.id, row.user, row.localData, row.isDeleted, row.thumbDetached, row.fileDownloaded])
                }
            }
        }
    }
}
