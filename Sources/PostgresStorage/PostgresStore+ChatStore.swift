import NIOCore
import PostgresNIO
import Storage

/// `ChatStore` on PostgreSQL: the same tables and indexes as the SQLite store (columns
/// keep the engine's names, quoted), the same reads by index, and one transaction per
/// batch, committed (synchronous_commit: the server's WAL is flushed, and the commit is
/// confirmed: `runCommitted`) before `commit` returns. Rows are written many per
/// statement.
extension PostgresStore: ChatStore {
    // MARK: start-up

    public func loadDirectory() throws -> StoreDirectory {
        try withConnection { connection in
            var directory = StoreDirectory()
            // The versions before the rows: a chat's rows are then at least as new as its
            // version, so a decision on them claims a version that is current or fails;
            // read after them, a version could be newer than the rows, and a claim of it
            // pass with what another node committed in between unseen.
            try readCountersAndVersions(into: &directory, connection)
            directory.users = try run(connection, "SELECT \(Columns.user) FROM \"user\" ORDER BY \"number\"").map {
                let (number, userId, regId) = try $0.decode((Int64, String, Int64).self)
                return UserRecord(number: number, userId: userId, regId: regId)
            }
            directory.endpoints = try run(connection, "SELECT \(Columns.endpoint) FROM endpoint ORDER BY ordinal").map {
                let (id, user, description, nickname, isLegacyDelegate, ordinal) = try $0.decode((Int64, Int64, String, String, Bool, Int64).self)
                return EndpointRow(id: id, user: user, description: description, nickname: nickname, isLegacyDelegate: isLegacyDelegate, ordinal: ordinal)
            }
            directory.chats = try run(connection, "SELECT \(Columns.chat) FROM chat ORDER BY \"number\"").map(PostgresStore.chat)
            directory.members = try run(connection, "SELECT \(Columns.member) FROM member ORDER BY chat, \"user\"").map(PostgresStore.member)
            return directory
        }
    }

    public func loadChats(_ numbers: [Int64]) throws -> StoreDirectory {
        try withConnection { connection in
            var directory = StoreDirectory()
            // The versions first (`loadDirectory` says why).
            try readCountersAndVersions(into: &directory, connection, chats: numbers)
            var binds = Binds()
            let wanted = binds.add(numbers)
            directory.chats = try run(connection, "SELECT \(Columns.chat) FROM chat WHERE \"number\" = ANY(\(wanted)::bigint[]) ORDER BY \"number\"", binds)
                .map(PostgresStore.chat)
            directory.members = try members(of: numbers, on: connection)
            return directory
        }
    }

    /// The memberships of the chats `numbers`, by chat and user.
    func members(of numbers: [Int64], on connection: PostgresConnection) throws -> [MemberRow] {
        var binds = Binds()
        return try run(connection, "SELECT \(Columns.member) FROM member WHERE chat = ANY(\(binds.add(numbers))::bigint[]) ORDER BY chat, \"user\"", binds)
            .map(PostgresStore.member)
    }

    /// The counters by name, in one round trip: the rows of `counter`, and `searchRow`, the
    /// search rows' sequence's last value (`v7-numbers`: every row taken is at most that).
    func counters(_ connection: PostgresConnection) throws -> [String: Int64] {
        var counters: [String: Int64] = [:]
        for row in try run(connection, "SELECT name, value FROM counter UNION ALL SELECT 'searchRow', last_value FROM search_row") {
            let (name, value) = try row.decode((String, Int64).self)
            counters[name] = value
        }
        return counters
    }

    /// The counters, and the versions of `chats` (nil: of every chat).
    private func readCountersAndVersions(into directory: inout StoreDirectory, _ connection: PostgresConnection, chats: [Int64]? = nil) throws {
        let counters = try counters(connection)
        directory.counters = StoreCounters(named: counters)
        directory.feedPositions = FeedSlots.positions(in: counters)
        var binds = Binds()
        let sql =
            chats.map { "SELECT chat, version FROM chat_version WHERE chat = ANY(\(binds.add($0))::bigint[])" } ?? "SELECT chat, version FROM chat_version"
        for row in try run(connection, sql, binds) {
            let (chat, version) = try row.decode((Int64, Int64).self)
            directory.chatVersions[chat] = version
        }
    }

    static func chat(_ row: PostgresRow) throws -> ChatRow {
        var cells = Cells(row, of: "chat")
        return try chat(&cells)
    }

