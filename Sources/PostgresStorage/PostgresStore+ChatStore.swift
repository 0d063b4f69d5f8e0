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
            directory.users = try run(connection, "SELECT \(unescaped: Columns.user) FROM \"user\" ORDER BY \"number\"").map {
                let (number, userId, regId) = try $0.decode((Int64, String, Int64).self)
                return UserRecord(number: number, userId: userId, regId: regId)
            }
            directory.userSettings = try run(connection, "SELECT \(unescaped: Columns.userSettings) FROM user_settings ORDER BY \"user\"").map(
                PostgresStore.userSettings)
            directory.endpoints = try run(connection, "SELECT \(unescaped: Columns.endpoint) FROM endpoint ORDER BY ordinal").map(PostgresStore.endpoint)
            directory.chats = try run(connection, "SELECT \(unescaped: Columns.chat) FROM chat ORDER BY \"number\"").map(PostgresStore.chat)
            directory.members = try run(connection, "SELECT \(unescaped: Columns.member) FROM member ORDER BY chat, \"user\"").map(PostgresStore.member)
            return directory
        }
    }

    public func loadChats(_ numbers: [Int64]) throws -> StoreDirectory {
        try withConnection { connection in
            var directory = StoreDirectory()
            // The versions first (`loadDirectory` says why).
            try readCountersAndVersions(into: &directory, connection, chats: numbers)
            directory.chats = try run(
                connection, "SELECT \(unescaped: Columns.chat) FROM chat WHERE \"number\" = ANY(\(numbers)::bigint[]) ORDER BY \"number\""
            )
            .map(PostgresStore.chat)
            directory.members = try members(of: numbers, on: connection)
            return directory
        }
    }

    /// The memberships of the chats `numbers`, by chat and user.
    func members(of numbers: [Int64], on connection: PostgresConnection) throws -> [MemberRow] {
        try run(connection, "SELECT \(unescaped: Columns.member) FROM member WHERE chat = ANY(\(numbers)::bigint[]) ORDER BY chat, \"user\"")
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
        let sql: SQL = chats.map { "SELECT chat, version FROM chat_version WHERE chat = ANY(\($0)::bigint[])" } ?? "SELECT chat, version FROM chat_version"
        for row in try run(connection, sql) {
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
        var chat = ChatRow(
            number: try cells.next(), subject: try cells.next(), isOneToOne: try cells.next(), invitePolicy: try cells.next(),
            isDefunct: try cells.next(), data: try cells.next(), lastMessage: try cells.next(), lastActivity: try cells.next())
        chat.pinPolicy = try cells.next()
        chat.pins = try cells.next()
        return chat
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
        static let endpoint = #"id, "user", description, nickname, "isLegacyDelegate", ordinal, "pushToken""#
        static let chat = #""number", subject, "isOneToOne", "invitePolicy", "isDefunct", data, "lastMessage", "lastActivity", "pinPolicy", pins"#
        static let refCount = "chat, target, tag, count, newest"
        static let member =
            #"chat, "user", "isActive", "isAdmin", "joinedAt", "leftAt", "isHidden", "localData", "privateData", "deliveredUpTo", "readUpTo", "numUnread", "numUnreadMentions", "mutedUntil", "isBanned""#
        static let userSettings = #""user", "presenceHidden", "lastActive", blocked"#
        static let message = MessageColumn.allCases.map { "\"\($0.rawValue)\"" }.joined(separator: ", ")
        static let messageUser = #"chat, id, "user", "localData", "isDeleted", "thumbDetached", "fileDownloaded", reactions"#
    }

    static func endpoint(_ row: PostgresRow) throws -> EndpointRow {
        let (id, user, description, nickname, isLegacyDelegate, ordinal, pushToken) = try row.decode((Int64, Int64, String, String, Bool, Int64, String?).self)
        var endpoint = EndpointRow(id: id, user: user, description: description, nickname: nickname, isLegacyDelegate: isLegacyDelegate, ordinal: ordinal)
        endpoint.pushToken = pushToken
        return endpoint
    }

    static func member(_ row: PostgresRow) throws -> MemberRow {
        let (
            chat, user, isActive, isAdmin, joinedAt, leftAt, isHidden, localData, privateData, deliveredUpTo, readUpTo, numUnread, numUnreadMentions,
            mutedUntil, isBanned
        ) =
            try row.decode((Int64, Int64, Bool, Bool, Int64, Int64?, Bool, String?, String?, Int64, Int64, Int64, Int64, Int64?, Bool).self)
        var member = MemberRow(
            chat: chat, user: user, isActive: isActive, isAdmin: isAdmin, joinedAt: joinedAt, leftAt: leftAt, isHidden: isHidden,
            localData: localData, privateData: privateData, deliveredUpTo: deliveredUpTo, readUpTo: readUpTo, numUnread: numUnread)
        member.numUnreadMentions = numUnreadMentions
        member.mutedUntil = mutedUntil
        member.isBanned = isBanned
        return member
    }

    static func userSettings(_ row: PostgresRow) throws -> UserSettingsRow {
        let (user, presenceHidden, lastActive, blocked) = try row.decode((Int64, Bool, Int64?, String).self)
        return UserSettingsRow(user: user, presenceHidden: presenceHidden, lastActive: lastActive, blocked: UserSettingsRow.blocked(stored: blocked))
    }

    static func message(_ row: PostgresRow) throws -> MessageRow {
        var cells = Cells(row, of: "message")
        return try MessageRow { column in
            switch column.kind {
            case .int: .int(try cells.next(Int64.self))
            case .optionalInt: .int(try cells.next(Int64?.self))
            case .text: .text(try cells.next(String.self))
            case .optionalText: .text(try cells.next(String?.self))
            case .bool: .bool(try cells.next(Bool.self))
            }
        }
    }

    // MARK: messages

    public func messages(chat: Int64, in ids: ClosedRange<Int64>) throws -> [MessageRow] {
        try withConnection { connection in
            try messages(connection, chat: chat) { column in "\(unescaped: column) BETWEEN \(ids.lowerBound) AND \(ids.upperBound)" }
        }
    }

    public func messages(chat: Int64, ids: [Int64]) throws -> [MessageRow] {
        guard !ids.isEmpty else { return [] }
        return try withConnection { connection in
            try messages(connection, chat: chat) { column in "\(unescaped: column) = ANY(\(ids))" }
        }
    }

    /// The messages `selecting` names (a condition on the column it is given), each with
    /// its references, reference counts and private states.
    private func messages(_ connection: PostgresConnection, chat: Int64, selecting: (String) -> SQL) throws -> [MessageRow] {
        func read(_ sql: (SQL) -> SQL, column: String) throws -> PostgresQueryResult {
            try run(connection, sql("chat = \(chat) AND \(selecting(column))"))
        }
        var messages = try read({ "SELECT \(unescaped: Columns.message) FROM message WHERE \($0) ORDER BY id" }, column: "id").map(PostgresStore.message)
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
        for row in try read({ "SELECT \(unescaped: Columns.refCount) FROM ref_count WHERE \($0) ORDER BY target, tag COLLATE \"C\"" }, column: "target") {
            let (chat, target, tag, count, newest) = try row.decode((Int64, Int64, String, Int64, Int64).self)
            if let position = index[target] {
                messages[position].refCounts.append(RefCountRow(chat: chat, target: target, tag: tag, count: count, newest: newest))
            }
        }
        for row in try read({ "SELECT \(unescaped: Columns.messageUser) FROM message_user WHERE \($0) ORDER BY id, \"user\"" }, column: "id") {
            let (chat, id, user, localData, isDeleted, thumbDetached, fileDownloaded, reactions) = try row.decode(
                (Int64, Int64, Int64, String?, Bool, Bool, Bool, String?).self)
            guard let position = index[id] else { continue }
            var state = MessageUserRow(chat: chat, id: id, user: user, localData: localData, isDeleted: isDeleted)
            state.thumbDetached = thumbDetached
            state.fileDownloaded = fileDownloaded
            state.reactions = reactions
            messages[position].privateStates.append(state)
        }
        return messages
    }

    public func messageIds(chat: Int64, matching filter: MessageFilter, from start: Int64, ascending: Bool, limit: Int) throws -> [Int64] {
        guard limit > 0 else { return [] }
        var from = "message m"
        var conditions: [SQL]
        let order: String
        if let referring = filter.referring {
            // Driven by the reference index: a thread's children, a message's edits.
            from = "message_ref r JOIN message m ON m.chat = r.chat AND m.id = r.source"
            conditions = [
                "r.chat = \(chat)", "r.target = \(referring.target)", "r.tag = \(referring.tag)",
                ascending ? "r.source >= \(start)" : "r.source <= \(start)", "r.source >= \(filter.firstId)"
            ]
            order = "r.source"
        } else {
            conditions = [
                "m.chat = \(chat)", ascending ? "m.id >= \(start)" : "m.id <= \(start)",
                "m.id >= \(filter.firstId)"
            ]
            order = "m.id"
        }
        if let last = filter.lastId { conditions.append("m.id <= \(last)") }
        if let tag = filter.tag { conditions.append("m.tag = \(tag)") }
        if let sender = filter.sender { conditions.append("m.sender = \(sender)") }
        if let notRefTag = filter.notRefTag {
            conditions.append("NOT EXISTS (SELECT 1 FROM message_ref x WHERE x.chat = m.chat AND x.source = m.id AND x.tag = \(notRefTag))")
        }
        if filter.onlyRecallable {
            conditions.append(#"NOT m."isRecalled""#)
            conditions.append("m.tag <> ALL(\(MessageFilter.reservedTags.sorted()))")
        }
        let sql: SQL =
            "SELECT m.id FROM \(unescaped: from) WHERE \(SQL(joining: conditions, separator: " AND "))"
            + " ORDER BY \(unescaped: order) \(unescaped: ascending ? "ASC" : "DESC") LIMIT \(Int64(limit))"
        return try withConnection { connection in try run(connection, sql).map { try $0.decode(Int64.self) } }
    }

    public func message(chat: Int64, sender: Int64, externalId: String) throws -> Int64? {
        let sql: SQL = #"SELECT min(id) FROM message WHERE chat = \#(chat) AND sender = \#(sender) AND "externalId" = \#(externalId)"#
        return try withConnection { connection in try run(connection, sql).first?.decode(Int64?.self) ?? nil }
    }

    public func mentions(of user: Int64, after position: MentionPosition?, limit: Int) throws -> [MentionPosition] {
        // No position: from before the highest there can be.
        let before = position ?? MentionPosition(timestamp: .max, chat: .max, id: .max)
        let sql: SQL = #"""
            SELECT timestamp, chat, id FROM message_mention WHERE "user" = \#(user)
            AND (timestamp, chat, id) < (\#(before.timestamp), \#(before.chat), \#(before.id))
            ORDER BY timestamp DESC, chat DESC, id DESC LIMIT \#(Int64(limit))
            """#
        return try withConnection { connection in
            try run(connection, sql).map { row in
                let (timestamp, chat, id) = try row.decode((Int64, Int64, Int64).self)
                return MentionPosition(timestamp: timestamp, chat: chat, id: id)
            }
        }
    }

    public func firstMessage(chat: Int64, notBefore timestamp: Int64) throws -> Int64? {
        // Timestamps never decrease along a chat's ids: a binary search over ids by point
        // reads of the primary key needs no index of its own.
        try withConnection { connection in
            guard let last = try run(connection, "SELECT max(id) FROM message WHERE chat = \(chat)").first?.decode(Int64?.self) else { return nil }
            var low: Int64 = 1
            var high = last + 1
            while low < high {
                let middle = low + (high - low) / 2
                let sql: SQL = #"SELECT "timestamp" FROM message WHERE chat = \#(chat) AND id = \#(middle)"#
                let value = try run(connection, sql).first?.decode(Int64.self) ?? Int64.min
                if value >= timestamp { high = middle } else { low = middle + 1 }
            }
            return low <= last ? low : nil
        }
    }

    public func references(chat: Int64, to target: Int64, tag: String, excluding excluded: Set<Int64>) throws -> (count: Int64, newest: Int64?) {
        let sql: SQL =
            "SELECT source FROM message_ref WHERE chat = \(chat) AND target = \(target) AND tag = \(tag) "
            + "AND NOT (source = ANY(\(excluded.sorted()))) ORDER BY source DESC"
        return try withConnection { connection in
            let sources = try run(connection, sql).map { try $0.decode(Int64.self) }
            return (Int64(sources.count), sources.first)
        }
    }

    // MARK: the change feed

    public func changedMessages(chats: [Int64], after seq: Int64, limit: Int) throws -> [MessageChangeRow] {
        guard !chats.isEmpty, limit > 0 else { return [] }
        // Each chat's first changes by the (chat, changeSeq) index, then the first of all:
        // O(chats × limit) index entries, not every change since `seq`.
        let sql: SQL = """
            SELECT m.chat, m.id, m."changeSeq" FROM unnest(\(chats)::bigint[]) AS c(chat)
            CROSS JOIN LATERAL (SELECT chat, id, "changeSeq" FROM message WHERE chat = c.chat AND "changeSeq" > \(seq)
                                ORDER BY "changeSeq" LIMIT \(Int64(limit))) m
            ORDER BY m."changeSeq" LIMIT \(Int64(limit))
            """
        return try withConnection { connection in
            try run(connection, sql).map {
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
        let sql: SQL =
            #"SELECT chat, "firstSeq", "firstId", "lastId" FROM range_change WHERE chat = ANY(\#(chats)) AND "lastSeq" > \#(seq) ORDER BY "firstSeq""#
        return try withConnection { connection in
            try run(connection, sql).map {
                let (chat, firstSeq, firstId, lastId) = try $0.decode((Int64, Int64, Int64, Int64).self)
                return RangeChangeRow(chat: chat, firstSeq: firstSeq, firstId: firstId, lastId: lastId)
            }
        }
    }

    public func searchable(by user: Int64, among hits: [SearchHit]) throws -> Set<SearchHit> {
        guard !hits.isEmpty else { return [] }
        let sql: SQL =
            #"SELECT m.chat, m.id, m."searchRow" FROM unnest(\#(hits.map(\.chat))::bigint[], "#
            + #"\#(hits.map(\.id))::bigint[], \#(hits.map(\.row))::bigint[]) AS h(chat, id, "row") "#
            + #"JOIN message m ON m.chat = h.chat AND m.id = h.id AND m."searchRow" = h."row" "#
            + #"WHERE NOT EXISTS (SELECT 1 FROM message_user u WHERE u.chat = m.chat AND u.id = m.id AND u."user" = \#(user) AND u."isDeleted")"#
        return try withConnection { connection in
            Set(
                try run(connection, sql).map {
                    let (chat, id, row) = try $0.decode((Int64, Int64, Int64).self)
                    return SearchHit(chat: chat, id: id, row: row)
                })
        }
    }

    // MARK: attachments and search

    public func blobUses(_ blob: String) throws -> Int64 {
        try withConnection { connection in try run(connection, "SELECT uses FROM blob WHERE hash = \(blob)").first?.decode(Int64.self) ?? 0 }
    }

    public func searchEntries(after row: Int64, limit: Int, maxBytes: Int) throws -> [SearchEntry] {
        let sql = PostgresStore.searchEntriesQuery(after: row, limit: limit, maxBytes: maxBytes)
        return try withConnection { connection in try PostgresStore.searchEntries(in: run(connection, sql)) }
    }
}
