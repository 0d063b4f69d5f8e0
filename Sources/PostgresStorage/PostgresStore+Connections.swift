import Dispatch
import Foundation
import Logging
import NIOCore
import NIOPosix
import NIOSSL
import PostgresNIO
import Storage
import Synchronization
import Threads

// Connections: the store's own (each attempt bounded) for what belongs to a session (the
// writer lock, the feed slot, listening), the pool (postgres-nio's `PostgresClient`) for
// everything else, and the statements run on them.

extension PostgresStore {
    // MARK: connections

    func connect() throws -> PostgresConnection {
        let id = shared.withLock { s -> Int in
            s.nextConnectionID += 1
            return s.nextConnectionID
        }
        return try PostgresStore.connect(location, id: id, patience: patience, logger: logger)
    }

    /// A new connection, waiting up to `patience` for a server that is not there or is
    /// starting or stopping.
    /// `retrying` is called before each attempt after a failed one.
    static func connect(
        _ location: Location, id: Int, patience: Duration, logger: Logger, retrying: (() -> Void)? = nil
    ) throws -> PostgresConnection {
        let deadline = ContinuousClock.now + patience
        while true {
            do {
                let connection = try connectOnce(location, id: id, logger: logger)
                do {
                    try makeCommitsDurable(connection, logger: logger)
                } catch {
                    try? connection.close().wait()
                    throw error
                }
                return connection
            } catch {
                if let error = error as? PSQLError, !PostgresStore.mayPassByWaiting(error) { throw error }
                guard ContinuousClock.now < deadline else { throw error }
                logger.warning("cannot reach PostgreSQL: trying again", metadata: ["store": "\(location)", "error": "\(PostgresStore.describe(error))"])
                Thread.sleep(forTimeInterval: 0.2)
                retrying?()
            }
        }
    }

    /// How long one connection attempt (the socket, TLS, the start-up and authentication
    /// exchange) may take. A server being restarted can accept a connection and never
    /// answer it: waiting for it without a bound held the writer lock's check, and every
    /// commit behind it, for good (a session waited 30 s and more for its answer).
    static let connectionPatience: Duration = .seconds(5)

    struct ConnectTimedOut: Error, CustomStringConvertible {
        var description: String { "PostgreSQL did not answer the connection within \(PostgresStore.connectionPatience)" }
    }

    /// One connection attempt, given up after `connectionPatience` (a connection that
    /// comes after that is closed).
    static func connectOnce(_ location: Location, id: Int, logger: Logger) throws -> PostgresConnection {
        let future = PostgresConnection.connect(
            on: MultiThreadedEventLoopGroup.singleton.next(), configuration: location.configuration, id: id, logger: logger)
        let outcome = Outcome<PostgresConnection>()
        future.whenComplete(outcome.complete)
        guard let result = outcome.wait(until: .now + connectionPatience) else {
            future.whenSuccess { late in late.close().whenComplete { _ in } }
            throw ConnectTimedOut()
        }
        return try result.get()
    }

    /// A commit is announced `Sent` once PostgreSQL says it is committed, which means on
    /// its disk only when `synchronous_commit` is not `off`: a role or database set to
    /// `off` would lose announced commits in a crash of the server. Such a setting is
    /// overridden for this connection (the others, `local` to `remote_apply`, all flush
    /// the server's own WAL first), and said once; the pool's connections, made after the
    /// store's first connection, then override it too (`asynchronousCommitsSeen`).
    static func makeCommitsDurable(_ connection: PostgresConnection, logger: Logger) throws {
        let shown = try wait(for: connection.query("SHOW synchronous_commit", logger: logger), on: connection, patience: connectionPatience)
        guard let level = try shown.first?.decode(String.self), level == "off" else { return }
        _ = try wait(for: connection.query("SET synchronous_commit = on", logger: logger), on: connection, patience: connectionPatience)
        if !asynchronousCommitsSeen.exchange(true, ordering: .relaxed) {
            logger.warning(
                "the database or role sets synchronous_commit = off, under which a crash of PostgreSQL loses commits it said were made: chatcore sets it on for its own connections",
                metadata: ["was": "\(level)"])
        }
    }