    /// A chat from the next cells of a row (`Columns.chat`), which may go on with more.
    static func chat(_ cells: inout Cells) throws -> ChatRow {
        ChatRow(
            number: try cells.next(), subject: try cells.next(), isOneToOne: try cells.next(), invitePolicy: try cells.next(),
            isDefunct: try cells.next(), data: try cells.next(), lastMessage: try cells.next(), lastActivity: try cells.next())
    }

    /// A row's cells, decoded one after the other.
    struct Cells {
        private var iterator: PostgresRow.Iterator
        private let kind: String

        init(_ row: PostgresRow, of kind: String) {
            iterator = row.makeIterator()
            self.kind = kind
        }

        mutating func next<T: PostgresDecodable>(_ type: T.Type = T.self) throws -> T {
            guard let cell = iterator.next() else { throw StoreFailure(.other, "a \(kind) row has fewer columns than read") }
            return try cell.decode(T.self)
        }
    }

    /// Column lists, in the order the readers below decode them.
    enum Columns {
        static let user = #""number", "userId", "regId""#
        static let endpoint = #"id, "user", description, nickname, "isLegacyDelegate", ordinal"#
        static let chat = #""number", subject, "isOneToOne", "invitePolicy", "isDefunct", data, "lastMessage", "lastActivity""#
        static let refCount = "chat, target, tag, count, newest"
        static let member =
            #"chat, "user", "isActive", "isAdmin", "joinedAt", "leftAt", "isHidden", "localData", "privateData", "deliveredUpTo", "readUpTo", "numUnread""#
        static let message =
            #"chat, id, sender, tag, content, data, "timestamp", "isControl", "neverCountsUnread", "isRecalled", "changeSeq", "searchRow", "#
            + #""thumbName", "thumbBlob", "fileName", "fileBlob", "fileSize", attachment"#
        static let messageUser = #"chat, id, "user", "localData", "isDeleted", "thumbDetached", "fileDownloaded""#
    }

    static func member(_ row: PostgresRow) throws -> MemberRow {
        let (chat, user, isActive, isAdmin, joinedAt, leftAt, isHidden, localData, privateData, deliveredUpTo, readUpTo, numUnread) =
            try row.decode((Int64, Int64, Bool, Bool, Int64, Int64?, Bool, String?, String?, Int64, Int64, Int64).self)
        return MemberRow(
            chat: chat, user: user, isActive: isActive, isAdmin: isAdmin, joinedAt: joinedAt, leftAt: leftAt, isHidden: isHidden,
            localData: localData, privateData: privateData, deliveredUpTo: deliveredUpTo, readUpTo: readUpTo, numUnread: numUnread)
    }

    static func message(_ row: PostgresRow) throws -> MessageRow {
        var cells = Cells(row, of: "message")
        var message = MessageRow(
            chat: try cells.next(), id: try cells.next(), sender: try cells.next(), tag: try cells.next(), content: try cells.next(),
            data: try cells.next(), refs: [], timestamp: try cells.next(), isControl: try cells.next(),
            neverCountsUnread: try cells.next(), isRecalled: try cells.next(), changeSeq: try cells.next(), searchRow: try cells.next())
        message.thumbName = try cells.next()
        message.thumbBlob = try cells.next()
        message.fileName = try cells.next()
        message.fileBlob = try cells.next()
        message.fileSize = try cells.next()
        message.attachment = try cells.next()
        return message
    }

    // MARK: messages

    public func messages(chat: Int64, in ids: ClosedRange<Int64>) throws -> [MessageRow] {
        try withConnection { connection in
            try messages(connection, chat: chat) { binds, column in "\(column) BETWEEN \(binds.add(ids.lowerBound)) AND \(binds.add(ids.upperBound))" }
        }
    }

    public func messages(chat: Int64, ids: [Int64]) throws -> [MessageRow] {
        guard !ids.isEmpty else { return [] }
        return try withConnection { connection in
            try messages(connection, chat: chat) { binds, column in "\(column) = ANY(\(binds.add(ids)))" }
        }
    }

