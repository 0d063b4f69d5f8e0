import Foundation
import PostgresNIO
import Storage
import Threads

/// `MessageSearchIndex` in the database itself: one index for every node, written in the
/// commit that makes or recalls a message (`message_search`, written by `commit`), so that
/// it is never behind the store, never lost in a crash, and costs a node nothing when it
/// takes over from another.
///
/// Each searchable message has a row of keys (`SearchText.keys`: its characters, its runs
/// of three characters, its chat), found through a GIN index: a query asks for the rows
/// holding all of its keys (`SearchText.queryKeys`) in the user's chats, newest first, and
/// checks each candidate's text (`SearchNeedle`), as the SQLite index does; a message with
/// too many keys is filed under `SearchText.longKey`, which every query reads too. The keys are
/// made by chatcore, not by PostgreSQL's text search or `pg_trgm`: those fold case and
/// split words by the database's locale (with `C`, only ASCII), where chatcore must match
/// the same text on every store.
public final class PostgresSearchIndex: MessageSearchIndex, Sendable {
    let store: PostgresStore
    private let failure = Locked<Error?>(nil)
    /// Messages up to this search row were written before the index was (v5): the refill
    /// adds them (`add`); the index holds every later one from its commit.
    private let addedByCommitsAfter = Locked<Int64?>(nil)
    /// A query scoped to more chats than this asks for their keys no more (`chat` filters
    /// them after): matching a long list of chats costs more than it saves.
    static let scopedChats = 64

    public init(store: PostgresStore) {
        self.store = store
    }

