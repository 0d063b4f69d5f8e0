import PostgresNIO
import Store

/// Several deciding nodes (`--all-nodes-decide`, docs/several-deciding-nodes.md): each
/// commit logs what it changed (`node_commit`, in the commit's own statement), each node
/// says who is connected to it (`node_online`) and what its sessions said that is never
/// stored (`node_event`), and each reads the others' before it decides
/// (`othersActivity`). Rows are numbered from one sequence; a node's own rows are
/// committed in its order, so a reader that keeps, per slot, the last number it read
/// never misses one. The writer trims what is older than a minute (`trimFollowed`); a
/// node that had not read a trimmed row reads the store again whole.
extension PostgresStore {
    public var othersDecide: Bool { allNodesDecide }

    /// How long the others' commits and events are kept.
    static let followedSeconds = 60

    /// The commit's row of `node_commit`, as a clause of its statement.
    func logForOthers(_ batch: StoreBatch, _ statement: OneStatement) {
        guard allNodesDecide else { return }
        let entry = FollowedCommit(of: batch, feedAfter: 0)
        func pairs(_ grouped: [Int64: [Int64]]) -> ([Int64], [Int64]) {
            let flat = grouped.sorted { $0.key < $1.key }.flatMap { chat, ids in ids.map { (chat, $0) } }
            return (flat.map(\.0), flat.map(\.1))
        }
        let (rewrittenChat, rewrittenId) = pairs(entry.rewritten)
        let (insertedChat, insertedId) = pairs(entry.inserted)
        let (memberChat, memberUser) = pairs(entry.members)
        var binds = statement.binds()
        let slot = binds.add(Int64(batch.feedSlot))
        // Unmoved, the slot's position is the one its counter holds before this commit.
        let upTo = "coalesce(\(binds.add(batch.counters?.changeSeq))::bigint, (SELECT value FROM counter WHERE name = \(binds.add(FeedSlots.counterName(of: batch.feedSlot)))), \(binds.add(FeedSlots.base(of: batch.feedSlot))))"
        statement.add("""
            INSERT INTO node_commit (slot, "feedUpTo", chats, users, "rewrittenChat", "rewrittenId", "insertedChat", "insertedId", "memberChat", "memberUser")
            VALUES (\(slot)::int, \(upTo), \(binds.add(entry.chats))::bigint[], \(binds.add(entry.users))::bigint[],
                    \(binds.add(rewrittenChat))::bigint[], \(binds.add(rewrittenId))::bigint[], \(binds.add(insertedChat))::bigint[],
                    \(binds.add(insertedId))::bigint[], \(binds.add(memberChat))::bigint[], \(binds.add(memberUser))::bigint[])
            """, binds)
    }

