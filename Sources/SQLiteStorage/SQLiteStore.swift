import Foundation
import GRDB
import Storage
import Synchronization
import Threads

#if canImport(Glibc)
    import Glibc
#endif

/// `ChatStore` on one SQLite file (WAL, synchronous=FULL) through GRDB.
///
/// The data directory holds `chatcore.sqlite` and a `lock` file: one process at a time
/// may serve a directory, because the engine keeps state in memory.
public final class SQLiteStore: Sendable {
    public let directory: URL?
    let pool: any DatabaseWriter
    private let lockDescriptor: Int32?
    /// Whether the last process stopped cleanly and nothing changed the files since:
    /// then SQLite's own guarantees cover the file and no whole check is needed.
    public let stoppedCleanly: Bool
    /// The store was created by this open (there was nothing to check).
    public let isNew: Bool
    /// Set by `closeCleanly`: a whole-file check it interrupts reports nothing, and one
    /// not started yet does not start. `checking`: the check reads the store now, and the
    /// pool is closed only once it does not (GRDB's pool must not be closed while another
    /// thread reads it: ThreadSanitizer saw a clean stop close it under the check).
    private let check = Locked<(closing: Bool, checking: Bool)>((false, false))
    /// The whole file was found undamaged since this process opened it (or needed no
    /// check): only then may a clean stop say the store was left whole.
    private let knownWhole = Atomic<Bool>(false)

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
        // Was the file changed while no chatcore had it (the state its last clean stop
        // wrote no longer matches: a copy, a restore)? Then it is checked as after a
        // crash: what start-up reads now, the whole file in the background. It was the
        // whole file before listening: a 10M-message store copied from elsewhere, with
        // its pages not in memory, first listened 35 s after the start.
        let lastStop = SQLiteStore.lastStop(directory: directory, path: path)
        isNew = lastStop == .none
        stoppedCleanly = lastStop == .clean || lastStop == .none
        knownWhole.store(stoppedCleanly, ordering: .sequentiallyConsistent)
        do {
            pool = try DatabasePool(path: path, configuration: configuration)
            try SQLiteStore.prepare(pool, name: path)
            SQLiteStore.writeState("open", directory: directory)
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
        stoppedCleanly = false
        isNew = false
        pool = writer
        try SQLiteStore.prepare(writer, name: writer.path)
    }

    // MARK: knowing whether the file changed while chatcore did not have it

    /// Where the store says how it was left: `open` while a process serves it (a crash
    /// leaves it so), `clean SIZE MTIME` after a clean stop, `unchecked` after a clean stop
    /// before the whole-file check a crash or a copy calls for had ended.
    private static func statePath(_ directory: URL) -> String {
        directory.appendingPathComponent("store-state").path
    }

    private static func fileStamp(_ path: String) -> String? {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        return "\(info.st_size) \(info.st_mtim.tv_sec).\(info.st_mtim.tv_nsec)"
    }

    /// Writes the state (advisory: when it cannot be written, the next open knows less
    /// and checks in the background, nothing more).
    private static func writeState(_ state: String, directory: URL) {
        let path = statePath(directory)
        let temporary = path + ".new"
        let descriptor = open(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o644)
        guard descriptor >= 0 else { return }
        let bytes = Array((state + "\n").utf8)
        let written = bytes.withUnsafeBytes { write(descriptor, $0.baseAddress, $0.count) }
        close(descriptor)
        if written == bytes.count { rename(temporary, path) } else { unlink(temporary) }
    }

    /// Size and modification time of the database and of its write-ahead log.
    private static func stamps(_ path: String) -> String {
        (fileStamp(path) ?? "none") + " " + (fileStamp(path + "-wal") ?? "none")
    }

    private enum LastStop { case clean, unclean, none }

    /// How the last process left the store: stopped cleanly (and the files are as it left
    /// them), or not (a crash, no state written: a store of an older release, or files
    /// changed since the clean stop: a copy, a restore), which are checked alike.
    private static func lastStop(directory: URL, path: String) -> LastStop {
        // No database and no log: a new store, nothing to check.
        if fileStamp(path) == nil && fileStamp(path + "-wal") == nil { return .none }
        guard let state = try? String(contentsOfFile: statePath(directory), encoding: .utf8), state.hasPrefix("clean ") else { return .unclean }
        let recorded = state.dropFirst("clean ".count).trimmingCharacters(in: .whitespacesAndNewlines)
        return stamps(path) == recorded ? .clean : .unclean
    }