    /// The messages `selecting` names (a condition on the column it is given), each with
    /// its references, reference counts and private states.
    private func messages(_ connection: PostgresConnection, chat: Int64, selecting: (inout Binds, String) -> String) throws -> [MessageRow] {
        func read(_ sql: (String) -> String, column: String) throws -> PostgresQueryResult {
            var binds = Binds()
            let chatParameter = binds.add(chat)
            let condition = selecting(&binds, column)
            return try run(connection, sql("chat = \(chatParameter) AND \(condition)"), binds)
        }
        var messages = try read({ "SELECT \(Columns.message) FROM message WHERE \($0) ORDER BY id" }, column: "id").map(PostgresStore.message)
        guard !messages.isEmpty else { return [] }
        var index: [Int64: Int] = [:]
        index.reserveCapacity(messages.count)
        for (position, message) in messages.enumerated() { index[message.id] = position }
        // Tags in bytewise order (COLLATE "C"), as memory and SQLite keep them, whatever
        // collation the database was made with.
        for row in try read({ "SELECT source, tag, target FROM message_ref WHERE \($0) ORDER BY source, tag COLLATE \"C\"" }, column: "source") {
            let (source, tag, target) = try row.decode((Int64, String, Int64).self)
            if let position = index[source] { messages[position].refs.append(RefRow(tag: tag, target: target)) }
        }
        for row in try read({ "SELECT \(Columns.refCount) FROM ref_count WHERE \($0) ORDER BY target, tag COLLATE \"C\"" }, column: "target") {
            let (chat, target, tag, count, newest) = try row.decode((Int64, Int64, String, Int64, Int64).self)
            if let position = index[target] {
                messages[position].refCounts.append(RefCountRow(chat: chat, target: target, tag: tag, count: count, newest: newest))
            }
        }
        for row in try read({ "SELECT \(Columns.messageUser) FROM message_user WHERE \($0) ORDER BY id, \"user\"" }, column: "id") {
            let (chat, id, user, localData, isDeleted, thumbDetached, fileDownloaded) = try row.decode((Int64, Int64, Int64, String?, Bool, Bool, Bool).self)
            guard let position = index[id] else { continue }
            var state = MessageUserRow(chat: chat, id: id, user: user, localData: localData, isDeleted: isDeleted)
            state.thumbDetached = thumbDetached
            state.fileDownloaded = fileDownloaded
            messages[position].privateStates.append(state)
        }
        return messages
    }