    /// What the refill left to add, from what it has added so far (`searchIndexUpTo`):
    /// below `searchIndexFrom` while a searchable message there is still missing, and
    /// else the store's last search row (nothing is missing: the search rows' sequence's,
    /// which `loadDirectory` gives too).
    public func indexedUpTo() throws -> Int64 {
        try store.withConnection { connection in
            let counters = try store.counters(connection)
            let from = counters["searchIndexFrom"] ?? 0
            let upTo = counters["searchIndexUpTo"] ?? 0
            addedByCommitsAfter.withLock { $0 = from }
            if upTo < from {
                let missing = try store.run(
                    connection,
                    #"SELECT 1 FROM message WHERE "searchRow" > \#(upTo) AND "searchRow" <= \#(from) AND content IS NOT NULL LIMIT 1"#)
                if missing.first != nil { return upTo }
            }
            return counters["searchRow"] ?? 0
        }
    }

    /// Adds the messages of a refill that the index does not have: only those written
    /// before it was (`addedByCommitsAfter`); a commit writes the others itself, so the
    /// entries the engine hands over after each commit cost nothing here. A message
    /// recalled since the refill read it is not added (its search row is gone).
    /// `searchIndexUpTo` records the last one added: `indexedUpTo` finds the refill done
    /// once no searchable message is left between it and `searchIndexFrom`. (It used to
    /// record the end of whatever was handed over, so every commit wrote the counter again,
    /// on the engine thread, and a commit during a refill recorded the refill as done.)
    public func add(_ entries: [SearchEntry], removing rows: [Int64]) {
        guard let after = addedByCommitsAfter.withLock({ $0 }) else { return }
        let missing = entries.filter { $0.row <= after }
        guard let last = missing.last?.row else { return }
        do {
            try store.withConnection { connection in
                let sql: SQL =
                    #"WITH added AS (INSERT INTO message_search (chat, id, "searchRow", keys) SELECT u.chat, u.id, u."row", u.keys FROM \#(PostgresStore.searchRows(missing)) "#
                    + #"JOIN message m ON m.chat = u.chat AND m.id = u.id AND m."searchRow" = u."row" ON CONFLICT (chat, id) DO NOTHING) "#
                    + #"UPDATE counter SET value = greatest(value, \#(last)) WHERE name = 'searchIndexUpTo'"#
                try store.runCommitted(connection, sql)
            }
        } catch {
            failure.withLock { $0 = error }
        }
    }

    public func waitUntilWritten() throws {
        if let failure = failure.withLock({ $0 }) { throw failure }
    }

    public func bulkLoadEnded() {}

    /// Candidates newest first, each checked on its text, until `limit` are found or the
    /// index has no more: a window of search rows at a time, from the newest back, each
    /// window four times the one before. A query of common words finds its hits in the
    /// first window and reads no further (PostgreSQL reads a GIN match whole and sorts it,
    /// so one query over the whole index costs what the whole index matches: 360 ms for
    /// "ok" at 200,000 messages); a rare one gets there in a few windows (6 at 10M).
    public func searchMessages(containing text: String, chats: [Int64], belowRow: Int64?, limit: Int, budget: SearchBudget) throws -> [SearchHit] {
        guard !chats.isEmpty, !text.isEmpty, limit > 0 else { return [] }
        let needle = SearchNeedle(text)
        let keys = SearchText.queryKeys(text)
        let scopes = chats.count <= PostgresSearchIndex.scopedChats ? chats.map(SearchText.scope) : nil
        let page = max(limit * 4, 256)
        var high =
            try belowRow
            ?? store.withConnection { connection in
                try store.run(connection, #"SELECT coalesce(max("searchRow"), 0) + 1 FROM message_search"#).first?.decode(Int64.self) ?? 1
            }
        var span: Int64 = PostgresSearchIndex.firstWindow
        var found: [SearchHit] = []
        while found.count < limit && high > 1 && !budget.isExhausted {
            let low = max(1, high - span)
            // The messages with the query's keys, and those filed as long, by two queries:
            // with an OR of the two in one, PostgreSQL read the window by search row instead
            // of through GIN (177 ms against 4 for a rare word).
            let matching = try candidates(withAll: keys, chats: chats, scopes: scopes, from: low, below: high, limit: page)
            // Long messages are few: their key alone narrows them (the chats' keys would
            // make GIN read every message of the user's chats).
            let long = try candidates(withAll: [SearchText.longKey], chats: chats, scopes: nil, from: low, below: high, limit: page, rare: true)
            // Below the last row of a full page, that page may lack rows: up to there, both
            // are complete.
            let complete = [matching, long].filter { $0.count == page }.compactMap(\.last?.row).max()
            let merged = (matching + long).filter { $0.row >= (complete ?? Int64.min) }.sorted { $0.row > $1.row }
            for candidate in merged where found.count < limit {
                guard budget.spend(bytes: candidate.content?.utf8.count ?? 0) else { break }
                if let content = candidate.content, needle.isFound(in: content) {
                    found.append(SearchHit(chat: candidate.chat, id: candidate.id, row: candidate.row))
                }
            }
            if let complete {
                high = complete
            } else {
                high = low
                span *= 4
            }
        }
        return found
    }

    /// Up to `limit` messages of `chats` filed under all of `keys`, with search rows from
    /// `from` to below `below`, newest first, with their content.
    private func candidates(
        withAll keys: [Int32], chats: [Int64], scopes: [Int32]?, from low: Int64, below high: Int64,
        limit: Int, rare: Bool = false
    ) throws -> [(chat: Int64, id: Int64, row: Int64, content: String?)] {
        // `rare`: keys that few messages have, read through GIN only (`+ 0` keeps the
        // search-row index out of the plan: through it, a window without such messages
        // cost a read of the whole window, 10 ms and more).
        let row = rare ? #"s."searchRow" + 0"# : #"s."searchRow""#
        var sql: SQL =
            #"SELECT s.chat, s.id, s."searchRow", m.content FROM message_search s JOIN message m ON m.chat = s.chat AND m.id = s.id "#
            + #"WHERE s.keys @> \#(keys)::int4[] AND s.chat = ANY(\#(chats)::bigint[]) "#
            + #"AND \#(unescaped: row) >= \#(low) AND \#(unescaped: row) < \#(high) "#
        if let scopes { sql = sql + #"AND s.keys && \#(scopes)::int4[] "# }
        sql = sql + #"ORDER BY \#(unescaped: row) DESC LIMIT \#(Int64(limit))"#
        return try store.withConnection { connection in
            try store.run(connection, sql).map {
                let (chat, id, row, content) = try $0.decode((Int64, Int64, Int64, String?).self)
                return (chat, id, row, content)
            }
        }
    }

    /// Search rows in the first window a search reads.
    static let firstWindow: Int64 = 16_384
}

extension PostgresStore {
    /// `entries` as rows (`u.chat`, `u.id`, `u."row"`, `u.keys`) of the index, for a FROM
    /// clause. The keys of all of them are one array parameter, sliced per entry (`unnest`
    /// cannot make rows of arrays).
    static func searchRows(_ entries: [SearchEntry]) -> SQL {
        var keys: [Int32] = []
        var from: [Int32] = []
        var to: [Int32] = []
        for entry in entries {
            from.append(Int32(keys.count + 1))
            keys.append(contentsOf: SearchText.keys(of: entry.text, chat: entry.chat))
            to.append(Int32(keys.count))
        }
        return #"(SELECT chat, id, "row", (\#(keys)::int4[])["from":"to"] AS keys "#
            + #"FROM unnest(\#(entries.map(\.chat))::bigint[], \#(entries.map(\.id))::bigint[], \#(entries.map(\.row))::bigint[], "#
            + #"\#(from)::int4[], \#(to)::int4[]) AS e(chat, id, "row", "from", "to")) u"#
    }

    /// The searchable text of the messages above `row`, by search row, at most `limit`
    /// and, but for the first, only while the texts so far take at most `maxBytes`
    /// (counted by the server: what is left out is never sent).
    static func searchEntriesQuery(after row: Int64, limit: Int, maxBytes: Int) -> SQL {
        let page: SQL =
            #"SELECT "searchRow", chat, id, content FROM message WHERE "searchRow" > \#(row) AND "searchRow" > 0 "#
            + #"AND content IS NOT NULL ORDER BY "searchRow" LIMIT \#(Int64(limit))"#
        return #"SELECT "searchRow", chat, id, content FROM (SELECT *, sum(octet_length(content)) OVER (ORDER BY "searchRow") AS upto "#
            + #"FROM (\#(page)) page) counted WHERE upto <= \#(Int64(maxBytes)) OR upto = octet_length(content) ORDER BY "searchRow""#
    }

    static func searchEntries(in rows: PostgresQueryResult) throws -> [SearchEntry] {
        try rows.map {
            let (row, chat, id, text) = try $0.decode((Int64, Int64, Int64, String).self)
            return SearchEntry(row: row, chat: chat, id: id, text: text)
        }
    }
}