    static let asynchronousCommitsSeen = Atomic<Bool>(false)

    /// Whether a failed connection attempt may succeed later: refused or unreachable, or
    /// the server is starting or stopping (SQLSTATE 57P0x, 08xxx) — it may be restarting.
    /// Anything else the server said (a wrong password, no such database), a server
    /// without TLS, a password the server asks for and none was given (it was tried again
    /// for the whole patience, 15 s), a way of proving it this client does not have, or a
    /// certificate that does not check out, will not change by waiting.
    static func mayPassByWaiting(_ error: PSQLError) -> Bool {
        if let state = error.serverInfo?[.sqlState], !state.hasPrefix("57P"), !state.hasPrefix("08") { return false }
        if [.sslUnsupported, .authMechanismRequiresPassword, .unsupportedAuthMechanism].contains(error.code) { return false }
        let underlying = error.underlying
        return !(underlying is NIOSSLError || underlying is NIOSSLExtraError || underlying is BoringSSLError)
    }

    /// The pool, made and run at its first use (after the store's first connection:
    /// `makeCommitsDurable`), until `shutDown`.
    func pool() throws -> PostgresClient {
        try shared.withLock { s in
            if let pool = s.pool { return pool.client }
            guard !s.isShutDown else { throw StoreFailure(.other, "the store is closed") }
            let client = PostgresClient(
                configuration: location.poolConfiguration(durableCommits: PostgresStore.asynchronousCommitsSeen.load(ordering: .relaxed)),
                backgroundLogger: logger)
            // Detached: a task made here would take the task-locals of whoever first
            // asked, and the client ends at the graceful shutdown of that caller's
            // service group, while the engine still answers and commits.
            s.pool = (client, Task.detached { await client.run() })
            return client
        }
    }

    /// Runs `body` on a connection leased from the pool, on the calling thread (the pool
    /// waits, without a thread, until `body` hands it back). Waits up to `patience` for one
    /// (the server may be restarting: the pool tries again meanwhile). A connection that
    /// broke is not given back for use; one in a failed transaction is rolled back first.
    func withConnection<T>(_ body: (PostgresConnection) throws -> T) throws -> T {
        try checkWriterLock()
        let client = try pool()
        let leased = Outcome<PostgresConnection>()
        let handedBack = Handback()
        let lease = Task.detached {
            do {
                try await client.withConnection { connection in
                    leased.complete(.success(connection))
                    await handedBack.wait()
                }
            } catch {
                leased.complete(.failure(error))
            }
        }
        defer { handedBack.signal() }
        guard let result = leased.wait(until: .now + patience) else {
            lease.cancel()
            throw NoConnection(patience: patience)
        }
        let connection = try result.get()
        do {
            return try body(connection)
        } catch {
            if !connection.isClosed && (try? wait(for: connection.query("ROLLBACK", logger: logger), on: connection)) == nil {
                connection.close().whenComplete { _ in }
            }
            throw error
        }
    }

    struct NoConnection: Error, CustomStringConvertible {
        let patience: Duration
        var description: String { "no connection to PostgreSQL within \(patience)" }
    }

    /// How long one statement may take before its connection is given up.
    static let statementPatience: Duration = .seconds(60)

    struct StatementTimedOut: Error, CustomStringConvertible {
        let patience: Duration
        var description: String { "PostgreSQL did not answer within \(patience) (the connection was closed)" }
    }

    struct ClosedUnanswered: Error, CustomStringConvertible {
        var description: String { "the connection to PostgreSQL closed before the statement was answered" }
    }

