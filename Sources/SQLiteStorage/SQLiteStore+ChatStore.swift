import GRDB
import Storage

/// `ChatStore` on SQLite: what the engine reads, through indexes, and one transaction per
/// batch that writes only what changed.
extension SQLiteStore: ChatStore {
    // MARK: start-up

    public func loadDirectory() throws -> StoreDirectory {
        try pool.read { db in
            var directory = StoreDirectory()
            directory.users = try UserRecord.order(Column("number")).fetchAll(db)
            directory.userSettings = try UserSettingsRow.order(Column("user")).fetchAll(db)
            directory.endpoints = try EndpointRow.order(Column("ordinal")).fetchAll(db)
            directory.chats = try ChatRow.order(Column("number")).fetchAll(db)
            directory.members = try MemberRow.order(Column("chat"), Column("user")).fetchAll(db)
            try readCounters(into: &directory, db)
            return directory
        }
    }

    public func loadChats(_ numbers: [Int64]) throws -> StoreDirectory {
        try pool.read { db in
            var directory = StoreDirectory()
            directory.chats = try ChatRow.filter(numbers.contains(Column("number"))).order(Column("number")).fetchAll(db)
            directory.members = try MemberRow.filter(numbers.contains(Column("chat"))).order(Column("chat"), Column("user")).fetchAll(db)
            try readCounters(into: &directory, db)
            return directory
        }
    }

    private func readCounters(into directory: inout StoreDirectory, _ db: Database) throws {
        let counters = try namedCounters(db)
        directory.counters = StoreCounters(named: counters)
        directory.feedPositions = FeedSlots.positions(in: counters)
    }

    private func namedCounters(_ db: Database) throws -> [String: Int64] {
        try Dictionary(
            uniqueKeysWithValues: Row.fetchAll(db, sql: "SELECT name, value FROM counter").map {
                (String.fromDatabaseValue($0[0]) ?? "", Int64.fromDatabaseValue($0[1]) ?? 0)
            })
    }

    public func feedPositions() throws -> [Int: Int64] {
        try pool.read { db in FeedSlots.positions(in: try namedCounters(db)) }
    }

    // MARK: messages

    public func messages(chat: Int64, in ids: ClosedRange<Int64>) throws -> [MessageRow] {
        try pool.read { db in try messages(chat: chat, .range(ids.lowerBound, ids.upperBound), db: db) }
    }

    public func messages(chat: Int64, ids: [Int64]) throws -> [MessageRow] {
        guard let low = ids.min(), let high = ids.max() else { return [] }
        return try pool.read { db in
            // Ids close together (a window with a few cached) read as a range, others by
            // the list; either way by statements prepared once.
            if high - low < Int64(ids.count) * 2 + 16 {
                let wanted = Set(ids)
                return try messages(chat: chat, .range(low, high), db: db).filter { wanted.contains($0.id) }
            }
            return try messages(chat: chat, .list(Selection.json(ids)), db: db)
        }
    }

    /// Which messages of a chat a read wants: ids from..through, or a JSON array of ids.
    private enum Selection {
        case range(Int64, Int64)
        case list(String)

        /// `ids` as a JSON array, for `json_each`.
        static func json(_ ids: [Int64]) -> String { "[" + ids.map { String($0) }.joined(separator: ",") + "]" }

        func arguments(chat: Int64) -> StatementArguments {
            switch self {
            case .range(let low, let high): [chat, low, high]
            case .list(let json): [chat, json]
            }
        }

        /// The statement of `both` for this kind of selection.
        func sql(_ both: (range: String, list: String)) -> String {
            switch self {
            case .range: both.range
            case .list: both.list
            }
        }
    }

    /// The statements reading messages and what completes them, made once.
    static let searchEntriesSQL = """
        SELECT searchRow, chat, id, content FROM message
        WHERE searchRow > ? AND searchRow > 0 AND content IS NOT NULL ORDER BY searchRow LIMIT ?
        """

