import NIOCore
import PostgresNIO
import Storage

// Writing: a batch's rows in one transaction (statements sent together), the numbers
// taken for new chats and users, and the search keys.

extension PostgresStore {
    // MARK: writing

    /// Two: while a batch commits, the next one inserts its new messages (and their
    /// references and search keys: most of a commit's work on the server, in a backend of
    /// its own) and waits for it before writing the rest (`commit`). One when every node
    /// decides: that second commit would insert messages before it claims their chats,
    /// and could wait for another node that waits for it, through this node's own wait
    /// for the commit before, which PostgreSQL cannot see (docs/several-deciding-nodes.md,
    /// step 3). A commit in one statement claims first: its SELECT runs before its WITH
    /// clauses, which nothing reads.
    public var commitsInFlight: Int { allNodesDecide ? 1 : 2 }

    /// Yes: `chatcore_claim` moves them on in each commit, or refuses it.
    public var comparesChatVersions: Bool { true }

    /// The next value of the kind's sequence (`v7-numbers`): never another node's, and
    /// not given again when the commit it was taken for fails. Chats and users one at a
    /// time; search rows `searchRowBlock` at a time (the sequence moves on by that much).
    public func takeNumbers(for kind: NumberedKind, count: Int) throws -> [ClosedRange<Int64>]? {
        let (sequence, block): (String, Int64) =
            switch kind {
            case .chat: ("chat_number", 1)
            case .user: ("user_number", 1)
            case .searchRow: ("search_row", PostgresStore.searchRowBlock)
            }
        let calls = max(1, (Int64(count) + block - 1) / block)
        let sql: SQL = "SELECT nextval('\(unescaped: sequence)') FROM generate_series(1, \(calls))"
        return try withConnection { connection in
            // Each value ends a block; another node's calls may come between them.
            var ranges: [ClosedRange<Int64>] = []
            for last in try run(connection, sql).map({ try $0.decode(Int64.self) }).sorted() {
                let first = last - block + 1
                if let previous = ranges.last, previous.upperBound + 1 == first {
                    ranges[ranges.count - 1] = previous.lowerBound...last
                } else {
                    ranges.append(first...last)
                }
            }
            return ranges
        }
    }

    public func commit(_ batch: StoreBatch) throws {
        var applied = batch.isEmpty
        defer {
            outcomes.record(batch.sequence, applied: applied)
            // Another node may have committed first, unannounced yet: what it did is read
            // before the next batch, so that this node's sessions get its events before
            // those of the batch decided again.
            if !applied && allNodesDecide { shared.withLock { s in s.told.commits = true } }
        }
        guard !batch.isEmpty else { return }
        do {
            try withConnection { connection in
                if let follows = batch.follows, outcomes.outcome(of: follows) != true {
                    try commit(batch, after: follows, on: connection)
                } else {
                    // postgres-nio sends a statement only once the one before it is
                    // answered, so each statement of a commit would cost a round trip. A
                    // batch is therefore written as one statement: its writes are
                    // data-modifying WITH clauses of the fence's SELECT, one implicit
                    // transaction, durable once confirmed (`runCommitted`). Those
                    // clauses all see the store as it was before the statement, not one
                    // another's rows, so each writes rows no other clause touches
                    // (`write`). So is a batch whose predecessor was applied by the time
                    // it starts.
                    let statement = OneStatement(connection: connection, store: self)
                    write(batch, statement)
                    logForOthers(batch, statement)
                    try statement.commit(main: PostgresStore.claim(batch.chatVersions).map { fence() + ", " + $0 } ?? fence())
                }
            }
            applied = true
        } catch let failure as StoreFailure {
            throw failure
        } catch let error as PSQLError {
            // 53100: disk_full; the class 53 (insufficient resources) passes once space or
            // memory is freed, like SQLite's full disk.
            if let state = error.serverInfo?[.sqlState], state.hasPrefix("53") {
                throw StoreFailure(.full, "PostgreSQL is out of resources: \(PostgresStore.describe(error))")
            }
            if error.serverInfo?[.sqlState] == PostgresStore.supersededState {
                throw StoreFailure(.superseded, supersededReason)
            }
            if let state = error.serverInfo?[.sqlState], PostgresStore.conflictStates.contains(state) {
                throw StoreFailure(.conflict, "PostgreSQL: \(PostgresStore.describe(error))")
            }
            throw StoreFailure(.other, "PostgreSQL: \(PostgresStore.describe(error))")
        } catch {
            throw StoreFailure(.other, "PostgreSQL: \(PostgresStore.describe(error))")
        }
    }

