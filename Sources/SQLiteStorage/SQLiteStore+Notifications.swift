import GRDB
import Storage

extension SQLiteStore: NotificationOutbox {
    public func takeDueNotifications(now: Int64, leaseUntil: Int64, limit: Int) throws -> [NotificationRow] {
        // Most looks find nothing due: they are answered without taking the write lock.
        let earliest = try pool.read { db in try Int64.fetchOne(db, sql: "SELECT min(due) FROM notification_outbox") }
        guard let earliest, earliest <= now else { return [] }
        return try pool.write { db in
            let rows = try Row.fetchAll(
                db, sql: "SELECT seq, chat, id, user, created, attempts FROM notification_outbox WHERE due <= ? ORDER BY due LIMIT ?",
                arguments: [now, limit])
            let lease = try db.cachedStatement(sql: "UPDATE notification_outbox SET due = ?, attempts = attempts + 1 WHERE seq = ?")
            return try rows.map { row in
                let seq: Int64 = row[0]
                try lease.execute(arguments: [leaseUntil, seq])
                return NotificationRow(
                    seq: seq, key: NotificationKey(chat: row[1], id: row[2], user: row[3]), created: row[4], due: leaseUntil, attempts: row[5] + 1)
            }
        }
    }

    public func finishNotifications(done: [Int64], retry: [(seq: Int64, due: Int64)]) throws {
        guard !done.isEmpty || !retry.isEmpty else { return }
        try pool.write { db in
            let delete = try db.cachedStatement(sql: "DELETE FROM notification_outbox WHERE seq = ?")
            for seq in done { try delete.execute(arguments: [seq]) }
            let reschedule = try db.cachedStatement(sql: "UPDATE notification_outbox SET due = ? WHERE seq = ?")
            for (seq, due) in retry { try reschedule.execute(arguments: [due, seq]) }
        }
    }

    public func trimNotifications(keep: Int) throws -> Int {
        // The rows between the lowest and highest numbers are at most their difference: most
        // looks need no count.
        let (low, high) = try pool.read { db -> (Int64, Int64) in
            let row = try Row.fetchOne(db, sql: "SELECT min(seq), max(seq) FROM notification_outbox")
            return (row?[0] ?? 0, row?[1] ?? 0)
        }
        guard high - low + 1 > keep else { return 0 }
        return try pool.write { db in
            let count = try Int.fetchOne(db, sql: "SELECT count(*) FROM notification_outbox") ?? 0
            guard count > keep else { return 0 }
            try db.execute(
                sql: "DELETE FROM notification_outbox WHERE seq IN (SELECT seq FROM notification_outbox ORDER BY seq LIMIT ?)", arguments: [count - keep])
            return db.changesCount
        }
    }

    public func nextNotificationDue() throws -> Int64? {
        try pool.read { db in try Int64.fetchOne(db, sql: "SELECT min(due) FROM notification_outbox") }
    }
}