    /// A clean stop (nothing is written after it): the connections are closed (SQLite
    /// checkpoints the log into the file as the last one closes, so it happens before, not
    /// after, what follows), then how the files were left is written, so that the next
    /// open can tell whether anything else changed them meanwhile. A whole-file check
    /// still running is interrupted, and the store not marked clean if it cannot close, or
    /// if that check had not yet found it whole: the next start checks it again (a clean
    /// stop soon after a crash or a copy had let the next start trust a damaged file).
    public func closeCleanly() {
        guard let directory else { return }
        check.change { $0.closing = true }
        if let pool = pool as? DatabasePool {
            // Interrupted again until it has stopped: an interrupt that comes before its
            // statement runs is lost.
            while check.withLock({ $0.checking }) {
                pool.interrupt()
                check.wait(until: { !$0.checking }, deadline: Date(timeIntervalSinceNow: 0.05)) { _ in }
            }
            do {
                try pool.close()
            } catch {
                return
            }
        }
        guard knownWhole.load(ordering: .sequentiallyConsistent) else {
            SQLiteStore.writeState("unchecked", directory: directory)
            return
        }
        let path = directory.appendingPathComponent("chatcore.sqlite").path
        SQLiteStore.writeState("clean " + SQLiteStore.stamps(path), directory: directory)
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
    ///
    /// The migrations run before, under NORMAL: each is a transaction of its own, and
    /// FULL synced the log after each one (a new store's start made 26 syncs before its
    /// first request, 12 so). Under NORMAL a crash may lose the last migrations done,
    /// never half of one, and the next start runs them again; the first commit under FULL
    /// syncs the log with them in it before anything is announced.
    static func prepare(_ writer: any DatabaseWriter, name: String) throws {
        try SQLiteStore.migrator.migrate(writer)
        let level = try writer.writeWithoutTransaction { db in
            try db.execute(sql: "PRAGMA synchronous = FULL")
            return try Int.fetchOne(db, sql: "PRAGMA synchronous")
        }
        guard level == 2 else {
            throw OpenError(description: "the store \(name) does not keep synchronous = FULL (it reads \(level.map(String.init) ?? "nothing"))")
        }
        // What start-up reads (per user and per chat, bounded by neither messages nor
        // history) is checked now; the message tables are checked in the background
        // (`checkInBackground`), so that opening does not read the whole file.
        for table in SQLiteStore.directoryTables {
            let check = try writer.read { db in try String.fetchOne(db, sql: "PRAGMA quick_check(\(table))") }
            guard check == "ok" else {
                throw OpenError(
                    description: "the store \(name) is damaged (quick_check of \(table): \(check ?? "no answer")); restore it from a backup or move it away")
            }
        }
    }

    /// The tables start-up reads whole.
    static let directoryTables = ["user", "endpoint", "chat", "member", "counter"]

    /// Checks the whole store on a thread of its own, at the lowest priority, and reports
    /// what it found (nil: nothing is damaged). A damaged page otherwise shows only when
    /// a request reads it.
    public func checkInBackground(report: @escaping @Sendable (String?) -> Void) {
        let thread = Thread { [self] in
            nameCurrentThread("store-check")
            setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, 19)
            let started = check.change { state -> Bool in
                guard !state.closing else { return false }
                state.checking = true
                return true
            }
            guard started else { return }
            let found: String?
            do {
                let lines = try pool.read { db in try String.fetchAll(db, sql: "PRAGMA quick_check") }
                found = lines == ["ok"] ? nil : lines.prefix(5).joined(separator: "; ")
            } catch {
                found = "\(error)"
            }
            // A check the clean stop interrupted found nothing.
            let closing = check.change { state -> Bool in
                state.checking = false
                return state.closing
            }
            guard !closing else { return }
            if found == nil { knownWhole.store(true, ordering: .sequentiallyConsistent) }
            report(found)
        }
        thread.start()
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
            try db.execute(
                sql: """
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
            try db.execute(
                sql: """
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
            try db.execute(
                sql: """
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
            try db.execute(
                sql: """
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
        migrator.registerMigration("v7-store-is-the-truth") { db in
            // What start-up used to recompute from every message is kept, exact, with the
            // data it counts: unread counts, last activity, reference counts, the uses of
            // stored contents, the feed and search positions. Marks moving over many
            // messages are one row each (range_change). Tags and search rows get indexes:
            // messages are read on demand now.
            try db.execute(
                sql: """
                    ALTER TABLE member ADD COLUMN numUnread INTEGER NOT NULL DEFAULT 0;
                    UPDATE member SET numUnread = (
                        SELECT count(*) FROM message m
                        WHERE m.chat = member.chat AND m.id >= max(member.readUpTo + 1, member.joinedAt)
                          AND (member.leftAt IS NULL OR m.id < member.leftAt)
                          AND m.sender != member.user AND m.neverCountsUnread = 0);
                    ALTER TABLE chat ADD COLUMN lastActivity INTEGER NOT NULL DEFAULT 0;
                    UPDATE chat SET lastActivity = coalesce(
                        (SELECT max(timestamp) FROM message m WHERE m.chat = chat.number AND m.neverCountsUnread = 0), 0);
                    CREATE TABLE ref_count (
                        chat INTEGER NOT NULL,
                        target INTEGER NOT NULL,
                        tag TEXT NOT NULL,
                        count INTEGER NOT NULL,
                        newest INTEGER NOT NULL,
                        PRIMARY KEY (chat, target, tag)
                    ) WITHOUT ROWID;
                    INSERT INTO ref_count (chat, target, tag, count, newest)
                        SELECT chat, target, tag, count(*), max(source) FROM message_ref GROUP BY chat, target, tag;
                    CREATE TABLE range_change (
                        chat INTEGER NOT NULL,
                        lastSeq INTEGER NOT NULL,
                        firstSeq INTEGER NOT NULL,
                        firstId INTEGER NOT NULL,
                        lastId INTEGER NOT NULL,
                        PRIMARY KEY (chat, lastSeq)
                    ) WITHOUT ROWID;
                    CREATE TABLE blob (
                        hash TEXT PRIMARY KEY,
                        uses INTEGER NOT NULL
                    ) WITHOUT ROWID;
                    INSERT INTO blob (hash, uses)
                        SELECT hash, count(*) FROM (
                            SELECT thumbBlob AS hash FROM message WHERE isRecalled = 0 AND thumbBlob IS NOT NULL
                            UNION ALL
                            SELECT fileBlob FROM message WHERE isRecalled = 0 AND fileBlob IS NOT NULL)
                        GROUP BY hash;
                    CREATE TABLE counter (
                        name TEXT PRIMARY KEY,
                        value INTEGER NOT NULL
                    ) WITHOUT ROWID;
                    INSERT INTO counter (name, value) VALUES
                        ('changeSeq', (SELECT coalesce(max(changeSeq), 0) FROM message)),
                        ('searchRow', (SELECT coalesce(max(searchRow), 0) FROM message));
                    CREATE INDEX message_by_tag ON message(chat, tag, id);
                    CREATE INDEX message_by_search_row ON message(searchRow) WHERE searchRow > 0;
                    """)
        }
        migrator.registerMigration("v8-external-ids") { db in
            // A sender's own identifier of a message: a send that names one already used
            // in the chat is answered with that message instead of posting another.
            try db.execute(
                sql: """
                    ALTER TABLE message ADD COLUMN externalId TEXT;
                    CREATE INDEX message_by_external_id ON message(chat, sender, externalId) WHERE externalId IS NOT NULL;
                    """)
        }
        migrator.registerMigration("v9-reactions") { db in
            // Each user's reactions to a message, kept with what else they did to it alone.
            try db.execute(sql: "ALTER TABLE message_user ADD COLUMN reactions TEXT")
        }
        migrator.registerMigration("v10-mentions") { db in
            // Whom a message mentions (shown on it), each member's unread mentions, and
            // each user's mentions across chats, newest first.
            try db.execute(
                sql: """
                    ALTER TABLE message ADD COLUMN mentions TEXT;
                    ALTER TABLE message ADD COLUMN mentionsAll INTEGER NOT NULL DEFAULT 0;
                    ALTER TABLE member ADD COLUMN numUnreadMentions INTEGER NOT NULL DEFAULT 0;
                    CREATE TABLE message_mention (
                        user INTEGER NOT NULL,
                        timestamp INTEGER NOT NULL,
                        chat INTEGER NOT NULL,
                        id INTEGER NOT NULL,
                        PRIMARY KEY (user, timestamp, chat, id)
                    ) WITHOUT ROWID;
                    """)
        }
        migrator.registerMigration("v11-pins") { db in
            // Who may pin (set when a chat starts: admins in a group, both in a one-to-one
            // chat), and the chat's pinned messages.
            try db.execute(
                sql: """
                    ALTER TABLE chat ADD COLUMN pinPolicy TEXT NOT NULL DEFAULT 'AdminsOnly';
                    UPDATE chat SET pinPolicy = 'ParticipantsOnly' WHERE isOneToOne = 1;
                    ALTER TABLE chat ADD COLUMN pins TEXT;
                    """)
        }
        migrator.registerMigration("v12-notifications") { db in
            // Notifications waiting to be sent to the application's server, written with
            // the messages they are about (`NotificationOutbox`), and what each endpoint
            // is woken with.
            try db.execute(
                sql: """
                    ALTER TABLE endpoint ADD COLUMN pushToken TEXT;
                    CREATE TABLE notification_outbox (
                        seq INTEGER PRIMARY KEY,
                        chat INTEGER NOT NULL,
                        id INTEGER NOT NULL,
                        user INTEGER NOT NULL,
                        created INTEGER NOT NULL,
                        due INTEGER NOT NULL,
                        attempts INTEGER NOT NULL DEFAULT 0
                    );
                    CREATE INDEX notification_by_due ON notification_outbox(due);
                    """)
        }
        migrator.registerMigration("v13-moderation") { db in
            // Members muted or banned by a chat's admins, and what users chose for
            // themselves (presence hidden, whom they block) and when they were last seen.
            try db.execute(
                sql: """
                    ALTER TABLE member ADD COLUMN mutedUntil INTEGER;
                    ALTER TABLE member ADD COLUMN isBanned INTEGER NOT NULL DEFAULT 0;
                    CREATE TABLE user_settings (
                        user INTEGER PRIMARY KEY,
                        presenceHidden INTEGER NOT NULL DEFAULT 0,
                        lastActive INTEGER,
                        blocked TEXT NOT NULL DEFAULT ''
                    );
                    """)
        }
        return migrator
    }

}