    /// A batch decided while commit `follows` may still be running: in one transaction,
    /// its new messages (with their references and search keys) first, beside that
    /// commit, as they touch no row it touches; then, once it is applied, the rest, by a
    /// statement of its own, whose snapshot has that commit's rows (an update of a
    /// message that commit inserted finds it). If that commit failed, nothing of this one
    /// is applied. Four round trips instead of one, only when commits queue up.
    func commit(_ batch: StoreBatch, after follows: Int64, on connection: PostgresConnection) throws {
        var early = StoreBatch()
        early.newMessages = batch.newMessages
        var rest = batch
        rest.newMessages = []
        try run(connection, "BEGIN")
        let first = OneStatement(connection: connection, store: self)
        write(early, first)
        try first.send(main: fence())
        guard outcomes.wait(for: follows) else {
            throw StoreFailure(.other, "the commit before it failed, and this one was decided after it: nothing of it was applied")
        }
        if !rest.isEmpty || !rest.chatVersions.isEmpty || allNodesDecide {
            let second = OneStatement(connection: connection, store: self)
            write(rest, second)
            logForOthers(batch, second)
            try second.send(main: PostgresStore.claim(rest.chatVersions).map { "SELECT " + $0 } ?? "SELECT 1")
        }
        try run(connection, "COMMIT")
    }