    /// Which search hits (`[[chat, id, searchRow], …]`) a user may still find. The hits
    /// drive the join (CROSS JOIN keeps them outside): one look-up by key each.
    static let searchableSQL = """
        SELECT m.chat, m.id, m.searchRow FROM json_each(?) AS h
        CROSS JOIN message AS m ON m.chat = json_extract(h.value, '$[0]') AND m.id = json_extract(h.value, '$[1]')
        WHERE m.searchRow = json_extract(h.value, '$[2]')
        AND NOT EXISTS (SELECT 1 FROM message_user AS u WHERE u.chat = m.chat AND u.id = m.id AND u.user = ? AND u.isDeleted = 1)
        """

    private enum ReadSQL {
        static func both(_ make: ((String) -> String) -> String) -> (range: String, list: String) {
            (make { "\($0) BETWEEN ? AND ?" }, make { "\($0) IN (SELECT value FROM json_each(?))" })
        }

        static let messages = both { "SELECT \(MessageRow.selectionSQL) FROM message WHERE chat = ? AND \($0("id")) ORDER BY id" }
        static let refs = both { "SELECT source, tag, target FROM message_ref WHERE chat = ? AND \($0("source")) ORDER BY source, tag" }
        static let refCounts = both { "SELECT \(RefCountRow.selectionSQL) FROM ref_count WHERE chat = ? AND \($0("target")) ORDER BY target, tag" }
        static let privateStates = both { "SELECT \(MessageUserRow.selectionSQL) FROM message_user WHERE chat = ? AND \($0("id")) ORDER BY id, user" }
        static let rangeChanges =
            "SELECT \(RangeChangeRow.selectionSQL) FROM range_change WHERE chat IN (SELECT value FROM json_each(?)) AND lastSeq > ? ORDER BY firstSeq"
    }

    /// The messages `selection` names, each with its references, reference counts and
    /// private states.
    private func messages(chat: Int64, _ selection: Selection, db: Database) throws -> [MessageRow] {
        let arguments = selection.arguments(chat: chat)
        var messages = try MessageRow.fetchAll(db.cachedStatement(sql: selection.sql(ReadSQL.messages)), arguments: arguments)
        guard !messages.isEmpty else { return [] }
        var index: [Int64: Int] = [:]
        index.reserveCapacity(messages.count)
        for (position, message) in messages.enumerated() { index[message.id] = position }
        let refs = try Row.fetchCursor(db.cachedStatement(sql: selection.sql(ReadSQL.refs)), arguments: arguments)
        while let row = try refs.next() {
            if let position = index[row[0]] { messages[position].refs.append(RefRow(tag: row[1], target: row[2])) }
        }
        let counts = try RefCountRow.fetchCursor(db.cachedStatement(sql: selection.sql(ReadSQL.refCounts)), arguments: arguments)
        while let count = try counts.next() {
            if let position = index[count.target] { messages[position].refCounts.append(count) }
        }
        let states = try MessageUserRow.fetchCursor(db.cachedStatement(sql: selection.sql(ReadSQL.privateStates)), arguments: arguments)
        while let state = try states.next() {
            if let position = index[state.id] { messages[position].privateStates.append(state) }
        }
        return messages
    }

