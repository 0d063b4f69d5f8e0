import PostgresNIO
import Storage

/// The outbox in PostgreSQL: every node's notifier takes from it, and `FOR UPDATE SKIP
/// LOCKED` with the lease (`due` moved on) gives each notification to one of them.
extension PostgresStore: NotificationOutbox {
    public func takeDueNotifications(now: Int64, leaseUntil: Int64, limit: Int) throws -> [NotificationRow] {
        let sql: SQL = #"""
            UPDATE notification_outbox n SET due = \#(leaseUntil), attempts = n.attempts + 1
            FROM (SELECT seq FROM notification_outbox WHERE due <= \#(now) ORDER BY due LIMIT \#(Int64(limit)) FOR UPDATE SKIP LOCKED) t
            WHERE n.seq = t.seq
            RETURNING n.seq, n.chat, n.id, n."user", n.created, n.attempts
            """#
        return try withConnection { connection in
            try run(connection, sql).map { row in
                let (seq, chat, id, user, created, attempts) = try row.decode((Int64, Int64, Int64, Int64, Int64, Int64).self)
                return NotificationRow(seq: seq, key: NotificationKey(chat: chat, id: id, user: user), created: created, due: leaseUntil, attempts: attempts)
            }
        }
    }

    public func finishNotifications(done: [Int64], retry: [(seq: Int64, due: Int64)]) throws {
        try withConnection { connection in
            if !done.isEmpty {
                try run(connection, "DELETE FROM notification_outbox WHERE seq = ANY(\(done)::bigint[])")
            }
            if !retry.isEmpty {
                try run(
                    connection,
                    #"""
                    UPDATE notification_outbox n SET due = u.due FROM unnest(\#(retry.map(\.seq))::bigint[], \#(retry.map(\.due))::bigint[]) AS u(seq, due)
                    WHERE n.seq = u.seq
                    """#)
            }
        }
    }

    public func trimNotifications(keep: Int) throws -> Int {
        try withConnection { connection in
            let bounds = try run(connection, "SELECT coalesce(min(seq), 0), coalesce(max(seq), 0) FROM notification_outbox").first?.decode((Int64, Int64).self)
            guard let (low, high) = bounds, high - low + 1 > Int64(keep) else { return 0 }
            let count = try run(connection, "SELECT count(*) FROM notification_outbox").first?.decode(Int64.self) ?? 0
            guard count > Int64(keep) else { return 0 }
            let sql: SQL = #"""
                DELETE FROM notification_outbox WHERE seq IN (
                    SELECT seq FROM notification_outbox ORDER BY seq LIMIT \#(count - Int64(keep)) FOR UPDATE SKIP LOCKED
                ) RETURNING 1
                """#
            return try run(connection, sql).reduce(0) { count, _ in count + 1 }
        }
    }

    public func nextNotificationDue() throws -> Int64? {
        try withConnection { connection in try run(connection, "SELECT min(due) FROM notification_outbox").first?.decode(Int64?.self) ?? nil }
    }
}
