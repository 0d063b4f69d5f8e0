import Foundation
import GRDB
import Storage
import Threads

/// `MessageSearchIndex` in its own SQLite file (`search.sqlite`), written by its own thread
/// in large transactions.
///
/// Two FTS5 tables, both scoped by chat inside the match (so that a query costs what the
/// asking user's chats hold, not the whole store):
/// - `message_search` (`trigram` tokenizer): a case-insensitive substring match of three
///   or more characters, the chat in a column of its own as exactly three characters of
///   the Private Use Area (`scopeToken`): one trigram, so that matching the user's chats
///   is an OR of single terms, not of phrases that share trigrams. Queries are single
///   terms only (candidates are verified on their text), so the index keeps which column
///   a trigram is in but not its positions (`detail = 'column'`): writing it cost a core
///   under a full send load, and with positions the index writer held sends to 70% of the
///   in-memory engine's rate;
/// - `message_grams` (`ascii` tokenizer, no positions): every character and every pair of
///   adjacent characters of the lowercased text as a token (`u<hex>`, `b<hex>v<hex>`), the
///   chat as `c<chat>`: queries of one or two characters (an emoji, a two-letter word)
///   are looked up, not scanned. It keeps no copy of its text (`content=''`): a hit's
///   chat and id come from `message_search` (same row), and a recalled message, gone
///   from there, is gone from its hits too.
///
/// Keeping it out of the message store's transactions keeps FTS5's index maintenance
/// (and its occasional segment merges) off the path from a send to its `Sent`. It is
/// derived data: the engine re-adds whatever it lacks, and an index file that cannot be
/// opened (or one laid out by an older release) is simply rebuilt.
public final class SQLiteSearchIndex: MessageSearchIndex, Sendable {
    /// The layout of the file; another one is rebuilt.
    static let layout = 4
    /// A query scoped to more chats than this filters the chats after matching instead.
    static let scopedChats = 64

    /// WAL: searches read while the writer thread writes.
    private let queue: DatabasePool
    /// What is handed over to the writer thread, shared with it.
    private struct Backlog {
        var pendingAdds: [SearchEntry] = []
        var pendingRemovals: [Int64] = []
        var failure: Error?
        /// What the texts handed over and not yet committed take (pending, and taken by
        /// the writer), with a little for each entry besides its text.
        var pendingBytes = 0
        var inFlightBytes = 0
        /// A bulk load ended and its segments are not merged yet.
        var mergePending = false
        /// Hand-overs so far (`add`), and how many of the first of them are in the index:
        /// `waitUntilWritten` waits for those made before it, not for the backlog to be
        /// empty, which it never is while someone sends without pause.
        var handedOver = 0
        var written = 0

        var hasWork: Bool { !pendingAdds.isEmpty || !pendingRemovals.isEmpty }

        /// Takes what is pending for the writer, with the hand-overs it holds.
        mutating func take() -> (adds: [SearchEntry], removals: [Int64], handedOver: Int) {
            defer {
                pendingAdds.removeAll(keepingCapacity: true)
                pendingRemovals.removeAll(keepingCapacity: true)
                inFlightBytes = pendingBytes
                pendingBytes = 0
            }
            return (pendingAdds, pendingRemovals, handedOver)
        }
    }

    private let backlog = Locked(Backlog())
    /// Past this backlog, `add` waits for the writer: sends faster than the index takes
    /// them (long texts, a slow disk, a sustained load) are slowed to its pace instead
    /// of piling their texts up in memory without bound.
    let backlogLimit: Int
    public static let defaultBacklogLimit = 32 << 20

    /// What handing `entries` over adds to the backlog.
    static func bytes(of entries: [SearchEntry]) -> Int {
        entries.reduce(0) { $0 + $1.text.utf8.count + 64 }
    }

    /// The texts handed over and not yet in the index (tests).
    var backlogBytes: Int {
        backlog.withLock { $0.pendingBytes + $0.inFlightBytes }
    }

    public init(directory: URL, backlogLimit: Int = SQLiteSearchIndex.defaultBacklogLimit) throws {
        let path = directory.appendingPathComponent("search.sqlite").path
        self.backlogLimit = backlogLimit
        queue = try SQLiteSearchIndex.open(path: path)
        let thread = Thread { [self] in
            nameCurrentThread("search-index")
            writeLoop()
        }
        thread.start()
    }