    /// The search index's rows (`PostgresSearchIndex`): a new searchable message's keys (or
    /// an older message's, made searchable once its attachments are stored), and a
    /// recalled message's row deleted (its search row set to 0), in the commit that makes
    /// or recalls it.
    func writeSearchKeys(_ batch: StoreBatch, _ statement: OneStatement) {
        let searchable =
            batch.newMessages.filter { $0.searchRow > 0 && $0.content != nil }
            + batch.messageUpdates.filter { $0.columns.contains(.searchRow) && $0.row.searchRow > 0 && $0.row.content != nil }.map(\.row)
        if !searchable.isEmpty {
            let rows = PostgresStore.searchRows(searchable.map { SearchEntry(row: $0.searchRow, chat: $0.chat, id: $0.id, text: $0.content!) })
            statement.add(#"INSERT INTO message_search (chat, id, "searchRow", keys) SELECT u.chat, u.id, u."row", u.keys FROM \#(rows)"#)
        }
        let recalled = batch.messageUpdates.filter { $0.columns.contains(.searchRow) && $0.row.searchRow == 0 }.map(\.row)
        if !recalled.isEmpty {
            statement.add(
                """
                DELETE FROM message_search s USING unnest(\(recalled.map(\.chat))::bigint[], \(recalled.map(\.id))::bigint[])
                AS r(chat, id) WHERE s.chat = r.chat AND s.id = r.id
                """)
        }
    }

    typealias Value = StoredValue

    /// Inserts `rows` (each with a value per column) in one clause whose text does not
    /// depend on how many rows there are: each column is bound as one array and `unnest`
    /// turns the arrays back into rows, so PostgreSQL parses and plans a short statement
    /// (with one tuple of parameters per row, parsing and planning the statement took a
    /// third of PostgreSQL's time); `conflict` is what follows ON CONFLICT.
    func insert(_ statement: OneStatement, into table: String, columns: [String], rows: [[Value]], conflict: String? = nil) {
        guard let first = rows.first else { return }
        let arrays = first.indices.map { column -> SQL in "\(column: rows.map { $0[column] })" }
        var sql: SQL =
            "INSERT INTO \(unescaped: table) (\(unescaped: columns.joined(separator: ", "))) SELECT * FROM unnest(\(SQL(joining: arrays, separator: ", ")))"
        if let conflict { sql = sql + " ON CONFLICT \(unescaped: conflict)" }
        statement.add(sql)
    }

    /// `ON CONFLICT (key) DO UPDATE` setting every other column to the new row's.
    static func replacing(key: [String], columns: [String]) -> String {
        "(\(key.joined(separator: ", "))) DO UPDATE SET " + columns.filter { !key.contains($0) }.map { "\($0) = EXCLUDED.\($0)" }.joined(separator: ", ")
    }

    /// A row found by its key (values of `keyColumns`) and the columns to write.
    struct RowUpdate {
        var key: [Int64]
        var values: [(column: String, value: Value)]
    }

    /// Writes the named columns of rows found by their keys: one clause per set of
    /// columns written, the keys and values bound as arrays (like `insert`). A batch
    /// changes each row at most once.
    func update(_ statement: OneStatement, _ table: String, keyColumns: [String], _ rows: [RowUpdate]) {
        var groups: [[String]: [RowUpdate]] = [:]
        var order: [[String]] = []
        for row in rows where !row.values.isEmpty {
            let columns = row.values.map(\.column)
            if groups[columns] == nil { order.append(columns) }
            groups[columns, default: []].append(row)
        }
        for columns in order {
            let group = groups[columns]!
            var arrays: [SQL] = []
            var names: [String] = []
            for position in keyColumns.indices {
                arrays.append("\(column: group.map { .int($0.key[position]) })")
                names.append("k\(position)")
            }
            for position in columns.indices {
                arrays.append("\(column: group.map { $0.values[position].value })")
                names.append("v\(position)")
            }
            let assignments = columns.enumerated().map { "\"\($1)\" = u.v\($0)" }
            let conditions = keyColumns.enumerated().map { "t.\($1) = u.k\($0)" }
            statement.add(
                "UPDATE \(unescaped: table) AS t SET \(unescaped: assignments.joined(separator: ", ")) FROM unnest(\(SQL(joining: arrays, separator: ", "))) "
                    + "AS u(\(unescaped: names.joined(separator: ", "))) WHERE \(unescaped: conditions.joined(separator: " AND "))")
        }
    }

    static let userColumns = Columns.user.components(separatedBy: ", ")
    static let endpointColumns = Columns.endpoint.components(separatedBy: ", ")
    static let chatColumns = Columns.chat.components(separatedBy: ", ")
    static let memberColumns = Columns.member.components(separatedBy: ", ")
    static let userSettingsColumns = Columns.userSettings.components(separatedBy: ", ")
    static let messageColumns = Columns.message.components(separatedBy: ", ")
    static let messageUserColumns = Columns.messageUser.components(separatedBy: ", ")
    static let refCountColumns = Columns.refCount.components(separatedBy: ", ")
    static let rangeChangeColumns = ["chat", #""lastSeq""#, #""firstSeq""#, #""firstId""#, #""lastId""#]

    /// The batch's writes, as clauses of `statement`. No two of them touch the same row:
    /// a chat, member or message is new (inserted) or stored (updated), touches leave out
    /// the messages the batch changed, a new message's references are inserted and only a
    /// stored one's dropped, reference counts are kept or deleted by key, blob counts are
    /// deleted or added to by what they were before, and an endpoint is written or removed.
    func write(_ batch: StoreBatch, _ statement: OneStatement) {
        typealias S = PostgresStore
        insert(statement, into: #""user""#, columns: S.userColumns, rows: batch.directory.newUsers.map { [.int($0.number), .text($0.userId), .int($0.regId)] })
        insert(
            statement, into: "user_settings", columns: S.userSettingsColumns,
            rows: batch.directory.userSettings.map { [.int($0.user), .bool($0.presenceHidden), .int($0.lastActive), .text($0.storedBlocked)] },
            conflict: S.replacing(key: [#""user""#], columns: S.userSettingsColumns))
        insert(
            statement, into: "endpoint", columns: S.endpointColumns,
            rows: batch.directory.endpoints.map {
                [.int($0.id), .int($0.user), .text($0.description), .text($0.nickname), .bool($0.isLegacyDelegate), .int($0.ordinal), .text($0.pushToken)]
            }, conflict: S.replacing(key: ["id"], columns: S.endpointColumns))
        // Written and removed endpoints are never the same ones (`StoreBatch`).
        if !batch.directory.removedEndpoints.isEmpty {
            statement.add("DELETE FROM endpoint WHERE id = ANY(\(batch.directory.removedEndpoints))")
        }
        insert(
            statement, into: "chat", columns: S.chatColumns,
            rows: batch.directory.newChats.map {
                [
                    .int($0.number), .text($0.subject), .bool($0.isOneToOne), .text($0.invitePolicy), .bool($0.isDefunct), .text($0.data), .int($0.lastMessage),
                    .int($0.lastActivity), .text($0.pinPolicy), .text($0.pins)
                ]
            })
        update(
            statement, "chat", keyColumns: [#""number""#],
            batch.directory.chatUpdates.map { update in
                let row = update.row
                return RowUpdate(
                    key: [row.number],
                    values: update.columns.sorted { $0.rawValue < $1.rawValue }.map { column in
                        switch column {
                        case .subject: (column.rawValue, .text(row.subject))
                        case .isDefunct: (column.rawValue, .bool(row.isDefunct))
                        case .data: (column.rawValue, .text(row.data))
                        case .lastMessage: (column.rawValue, .int(row.lastMessage))
                        case .lastActivity: (column.rawValue, .int(row.lastActivity))
                        case .pins: (column.rawValue, .text(row.pins))
                        }
                    })
            })
        insert(
            statement, into: "member", columns: S.memberColumns, rows: batch.directory.members.map(S.values),
            conflict: S.replacing(key: ["chat", #""user""#], columns: S.memberColumns))
        update(
            statement, "member", keyColumns: ["chat", #""user""#],
            batch.directory.memberUpdates.map { update in
                let row = update.row
                return RowUpdate(
                    key: [row.chat, row.user],
                    values: update.columns.sorted { $0.rawValue < $1.rawValue }.map { column in
                        switch column {
                        case .isActive: (column.rawValue, .bool(row.isActive))
                        case .isAdmin: (column.rawValue, .bool(row.isAdmin))
                        case .joinedAt: (column.rawValue, .int(row.joinedAt))
                        case .leftAt: (column.rawValue, .int(row.leftAt))
                        case .isHidden: (column.rawValue, .bool(row.isHidden))
                        case .localData: (column.rawValue, .text(row.localData))
                        case .privateData: (column.rawValue, .text(row.privateData))
                        case .deliveredUpTo: (column.rawValue, .int(row.deliveredUpTo))
                        case .readUpTo: (column.rawValue, .int(row.readUpTo))
                        case .numUnread: (column.rawValue, .int(row.numUnread))
                        case .numUnreadMentions: (column.rawValue, .int(row.numUnreadMentions))
                        case .mutedUntil: (column.rawValue, .int(row.mutedUntil))
                        case .isBanned: (column.rawValue, .bool(row.isBanned))
                        }
                    })
            })
        insert(statement, into: "message", columns: S.messageColumns, rows: batch.newMessages.map(S.values))
        insert(
            statement, into: "message_ref", columns: ["chat", "source", "tag", "target"],
            rows: batch.newMessages.flatMap { message in
                message.refs.map { [.int(message.chat), .int(message.id), .text($0.tag), .int($0.target)] }
            }, conflict: "DO NOTHING")
        insert(
            statement, into: "message_mention", columns: [#""user""#, "timestamp", "chat", "id"],
            rows: batch.newMessages.flatMap { message in
                message.mentionedUsers.map { [.int($0), .int(message.timestamp), .int(message.chat), .int(message.id)] }
            }, conflict: "DO NOTHING")
        update(
            statement, "message", keyColumns: ["chat", "id"],
            batch.messageUpdates.map { update in
                RowUpdate(
                    key: [update.row.chat, update.row.id],
                    values: update.columns.sorted { $0.rawValue < $1.rawValue }.map { column in (column.rawValue, update.row[column]) })
            })
        writeSearchKeys(batch, statement)
        if !batch.droppedReferences.isEmpty {
            statement.add(
                """
                DELETE FROM message_ref r USING unnest(\(batch.droppedReferences.map(\.chat))::bigint[], \(batch.droppedReferences.map(\.id))::bigint[])
                AS d(chat, source) WHERE r.chat = d.chat AND r.source = d.source
                """)
        }
        if !batch.touches.isEmpty {
            statement.add(
                """
                UPDATE message m SET "changeSeq" = t.seq
                FROM unnest(\(batch.touches.map(\.chat))::bigint[], \(batch.touches.map(\.id))::bigint[], \(batch.touches.map(\.seq))::bigint[])
                AS t(chat, id, seq) WHERE m.chat = t.chat AND m.id = t.id
                """)
        }
        insert(
            statement, into: "range_change", columns: S.rangeChangeColumns,
            rows: batch.rangeChanges.map {
                [.int($0.chat), .int($0.lastSeq), .int($0.firstSeq), .int($0.firstId), .int($0.lastId)]
            }, conflict: S.replacing(key: ["chat", #""lastSeq""#], columns: S.rangeChangeColumns))
        let kept = batch.refCounts.filter { $0.count > 0 }
        insert(
            statement, into: "ref_count", columns: S.refCountColumns,
            rows: kept.map {
                [.int($0.chat), .int($0.target), .text($0.tag), .int($0.count), .int($0.newest)]
            }, conflict: S.replacing(key: ["chat", "target", "tag"], columns: S.refCountColumns))
        let gone = batch.refCounts.filter { $0.count <= 0 }
        if !gone.isEmpty {
            statement.add(
                """
                DELETE FROM ref_count c USING unnest(\(gone.map(\.chat))::bigint[], \(gone.map(\.target))::bigint[], \(gone.map(\.tag))::text[])
                AS g(chat, target, tag) WHERE c.chat = g.chat AND c.target = g.target AND c.tag = g.tag
                """)
        }
        insert(
            statement, into: "message_user", columns: S.messageUserColumns,
            rows: batch.privateStates.map {
                [
                    .int($0.chat), .int($0.id), .int($0.user), .text($0.localData), .bool($0.isDeleted), .bool($0.thumbDetached), .bool($0.fileDownloaded),
                    .text($0.reactions)
                ]
            }, conflict: S.replacing(key: ["chat", "id", #""user""#], columns: S.messageUserColumns))
        let blobs = batch.blobUses.filter { $0.value != 0 }.sorted { $0.key < $1.key }
        if !blobs.isEmpty {
            // A count that reaches zero is deleted, the others are added to (or made): two
            // clauses that decide on the count before the statement, so that they never
            // touch the same row.
            let uses: SQL = "unnest(\(blobs.map(\.key))::text[], \(blobs.map(\.value))::bigint[]) AS u(hash, delta)"
            statement.add("DELETE FROM blob b USING \(uses) WHERE b.hash = u.hash AND b.uses + u.delta <= 0")
            statement.add(
                """
                INSERT INTO blob (hash, uses) SELECT u.hash, u.delta FROM \(uses) LEFT JOIN blob b ON b.hash = u.hash
                WHERE coalesce(b.uses, 0) + u.delta > 0 ON CONFLICT (hash) DO UPDATE SET uses = blob.uses + EXCLUDED.uses
                """)
        }
        if let counters = batch.counters {
            // This node's feed slot's position only: the search rows' sequence keeps the
            // last search row (`takeNumbers`).
            statement.add(
                """
                INSERT INTO counter (name, value) VALUES (\(FeedSlots.counterName(of: counters.slot)), \(counters.changeSeq))
                ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value
                """)
        }
        insert(
            statement, into: "notification_outbox", columns: ["chat", "id", #""user""#, "created", "due"],
            rows: batch.notifications.map { [.int($0.key.chat), .int($0.key.id), .int($0.key.user), .int($0.created), .int($0.due)] })
    }

    static func values(_ member: MemberRow) -> [Value] {
        [
            .int(member.chat), .int(member.user), .bool(member.isActive), .bool(member.isAdmin), .int(member.joinedAt), .int(member.leftAt),
            .bool(member.isHidden),
            .text(member.localData), .text(member.privateData), .int(member.deliveredUpTo), .int(member.readUpTo), .int(member.numUnread),
            .int(member.numUnreadMentions), .int(member.mutedUntil), .bool(member.isBanned)
        ]
    }

    static func values(_ message: MessageRow) -> [Value] {
        MessageColumn.all.map { message[$0] }
    }
}

/// The writes of one commit, kept as the WITH clauses of one statement that `send(main:)`
/// or `commit(main:)` sends.
final class OneStatement {
    let connection: PostgresConnection
    let store: PostgresStore
    private var clauses: [SQL] = []

    init(connection: PostgresConnection, store: PostgresStore) {
        self.connection = connection
        self.store = store
    }

    func add(_ clause: SQL) {
        clauses.append(clause)
    }

    /// The clauses as the WITH clauses of `main`.
    private func statement(_ main: SQL) -> SQL {
        guard !clauses.isEmpty else { return main }
        let with = clauses.enumerated().map { index, clause -> SQL in "w\(unescaped: String(index)) AS (\(clause))" }
        return "WITH \(SQL(joining: with, separator: ", ")) \(main)"
    }

    /// Sends the statement inside a transaction block and waits for its answer.
    func send(main: SQL) throws {
        _ = try store.wait(for: connection.query(statement(main).query, logger: store.logger), on: connection)
    }

    /// Sends the statement as a transaction of its own and waits until it is committed
    /// (`PostgresStore.runCommitted`).
    func commit(main: SQL) throws {
        try store.runCommitted(connection, statement(main))
    }
}
