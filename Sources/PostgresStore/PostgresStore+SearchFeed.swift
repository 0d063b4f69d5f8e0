import Foundation
import Logging
import PostgresNIO
import Store

extension PostgresStore {
    /// The searchable text of the messages above `row`, by search row, at most `limit`
    /// and, but for the first, only while the texts so far take at most `maxBytes`
    /// (counted by the server: what is left out is never sent).
    static func searchEntriesQuery(after row: Int64, limit: Int, maxBytes: Int) -> (sql: String, binds: Binds) {
        var binds = Binds()
        let page = #"SELECT "searchRow", chat, id, content FROM message WHERE "searchRow" > \#(binds.add(row)) AND "searchRow" > 0 "#
            + #"AND content IS NOT NULL ORDER BY "searchRow" LIMIT \#(binds.add(Int64(limit)))"#
        let sql = #"SELECT "searchRow", chat, id, content FROM (SELECT *, sum(octet_length(content)) OVER (ORDER BY "searchRow") AS upto "#
            + #"FROM (\#(page)) page) counted WHERE upto <= \#(binds.add(Int64(maxBytes))) OR upto = octet_length(content) ORDER BY "searchRow""#
        return (sql, binds)
    }

    static func searchEntries(in rows: PostgresQueryResult) throws -> [SearchEntry] {
        try rows.map {
            let (row, chat, id, text) = try $0.decode((Int64, Int64, Int64, String).self)
            return SearchEntry(row: row, chat: chat, id: id, text: text)
        }
    }

    /// What a node that is not the writer reads to keep its own search index up to date
    /// while it relays (`searchEntries`, without the writer lock), so that it can answer
    /// searches as soon as it takes over instead of first indexing everything written
    /// while it waited. One connection, made again when it breaks.
    public final class SearchFeed: @unchecked Sendable {
        let location: Location
        let logger: Logger
        private var connection: PostgresConnection?

        public init(location: Location, logger: Logger) {
            self.location = location
            self.logger = logger
        }

        /// Messages whose search row is above `row`, by row, at most `limit` and
        /// `maxBytes` of text but for the first (one caller at a time).
        public func entries(after row: Int64, limit: Int, maxBytes: Int) throws -> [SearchEntry] {
            // One attempt (its caller tries again every second, and says so once a minute):
            // `connect` with patience would log every retry while the database is away.
            let connection = try self.connection.flatMap { $0.isClosed ? nil : $0 }
                ?? PostgresStore.connect(location, id: 1_000_002, patience: .zero, logger: logger)
            self.connection = connection
            let (sql, binds) = PostgresStore.searchEntriesQuery(after: row, limit: limit, maxBytes: maxBytes)
            do {
                let rows = try PostgresStore.wait(for: connection.query(PostgresQuery(unsafeSQL: sql, binds: binds.bindings), logger: logger),
                                                  on: connection, patience: .seconds(30))
                return try PostgresStore.searchEntries(in: rows)
            } catch {
                close()
                throw OpenError(description: PostgresStore.describe(error))
            }
        }

        public func close() {
            try? connection?.close().wait()
            connection = nil
        }
    }
}