    public func messageIds(chat: Int64, matching filter: MessageFilter, from start: Int64, ascending: Bool, limit: Int) throws -> [Int64] {
        guard limit > 0 else { return [] }
        var conditions = ["m.chat = ?", ascending ? "m.id >= ?" : "m.id <= ?", "m.id >= ?"]
        var arguments: StatementArguments = [chat, start, filter.firstId]
        var from = "message m"
        if let last = filter.lastId {
            conditions.append("m.id <= ?")
            arguments += [last]
        }
        if let referring = filter.referring {
            // Driven by the reference index: a thread's children, a message's edits.
            // Named: without statistics SQLite prefers the primary key's range of
            // sources and walks every reference of the chat (8 ms instead of 0.08 ms for
            // a thread of 100,000 replies in a chat of a million messages).
            from = "message_ref r INDEXED BY message_ref_by_target JOIN message m ON m.chat = r.chat AND m.id = r.source"
            conditions[0] = "r.chat = ? AND r.target = ? AND r.tag = ?"
            arguments = [chat, referring.target, referring.tag, start, filter.firstId]
            if let last = filter.lastId { arguments += [last] }
            conditions[1] = ascending ? "r.source >= ?" : "r.source <= ?"
            conditions[2] = "r.source >= ?"
        }
        if let tag = filter.tag {
            conditions.append("m.tag = ?")
            arguments += [tag]
            // By (chat, tag, id): the ids of one tag in order, however rare the tag.
            if filter.referring == nil { from = "message m INDEXED BY message_by_tag" }
        }
        if let sender = filter.sender {
            conditions.append("m.sender = ?")
            arguments += [sender]
        }
        if let notRefTag = filter.notRefTag {
            conditions.append("NOT EXISTS (SELECT 1 FROM message_ref x WHERE x.chat = m.chat AND x.source = m.id AND x.tag = ?)")
            arguments += [notRefTag]
        }
        if filter.onlyRecallable {
            conditions.append("m.isRecalled = 0")
            conditions.append("m.tag NOT IN (" + MessageFilter.reservedTags.sorted().map { "'\($0)'" }.joined(separator: ",") + ")")
        }
        let order = filter.referring != nil ? "r.source" : "m.id"
        let sql = "SELECT m.id FROM \(from) WHERE " + conditions.joined(separator: " AND ") + " ORDER BY \(order) \(ascending ? "ASC" : "DESC") LIMIT ?"
        arguments += [limit]
        // A bounded set of shapes (which conditions are present): prepared once each.
        return try pool.read { db in try Int64.fetchAll(db.cachedStatement(sql: sql), arguments: arguments) }
    }

    public func message(chat: Int64, sender: Int64, externalId: String) throws -> Int64? {
        try pool.read { db in
            try Int64.fetchOne(
                db.cachedStatement(sql: "SELECT min(id) FROM message WHERE chat = ? AND sender = ? AND externalId = ?"),
                arguments: [chat, sender, externalId])
        }
    }

    public func mentions(of user: Int64, after position: MentionPosition?, limit: Int) throws -> [MentionPosition] {
        // No position: from before the highest there can be.
        let before = position ?? MentionPosition(timestamp: .max, chat: .max, id: .max)
        return try pool.read { db in
            try Row.fetchAll(
                db.cachedStatement(
                    sql: """
                        SELECT timestamp, chat, id FROM message_mention WHERE user = ? AND (timestamp, chat, id) < (?, ?, ?)
                        ORDER BY timestamp DESC, chat DESC, id DESC LIMIT ?
                        """), arguments: [user, before.timestamp, before.chat, before.id, limit]
            ).map { MentionPosition(timestamp: $0[0], chat: $0[1], id: $0[2]) }
        }
    }

    public func firstMessage(chat: Int64, notBefore timestamp: Int64) throws -> Int64? {
        try pool.read { db in
            // Timestamps never decrease along a chat's ids: a binary search over ids by
            // point reads needs no index of its own.
            guard let last = try Int64.fetchOne(db.cachedStatement(sql: "SELECT max(id) FROM message WHERE chat = ?"), arguments: [chat]) else { return nil }
            let at = try db.cachedStatement(sql: "SELECT timestamp FROM message WHERE chat = ? AND id = ?")
            var low: Int64 = 1
            var high = last + 1
            while low < high {
                let middle = low + (high - low) / 2
                let value = try Int64.fetchOne(at, arguments: [chat, middle]) ?? Int64.min
                if value >= timestamp { high = middle } else { low = middle + 1 }
            }
            return low <= last ? low : nil
        }
    }

    public func references(chat: Int64, to target: Int64, tag: String, excluding excluded: Set<Int64>) throws -> (count: Int64, newest: Int64?) {
        try pool.read { db in
            let sources = try Int64.fetchCursor(
                db.cachedStatement(sql: "SELECT source FROM message_ref WHERE chat = ? AND target = ? AND tag = ? ORDER BY source DESC"),
                arguments: [chat, target, tag])
            var count: Int64 = 0
            var newest: Int64?
            while let source = try sources.next() {
                guard !excluded.contains(source) else { continue }
                count += 1
                if newest == nil { newest = source }
            }
            return (count, newest)
        }
    }

