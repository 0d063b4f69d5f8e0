import GRDB
import Storage

extension SQLiteStore: NotificationOutbox {
    public func takeDueNotifications(now: Int64, leaseUntil: Int64, limit: Int) throws -> [NotificationRow] {
        try pool.write { db in
            let rows = try Row.fetchAll(
                db, sql: "SELECT chat, id, user, created, due, attempts FROM notification_outbox WHERE due <= ? ORDER BY due LIMIT ?",
                arguments: [now, limit])
            let lease = try db.cachedStatement(sql: "UPDATE notification_outbox SET due = ?, attempts = attempts + 1 WHERE chat = ? AND id = ? AND user = ?")
            return try rows.map { row in
                let key = NotificationKey(chat: row[0], id: row[1], user: row[2])
                try lease.execute(arguments: [leaseUntil, key.chat, key.id, key.user])
                return NotificationRow(key: key, created: row[3], due: leaseUntil, attempts: row[5] + 1)
            }
        }
    }

    public func finishNotifications(done: [NotificationKey], retry: [(key: NotificationKey, due: Int64)]) throws {
        guard !done.isEmpty || !retry.isEmpty else { return }
        try pool.write { db in
            let delete = try db.cachedStatement(sql: "DELETE FROM notification_outbox WHERE chat = ? AND id = ? AND user = ?")
            for key in done { try delete.execute(arguments: [key.chat, key.id, key.user]) }
            let reschedule = try db.cachedStatement(sql: "UPDATE notification_outbox SET due = ? WHERE chat = ? AND id = ? AND user = ?")
            for (key, due) in retry { try reschedule.execute(arguments: [due, key.chat, key.id, key.user]) }
        }
    }

    public func trimNotifications(keep: Int) throws -> Int {
        try pool.write { db in
            let count = try Int.fetchOne(db, sql: "SELECT count(*) FROM notification_outbox") ?? 0
            guard count > keep else { return 0 }
            try db.execute(
                sql: """
                    DELETE FROM notification_outbox WHERE (chat, id, user) IN
                        (SELECT chat, id, user FROM notification_outbox ORDER BY created, chat, id, user LIMIT ?)
                    """,
                arguments: [count - keep])
            return db.changesCount
        }
    }

    public func nextNotificationDue() throws -> Int64? {
        try pool.read { db in try Int64.fetchOne(db, sql: "SELECT min(due) FROM notification_outbox") }
    }
}
