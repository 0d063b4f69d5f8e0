import Foundation
import PostgresNIO
import Storage

/// Several deciding nodes (`--all-nodes-decide`, docs/several-deciding-nodes.md): each
/// commit logs what it changed (`node_commit`, in the commit's own statement), each node
/// says who is connected to it (`node_online`) and what its sessions said that is never
/// stored (`node_event`), and each reads the others' before it decides
/// (`othersActivity`), when it is told of them (`LISTEN`/`NOTIFY`, `Told`) or before a
/// batch that answers requests. Rows are numbered from one sequence; a node's own rows are
/// committed in its order, so a reader that keeps, per slot, the last number it read
/// never misses one. Every deciding node trims what is older than a minute (`trimFollowed`); a
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
        let slot = Int64(batch.feedSlot)
        // Unmoved, the slot's position is the one its counter holds before this commit.
        let upTo: SQL =
            "coalesce(\(batch.counters?.changeSeq)::bigint, (SELECT value FROM counter WHERE name = \(FeedSlots.counterName(of: batch.feedSlot))), \(FeedSlots.base(of: batch.feedSlot)))"
        statement.add(
            """
            INSERT INTO node_commit (slot, "feedUpTo", chats, users, "rewrittenChat", "rewrittenId", "insertedChat", "insertedId", "memberChat", "memberUser")
            VALUES (\(slot)::int, \(upTo), \(entry.chats)::bigint[], \(entry.users)::bigint[],
                    \(rewrittenChat)::bigint[], \(rewrittenId)::bigint[], \(insertedChat)::bigint[],
                    \(insertedId)::bigint[], \(memberChat)::bigint[], \(memberUser)::bigint[])
            """)
    }

    /// What a node is told of the others' doings: every commit, change of who is
    /// connected and transient event of a deciding node notifies the channel
    /// `followChannel` (triggers of migration `v10-notify-followers`) with its kind and the
    /// slot of the node it was done on; a node listens on a connection of its own.
    struct Told {
        var listener: PostgresConnection?
        /// Called when another node did something (`wakeWhenOthersAct`).
        var wake: (@Sendable () -> Void)?
        /// Whether another node committed, or changed who is connected to it or said
        /// something, since `othersActivity` last looked.
        var commits = true
        var transient = true
        /// When `othersActivity` last read everything, whatever it was told.
        var lookedWhole = ContinuousClock.now
        /// The cursor `othersActivity` last answered with: asked from another, it reads.
        var answered: FollowCursor?
        /// Who is connected to the other nodes, as last read.
        var online: Set<Int64> = []
    }

    static let followChannel = "chatcore_follow"

    /// How often a node reads everything the others did, even told nothing (a
    /// notification lost with its connection, or missed while listening started).
    static let wholeLookInterval = Duration.seconds(1)

    public func wakeWhenOthersAct(_ wake: @escaping @Sendable () -> Void) -> Bool {
        guard allNodesDecide else { return false }
        shared.withLock { s in s.told.wake = wake }
        listenIfDeaf()
        return true
    }

    /// Listens on `followChannel` on a connection of its own, unless it already does (the
    /// connection breaks with the server's restart: the beat thread calls this again).
    func listenIfDeaf() {
        // One at a time (the beat thread's and the engine's first).
        relistening.exclusively { listenNowIfDeaf() }
    }

    private func listenNowIfDeaf() {
        let (deaf, wanted) = shared.withLock { s in (s.told.listener.map(\.isClosed) ?? true, s.told.wake != nil && !s.isShutDown) }
        guard deaf, wanted else { return }
        do {
            let connection = try connect()
            let ownSlot = feedSlot
            connection.addListener(channel: PostgresStore.followChannel) { [weak self] _, notification in
                self?.told(notification.payload, ownSlot: ownSlot)
            }
            // addListener asks for it too; this one is answered once it holds.
            try run(connection, "LISTEN \(unescaped: PostgresStore.followChannel)")
            let wake = shared.withLock { s -> (@Sendable () -> Void)? in
                s.told.listener = connection
                // Whatever happened while nobody listened is read.
                s.told.commits = true
                s.told.transient = true
                return s.told.wake
            }
            wake?()
        } catch {
            logger.warning(
                "cannot listen for the other deciding nodes: looking by itself every 50 ms instead, and trying again each second",
                metadata: ["error": "\(PostgresStore.describe(error))"])
        }
    }

    /// A notification on `followChannel`: "c" (a commit) or "t" (who is connected, or a
    /// transient event), then the slot of the node it came from.
    private func told(_ payload: String, ownSlot: Int) {
        guard let kind = payload.first, let from = Int(payload.dropFirst()), from != ownSlot else { return }
        let wake = shared.withLock { s -> (@Sendable () -> Void)? in
            if kind == "c" { s.told.commits = true } else { s.told.transient = true }
            return s.told.wake
        }
        wake?()
    }

    /// What `othersActivity` reads now: the others' commits when it was told of one, and
    /// first whether there are any, who is connected and whether there are events (one
    /// statement, `look`) when it was told of presence or events, is asked to look
    /// `thoroughly`, is not listening, was asked from another cursor than it last answered
    /// with, or last looked longer than `wholeLookInterval` ago.
    private func dueReads(after cursor: FollowCursor, thoroughly: Bool) -> (look: Bool, commits: Bool) {
        shared.withLock { s in
            let now = ContinuousClock.now
            let listening = !(s.told.listener?.isClosed ?? true)
            let look = thoroughly || s.told.transient || !listening || s.told.answered != cursor || now - s.told.lookedWhole >= PostgresStore.wholeLookInterval
            defer {
                s.told.commits = false
                s.told.transient = false
                if look { s.told.lookedWhole = now }
            }
            return (look, s.told.commits)
        }
    }

    public func othersActivity(besides slot: Int, after cursor: FollowCursor?, thoroughly: Bool) throws -> OthersActivity? {
        guard let cursor else { return try withConnection { connection in try now(connection) } }
        let due = dueReads(after: cursor, thoroughly: thoroughly)
        do {
            let activity = try othersActivity(besides: slot, after: cursor, look: due.look, commits: due.commits)
            shared.withLock { s in
                s.told.answered = activity?.cursor
                if let online = activity?.online { s.told.online = online }
            }
            return activity
        } catch {
            // Read again, as told: the commits, and who is connected and the events.
            shared.withLock { s in
                s.told.commits = s.told.commits || due.commits
                s.told.transient = s.told.transient || due.look
            }
            throw error
        }
    }

    private func othersActivity(besides slot: Int, after cursor: FollowCursor, look: Bool, commits: Bool) throws -> OthersActivity? {
        var activity = OthersActivity(cursor: cursor)
        activity.online = shared.withLock { s in s.told.online }
        guard look || commits else { return activity }
        return try withConnection { connection in
            var readCommits = commits
            var readEvents = false
            if look {
                let seen = try self.look(besides: slot, after: cursor, connection)
                activity.online = seen.online
                readCommits = readCommits || seen.commits
                readEvents = seen.events
            }
            if readCommits {
                // One snapshot: the chats as exactly the commits read left them.
                try run(connection, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                do {
                    guard let read = try self.commits(besides: slot, after: cursor, on: connection) else {
                        try run(connection, "ROLLBACK")
                        return nil
                    }
                    try run(connection, "COMMIT")
                    // Who is connected, as the look (or the last one) found.
                    let online = activity.online
                    activity = read
                    activity.online = online
                } catch {
                    _ = try? run(connection, "ROLLBACK")
                    throw error
                }
            }
            if readEvents { try self.readEvents(into: &activity, besides: slot, connection) }
            return activity
        }
    }

    /// In one statement: whether another node committed after `cursor` (or rows it had not
    /// read were trimmed), who is connected to the other nodes, and whether they have
    /// events after it. Most looks find no commit and no event.
    private func look(besides slot: Int, after cursor: FollowCursor, _ connection: PostgresConnection) throws
        -> (commits: Bool, online: Set<Int64>, events: Bool)
    {
        let known = PostgresStore.known(cursor.commits)
        let heard = PostgresStore.known(cursor.transient)
        let sql: SQL = """
            SELECT EXISTS (SELECT 1 FROM \(PostgresStore.after(known, besides: slot))
                           JOIN LATERAL (SELECT 1 FROM node_commit c WHERE \(unescaped: PostgresStore.inSlotAfter("c")) LIMIT 1) c ON true)
                   OR EXISTS (SELECT 1 FROM node_commit_trimmed t LEFT JOIN \(known) ON k.slot = t.slot
                              WHERE t."upTo" > coalesce(k."number", 0)),
                   ARRAY(SELECT DISTINCT "user" FROM node_online WHERE slot <> \(Int64(slot))::int),
                   EXISTS (SELECT 1 FROM \(PostgresStore.after(heard, besides: slot))
                           JOIN LATERAL (SELECT 1 FROM node_event e WHERE \(unescaped: PostgresStore.inSlotAfter("e")) LIMIT 1) e ON true)
            """
        guard let row = try run(connection, sql).first else { return (true, [], true) }
        let (commits, online, events) = try row.decode((Bool, [Int64], Bool).self)
        return (commits, Set(online), events)
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
            let commits = try run(
                connection,
                """
                SELECT c.slot, c."number", c."feedUpTo", c.chats, c.users, c."rewrittenChat", c."rewrittenId", c."insertedChat", c."insertedId",
                       c."memberChat", c."memberUser"
                FROM \(PostgresStore.after(PostgresStore.known(cursor.commits), besides: slot))
                JOIN LATERAL (SELECT * FROM node_commit c WHERE \(unescaped: PostgresStore.inSlotAfter("c"))) c ON true ORDER BY c.slot, c."number"
                """)
            for row in commits {
                let (slot32, number, upTo, chats, users, rewrittenChat, rewrittenId, insertedChat, insertedId, memberChat, memberUser) =
                    try row.decode((Int32, Int64, Int64, [Int64], [Int64], [Int64], [Int64], [Int64], [Int64], [Int64], [Int64]).self)
                let committer = Int(slot32)
                let after = next.feed[committer] ?? FeedSlots.base(of: committer)
                activity.commits.append(
                    FollowedCommit(
                        slot: committer, feedAfter: after, feedUpTo: max(after, upTo), chats: chats, users: users,
                        rewritten: PostgresStore.grouped(rewrittenChat, rewrittenId),
                        inserted: PostgresStore.grouped(insertedChat, insertedId),
                        members: PostgresStore.grouped(memberChat, memberUser)))
                next.commits[committer] = number
                next.feed[committer] = max(after, upTo)
            }
            let numbers = Set(activity.commits.flatMap(\.chats)).sorted()
            if !numbers.isEmpty { activity.chats = try chatsAsFollowed(numbers, on: connection) }
            let users = Set(activity.commits.flatMap(\.users)).sorted()
            if !users.isEmpty {
                activity.users = try run(connection, "SELECT \(unescaped: Columns.user) FROM \"user\" WHERE \"number\" = ANY(\(users)::bigint[])").map {
                    let (number, userId, regId) = try $0.decode((Int64, String, Int64).self)
                    return UserRecord(number: number, userId: userId, regId: regId)
                }
                activity.endpoints = try run(
                    connection, "SELECT \(unescaped: Columns.endpoint) FROM endpoint WHERE \"user\" = ANY(\(users)::bigint[]) ORDER BY ordinal"
                ).map(PostgresStore.endpoint)
                activity.userSettings = try run(
                    connection, "SELECT \(unescaped: Columns.userSettings) FROM user_settings WHERE \"user\" = ANY(\(users)::bigint[])"
                ).map(PostgresStore.userSettings)
            }
            activity.cursor = next
            return activity
        }
    }

    /// The chats `numbers` with their versions and members, in the snapshot of the
    /// transaction `connection` is in (so versions and rows agree, whatever the order they
    /// are read in): two statements, not `loadChats`' four, since a node following the
    /// others keeps its own counters (`Engine.replace`).
    private func chatsAsFollowed(_ numbers: [Int64], on connection: PostgresConnection) throws -> StoreDirectory {
        var directory = StoreDirectory()
        let chats = try run(
            connection,
            """
            SELECT \(unescaped: Columns.chat), coalesce(v.version, 0) FROM chat LEFT JOIN chat_version v ON v.chat = chat."number"
            WHERE chat."number" = ANY(\(numbers)::bigint[]) ORDER BY chat."number"
            """)
        for row in chats {
            var cells = Cells(row, of: "chat")
            let chat = try PostgresStore.chat(&cells)
            directory.chats.append(chat)
            directory.chatVersions[chat.number] = try cells.next(Int64.self)
        }
        directory.members = try members(of: numbers, on: connection)
        return directory
    }

    /// The other nodes' transient events after `activity.cursor`.
    private func readEvents(into activity: inout OthersActivity, besides slot: Int, _ connection: PostgresConnection) throws {
        do {
            var next = activity.cursor
            let cursor = activity.cursor
            let events = try run(
                connection,
                """
                SELECT e.slot, e."number", e.kind, e."user", e.chat, e.tag, e.data FROM \(PostgresStore.after(PostgresStore.known(cursor.transient), besides: slot))
                JOIN LATERAL (SELECT * FROM node_event e WHERE \(unescaped: PostgresStore.inSlotAfter("e"))) e ON true ORDER BY e."number"
                """)
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
        let sql: SQL = """
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

    /// Every slot but `slot`, with the number read up to in it (`known`, else 0), as a
    /// table `s(slot, after)`: joined laterally with a table's rows of each slot after
    /// it, each slot's are read by the index on (slot, number), however long the table.
    private static func after(_ known: SQL, besides slot: Int) -> SQL {
        """
        (SELECT g.slot, coalesce(k."number", 0) AS "after" FROM generate_series(0, \(unescaped: String(FeedSlots.count - 1))) AS g(slot)
         LEFT JOIN \(known) ON k.slot = g.slot WHERE g.slot <> \(Int64(slot))::int) AS s
        """
    }

    /// The rows of table `alias` in slot `s.slot` after number `s."after"`, as a range of
    /// the index on (slot, number): written with the slot and number as one row, the
    /// planner cannot take the primary key's index on the number alone instead (and with
    /// it read a minute of every node's commits to find a few).
    private static func inSlotAfter(_ alias: String) -> String {
        #"(\#(alias).slot, \#(alias)."number") > (s.slot, s."after") AND (\#(alias).slot, \#(alias)."number") < (s.slot + 1, 0)"#
    }

    /// `(slot, number)` pairs as a table `k` to join with.
    private static func known(_ numbers: [Int: Int64]) -> SQL {
        let slots = numbers.keys.sorted()
        return "unnest(\(slots.map { Int32($0) })::int[], \(slots.map { numbers[$0]! })::bigint[]) AS k(slot, \"number\")"
    }

    private static func grouped(_ keys: [Int64], _ values: [Int64]) -> [Int64: [Int64]] {
        var grouped: [Int64: [Int64]] = [:]
        for (key, value) in zip(keys, values) { grouped[key, default: []].append(value) }
        return grouped
    }

    public func announceOnline(slot: Int, joined: [Int64], left: [Int64]) throws {
        try withConnection { connection in
            let which = Int64(slot)
            try run(
                connection,
                """
                WITH joined AS (INSERT INTO node_online (slot, "user") SELECT \(which)::int, u FROM unnest(\(joined)::bigint[]) u ON CONFLICT DO NOTHING)
                DELETE FROM node_online WHERE slot = \(which)::int AND "user" = ANY(\(left)::bigint[])
                """)
        }
    }

    public func announce(_ event: TransientEvent, slot: Int) throws {
        let (kind, user, chat, tag, data): (String, Int64, Int64, String?, String?) =
            switch event {
            case .typing(let user, let chat): ("typing", user, chat, nil, nil)
            case .chatEvent(let user, let chat, let tag, let data): ("chatEvent", user, chat, tag, data)
            }
        try withConnection { connection in
            _ = try run(
                connection,
                """
                INSERT INTO node_event (slot, kind, "user", chat, tag, data)
                VALUES (\(Int64(slot))::int, \(kind), \(user), \(chat), \(tag), \(data))
                """)
        }
    }

    /// Drops the commits and events older than `followedSeconds`, keeping per slot the last
    /// commit row dropped, and who was connected to a node that no longer holds its feed
    /// slot (it stopped or died: a message to them is no longer delivered as if they were
    /// connected). Every deciding node does, every second.
    func trimFollowed(on connection: PostgresConnection) throws {
        try run(
            connection,
            """
            WITH gone AS (DELETE FROM node_commit WHERE at < now() - interval '\(unescaped: String(PostgresStore.followedSeconds)) seconds' RETURNING slot, "number"),
            trimmed AS (INSERT INTO node_commit_trimmed (slot, "upTo") SELECT slot, max("number") FROM gone GROUP BY slot
                        ON CONFLICT (slot) DO UPDATE SET "upTo" = greatest(node_commit_trimmed."upTo", EXCLUDED."upTo")),
            offline AS (DELETE FROM node_online o WHERE NOT EXISTS (
                SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND l.classid::bigint * 4294967296 + l.objid::bigint = \(PostgresStore.feedSlotLockKey) + o.slot))
            DELETE FROM node_event WHERE at < now() - interval '\(unescaped: String(PostgresStore.followedSeconds)) seconds'
            """)
    }
}

/// The nodes on one database coordinate through it: numbers from its sequences, feed
/// slots held by advisory locks, and what the others did read from their commits.
extension PostgresStore: NodeCoordination {}