    public func othersActivity(besides slot: Int, after cursor: FollowCursor?) throws -> OthersActivity? {
        try withConnection { connection in
            guard let cursor else { return try now(connection) }
            var activity = OthersActivity(cursor: cursor)
            if try anythingNew(besides: slot, after: cursor, connection) {
                // One snapshot: the chats as exactly the commits read left them.
                try run(connection, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                do {
                    guard let read = try commits(besides: slot, after: cursor, on: connection) else {
                        try run(connection, "ROLLBACK")
                        return nil
                    }
                    try run(connection, "COMMIT")
                    activity = read
                } catch {
                    _ = try? run(connection, "ROLLBACK")
                    throw error
                }
            }
            try readPresenceAndEvents(into: &activity, besides: slot, connection)
            return activity
        }
    }

    /// Whether another node committed after `cursor`, or rows it had not read were
    /// trimmed: one statement, when nothing happened (most of the looks of an idle node).
    private func anythingNew(besides slot: Int, after cursor: FollowCursor, _ connection: PostgresConnection) throws -> Bool {
        var binds = Binds()
        let known = PostgresStore.known(cursor.commits, &binds)
        return try run(connection, """
            SELECT EXISTS (SELECT 1 FROM node_commit c LEFT JOIN \(known) ON k.slot = c.slot
                           WHERE c.slot <> \(binds.add(Int64(slot)))::int AND c."number" > coalesce(k."number", 0))
                OR EXISTS (SELECT 1 FROM node_commit_trimmed t LEFT JOIN \(PostgresStore.known(cursor.commits, &binds)) ON k.slot = t.slot
                           WHERE t."upTo" > coalesce(k."number", 0))
            """, binds).first?.decode(Bool.self) ?? true
    }

    /// The others' commits after `cursor` and the chats they changed, in the snapshot of
    /// the transaction `connection` is in; nil when some were trimmed unread.
    private func commits(besides slot: Int, after cursor: FollowCursor, on connection: PostgresConnection) throws -> OthersActivity? {
        do {
            for row in try run(connection, #"SELECT slot, "upTo" FROM node_commit_trimmed"#) {
                let (trimmedSlot, upTo) = try row.decode((Int32, Int64).self)
                if cursor.commits[Int(trimmedSlot)] ?? 0 < upTo { return nil }
            }
            var next = cursor
            var activity = OthersActivity(cursor: cursor)
            var binds = Binds()
            let known = PostgresStore.known(cursor.commits, &binds)
            let commits = try run(connection, """
                SELECT c.slot, c."number", c."feedUpTo", c.chats, c.users, c."rewrittenChat", c."rewrittenId", c."insertedChat", c."insertedId",
                       c."memberChat", c."memberUser"
                FROM node_commit c LEFT JOIN \(known) ON k.slot = c.slot
                WHERE c.slot <> \(binds.add(Int64(slot)))::int AND c."number" > coalesce(k."number", 0) ORDER BY c.slot, c."number"
                """, binds)
            for row in commits {
                let (slot32, number, upTo, chats, users, rewrittenChat, rewrittenId, insertedChat, insertedId, memberChat, memberUser) =
                    try row.decode((Int32, Int64, Int64, [Int64], [Int64], [Int64], [Int64], [Int64], [Int64], [Int64], [Int64]).self)
                let committer = Int(slot32)
                let after = next.feed[committer] ?? FeedSlots.base(of: committer)
                activity.commits.append(FollowedCommit(slot: committer, feedAfter: after, feedUpTo: max(after, upTo), chats: chats, users: users,
                                                       rewritten: PostgresStore.grouped(rewrittenChat, rewrittenId),
                                                       inserted: PostgresStore.grouped(insertedChat, insertedId),
                                                       members: PostgresStore.grouped(memberChat, memberUser)))
                next.commits[committer] = number
                next.feed[committer] = max(after, upTo)
            }
            let numbers = Set(activity.commits.flatMap(\.chats)).sorted()
            if !numbers.isEmpty { activity.chats = try loadChats(numbers, on: connection) }
            let users = Set(activity.commits.flatMap(\.users)).sorted()
            if !users.isEmpty {
                var binds = Binds()
                let wanted = binds.add(users)
                activity.users = try run(connection, "SELECT \(Columns.user) FROM \"user\" WHERE \"number\" = ANY(\(wanted)::bigint[])", binds).map {
                    let (number, userId, regId) = try $0.decode((Int64, String, Int64).self)
                    return UserRecord(number: number, userId: userId, regId: regId)
                }
                activity.endpoints = try run(connection, "SELECT \(Columns.endpoint) FROM endpoint WHERE \"user\" = ANY(\(wanted)::bigint[]) ORDER BY ordinal", binds).map {
                    let (id, user, description, nickname, isLegacyDelegate, ordinal) = try $0.decode((Int64, Int64, String, String, Bool, Int64).self)
                    return EndpointRow(id: id, user: user, description: description, nickname: nickname, isLegacyDelegate: isLegacyDelegate, ordinal: ordinal)
                }
            }
            activity.cursor = next
            return activity
        }
    }

    /// Who is connected to the other nodes, and their events after `activity.cursor`.
    private func readPresenceAndEvents(into activity: inout OthersActivity, besides slot: Int, _ connection: PostgresConnection) throws {
        do {
            var next = activity.cursor
            let cursor = activity.cursor
            var onlineBinds = Binds()
            activity.online = Set(try run(connection, "SELECT DISTINCT \"user\" FROM node_online WHERE slot <> \(onlineBinds.add(Int64(slot)))::int", onlineBinds)
                .map { try $0.decode(Int64.self) })
            var eventBinds = Binds()
            let heard = PostgresStore.known(cursor.transient, &eventBinds)
            let events = try run(connection, """
                SELECT e.slot, e."number", e.kind, e."user", e.chat, e.tag, e.data FROM node_event e LEFT JOIN \(heard) ON k.slot = e.slot
                WHERE e.slot <> \(eventBinds.add(Int64(slot)))::int AND e."number" > coalesce(k."number", 0) ORDER BY e."number"
                """, eventBinds)
            for row in events {
                let (sender, number, kind, user, chat, tag, data) = try row.decode((Int32, Int64, String, Int64, Int64, String?, String?).self)
                next.transient[Int(sender)] = max(next.transient[Int(sender)] ?? 0, number)
                switch kind {
                case "typing": activity.transient.append(.typing(user: user, chat: chat))
                case "chatEvent": activity.transient.append(.chatEvent(user: user, chat: chat, tag: tag ?? "", data: data))
                default: continue
                }
            }
            activity.cursor = next
        }
    }

    /// A cursor at what is committed now: each slot's last row, event and feed position.
    private func now(_ connection: PostgresConnection) throws -> OthersActivity {
        var now = FollowCursor()
        let sql = """
            SELECT 'commit', slot, max(n) FROM (SELECT slot, "number" AS n FROM node_commit UNION ALL SELECT slot, "upTo" FROM node_commit_trimmed) c GROUP BY slot
            UNION ALL SELECT 'event', slot, max("number") FROM node_event GROUP BY slot
            """
        for row in try run(connection, sql) {
            let (kind, slot, number) = try row.decode((String, Int32, Int64).self)
            if kind == "commit" { now.commits[Int(slot)] = number } else { now.transient[Int(slot)] = number }
        }
        now.feed = FeedSlots.positions(in: try counters(connection))
        return OthersActivity(cursor: now)
    }

    /// `(slot, number)` pairs as a table `k` to join with.
    private static func known(_ numbers: [Int: Int64], _ binds: inout Binds) -> String {
        let slots = numbers.keys.sorted()
        return "unnest(\(binds.add(slots.map { Int32($0) }))::int[], \(binds.add(slots.map { numbers[$0]! }))::bigint[]) AS k(slot, \"number\")"
    }

    private static func grouped(_ keys: [Int64], _ values: [Int64]) -> [Int64: [Int64]] {
        var grouped: [Int64: [Int64]] = [:]
        for (key, value) in zip(keys, values) { grouped[key, default: []].append(value) }
        return grouped
    }

    public func announceOnline(slot: Int, joined: [Int64], left: [Int64]) throws {
        try withConnection { connection in
            var binds = Binds()
            let which = binds.add(Int64(slot))
            try run(connection, """
                WITH joined AS (INSERT INTO node_online (slot, "user") SELECT \(which)::int, u FROM unnest(\(binds.add(joined))::bigint[]) u ON CONFLICT DO NOTHING)
                DELETE FROM node_online WHERE slot = \(which)::int AND "user" = ANY(\(binds.add(left))::bigint[])
                """, binds)
        }
    }

    public func announce(_ event: TransientEvent, slot: Int) throws {
        let (kind, user, chat, tag, data): (String, Int64, Int64, String?, String?) = switch event {
        case .typing(let user, let chat): ("typing", user, chat, nil, nil)
        case .chatEvent(let user, let chat, let tag, let data): ("chatEvent", user, chat, tag, data)
        }
        try withConnection { connection in
            var binds = Binds()
            try run(connection, """
                INSERT INTO node_event (slot, kind, "user", chat, tag, data)
                VALUES (\(binds.add(Int64(slot)))::int, \(binds.add(kind)), \(binds.add(user)), \(binds.add(chat)), \(binds.add(tag)), \(binds.add(data)))
                """, binds)
        }
    }

    /// Drops the commits and events older than `followedSeconds`, keeping per slot the last
    /// commit row dropped, and who was connected to a node that no longer holds its feed
    /// slot (it stopped or died: a message to them is no longer delivered as if they were
    /// connected). Every deciding node does, every second.
    func trimFollowed(on connection: PostgresConnection) throws {
        var binds = Binds()
        try run(connection, """
            WITH gone AS (DELETE FROM node_commit WHERE at < now() - interval '\(PostgresStore.followedSeconds) seconds' RETURNING slot, "number"),
            trimmed AS (INSERT INTO node_commit_trimmed (slot, "upTo") SELECT slot, max("number") FROM gone GROUP BY slot
                        ON CONFLICT (slot) DO UPDATE SET "upTo" = greatest(node_commit_trimmed."upTo", EXCLUDED."upTo")),
            offline AS (DELETE FROM node_online o WHERE NOT EXISTS (
                SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND l.classid::bigint * 4294967296 + l.objid::bigint = \(binds.add(PostgresStore.feedSlotLockKey)) + o.slot))
            DELETE FROM node_event WHERE at < now() - interval '\(PostgresStore.followedSeconds) seconds'
            """, binds)
    }
}
