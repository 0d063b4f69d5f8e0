import PostgresNIO
import Storage

/// The outbox in PostgreSQL: every node's notifier takes from it, and `FOR UPDATE SKIP
/// LOCKED` with the lease (`due` moved on) gives each notification to one of them.
extension PostgresStore: NotificationOutbox {
    public func takeDueNotifications(now: Int64, leaseUntil: Int64, limit: Int) throws -> [NotificationRow] {
        let sql: SQL = #"""
            UPDATE notification_outbox n SET due = \#(leaseUntil), attempts = n.attempts + 1
            FROM (
                SELECT chat, id, "user" FROM notification_outbox WHERE due <= \#(now) ORDER BY due LIMIT \#(Int64(limit)) FOR UPDATE SKIP LOCKED
            ) t
            WHERE n.chat = t.chat AND n.id = t.id AND n."user" = t."user"
            RETURNING n.chat, n.id, n."user", n.created, n.attempts
            """#
        return try withConnection { connection in
            try run(connection, sql).map { row in
                let (chat, id, user, created, attempts) = try row.decode((Int64, Int64, Int64, Int64, Int64).self)
                return NotificationRow(key: NotificationKey(chat: chat, id: id, user: user), created: created, due: leaseUntil, attempts: attempts)
            }
        }
    }

    public func finishNotifications(done: [NotificationKey], retry: [(key: NotificationKey, due: Int64)]) throws {
        try withConnection { connection in
            if !done.isEmpty {
                try run(
                    connection,
                    #"""
                    DELETE FROM notification_outbox n USING unnest(\#(done.map(\.chat))::bigint[], \#(done.map(\.id))::bigint[], \#(done.map(\.user))::bigint[])
                    AS u(chat, id, "user") WHERE n.chat = u.chat AND n.id = u.id AND n."user" = u."user"
                    """#)
            }
            if !retry.isEmpty {
                try run(
                    connection,
                    #"""
                    UPDATE notification_outbox n SET due = u.due
                    FROM unnest(\#(retry.map(\.key.chat))::bigint[], \#(retry.map(\.key.id))::bigint[], \#(retry.map(\.key.user))::bigint[], \#(retry.map(\.due))::bigint[])
                    AS u(chat, id, "user", due) WHERE n.chat = u.chat AND n.id = u.id AND n."user" = u."user"
                    """#)
            }
        }
    }

    public func trimNotifications(keep: Int) throws -> Int {
        try withConnection { connection in
            let count = try run(connection, "SELECT count(*) FROM notification_outbox").first?.decode(Int64.self) ?? 0
            guard count > Int64(keep) else { return 0 }
            let sql: SQL = #"""
                DELETE FROM notification_outbox n USING (
                    SELECT chat, id, "user" FROM notification_outbox ORDER BY created, chat, id, "user" LIMIT \#(count - Int64(keep)) FOR UPDATE SKIP LOCKED
                ) t WHERE n.chat = t.chat AND n.id = t.id AND n."user" = t."user" RETURNING 1
                """#
            return try run(connection, sql).reduce(0) { count, _ in count + 1 }
        }
    }

    public func nextNotificationDue() throws -> Int64? {
        try withConnection { connection in try run(connection, "SELECT min(due) FROM notification_outbox").first?.decode(Int64?.self) ?? nil }
    }
}
