import GRDB
import Store

/// `ChatStore` on SQLite: what the engine reads, through indexes, and one transaction per
/// batch that writes only what changed.
extension SQLiteStore: ChatStore {
    // MARK: start-up

    public func loadDirectory() throws -> StoreDirectory {
        try pool.read { db in
            var directory = StoreDirectory()
            directory.users = try UserRecord.order(Column("number")).fetchAll(db)
            directory.endpoints = try EndpointRow.order(Column("ordinal")).fetchAll(db)
            directory.chats = try ChatRow.order(Column("number")).fetchAll(db)
            directory.members = try MemberRow.order(Column("chat"), Column("user")).fetchAll(db)
            let counters = try Dictionary(uniqueKeysWithValues: Row.fetchAll(db, sql: "SELECT name, value FROM counter").map {
                (String.fromDatabaseValue($0[0]) ?? "", Int64.fromDatabaseValue($0[1]) ?? 0)
            })
            directory.counters = StoreCounters(changeSeq: counters["changeSeq"] ?? 0, searchRow: counters["searchRow"] ?? 0)
            return directory
        }
    }

    // MARK: messages

    public func messages(chat: Int64, in ids: ClosedRange<Int64>) throws -> [MessageRow] {
        try pool.read { db in
            var messages = try MessageRow.fetchAll(db, sql: "SELECT \(MessageRow.selectionSQL) FROM message WHERE chat = ? AND id BETWEEN ? AND ? ORDER BY id",
                                                   arguments: [chat, ids.lowerBound, ids.upperBound])
            guard !messages.isEmpty else { return [] }
            let first = messages[0].id
            try complete(&messages, db: db, where: "chat = ? AND %@ BETWEEN ? AND ?", arguments: [chat, first, messages.last!.id])
            return messages
        }
    }

    public func messages(chat: Int64, ids: [Int64]) throws -> [MessageRow] {
        guard !ids.isEmpty else { return [] }
        return try pool.read { db in
            var all: [MessageRow] = []
            for start in stride(from: 0, to: ids.count, by: 500) {
                let part = Array(ids[start..<min(start + 500, ids.count)])
                let list = part.map(String.init).joined(separator: ",")
                var messages = try MessageRow.fetchAll(db, sql: "SELECT \(MessageRow.selectionSQL) FROM message WHERE chat = ? AND id IN (\(list)) ORDER BY id",
                                                       arguments: [chat])
                try complete(&messages, db: db, where: "chat = ? AND %@ IN (\(list))", arguments: [chat])
                all += messages
            }
            return all
        }
    }

    /// Adds each message's references, reference counts and private states (the rows
    /// `condition` selects, with `%@` standing for the table's message column).
    private func complete(_ messages: inout [MessageRow], db: Database, where condition: String, arguments: StatementArguments) throws {
        var index: [Int64: Int] = [:]
        for (position, message) in messages.enumerated() { index[message.id] = position }
        let refs = try Row.fetchCursor(db, sql: "SELECT source, tag, target FROM message_ref WHERE " + condition.replacingOccurrences(of: "%@", with: "source")
                                       + " ORDER BY source, tag", arguments: arguments)
        while let row = try refs.next() {
            if let position = index[row[0]] { messages[position].refs.append(RefRow(tag: row[1], target: row[2])) }
        }
        let counts = try RefCountRow.fetchCursor(db, sql: "SELECT \(RefCountRow.selectionSQL) FROM ref_count WHERE " + condition.replacingOccurrences(of: "%@", with: "target")
                                                 + " ORDER BY target, tag", arguments: arguments)
        while let count = try counts.next() {
            if let position = index[count.target] { messages[position].refCounts.append(count) }
        }
        let states = try MessageUserRow.fetchCursor(db, sql: "SELECT \(MessageUserRow.selectionSQL) FROM message_user WHERE " + condition.replacingOccurrences(of: "%@", with: "id")
                                                    + " ORDER BY id, user", arguments: arguments)
        while let state = try states.next() {
            if let position = index[state.id] { messages[position].privateStates.append(state) }
        }
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
            from = "message_ref r JOIN message m ON m.chat = r.chat AND m.id = r.source"
            conditions[0] = "r.chat = ? AND r.target = ? AND r.tag = ?"
            arguments = [chat, referring.target, referring.tag, start, filter.firstId]
            if let last = filter.lastId { arguments += [last] }
            conditions[1] = ascending ? "r.source >= ?" : "r.source <= ?"
            conditions[2] = "r.source >= ?"
        }
        if let tag = filter.tag {
            conditions.append("m.tag = ?")
            arguments += [tag]
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
        return try pool.read { db in try Int64.fetchAll(db, sql: sql, arguments: arguments) }
    }

