import Foundation
import GRDB
import Store

/// `MessageSearchIndex` in its own SQLite file (`search.sqlite`): FTS5 with the `trigram`
/// tokenizer, written by its own thread in large transactions.
///
/// Keeping it out of the message store's transactions keeps FTS5's index maintenance
/// (and its occasional segment merges) off the path from a send to its `Sent`. It is
/// derived data: the engine re-adds whatever it lacks at start-up, and a damaged index
/// file is simply rebuilt.
public final class SQLiteSearchIndex: MessageSearchIndex, @unchecked Sendable {
    private let queue: DatabaseQueue
    private let condition = NSCondition()
    private var pendingAdds: [SearchEntry] = []
    private var pendingRemovals: [Int64] = []
    /// Work handed to the writer and not yet committed.
    private var inFlight = 0
    private var failure: Error?

    public init(directory: URL) throws {
        let path = directory.appendingPathComponent("search.sqlite").path
        queue = try SQLiteSearchIndex.open(path: path)
        let thread = Thread { [self] in writeLoop() }
        thread.name = "chatcore-search-index"
        thread.start()
    }

    private static func open(path: String) throws -> DatabaseQueue {
        func make() throws -> DatabaseQueue {
            var configuration = Configuration()
            configuration.label = "chatcore-search"
            configuration.prepareDatabase { db in
                try db.execute(sql: "PRAGMA journal_mode = WAL")
                try db.execute(sql: "PRAGMA synchronous = NORMAL")
            }
            let queue = try DatabaseQueue(path: path, configuration: configuration)
            try queue.write { db in
                try db.execute(sql: """
                    CREATE VIRTUAL TABLE IF NOT EXISTS message_search
                    USING fts5(text, chat UNINDEXED, id UNINDEXED, tokenize = 'trigram')
                    """)
            }
            let check = try queue.read { db in try String.fetchOne(db, sql: "PRAGMA quick_check") }
            guard check == "ok" else { throw DatabaseError(message: "quick_check: \(check ?? "no answer")") }
            return queue
        }
        do {
            return try make()
        } catch {
            // Derived data: start again from nothing (the engine refills it).
            for suffix in ["", "-wal", "-shm"] { unlink(path + suffix) }
            return try make()
        }
    }

    public func indexedUpTo() throws -> Int64 {
        try queue.read { db in try Int64.fetchOne(db, sql: "SELECT max(rowid) FROM message_search") ?? 0 }
    }

    public func add(_ entries: [SearchEntry], removing rows: [Int64]) {
        guard !entries.isEmpty || !rows.isEmpty else { return }
        condition.lock()
        pendingAdds.append(contentsOf: entries)
        pendingRemovals.append(contentsOf: rows)
        condition.broadcast()
        condition.unlock()
    }

    public func waitUntilWritten() throws {
        condition.lock()
        while (!pendingAdds.isEmpty || !pendingRemovals.isEmpty || inFlight > 0) && failure == nil { condition.wait() }
        let failure = self.failure
        condition.unlock()
        if let failure { throw failure }
    }

    /// Waits until everything added so far is in the index, then queries it.
    public func searchMessages(containing text: String, chats: [Int64], belowRow: Int64?, limit: Int) throws -> [SearchHit] {
        try waitUntilWritten()
        guard !chats.isEmpty else { return [] }
        // One FTS5 phrase: with trigrams, a case-insensitive substring match.
        let phrase = "\"" + text.replacingOccurrences(of: "\"", with: "\"\"") + "\""
        let chatList = chats.map(String.init).joined(separator: ",")
        var sql = "SELECT chat, id, rowid FROM message_search WHERE message_search MATCH ? AND chat IN (\(chatList))"
        var arguments: StatementArguments = [phrase]
        if let belowRow {
            sql += " AND rowid < ?"
            arguments += [belowRow]
        }
        sql += " ORDER BY rowid DESC LIMIT ?"
        arguments += [limit]
        return try queue.read { db in
            try Row.fetchAll(db, sql: sql, arguments: arguments).map { SearchHit(chat: $0[0], id: $0[1], row: $0[2]) }
        }
    }

    private func writeLoop() {
        while true {
            condition.lock()
            while pendingAdds.isEmpty && pendingRemovals.isEmpty { condition.wait() }
            let adds = pendingAdds
            let removals = pendingRemovals
            pendingAdds.removeAll(keepingCapacity: true)
            pendingRemovals.removeAll(keepingCapacity: true)
            inFlight += 1
            condition.unlock()
            var error: Error?
            do {
                try queue.write { db in
                    let insert = try db.cachedStatement(sql: "INSERT OR REPLACE INTO message_search (rowid, text, chat, id) VALUES (?, ?, ?, ?)")
                    for entry in adds { try insert.execute(arguments: [entry.row, entry.text, entry.chat, entry.id]) }
                    let delete = try db.cachedStatement(sql: "DELETE FROM message_search WHERE rowid = ?")
                    for row in removals { try delete.execute(arguments: [row]) }
                }
            } catch let caught {
                error = caught
            }
            condition.lock()
            inFlight -= 1
            if let error { failure = error }
            condition.broadcast()
            condition.unlock()
        }
    }
}