    /// Waits for a statement's result. A statement sent on a connection that died under
    /// it may never be answered (postgres-nio leaves it waiting): the wait looks at the
    /// connection every 100 ms and ends a second after it closed, and after
    /// `statementPatience` in any case, closing the connection — instead of the engine
    /// waiting for ever, or for the whole patience after a server restart.
    func wait<T: Sendable>(for future: EventLoopFuture<T>, on connection: PostgresConnection) throws -> T {
        try PostgresStore.wait(for: future, on: connection, patience: PostgresStore.statementPatience)
    }

    static func wait<T: Sendable>(for future: EventLoopFuture<T>, on connection: PostgresConnection, patience: Duration) throws -> T {
        let outcome = Outcome<T>()
        future.whenComplete(outcome.complete)
        let deadline = ContinuousClock.now + patience
        var closedSince: ContinuousClock.Instant?
        while true {
            if let result = outcome.wait(until: .now + .milliseconds(100)) { return try result.get() }
            let now = ContinuousClock.now
            if connection.isClosed {
                // An answer that came just before the close is being handed over.
                if closedSince == nil { closedSince = now }
                if now - closedSince! >= .seconds(1) { throw ClosedUnanswered() }
            }
            if now >= deadline {
                let closing: EventLoopFuture<Void> = connection.close()
                closing.whenComplete { _ in }
                throw StatementTimedOut(patience: patience)
            }
        }
    }

    // MARK: statements

    /// Runs one statement and returns its rows.
    @discardableResult
    func run(_ connection: PostgresConnection, _ sql: SQL) throws -> PostgresQueryResult {
        try wait(for: connection.query(sql.query, logger: logger), on: connection)
    }

    /// Runs one statement that writes, as its own (implicit) transaction, and returns its
    /// rows once that transaction is committed; throws when it is not. PostgreSQL commits
    /// it when it reaches the statement's Sync, after it sent the statement's
    /// CommandComplete, and postgres-nio answers the statement at CommandComplete: a
    /// commit refused at that point (a deferred constraint, the server stopped or out of
    /// disk) reaches the client only as an error after the answer, which closes the
    /// connection. So an empty statement is queued behind it: postgres-nio sends it only
    /// once the server said it is ready for the next (ReadyForQuery, after the commit),
    /// and it is answered only if the commit was. Queued at once, not after the answer,
    /// it costs the server one more round trip but the caller no more waiting than that.
    /// Without it a send could be announced `Sent` and never be stored.
    @discardableResult
    func runCommitted(_ connection: PostgresConnection, _ sql: SQL) throws -> PostgresQueryResult {
        let answer = connection.query(sql.query, logger: logger)
        let confirmation = connection.query("", logger: logger)
        let rows = try wait(for: answer, on: connection)
        _ = try wait(for: confirmation, on: connection)
        return rows
    }

    /// An error in words (PostgreSQL's own message and SQLSTATE when the server sent one).
    static func describe(_ error: Error) -> String {
        guard let error = error as? PSQLError else { return "\(error)" }
        if let info = error.serverInfo {
            return "\(info[.message] ?? "error") (SQLSTATE \(info[.sqlState] ?? "?"))"
        }
        if error.code == .sslUnsupported {
            return "the server does not offer TLS, which sslmode asks for"
        }
        if let underlying = error.underlying {
            return "\(error.code): \(underlying)"
        }
        return "\(error.code)"
    }
}

/// Said once by the thread that used a leased connection, waited for by the pool's task
/// that leased it (which then gives the connection back to the pool).
final class Handback: Sendable {
    private let state = Locked<(given: Bool, waiter: CheckedContinuation<Void, Never>?)>((false, nil))

    func wait() async {
        await withCheckedContinuation { continuation in
            let now = state.withLock { s -> Bool in
                if s.given { return true }
                s.waiter = continuation
                return false
            }
            if now { continuation.resume() }
        }
    }

    func signal() {
        let waiter = state.withLock { s -> CheckedContinuation<Void, Never>? in
            s.given = true
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume()
    }
}