    public func firstMessage(chat: Int64, notBefore timestamp: Int64) throws -> Int64? {
        try pool.read { db in
            // Timestamps never decrease along a chat's ids: a binary search over ids by
            // point reads needs no index of its own.
            guard let last = try Int64.fetchOne(db, sql: "SELECT max(id) FROM message WHERE chat = ?", arguments: [chat]) else { return nil }
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
            let sources = try Int64.fetchCursor(db, sql: "SELECT source FROM message_ref WHERE chat = ? AND target = ? AND tag = ? ORDER BY source DESC",
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
        guard !chats.isEmpty else { return [] }
        // Each chat's changes by the (chat, changeSeq) index, merged.
        let list = chats.map(String.init).joined(separator: ",")
        return try pool.read { db in
            try Row.fetchAll(db, sql: "SELECT chat, id, changeSeq FROM message WHERE chat IN (\(list)) AND changeSeq > ? ORDER BY changeSeq LIMIT ?",
                             arguments: [seq, limit]).map { MessageChangeRow(chat: $0[0], id: $0[1], changeSeq: $0[2]) }
        }
    }

    public func rangeChanges(chats: [Int64], after seq: Int64) throws -> [RangeChangeRow] {
        guard !chats.isEmpty else { return [] }
        let list = chats.map(String.init).joined(separator: ",")
        return try pool.read { db in
            try RangeChangeRow.fetchAll(db, sql: """
                SELECT \(RangeChangeRow.selectionSQL) FROM range_change WHERE chat IN (\(list)) AND lastSeq > ? ORDER BY firstSeq
                """, arguments: [seq])
        }
    }

    public func privatelyDeleted(by user: Int64, among messages: [MessageAddress]) throws -> Set<MessageAddress> {
        guard !messages.isEmpty else { return [] }
        return try pool.read { db in
            var deleted = Set<MessageAddress>()
            for start in stride(from: 0, to: messages.count, by: 400) {
                let part = messages[start..<min(start + 400, messages.count)]
                let values = part.map { "(\($0.chat),\($0.id))" }.joined(separator: ",")
                for row in try Row.fetchAll(db, sql: """
                    SELECT chat, id FROM message_user WHERE user = ? AND isDeleted = 1 AND (chat, id) IN (VALUES \(values))
                    """, arguments: [user]) {
                    deleted.insert(MessageAddress(chat: row[0], id: row[1]))
                }
            }
            return deleted
        }
    }

    // MARK: attachments and search

    public func blobUses(_ blob: String) throws -> Int64 {
        try pool.read { db in try Int64.fetchOne(db, sql: "SELECT uses FROM blob WHERE hash = ?", arguments: [blob]) ?? 0 }
    }

    public func searchEntries(after row: Int64, limit: Int) throws -> [SearchEntry] {
        try pool.read { db in
            try Row.fetchAll(db, sql: """
                SELECT searchRow, chat, id, content FROM message WHERE searchRow > ? AND content IS NOT NULL ORDER BY searchRow LIMIT ?
                """, arguments: [row, limit]).map { SearchEntry(row: $0[0], chat: $0[1], id: $0[2], text: $0[3]) }
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
        for user in batch.newUsers { try user.insert(db) }
        for endpoint in batch.endpoints { try endpoint.insert(db, onConflict: .replace) }
        for id in batch.removedEndpoints { _ = try EndpointRow.deleteOne(db, key: id) }
        for chat in batch.newChats { try chat.insert(db) }
        for update in batch.chatUpdates { try update.row.update(db, columns: update.columns.map(\.rawValue)) }
        for member in batch.members { try member.insert(db, onConflict: .replace) }
        for update in batch.memberUpdates { try update.row.update(db, columns: update.columns.map(\.rawValue)) }
        if !batch.newMessages.isEmpty {
            let insertRef = try db.cachedStatement(sql: "INSERT OR IGNORE INTO message_ref (chat, source, tag, target) VALUES (?, ?, ?, ?)")
            for message in batch.newMessages {
                try message.insert(db)
                for ref in message.refs { try insertRef.execute(arguments: [message.chat, message.id, ref.tag, ref.target]) }
            }
        }
        for update in batch.messageUpdates { try update.row.update(db, columns: update.columns.map(\.rawValue)) }
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
            try db.execute(sql: "INSERT INTO blob (hash, uses) VALUES (?, ?) ON CONFLICT(hash) DO UPDATE SET uses = uses + excluded.uses",
                           arguments: [blob, delta])
            try db.execute(sql: "DELETE FROM blob WHERE hash = ? AND uses <= 0", arguments: [blob])
        }
        if let counters = batch.counters {
            let set = try db.cachedStatement(sql: "INSERT INTO counter (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value")
            try set.execute(arguments: ["changeSeq", counters.changeSeq])
            try set.execute(arguments: ["searchRow", counters.searchRow])
        }
    }
}
