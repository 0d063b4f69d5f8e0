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
    public let directory: URL
    private let pool: DatabasePool
    private let lockDescriptor: Int32

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
        configuration.prepareDatabase { db in
            try db.execute(sql: "PRAGMA synchronous = FULL")
        }
        let path = directory.appendingPathComponent("chatcore.sqlite").path
        do {
            pool = try DatabasePool(path: path, configuration: configuration)
            try SQLiteStore.migrator.migrate(pool)
            let check = try pool.read { db in try String.fetchOne(db, sql: "PRAGMA quick_check") }
            guard check == "ok" else {
                throw OpenError(description: "the store \(path) is damaged (quick_check: \(check ?? "no answer")); restore it from a backup or move it away")
            }
        } catch let error as OpenError {
            close(descriptor)
            throw error
        } catch {
            close(descriptor)
            throw OpenError(description: "cannot open the store \(path): \(error)")
        }
    }

    deinit {
        close(lockDescriptor)
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
        return migrator
    }

    public func loadSnapshot() throws -> StoreSnapshot {
        try pool.read { db in
            let rows = try Row.fetchAll(db, sql: "SELECT number, userId, regId FROM user ORDER BY number")
            return StoreSnapshot(users: rows.map { UserRecord(number: $0["number"], userId: $0["userId"], regId: $0["regId"]) })
        }
    }

    public func commit(_ batch: StoreBatch) throws {
        guard !batch.isEmpty else { return }
        try pool.write { db in
            for user in batch.newUsers {
                try db.execute(sql: "INSERT INTO user (number, userId, regId) VALUES (?, ?, ?)", arguments: [user.number, user.userId, user.regId])
            }
        }
    }
}