    // MARK: the change feed

    public func changedMessages(chats: [Int64], after seq: Int64, limit: Int) throws -> [MessageChangeRow] {
        guard !chats.isEmpty, limit > 0 else { return [] }
        return try pool.read { db in
            // Each chat's first changes by the (chat, changeSeq) index, merged; once `limit`
            // are known, the next chats need only what comes before the last of them. Far
            // back in a busy feed this reads O(chats × limit) index entries, not every
            // change since `seq`.
            let first = try db.cachedStatement(sql: "SELECT id, changeSeq FROM message WHERE chat = ? AND changeSeq > ? ORDER BY changeSeq LIMIT ?")
            let bounded = try db.cachedStatement(
                sql: """
                    SELECT id, changeSeq FROM message WHERE chat = ? AND changeSeq > ? AND changeSeq < ? ORDER BY changeSeq LIMIT ?
                    """)
            var found: [MessageChangeRow] = []
            for chat in chats {
                let rows: RowCursor
                if found.count < limit {
                    rows = try Row.fetchCursor(first, arguments: [chat, seq, limit])
                } else {
                    rows = try Row.fetchCursor(bounded, arguments: [chat, seq, found[limit - 1].changeSeq, limit])
                }
                var added = false
                while let row = try rows.next() {
                    found.append(MessageChangeRow(chat: chat, id: row[0], changeSeq: row[1]))
                    added = true
                }
                if added {
                    found.sort { $0.changeSeq < $1.changeSeq }
                    if found.count > limit { found.removeLast(found.count - limit) }
                }
            }
            return found
        }
    }

    public func rangeChanges(chats: [Int64], after seq: Int64) throws -> [RangeChangeRow] {
        guard !chats.isEmpty else { return [] }
        return try pool.read { db in
            try RangeChangeRow.fetchAll(db.cachedStatement(sql: ReadSQL.rangeChanges), arguments: [Selection.json(chats), seq])
        }
    }

    public func searchable(by user: Int64, among hits: [SearchHit]) throws -> Set<SearchHit> {
        guard !hits.isEmpty else { return [] }
        return try pool.read { db in
            var found = Set<SearchHit>()
            let triples = "[" + hits.map { "[\($0.chat),\($0.id),\($0.row)]" }.joined(separator: ",") + "]"
            let rows = try Row.fetchCursor(db.cachedStatement(sql: SQLiteStore.searchableSQL), arguments: [triples, user])
            while let row = try rows.next() { found.insert(SearchHit(chat: row[0], id: row[1], row: row[2])) }
            return found
        }
    }

    // MARK: attachments and search

    public func blobUses(_ blob: String) throws -> Int64 {
        try pool.read { db in try Int64.fetchOne(db, sql: "SELECT uses FROM blob WHERE hash = ?", arguments: [blob]) ?? 0 }
    }

    public func searchEntries(after row: Int64, limit: Int, maxBytes: Int) throws -> [SearchEntry] {
        // `searchRow > 0` lets SQLite use the partial index (message_by_search_row): it cannot
        // tell that a bound `?` implies it, and without it every page scanned and sorted the
        // whole table (refilling the index of 10M messages would have taken hours).
        try pool.read { db in
            let rows = try Row.fetchCursor(db.cachedStatement(sql: SQLiteStore.searchEntriesSQL), arguments: [row, limit])
            var page: [SearchEntry] = []
            var bytes = 0
            while let row = try rows.next() {
                let entry = SearchEntry(row: row[0], chat: row[1], id: row[2], text: row[3])
                bytes += entry.text.utf8.count
                if bytes > maxBytes && !page.isEmpty { break }
                page.append(entry)
            }
            return page
        }
    }

    // MARK: writing