    private static func open(path: String) throws -> DatabasePool {
        func make() throws -> DatabasePool {
            var configuration = Configuration()
            configuration.label = "chatcore-search"
            configuration.prepareDatabase { db in
                try db.execute(sql: "PRAGMA synchronous = NORMAL")
                // NORMAL syncs at checkpoints only: one of SQLite's default 1,000 pages
                // (about 80 messages' trigrams) synced 4 MB at once, and the store's own
                // commit synced behind it on the same disk: one send in 80 waited 9-12 ms
                // for its `Sent` (p99 10 ms, against the disk's fdatasync p99 under 1 ms).
                // Checkpoints of 100 pages hold a commit about 1 ms.
                try db.execute(sql: "PRAGMA wal_autocheckpoint = 100")
            }
            let queue = try DatabasePool(path: path, configuration: configuration)
            let layout = try queue.read { db in try Int.fetchOne(db, sql: "PRAGMA user_version") ?? 0 }
            let empty = try queue.read { db in try Int.fetchOne(db, sql: "SELECT count(*) FROM sqlite_master") ?? 0 } == 0
            guard layout == SQLiteSearchIndex.layout || empty else {
                throw DatabaseError(message: "search index layout \(layout), not \(SQLiteSearchIndex.layout)")
            }
            try queue.write { db in
                try db.execute(
                    sql: """
                        CREATE VIRTUAL TABLE IF NOT EXISTS message_search
                        USING fts5(text, scope, chat UNINDEXED, id UNINDEXED, tokenize = 'trigram', detail = 'column', columnsize = 0);
                        CREATE VIRTUAL TABLE IF NOT EXISTS message_grams
                        USING fts5(grams, tokenize = 'ascii', detail = 'none', content = '', columnsize = 0);
                        PRAGMA user_version = \(SQLiteSearchIndex.layout);
                        """)
            }
            // No check of the whole file here: that would make opening cost what history
            // holds. A damaged index shows as a search that fails (Internal); removing
            // search.sqlite makes chatcore rebuild it from the store.
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

    /// Hands entries over to the writer; waits first while the backlog is past
    /// `backlogLimit` (unless the writer failed: then what is handed over is lost anyway,
    /// and refilled from the store at the next start).
    public func add(_ entries: [SearchEntry], removing rows: [Int64]) {
        guard !entries.isEmpty || !rows.isEmpty else { return }
        let limit = backlogLimit
        backlog.wait(until: { $0.pendingBytes + $0.inFlightBytes <= limit || $0.failure != nil }, notifying: true) { backlog in
            backlog.pendingBytes += SQLiteSearchIndex.bytes(of: entries)
            backlog.pendingAdds.append(contentsOf: entries)
            backlog.pendingRemovals.append(contentsOf: rows)
            backlog.handedOver += 1
        }
    }

    /// Waits until what was handed over before the call is in the index (what is handed
    /// over meanwhile may be written too, or not). It waited for the index to have
    /// nothing left to write, which beside a session sending without pause is never.
    public func waitUntilWritten() throws {
        let handed = backlog.withLock { $0.handedOver }
        let failure = backlog.wait(until: { $0.written >= handed || $0.failure != nil }) { $0.failure }
        if let failure { throw failure }
    }

    /// Waits until everything handed over before the call is in the index, then queries
    /// it. Before, it waited until the index had nothing left to write: beside a session
    /// sending without pause that was when the sends stopped (test_search_index.py: a
    /// search made at the first of 20,000 pipelined sends was answered after the last).
    ///
    /// Three characters or more: the index gives the messages that have three of the
    /// query's trigrams (its first, middle and last), each a single term, and their text is
    /// checked for the whole query here. A phrase of all its trigrams would be exact, but
    /// intersecting every trigram's positions costs what the commonest trigram holds
    /// (measured: 27 ms for a rare three-word phrase in a store of a million messages,
    /// 2.7 ms this way). One statement, newest first, read only as far as `limit` hits
    /// need: FTS5 walks its doclists in rowid order, so stopping early is free, where
    /// pages of a fixed size would each start the match again.
    public func searchMessages(containing text: String, chats: [Int64], belowRow: Int64?, limit: Int, budget: SearchBudget) throws -> [SearchHit] {
        try waitUntilWritten()
        guard !chats.isEmpty, !text.isEmpty, limit > 0 else { return [] }
        let scoped = chats.count <= SQLiteSearchIndex.scopedChats
        let scalars = Array(text.unicodeScalars)
        let match: String
        let sql: String
        if scalars.count < 3 {
            var grams = SQLiteSearchIndex.queryToken(text)
            if scoped { grams += " AND (" + chats.map { "c\($0)" }.joined(separator: " OR ") + ")" }
            match = grams
            sql = scoped ? Query.grams : Query.gramsFiltered
        } else {
            var positions = [0, (scalars.count - 3) / 2, scalars.count - 3]
            positions = positions.enumerated().filter { $0.offset == 0 || $0.element != positions[$0.offset - 1] }.map(\.element)
            let terms = positions.map { start in
                "\"" + String(String.UnicodeScalarView(scalars[start..<start + 3])).replacingOccurrences(of: "\"", with: "\"\"") + "\""
            }
            var trigrams = "text : (" + terms.joined(separator: " AND ") + ")"
            if scoped { trigrams += " AND scope : (" + chats.map { "\"" + SQLiteSearchIndex.scopeToken($0) + "\"" }.joined(separator: " OR ") + ")" }
            match = trigrams
            sql = scoped ? Query.trigrams : Query.trigramsFiltered
        }
        var arguments: StatementArguments = [match, belowRow ?? Int64.max]
        if !scoped { arguments += ["[" + chats.map { String($0) }.joined(separator: ",") + "]"] }
        let needle = scalars.count >= 3 ? SearchNeedle(text) : nil
        return try queue.read { db in
            let rows = try Row.fetchCursor(db.cachedStatement(sql: sql), arguments: arguments)
            var found: [SearchHit] = []
            while found.count < limit, let row = try rows.next() {
                if let needle {
                    var paid = true
                    let matches = try row.withUnsafeData(atIndex: 3) { data in
                        data.map { data in
                            paid = budget.spend(bytes: data.count)
                            return paid && data.withUnsafeBytes { needle.isFound(in: $0.bindMemory(to: UInt8.self)) }
                        } ?? false
                    }
                    guard paid else { break }
                    guard matches else { continue }
                } else {
                    guard budget.spend(bytes: 0) else { break }
                }
                found.append(SearchHit(chat: row[0], id: row[1], row: row[2]))
            }
            return found
        }
    }

    /// The statements of `searchMessages`: the user's chats inside the match, or (more
    /// chats than `scopedChats`) filtered after it.
    private enum Query {
        static let trigrams = "SELECT chat, id, rowid, text FROM message_search WHERE message_search MATCH ? AND rowid < ? ORDER BY rowid DESC"
        static let trigramsFiltered = """
            SELECT chat, id, rowid, text FROM message_search WHERE message_search MATCH ? AND rowid < ?
            AND chat IN (SELECT value FROM json_each(?)) ORDER BY rowid DESC
            """
        static let grams = """
            SELECT s.chat, s.id, g.rowid FROM message_grams g JOIN message_search s ON s.rowid = g.rowid
            WHERE message_grams MATCH ? AND g.rowid < ? ORDER BY g.rowid DESC
            """
        static let gramsFiltered = """
            SELECT s.chat, s.id, g.rowid FROM message_grams g JOIN message_search s ON s.rowid = g.rowid
            WHERE message_grams MATCH ? AND g.rowid < ? AND s.chat IN (SELECT value FROM json_each(?)) ORDER BY g.rowid DESC
            """
    }

    /// A chat as one trigram: three characters of the Private Use Area (U+E000 on, 6,400 of
    /// them: 2.6·10¹¹ chats).
    static func scopeToken(_ chat: Int64) -> String {
        let base: Int64 = 6400
        let digits = [chat / (base * base) % base, chat / base % base, chat % base]
        return String(String.UnicodeScalarView(digits.map { Unicode.Scalar(UInt32(0xE000 + $0))! }))
    }

    // MARK: one- and two-character grams

    private static let hexDigits = Array("0123456789abcdef".utf8)

    /// Appends `value` in lowercase hexadecimal without leading zeros: how a gram names a
    /// character, in the index and in a query alike.
    private static func appendHex(_ value: UInt32, to out: inout [UInt8]) {
        var shift = 28
        while shift > 0 && value >> UInt32(shift) == 0 { shift -= 4 }
        while shift >= 0 {
            out.append(hexDigits[Int(value >> UInt32(shift) & 0xF)])
            shift -= 4
        }
    }

    /// The gram of one character (`u<hex>`) or of a pair (`b<hex>v<hex>`).
    private static func appendGram(_ first: UInt32, _ second: UInt32?, to out: inout [UInt8]) {
        out.append(UInt8(ascii: second == nil ? "u" : "b"))
        appendHex(first, to: &out)
        if let second {
            out.append(UInt8(ascii: "v"))
            appendHex(second, to: &out)
        }
    }

    /// The token a one- or two-character query looks up.
    static func queryToken(_ text: String) -> String {
        let scalars = Array(text.lowercased().unicodeScalars)
        var out: [UInt8] = []
        appendGram(scalars[0].value, scalars.count == 1 ? nil : scalars[1].value, to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// Every character and pair of adjacent characters of the lowercased text, each once,
    /// and the chat's token.
    static func grams(_ text: String, chat: Int64) -> String {
        // Built as bytes, each gram once (sets of the scalars' values): strings and sets
        // of strings per gram made this most of the index writer's time.
        let scalars = Array(text.lowercased().unicodeScalars)
        var singles = Set<UInt32>(minimumCapacity: scalars.count)
        var pairs = Set<UInt64>(minimumCapacity: scalars.count)
        var out: [UInt8] = []
        out.reserveCapacity(scalars.count * 14 + 24)
        for (index, scalar) in scalars.enumerated() {
            if singles.insert(scalar.value).inserted {
                appendGram(scalar.value, nil, to: &out)
                out.append(UInt8(ascii: " "))
            }
            if index + 1 < scalars.count {
                let next = scalars[index + 1].value
                if pairs.insert(UInt64(scalar.value) << 32 | UInt64(next)).inserted {
                    appendGram(scalar.value, next, to: &out)
                    out.append(UInt8(ascii: " "))
                }
            }
        }
        out.append(UInt8(ascii: "c"))
        out.append(contentsOf: String(chat).utf8)
        return String(decoding: out, as: UTF8.self)
    }

    /// Pages one merge step writes, and how long the writer is idle before it merges.
    static let pagesPerMergeStep = 256
    static let idleBeforeMerging = 0.1

    public func bulkLoadEnded() {
        backlog.change { $0.mergePending = true }
    }

    /// One step of merging every segment into one, while nothing else is to be written
    /// (after a bulk load only: FTS5's own automerge keeps the segments of everyday writes
    /// in check, and merging a small new segment into one huge one each time would
    /// rewrite the index). An index rebuilt a page at a time is many segments, and a query
    /// reads every one (measured at 10M: search p99 33 ms, 21 ms once merged). Returns
    /// whether more is left to merge.
    private func mergeStep() -> Bool {
        do {
            return try queue.write { db in
                var more = false
                for table in ["message_search", "message_grams"] {
                    let before = db.totalChangesCount
                    // A negative page count: merge towards one segment, this many pages at a time.
                    try db.execute(sql: "INSERT INTO \(table) (\(table), rank) VALUES ('merge', ?)", arguments: [-SQLiteSearchIndex.pagesPerMergeStep])
                    // FTS5 reports a merge that did something as changes (two or more).
                    if db.totalChangesCount - before >= 2 { more = true }
                }
                return more
            }
        } catch {
            return false  // derived data: a failed merge leaves the index as it was
        }
    }

    private func writeLoop() {
        /// The highest row written (nil until read from the file).
        var highestRow: Int64?
        while true {
            var work = backlog.wait(until: { $0.hasWork || $0.mergePending }) { $0.hasWork ? $0.take() : nil }
            if work == nil {
                // Idle after a bulk load: merge a little, unless work comes meanwhile.
                let idle = Date(timeIntervalSinceNow: SQLiteSearchIndex.idleBeforeMerging)
                work = backlog.wait(until: \.hasWork, deadline: idle) { $0.hasWork ? $0.take() : nil }
                if work == nil {
                    let more = mergeStep()
                    backlog.withLock { $0.mergePending = more }
                    continue
                }
            }
            let (adds, removals, handedOver) = work!
            var error: Error?
            do {
                try queue.write { db in
                    let insert = try db.cachedStatement(sql: "INSERT INTO message_search (rowid, text, scope, chat, id) VALUES (?, ?, ?, ?, ?)")
                    let replace = try db.cachedStatement(sql: "INSERT OR REPLACE INTO message_search (rowid, text, scope, chat, id) VALUES (?, ?, ?, ?, ?)")
                    let insertGrams = try db.cachedStatement(sql: "INSERT INTO message_grams (rowid, grams) VALUES (?, ?)")
                    let known = try db.cachedStatement(sql: "SELECT 1 FROM message_search WHERE rowid = ?")
                    if highestRow == nil { highestRow = try Int64.fetchOne(db, sql: "SELECT max(rowid) FROM message_search") ?? 0 }
                    for entry in adds {
                        let arguments: StatementArguments = [entry.row, entry.text, SQLiteSearchIndex.scopeToken(entry.chat), entry.chat, entry.id]
                        if entry.row > highestRow! {
                            // New (rows only grow): no look-up, no replacing.
                            try insert.execute(arguments: arguments)
                            highestRow = entry.row
                        } else {
                            // A row handed over again (a refill) is replaced and keeps its grams.
                            let had = try Bool.fetchOne(known, arguments: [entry.row]) ?? false
                            try replace.execute(arguments: arguments)
                            if had { continue }
                        }
                        try insertGrams.execute(arguments: [entry.row, SQLiteSearchIndex.grams(entry.text, chat: entry.chat)])
                    }
                    // The grams of a recalled message stay (they keep no text to delete by);
                    // without its row here, its hits are not found.
                    let delete = try db.cachedStatement(sql: "DELETE FROM message_search WHERE rowid = ?")
                    for row in removals { try delete.execute(arguments: [row]) }
                }
            } catch let caught {
                error = caught
                highestRow = nil  // the transaction was rolled back: read it again
            }
            backlog.change { backlog in
                backlog.inFlightBytes = 0
                if let error { backlog.failure = error } else { backlog.written = handedOver }
            }
        }
    }
}