    public func messageIds(chat: Int64, matching filter: MessageFilter, from start: Int64, ascending: Bool, limit: Int) throws -> [Int64] {
        guard limit > 0 else { return [] }
        var binds = Binds()
        var from = "message m"
        var conditions: [String]
        let order: String
        if let referring = filter.referring {
            // Driven by the reference index: a thread's children, a message's edits.
            from = "message_ref r JOIN message m ON m.chat = r.chat AND m.id = r.source"
            conditions = [
                "r.chat = \(binds.add(chat))", "r.target = \(binds.add(referring.target))", "r.tag = \(binds.add(referring.tag))",
                ascending ? "r.source >= \(binds.add(start))" : "r.source <= \(binds.add(start))", "r.source >= \(binds.add(filter.firstId))"
            ]
            order = "r.source"
        } else {
            conditions = [
                "m.chat = \(binds.add(chat))", ascending ? "m.id >= \(binds.add(start))" : "m.id <= \(binds.add(start))",
                "m.id >= \(binds.add(filter.firstId))"
            ]
            order = "m.id"
        }
        if let last = filter.lastId { conditions.append("m.id <= \(binds.add(last))") }
        if let tag = filter.tag { conditions.append("m.tag = \(binds.add(tag))") }
        if let sender = filter.sender { conditions.append("m.sender = \(binds.add(sender))") }
        if let notRefTag = filter.notRefTag {
            conditions.append("NOT EXISTS (SELECT 1 FROM message_ref x WHERE x.chat = m.chat AND x.source = m.id AND x.tag = \(binds.add(notRefTag)))")
        }
        if filter.onlyRecallable {
            conditions.append(#"NOT m."isRecalled""#)
            conditions.append("m.tag <> ALL(\(binds.add(MessageFilter.reservedTags.sorted())))")
        }
        let sql =
            "SELECT m.id FROM \(from) WHERE " + conditions.joined(separator: " AND ")
            + " ORDER BY \(order) \(ascending ? "ASC" : "DESC") LIMIT \(binds.add(Int64(limit)))"
        return try withConnection { connection in try run(connection, sql, binds).map { try $0.decode(Int64.self) } }
    }

    public func firstMessage(chat: Int64, notBefore timestamp: Int64) throws -> Int64? {
        // Timestamps never decrease along a chat's ids: a binary search over ids by point
        // reads of the primary key needs no index of its own.
        try withConnection { connection in
            var binds = Binds()
            let lastSQL = "SELECT max(id) FROM message WHERE chat = \(binds.add(chat))"
            guard let last = try run(connection, lastSQL, binds).first?.decode(Int64?.self) else { return nil }
            var low: Int64 = 1
            var high = last + 1
            while low < high {
                let middle = low + (high - low) / 2
                var at = Binds()
                let sql = #"SELECT "timestamp" FROM message WHERE chat = \#(at.add(chat)) AND id = \#(at.add(middle))"#
                let value = try run(connection, sql, at).first?.decode(Int64.self) ?? Int64.min
                if value >= timestamp { high = middle } else { low = middle + 1 }
            }
            return low <= last ? low : nil
        }
    }

    public func references(chat: Int64, to target: Int64, tag: String, excluding excluded: Set<Int64>) throws -> (count: Int64, newest: Int64?) {
        var binds = Binds()
        let sql =
            "SELECT source FROM message_ref WHERE chat = \(binds.add(chat)) AND target = \(binds.add(target)) AND tag = \(binds.add(tag)) "
            + "AND NOT (source = ANY(\(binds.add(excluded.sorted())))) ORDER BY source DESC"
        return try withConnection { connection in
            let sources = try run(connection, sql, binds).map { try $0.decode(Int64.self) }
            return (Int64(sources.count), sources.first)
        }
    }

    // MARK: the change feed

    public func changedMessages(chats: [Int64], after seq: Int64, limit: Int) throws -> [MessageChangeRow] {
        guard !chats.isEmpty, limit > 0 else { return [] }
        // Each chat's first changes by the (chat, changeSeq) index, then the first of all:
        // O(chats × limit) index entries, not every change since `seq`.
        var binds = Binds()
        let chatsParameter = binds.add(chats)
        let seqParameter = binds.add(seq)
        let limitParameter = binds.add(Int64(limit))
        let sql = """
            SELECT m.chat, m.id, m."changeSeq" FROM unnest(\(chatsParameter)::bigint[]) AS c(chat)
            CROSS JOIN LATERAL (SELECT chat, id, "changeSeq" FROM message WHERE chat = c.chat AND "changeSeq" > \(seqParameter)
                                ORDER BY "changeSeq" LIMIT \(limitParameter)) m
            ORDER BY m."changeSeq" LIMIT \(limitParameter)
            """
        return try withConnection { connection in
            try run(connection, sql, binds).map {
                let (chat, id, changeSeq) = try $0.decode((Int64, Int64, Int64).self)
                return MessageChangeRow(chat: chat, id: id, changeSeq: changeSeq)
            }
        }
    }

    public func feedPositions() throws -> [Int: Int64] {
        try withConnection { connection in FeedSlots.positions(in: try counters(connection)) }
    }

    public func rangeChanges(chats: [Int64], after seq: Int64) throws -> [RangeChangeRow] {
        guard !chats.isEmpty else { return [] }
        var binds = Binds()
        let sql =
            #"SELECT chat, "firstSeq", "firstId", "lastId" FROM range_change WHERE chat = ANY(\#(binds.add(chats))) AND "lastSeq" > \#(binds.add(seq)) ORDER BY "firstSeq""#
        return try withConnection { connection in
            try run(connection, sql, binds).map {
                let (chat, firstSeq, firstId, lastId) = try $0.decode((Int64, Int64, Int64, Int64).self)
                return RangeChangeRow(chat: chat, firstSeq: firstSeq, firstId: firstId, lastId: lastId)
            }
        }
    }

    public func searchable(by user: Int64, among hits: [SearchHit]) throws -> Set<SearchHit> {
        guard !hits.isEmpty else { return [] }
        var binds = Binds()
        let sql =
            #"SELECT m.chat, m.id, m."searchRow" FROM unnest(\#(binds.add(hits.map(\.chat)))::bigint[], "#
            + #"\#(binds.add(hits.map(\.id)))::bigint[], \#(binds.add(hits.map(\.row)))::bigint[]) AS h(chat, id, "row") "#
            + #"JOIN message m ON m.chat = h.chat AND m.id = h.id AND m."searchRow" = h."row" "#
            + #"WHERE NOT EXISTS (SELECT 1 FROM message_user u WHERE u.chat = m.chat AND u.id = m.id AND u."user" = \#(binds.add(user)) AND u."isDeleted")"#
        return try withConnection { connection in
            Set(
                try run(connection, sql, binds).map {
                    let (chat, id, row) = try $0.decode((Int64, Int64, Int64).self)
                    return SearchHit(chat: chat, id: id, row: row)
                })
        }
    }

    // MARK: attachments and search

    public func blobUses(_ blob: String) throws -> Int64 {
        var binds = Binds()
        let sql = "SELECT uses FROM blob WHERE hash = \(binds.add(blob))"
        return try withConnection { connection in try run(connection, sql, binds).first?.decode(Int64.self) ?? 0 }
    }

    public func searchEntries(after row: Int64, limit: Int, maxBytes: Int) throws -> [SearchEntry] {
        let (sql, binds) = PostgresStore.searchEntriesQuery(after: row, limit: limit, maxBytes: maxBytes)
        return try withConnection { connection in try PostgresStore.searchEntries(in: run(connection, sql, binds)) }
    }

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
        var binds = Binds()
        let sql = "SELECT nextval('\(sequence)') FROM generate_series(1, \(binds.add(calls)))"
        return try withConnection { connection in
            // Each value ends a block; another node's calls may come between them.
            var ranges: [ClosedRange<Int64>] = []
            for last in try run(connection, sql, binds).map({ try $0.decode(Int64.self) }).sorted() {
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
                    try statement.commit { binds in
                        let fence = fence(&binds)
                        return PostgresStore.claim(batch.chatVersions, &binds).map { fence + ", " + $0 } ?? fence
                    }
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
    private func commit(_ batch: StoreBatch, after follows: Int64, on connection: PostgresConnection) throws {
        var early = StoreBatch()
        early.newMessages = batch.newMessages
        var rest = batch
        rest.newMessages = []
        try run(connection, "BEGIN")
        let first = OneStatement(connection: connection, store: self)
        write(early, first)
        try first.send { binds in fence(&binds) }
        guard outcomes.wait(for: follows) else {
            throw StoreFailure(.other, "the commit before it failed, and this one was decided after it: nothing of it was applied")
        }
        if !rest.isEmpty || !rest.chatVersions.isEmpty || allNodesDecide {
            let second = OneStatement(connection: connection, store: self)
            write(rest, second)
            logForOthers(batch, second)
            try second.send { binds in PostgresStore.claim(rest.chatVersions, &binds).map { "SELECT " + $0 } ?? "SELECT 1" }
        }
        try run(connection, "COMMIT")
    }

    /// The search index's rows (`PostgresSearchIndex`): a new searchable message's keys,
    /// and a recalled message's row deleted (its search row set to 0), in the commit that
    /// makes or recalls it.
    private func writeSearchKeys(_ batch: StoreBatch, _ statement: OneStatement) {
        let searchable = batch.newMessages.filter { $0.searchRow > 0 && $0.content != nil }
        if !searchable.isEmpty {
            var binds = statement.binds()
            let rows = PostgresStore.searchRows(searchable.map { SearchEntry(row: $0.searchRow, chat: $0.chat, id: $0.id, text: $0.content!) }, &binds)
            statement.add(#"INSERT INTO message_search (chat, id, "searchRow", keys) SELECT u.chat, u.id, u."row", u.keys FROM \#(rows)"#, binds)
        }
        let recalled = batch.messageUpdates.filter { $0.columns.contains(.searchRow) && $0.row.searchRow == 0 }.map(\.row)
        if !recalled.isEmpty {
            var binds = statement.binds()
            statement.add(
                """
                DELETE FROM message_search s USING unnest(\(binds.add(recalled.map(\.chat)))::bigint[], \(binds.add(recalled.map(\.id)))::bigint[])
                AS r(chat, id) WHERE s.chat = r.chat AND s.id = r.id
                """, binds)
        }
    }

    /// A value of a row written by `insert` or `update`.
    enum Value {
        case int(Int64?)
        case text(String?)
        case bool(Bool)
    }

    /// Inserts `rows` (each with a value per column) in one clause whose text does not
    /// depend on how many rows there are: each column is bound as one array and `unnest`
    /// turns the arrays back into rows, so PostgreSQL parses and plans a short statement
    /// (with one tuple of parameters per row, parsing and planning the statement took a
    /// third of PostgreSQL's time); `conflict` is what follows ON CONFLICT.
    private func insert(_ statement: OneStatement, into table: String, columns: [String], rows: [[Value]], conflict: String? = nil) {
        guard let first = rows.first else { return }
        var binds = statement.binds()
        let arrays = first.indices.map { column in binds.add(column: rows.map { $0[column] }) }
        var sql = "INSERT INTO \(table) (\(columns.joined(separator: ", "))) SELECT * FROM unnest(\(arrays.joined(separator: ", ")))"
        if let conflict { sql += " ON CONFLICT \(conflict)" }
        statement.add(sql, binds)
    }

    /// `ON CONFLICT (key) DO UPDATE` setting every other column to the new row's.
    private static func replacing(key: [String], columns: [String]) -> String {
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
    private func update(_ statement: OneStatement, _ table: String, keyColumns: [String], _ rows: [RowUpdate]) {
        var groups: [[String]: [RowUpdate]] = [:]
        var order: [[String]] = []
        for row in rows where !row.values.isEmpty {
            let columns = row.values.map(\.column)
            if groups[columns] == nil { order.append(columns) }
            groups[columns, default: []].append(row)
        }
        for columns in order {
            let group = groups[columns]!
            var binds = statement.binds()
            var arrays: [String] = []
            var names: [String] = []
            for position in keyColumns.indices {
                arrays.append(binds.add(column: group.map { .int($0.key[position]) }))
                names.append("k\(position)")
            }
            for position in columns.indices {
                arrays.append(binds.add(column: group.map { $0.values[position].value }))
                names.append("v\(position)")
            }
            let assignments = columns.enumerated().map { "\"\($1)\" = u.v\($0)" }
            let conditions = keyColumns.enumerated().map { "t.\($1) = u.k\($0)" }
            statement.add(
                "UPDATE \(table) AS t SET \(assignments.joined(separator: ", ")) FROM unnest(\(arrays.joined(separator: ", "))) "
                    + "AS u(\(names.joined(separator: ", "))) WHERE \(conditions.joined(separator: " AND "))", binds)
        }
    }

    private static let userColumns = Columns.user.components(separatedBy: ", ")
    private static let endpointColumns = Columns.endpoint.components(separatedBy: ", ")
    private static let chatColumns = Columns.chat.components(separatedBy: ", ")
    private static let memberColumns = Columns.member.components(separatedBy: ", ")
    private static let messageColumns = Columns.message.components(separatedBy: ", ")
    private static let messageUserColumns = Columns.messageUser.components(separatedBy: ", ")
    private static let refCountColumns = Columns.refCount.components(separatedBy: ", ")
    private static let rangeChangeColumns = ["chat", #""lastSeq""#, #""firstSeq""#, #""firstId""#, #""lastId""#]

    /// The batch's writes, as clauses of `statement`. No two of them touch the same row:
    /// a chat, member or message is new (inserted) or stored (updated), touches leave out
    /// the messages the batch changed, a new message's references are inserted and only a
    /// stored one's dropped, reference counts are kept or deleted by key, blob counts are
    /// deleted or added to by what they were before, and an endpoint is written or removed.
    private func write(_ batch: StoreBatch, _ statement: OneStatement) {
        typealias S = PostgresStore
        insert(statement, into: #""user""#, columns: S.userColumns, rows: batch.newUsers.map { [.int($0.number), .text($0.userId), .int($0.regId)] })
        insert(
            statement, into: "endpoint", columns: S.endpointColumns,
            rows: batch.endpoints.map {
                [.int($0.id), .int($0.user), .text($0.description), .text($0.nickname), .bool($0.isLegacyDelegate), .int($0.ordinal)]
            }, conflict: S.replacing(key: ["id"], columns: S.endpointColumns))
        // Written and removed endpoints are never the same ones (`StoreBatch`).
        if !batch.removedEndpoints.isEmpty {
            var binds = statement.binds()
            statement.add("DELETE FROM endpoint WHERE id = ANY(\(binds.add(batch.removedEndpoints)))", binds)
        }
        insert(
            statement, into: "chat", columns: S.chatColumns,
            rows: batch.newChats.map {
                [
                    .int($0.number), .text($0.subject), .bool($0.isOneToOne), .text($0.invitePolicy), .bool($0.isDefunct), .text($0.data), .int($0.lastMessage),
                    .int($0.lastActivity)
                ]
            })
        update(
            statement, "chat", keyColumns: [#""number""#],
            batch.chatUpdates.map { update in
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
                        }
                    })
            })
        insert(
            statement, into: "member", columns: S.memberColumns, rows: batch.members.map(S.values),
            conflict: S.replacing(key: ["chat", #""user""#], columns: S.memberColumns))
        update(
            statement, "member", keyColumns: ["chat", #""user""#],
            batch.memberUpdates.map { update in
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
                        }
                    })
            })
        insert(statement, into: "message", columns: S.messageColumns, rows: batch.newMessages.map(S.values))
        insert(
            statement, into: "message_ref", columns: ["chat", "source", "tag", "target"],
            rows: batch.newMessages.flatMap { message in
                message.refs.map { [.int(message.chat), .int(message.id), .text($0.tag), .int($0.target)] }
            }, conflict: "DO NOTHING")
        update(
            statement, "message", keyColumns: ["chat", "id"],
            batch.messageUpdates.map { update in
                let row = update.row
                return RowUpdate(
                    key: [row.chat, row.id],
                    values: update.columns.sorted { $0.rawValue < $1.rawValue }.map { column in
                        switch column {
                        case .content: (column.rawValue, .text(row.content))
                        case .data: (column.rawValue, .text(row.data))
                        case .isRecalled: (column.rawValue, .bool(row.isRecalled))
                        case .changeSeq: (column.rawValue, .int(row.changeSeq))
                        case .searchRow: (column.rawValue, .int(row.searchRow))
                        case .thumbName: (column.rawValue, .text(row.thumbName))
                        case .thumbBlob: (column.rawValue, .text(row.thumbBlob))
                        case .fileName: (column.rawValue, .text(row.fileName))
                        case .fileBlob: (column.rawValue, .text(row.fileBlob))
                        case .fileSize: (column.rawValue, .int(row.fileSize))
                        case .attachment: (column.rawValue, .text(row.attachment))
                        }
                    })
            })
        writeSearchKeys(batch, statement)
        if !batch.droppedReferences.isEmpty {
            var binds = statement.binds()
            statement.add(
                """
                DELETE FROM message_ref r USING unnest(\(binds.add(batch.droppedReferences.map(\.chat)))::bigint[], \(binds.add(batch.droppedReferences.map(\.id)))::bigint[])
                AS d(chat, source) WHERE r.chat = d.chat AND r.source = d.source
                """, binds)
        }
        if !batch.touches.isEmpty {
            var binds = statement.binds()
            statement.add(
                """
                UPDATE message m SET "changeSeq" = t.seq
                FROM unnest(\(binds.add(batch.touches.map(\.chat)))::bigint[], \(binds.add(batch.touches.map(\.id)))::bigint[], \(binds.add(batch.touches.map(\.seq)))::bigint[])
                AS t(chat, id, seq) WHERE m.chat = t.chat AND m.id = t.id
                """, binds)
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
            var binds = statement.binds()
            statement.add(
                """
                DELETE FROM ref_count c USING unnest(\(binds.add(gone.map(\.chat)))::bigint[], \(binds.add(gone.map(\.target)))::bigint[], \(binds.add(gone.map(\.tag)))::text[])
                AS g(chat, target, tag) WHERE c.chat = g.chat AND c.target = g.target AND c.tag = g.tag
                """, binds)
        }
        insert(
            statement, into: "message_user", columns: S.messageUserColumns,
            rows: batch.privateStates.map {
                [.int($0.chat), .int($0.id), .int($0.user), .text($0.localData), .bool($0.isDeleted), .bool($0.thumbDetached), .bool($0.fileDownloaded)]
            }, conflict: S.replacing(key: ["chat", "id", #""user""#], columns: S.messageUserColumns))
        let blobs = batch.blobUses.filter { $0.value != 0 }.sorted { $0.key < $1.key }
        if !blobs.isEmpty {
            // A count that reaches zero is deleted, the others are added to (or made): two
            // clauses that decide on the count before the statement, so that they never
            // touch the same row.
            var binds = statement.binds()
            let uses = "unnest(\(binds.add(blobs.map(\.key)))::text[], \(binds.add(blobs.map(\.value)))::bigint[]) AS u(hash, delta)"
            statement.add("DELETE FROM blob b USING \(uses) WHERE b.hash = u.hash AND b.uses + u.delta <= 0", binds)
            statement.add(
                """
                INSERT INTO blob (hash, uses) SELECT u.hash, u.delta FROM \(uses) LEFT JOIN blob b ON b.hash = u.hash
                WHERE coalesce(b.uses, 0) + u.delta > 0 ON CONFLICT (hash) DO UPDATE SET uses = blob.uses + EXCLUDED.uses
                """, binds)
        }
        if let counters = batch.counters {
            // This node's feed slot's position only: the search rows' sequence keeps the
            // last search row (`takeNumbers`).
            var binds = statement.binds()
            statement.add(
                """
                INSERT INTO counter (name, value) VALUES (\(binds.add(FeedSlots.counterName(of: counters.slot))), \(binds.add(counters.changeSeq)))
                ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value
                """, binds)
        }
    }

    private static func values(_ member: MemberRow) -> [Value] {
        [
            .int(member.chat), .int(member.user), .bool(member.isActive), .bool(member.isAdmin), .int(member.joinedAt), .int(member.leftAt),
            .bool(member.isHidden),
            .text(member.localData), .text(member.privateData), .int(member.deliveredUpTo), .int(member.readUpTo), .int(member.numUnread)
        ]
    }

    private static func values(_ message: MessageRow) -> [Value] {
        [
            .int(message.chat), .int(message.id), .int(message.sender), .text(message.tag), .text(message.content), .text(message.data),
            .int(message.timestamp),
            .bool(message.isControl), .bool(message.neverCountsUnread), .bool(message.isRecalled), .int(message.changeSeq), .int(message.searchRow),
            .text(message.thumbName), .text(message.thumbBlob), .text(message.fileName), .text(message.fileBlob), .int(message.fileSize),
            .text(message.attachment)
        ]
    }
}

extension PostgresStore.Binds {
    mutating func add(_ value: PostgresStore.Value) -> String {
        switch value {
        case .int(let number): add(number)
        case .text(let text): add(text)
        case .bool(let flag): add(flag)
        }
    }

    /// One column of rows (values of one type, as the first one is) as one array
    /// parameter, cast to its SQL array type.
    mutating func add(column values: [PostgresStore.Value]) -> String {
        switch values.first {
        case .int?, nil:
            bindings.append(NullableArray(values.map { if case .int(let number) = $0 { number } else { nil } }))
            return next() + "::bigint[]"
        case .text?:
            bindings.append(NullableArray(values.map { if case .text(let text) = $0 { text } else { nil } }))
            return next() + "::text[]"
        case .bool?:
            bindings.append(NullableArray(values.map { if case .bool(let flag) = $0 { flag } else { nil } }))
            return next() + "::boolean[]"
        }
    }
}

/// An array parameter whose elements may be NULL (postgres-nio's arrays cannot hold
/// NULL), in PostgreSQL's binary array format: dimensions, whether a NULL is in it, the
/// element type, length and lower bound, then each element (length -1 for NULL).
struct NullableArray<Element: PostgresArrayEncodable & PostgresNonThrowingEncodable>: PostgresNonThrowingEncodable {
    let elements: [Element?]

    init(_ elements: [Element?]) {
        self.elements = elements
    }

    static var psqlType: PostgresDataType { Element.psqlArrayType }
    static var psqlFormat: PostgresFormat { .binary }

    func encode<JSONEncoder: PostgresJSONEncoder>(into buffer: inout ByteBuffer, context: PostgresEncodingContext<JSONEncoder>) {
        buffer.writeInteger(elements.isEmpty ? 0 : 1, as: Int32.self)
        buffer.writeInteger(elements.contains { $0 == nil } ? 1 : 0, as: Int32.self)
        buffer.writeInteger(Element.psqlType.rawValue)
        guard !elements.isEmpty else { return }
        buffer.writeInteger(Int32(elements.count))
        buffer.writeInteger(1, as: Int32.self)
        for element in elements {
            guard let element else {
                buffer.writeInteger(-1, as: Int32.self)
                continue
            }
            let lengthAt = buffer.writerIndex
            buffer.writeInteger(0, as: Int32.self)
            let start = buffer.writerIndex
            element.encode(into: &buffer, context: context)
            buffer.setInteger(Int32(buffer.writerIndex - start), at: lengthAt)
        }
    }
}

/// The writes of one commit, kept as the WITH clauses of one statement that `send(main:)`
/// or `commit(main:)` sends: their parameters are numbered across all of them (take each
/// clause's `binds()` from here and hand them back with `add`).
final class OneStatement {
    let connection: PostgresConnection
    let store: PostgresStore
    private var shared = PostgresStore.Binds()
    private var clauses: [String] = []

    init(connection: PostgresConnection, store: PostgresStore) {
        self.connection = connection
        self.store = store
    }

    /// Where the next clause's parameters go.
    func binds() -> PostgresStore.Binds {
        shared
    }

    func add(_ sql: String, _ binds: PostgresStore.Binds) {
        shared = binds
        clauses.append(sql)
    }

    /// The clauses as the WITH clauses of `main` (made with the same parameters).
    private func statement(_ main: (inout PostgresStore.Binds) -> String) -> PostgresQuery {
        var binds = shared
        let query = main(&binds)
        let sql = clauses.isEmpty ? query : "WITH " + clauses.enumerated().map { "w\($0) AS (\($1))" }.joined(separator: ", ") + " " + query
        return PostgresQuery(unsafeSQL: sql, binds: binds.bindings)
    }

    /// Sends the statement inside a transaction block and waits for its answer.
    func send(main: (inout PostgresStore.Binds) -> String) throws {
        _ = try store.wait(for: connection.query(statement(main), logger: store.logger), on: connection)
    }

    /// Sends the statement as a transaction of its own and waits until it is committed
    /// (`PostgresStore.runCommitted`).
    func commit(main: (inout PostgresStore.Binds) -> String) throws {
        try store.runCommitted(connection, statement(main))
    }
}