    public func commit(_ batch: StoreBatch) throws {
        guard !batch.isEmpty else { return }
        do {
            try pool.write { db in try write(batch, db: db) }
        } catch let error as DatabaseError {
            switch error.resultCode.primaryResultCode {
            case .SQLITE_FULL: throw StoreFailure(.full, "the disk is full (\(error.message ?? "SQLITE_FULL"))")
            case .SQLITE_IOERR: throw StoreFailure(.io, "an I/O error (\(error.message ?? "SQLITE_IOERR"), extended code \(error.extendedResultCode.rawValue))")
            default: throw StoreFailure(.other, "\(error)")
            }
        }
    }

    private func write(_ batch: StoreBatch, db: Database) throws {
        for user in batch.directory.newUsers { try user.insert(db) }
        for settings in batch.directory.userSettings { try settings.insert(db, onConflict: .replace) }
        for endpoint in batch.directory.endpoints { try endpoint.insert(db, onConflict: .replace) }
        for id in batch.directory.removedEndpoints { _ = try EndpointRow.deleteOne(db, key: id) }
        for chat in batch.directory.newChats { try chat.insert(db) }
        for update in batch.directory.chatUpdates { try update.row.update(db, changing: update.columns) }
        for member in batch.directory.members { try member.insert(db, onConflict: .replace) }
        for update in batch.directory.memberUpdates { try update.row.update(db, changing: update.columns) }
        if !batch.newMessages.isEmpty {
            let insertRef = try db.cachedStatement(sql: "INSERT OR IGNORE INTO message_ref (chat, source, tag, target) VALUES (?, ?, ?, ?)")
            let insertMessage = try db.cachedStatement(sql: MessageRow.insertSQL)
            for message in batch.newMessages {
                try insertMessage.execute(arguments: message.insertArguments)
                for ref in message.refs { try insertRef.execute(arguments: [message.chat, message.id, ref.tag, ref.target]) }
                if !message.mentionedUsers.isEmpty {
                    let insertMention = try db.cachedStatement(sql: "INSERT OR IGNORE INTO message_mention (user, timestamp, chat, id) VALUES (?, ?, ?, ?)")
                    for user in message.mentionedUsers { try insertMention.execute(arguments: [user, message.timestamp, message.chat, message.id]) }
                }
            }
        }
        for update in batch.messageUpdates { try update.row.update(db, changing: update.columns) }
        if !batch.droppedReferences.isEmpty {
            let drop = try db.cachedStatement(sql: "DELETE FROM message_ref WHERE chat = ? AND source = ?")
            for (chat, id) in batch.droppedReferences { try drop.execute(arguments: [chat, id]) }
        }
        if !batch.touches.isEmpty {
            let touch = try db.cachedStatement(sql: "UPDATE message SET changeSeq = ? WHERE chat = ? AND id = ?")
            for (chat, id, seq) in batch.touches { try touch.execute(arguments: [seq, chat, id]) }
        }
        for change in batch.rangeChanges { try change.insert(db) }
        for count in batch.refCounts {
            if count.count > 0 {
                try count.insert(db, onConflict: .replace)
            } else {
                try db.execute(sql: "DELETE FROM ref_count WHERE chat = ? AND target = ? AND tag = ?", arguments: [count.chat, count.target, count.tag])
            }
        }
        for state in batch.privateStates { try state.insert(db, onConflict: .replace) }
        for (blob, delta) in batch.blobUses where delta != 0 {
            try db.execute(
                sql: "INSERT INTO blob (hash, uses) VALUES (?, ?) ON CONFLICT(hash) DO UPDATE SET uses = uses + excluded.uses",
                arguments: [blob, delta])
            try db.execute(sql: "DELETE FROM blob WHERE hash = ? AND uses <= 0", arguments: [blob])
        }
        if let counters = batch.counters {
            let set = try db.cachedStatement(sql: "INSERT INTO counter (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value")
            for counter in counters.named { try set.execute(arguments: [counter.name, counter.value]) }
        }
        if !batch.notifications.isEmpty {
            let insert = try db.cachedStatement(
                sql: "INSERT INTO notification_outbox (chat, id, user, created, due) VALUES (?, ?, ?, ?, ?)")
            for row in batch.notifications {
                try insert.execute(arguments: [row.key.chat, row.key.id, row.key.user, row.created, row.due])
            }
        }
    }
}
