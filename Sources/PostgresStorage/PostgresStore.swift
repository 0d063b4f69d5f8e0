import Dispatch
import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import NIOSSL
import PostgresNIO
import Storage
import Synchronization
import Threads

/// `ChatStore` on a PostgreSQL database, through postgres-nio.
///
/// The engine calls the store synchronously from its own thread (never from an event
/// loop), so each call here runs its statements on a connection and waits for them.
/// Connections are kept and reused; one that breaks (the server restarted) is dropped and
/// a new one is made for the next call, waiting for the server up to `patience`.
///
/// One chatcore process serves a database at a time, as with SQLite's lock file: the
/// engine keeps users, chats and memberships in memory and allocates ids from it, so a
/// second writer would hand out the same ids. A session-level advisory lock, held on a
/// connection of its own for as long as the process runs, says so to a second process.
///
/// The lock alone does not fence a writer that lost it: its connection can close (the
/// server restarted, a backend was terminated, the network dropped it) while a commit of
/// the writer is under way on another connection, and the node that takes the lock next
/// could read the store before that commit lands, then hand out the same ids or write
/// over it from memory that is behind. So each writer also takes the next *writer epoch*
/// (a row it increments) once it holds the lock, and every commit checks, under a share
/// lock on that row held until it ends, that the epoch is still its own
/// (`chatcore_fence`): the next writer's increment waits for a commit that holds the row,
/// and a commit that reaches the row after the increment fails whole. A writer that finds
/// another epoch stops (`StoreFailure.superseded`).
public final class PostgresStore: Sendable {
    public struct OpenError: Error, CustomStringConvertible {
        public let description: String

        public init(description: String) {
            self.description = description
        }
    }

    /// Where the database is and who connects (from `--store`).
    public struct Location: Sendable, CustomStringConvertible {
        public enum Address: Sendable {
            case tcp(host: String, port: Int)
            case unix(path: String)
        }

        /// Whether and how TLS protects a TCP connection (libpq's `sslmode`; a Unix
        /// socket never uses TLS).
        public enum TLSMode: String, Sendable, CaseIterable {
            /// Never.
            case disable
            /// When the server offers it, without checking its certificate (libpq's default).
            case prefer
            /// Always; the certificate is not checked unless `sslrootcert` is given, then
            /// as for verify-ca (libpq does the same).
            case require
            /// Always, with a certificate signed by `sslrootcert` (or the system's roots).
            case verifyCA = "verify-ca"
            /// As verify-ca, and the certificate names the host connected to.
            case verifyFull = "verify-full"
        }

        public var address: Address
        public var user: String
        public var database: String
        public var password: String?
        public var tlsMode: TLSMode
        /// The certificates (PEM) a server's certificate must chain to (`sslrootcert`).
        public var rootCertificates: String?
        let tls: PostgresConnection.Configuration.TLS

        /// `postgres://USER@HOST[:PORT]/DATABASE[?sslmode=MODE&sslrootcert=FILE]`, or
        /// `postgres://USER@/DATABASE?host=/run/postgresql` (a Unix socket in that
        /// directory), in libpq's spelling. A password in the URL is refused: command lines
        /// are visible to every user of the machine.
        public init(url text: String, password: String?) throws {
            guard let url = URLComponents(string: text), let scheme = url.scheme, scheme == "postgres" || scheme == "postgresql" else {
                throw OpenError(description: "--store must be a postgres:// URL (postgres://USER@HOST[:PORT]/DATABASE), not \(text)")
            }
            guard url.password == nil else {
                throw OpenError(
                    description: "--store must not carry a password (command lines are visible to every user of the machine): "
                        + "use --store-password-file or PGPASSWORD")
            }
            let database = url.path.hasPrefix("/") ? String(url.path.dropFirst()) : url.path
            guard !database.isEmpty else { throw OpenError(description: "--store names no database: postgres://USER@HOST/DATABASE") }
            let socketDirectory = url.queryItems?.first { $0.name == "host" }?.value
            let port = url.port ?? 5432
            if let socketDirectory, socketDirectory.hasPrefix("/") {
                address = .unix(path: socketDirectory + "/.s.PGSQL.\(port)")
            } else if let host = url.host, !host.isEmpty {
                address = .tcp(host: host, port: port)
            } else {
                address = .unix(path: "/var/run/postgresql/.s.PGSQL.\(port)")
            }
            user = url.user ?? ProcessInfo.processInfo.environment["USER"] ?? "postgres"
            self.database = database
            self.password = password
            let query = url.queryItems ?? []
            if let unknown = query.first(where: { !["host", "sslmode", "sslrootcert"].contains($0.name) }) {
                throw OpenError(description: "--store: unknown parameter \(unknown.name) (known: host, sslmode, sslrootcert)")
            }
            let mode = query.first { $0.name == "sslmode" }?.value ?? TLSMode.prefer.rawValue
            guard let tlsMode = TLSMode(rawValue: mode) else {
                throw OpenError(description: "--store: sslmode must be one of \(TLSMode.allCases.map(\.rawValue).joined(separator: ", ")), not \(mode)")
            }
            self.tlsMode = tlsMode
            rootCertificates = query.first { $0.name == "sslrootcert" }?.value
            // A Unix socket never uses TLS (as with libpq): no context is made for it.
            if case .tcp = address {
                tls = try Location.tls(tlsMode, rootCertificates: rootCertificates)
            } else {
                tls = .disable
            }
        }

        /// What postgres-nio is told: TLS is offered (prefer) or demanded (the others),
        /// with the certificate checks the mode asks for.
        private static func tls(_ mode: TLSMode, rootCertificates: String?) throws -> PostgresConnection.Configuration.TLS {
            guard mode != .disable else { return .disable }
            var configuration = TLSConfiguration.makeClientConfiguration()
            switch mode {
            case .disable, .prefer: configuration.certificateVerification = .none
            case .require: configuration.certificateVerification = rootCertificates == nil ? .none : .noHostnameVerification
            case .verifyCA: configuration.certificateVerification = .noHostnameVerification
            case .verifyFull: configuration.certificateVerification = .fullVerification
            }
            if let rootCertificates {
                guard FileManager.default.isReadableFile(atPath: rootCertificates) else {
                    throw OpenError(description: "--store: sslrootcert \(rootCertificates) cannot be read")
                }
                configuration.trustRoots = .file(rootCertificates)
            }
            let context: NIOSSLContext
            do {
                context = try NIOSSLContext(configuration: configuration)
            } catch {
                throw OpenError(description: "--store: cannot set up TLS (sslmode=\(mode.rawValue)): \(error)")
            }
            return mode == .prefer ? .prefer(context) : .require(context)
        }

        public var description: String {
            switch address {
            case .tcp(let host, let port): "postgres://\(user)@\(host):\(port)/\(database) (sslmode \(tlsMode.rawValue))"
            case .unix(let path): "postgres://\(user)@/\(database) (socket \(path))"
            }
        }

        var configuration: PostgresConnection.Configuration {
            var configuration: PostgresConnection.Configuration
            switch address {
            case .tcp(let host, let port):
                configuration = .init(host: host, port: port, username: user, password: password, database: database, tls: tls)
            case .unix(let path):
                configuration = .init(unixSocketPath: path, username: user, password: password, database: database)
            }
            configuration.options.connectTimeout = .seconds(5)
            // Every connection of this process is named after it: a node taking over
            // from a writer that stopped answering ends exactly that writer's sessions.
            configuration.options.additionalStartupParameters = [("application_name", PostgresStore.nodeName)]
            return configuration
        }
    }

    public let location: Location
    let logger: Logger
    /// What the store's threads share.
    struct Shared {
        var idle: [PostgresConnection] = []
        var nextConnectionID = 0
        /// Holds the advisory lock that makes this process the database's only writer.
        var lockHolder: PostgresConnection?
        /// Set by `shutDown`: a closed lock connection is then not replaced.
        var isShutDown = false
        /// The writer epoch this process took when it became the writer; every commit
        /// checks that it is still the database's.
        var epoch: Int64 = 0
        /// `feedSlot`.
        var slot = 0
        /// The epoch of its feed slot this process took with it.
        var slotEpoch: Int64 = 0
        /// What this node is told of the other deciding nodes' doings (`allNodesDecide`;
        /// PostgresStore+Following.swift).
        var told = Told()
        var superseded: (@Sendable (String) -> Void)?
    }

    let shared = Locked(Shared())
    /// One `listenIfDeaf` at a time.
    let relistening = Locked(())
    /// Whether every node on the database decides (`--all-nodes-decide`): each follows
    /// the others' commits (`othersActivity`), and its commits are fenced by its feed
    /// slot's epoch (`slotEpoch`), which a node that takes the slot after it moves on.
    public let allNodesDecide: Bool
    /// Whether this process holds the writer lock (else it decides beside the writer, and
    /// says nothing of where it accepts connections: nobody relays to it).
    public let isWriter: Bool
    /// Called (on another thread) when another process became the database's
    /// writer while this one was serving: its memory may be behind the store, so it
    /// must stop. Without it, the next commit fails and stops the service.
    public var onSuperseded: (@Sendable (String) -> Void)? {
        get { shared.withLock { s in s.superseded } }
        set { shared.withLock { s in s.superseded = newValue } }
    }
    /// One check of the writer lock at a time (the engine's and the watcher's).
    private let relocking = Locked(())
    /// Whether each recent commit was applied, for the commit in flight after it.
    let outcomes = CommitOutcomes()
    /// How long a call waits for the server to come back before it fails.
    public let patience: Duration = .seconds(15)

    /// This process among the database's sessions (`application_name`): unique per
    /// process, short enough that PostgreSQL keeps it whole (63 bytes).
    public static let nodeName = "chatcore-\(ProcessInfo.processInfo.processIdentifier)-\(String(UInt64.random(in: 0...UInt64.max), radix: 16))"

    /// How often the writer says it is alive (`writer_beat`).
    static let beatSeconds = 1.0

    /// The advisory lock's key: "chatcore" read as a number.
    static let writerLockKey: Int64 = 0x6368_6174_636f_7265

    /// Opens the store as the database's writer: with the lock `writerLock` holds (taken
    /// by `WriterLock.wait`), else taking it now or failing (`WriterLockHeld`). With
    /// `allNodesDecide`, every node decides: with `besideTheWriter`, this one opens it
    /// without the writer lock, deciding beside the writer in a feed slot of its own.
    public init(location: Location, logger: Logger, writerLock: WriterLock? = nil, allNodesDecide: Bool = false, besideTheWriter: Bool = false) throws {
        self.location = location
        self.logger = logger
        self.allNodesDecide = allNodesDecide || besideTheWriter
        self.isWriter = !besideTheWriter
        do {
            if besideTheWriter {
                let connection = try connect()
                _ = try? run(connection, "SET synchronous_commit = off")
                shared.withLock { s in s.lockHolder = connection }
                try withConnection { connection in try migrate(connection) }
            } else {
                if let writerLock {
                    hold(writerLock.connection)
                } else {
                    try takeWriterLock()
                }
                try withConnection { connection in
                    try migrate(connection)
                    let taken = try takeEpoch(connection)
                    shared.withLock { s in s.epoch = taken }
                }
            }
            try takeFeedSlot()
            if self.allNodesDecide { try takeSlotEpoch() }
            if besideTheWriter { watchSlotLock() }
            startBeating()
        } catch let error as OpenError {
            shutDown()
            throw error
        } catch let error as WriterLockHeld {
            shutDown()
            throw error
        } catch {
            shutDown()
            throw OpenError(description: "cannot open the store \(location): \(PostgresStore.describe(error))")
        }
    }

    /// This node's feed slot (`FeedSlots`, `ChatStore.feedSlot`): the first one no other
    /// node holds, by an advisory lock of the session that holds the writer lock, so it is
    /// held exactly as long as the writer lock is. While one node decides that is slot 0
    /// (the one before it let go of it with the writer lock), unless something else holds
    /// it; with several deciding nodes (docs/several-deciding-nodes.md) each gets its own.
    public var feedSlot: Int { shared.withLock { s in s.slot } }

    private func takeFeedSlot() throws {
        guard let holder = shared.withLock({ s in s.lockHolder }) else { return }
        for slot in 0..<FeedSlots.count {
            if try lockFeedSlot(slot, on: holder) {
                shared.withLock { s in s.slot = slot }
                if slot != 0 { logger.info("another node holds feed slot 0: this node numbers its changes in another", metadata: ["feedSlot": "\(slot)"]) }
                return
            }
        }
        throw OpenError(description: "every one of the \(FeedSlots.count) feed slots of \(location) is held: another node must stop first")
    }

    /// Takes feed slot `slot`'s advisory lock for `connection`'s session, if no other holds it.
    private func lockFeedSlot(_ slot: Int, on connection: PostgresConnection) throws -> Bool {
        try run(connection, "SELECT pg_try_advisory_lock(\(PostgresStore.feedSlotLockKey + Int64(slot)))").first?.decode(Bool.self) == true
    }

    /// Moves this node's feed slot's epoch on (`allNodesDecide`): a node that held the
    /// slot before can commit no more. What that node said of who was connected to it
    /// goes.
    private func takeSlotEpoch() throws {
        let slot = Int64(feedSlot)
        try withConnection { connection in
            var binds = Binds()
            let rows = try runCommitted(
                connection,
                PostgresQuery(
                    unsafeSQL: """
                        WITH taken AS (UPDATE slot_epoch SET epoch = epoch + 1 WHERE slot = \(binds.add(slot))::int RETURNING epoch),
                        gone AS (DELETE FROM node_online WHERE slot = \(binds.add(slot))::int)
                        SELECT epoch FROM taken
                        """, binds: binds.bindings))
            guard let taken = try rows.first?.decode(Int64.self) else {
                throw OpenError(description: "the store \(location) has no slot_epoch row for feed slot \(slot): it was changed by hand")
            }
            shared.withLock { s in s.slotEpoch = taken }
        }
    }

    /// A node deciding beside the writer holds its feed slot on a connection of its own:
    /// when that closes (PostgreSQL restarted), it takes the slot again at once, and stops
    /// if another node took it meanwhile (its epoch moved on).
    private func watchSlotLock() {
        guard let connection = shared.withLock({ s in s.lockHolder }) else { return }
        connection.closeFuture.whenComplete { [weak self] _ in
            guard let store = self else { return }
            DispatchQueue.global().async {
                guard !store.shared.withLock({ s in s.isShutDown }) else { return }
                do {
                    try store.takeSlotAgain()
                } catch {
                    store.logger.error("the feed slot could not be taken again", metadata: ["error": "\(error)"])
                    store.onSuperseded?("\(error)")
                }
            }
        }
    }

    private func takeSlotAgain() throws {
        let connection = try connect()
        let (slot, epoch) = shared.withLock { s in (s.slot, s.slotEpoch) }
        var binds = Binds()
        let current = try? run(connection, "SELECT epoch FROM slot_epoch WHERE slot = \(binds.add(Int64(slot)))::int", binds).first?.decode(Int64.self)
        guard (try? lockFeedSlot(slot, on: connection)) == true, current == epoch else {
            try? connection.close().wait()
            throw StoreFailure(.superseded, "another node took feed slot \(slot), in which this node numbers its changes: this one stops")
        }
        shared.withLock { s in s.lockHolder = connection }
        watchSlotLock()
    }

    /// The advisory lock of feed slot 0; slot `s`'s is this plus `s`.
    static let feedSlotLockKey: Int64 = writerLockKey + 0x100

    /// Another process holds the writer lock of the database.
    public struct WriterLockHeld: Error, CustomStringConvertible {
        public let location: Location
        public var description: String {
            "another chatcore process is serving the database \(location) (it holds the writer lock)"
        }
    }

    deinit {
        shutDown()
    }

    /// Closes every connection (the advisory lock goes with its connection).
    public func shutDown() {
        let connections = shared.withLock { s -> [PostgresConnection] in
            s.isShutDown = true
            let all = s.idle + (s.lockHolder.map { [$0] } ?? []) + (s.told.listener.map { [$0] } ?? [])
            s.idle = []
            s.lockHolder = nil
            s.told.listener = nil
            return all
        }
        for connection in connections { try? connection.close().wait() }
    }

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
    static func connect(_ location: Location, id: Int, patience: Duration, logger: Logger) throws -> PostgresConnection {
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
    private static func connectOnce(_ location: Location, id: Int, logger: Logger) throws -> PostgresConnection {
        let future = PostgresConnection.connect(
            on: MultiThreadedEventLoopGroup.singleton.next(), configuration: location.configuration, id: id, logger: logger)
        let outcome = Locked<Result<PostgresConnection, Error>?>(nil)
        future.whenComplete { result in outcome.change { $0 = result } }
        let seconds = Double(connectionPatience.components.seconds)
        guard let result = outcome.wait(until: { $0 != nil }, deadline: Date(timeIntervalSinceNow: seconds), then: { $0 }) else {
            future.whenSuccess { late in late.close().whenComplete { _ in } }
            throw ConnectTimedOut()
        }
        return try result.get()
    }

    /// A commit is announced `Sent` once PostgreSQL says it is committed, which means on
    /// its disk only when `synchronous_commit` is not `off`: a role or database set to
    /// `off` would lose announced commits in a crash of the server. Such a setting is
    /// overridden for this connection (the others, `local` to `remote_apply`, all flush
    /// the server's own WAL first), and said once.
    static func makeCommitsDurable(_ connection: PostgresConnection, logger: Logger) throws {
        let shown = try wait(for: connection.query("SHOW synchronous_commit", logger: logger), on: connection, patience: connectionPatience)
        guard let level = try shown.first?.decode(String.self), level == "off" else { return }
        _ = try wait(for: connection.query("SET synchronous_commit = on", logger: logger), on: connection, patience: connectionPatience)
        if !warnedOfAsynchronousCommits.exchange(true, ordering: .relaxed) {
            logger.warning(
                "the database or role sets synchronous_commit = off, under which a crash of PostgreSQL loses commits it said were made: chatcore sets it on for its own connections",
                metadata: ["was": "\(level)"])
        }
    }

    private static let warnedOfAsynchronousCommits = Atomic<Bool>(false)

    /// Whether a failed connection attempt may succeed later: refused or unreachable, or
    /// the server is starting or stopping (SQLSTATE 57P0x, 08xxx) — it may be restarting.
    /// Anything else the server said (a wrong password, no such database), a server
    /// without TLS, or a certificate that does not check out, will not change by waiting.
    static func mayPassByWaiting(_ error: PSQLError) -> Bool {
        if let state = error.serverInfo?[.sqlState], !state.hasPrefix("57P"), !state.hasPrefix("08") { return false }
        if error.code == .sslUnsupported { return false }
        let underlying = error.underlying
        return !(underlying is NIOSSLError || underlying is NIOSSLExtraError || underlying is BoringSSLError)
    }

    /// Runs `body` on a connection of the pool (made when none is idle). A connection that
    /// broke is closed, not kept; one in a failed transaction is rolled back first.
    func withConnection<T>(_ body: (PostgresConnection) throws -> T) throws -> T {
        try checkWriterLock()
        let connection = try takeIdle() ?? connect()
        do {
            let result = try body(connection)
            shared.withLock { s in s.idle.append(connection) }
            return result
        } catch {
            if connection.isClosed {
                try? connection.close().wait()
            } else if (try? wait(for: connection.query("ROLLBACK", logger: logger), on: connection)) != nil {
                shared.withLock { s in s.idle.append(connection) }
            } else {
                try? connection.close().wait()
            }
            throw error
        }
    }

    /// An idle connection that is still open (the server closes them when it restarts).
    private func takeIdle() -> PostgresConnection? {
        while let connection = shared.withLock({ s in s.idle.popLast() }) {
            if !connection.isClosed { return connection }
            try? connection.close().wait()
        }
        return nil
    }

    /// How long one statement may take before its connection is given up.
    public let statementPatience: Duration = .seconds(60)

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
        try PostgresStore.wait(for: future, on: connection, patience: statementPatience)
    }

    static func wait<T: Sendable>(for future: EventLoopFuture<T>, on connection: PostgresConnection, patience: Duration) throws -> T {
        let outcome = Locked<Result<T, Error>?>(nil)
        future.whenComplete { result in outcome.change { $0 = result } }
        let deadline = ContinuousClock.now + patience
        var closedSince: ContinuousClock.Instant?
        while outcome.wait(until: { $0 != nil }, deadline: Date(timeIntervalSinceNow: 0.1), then: { $0 == nil }) {
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
        return try outcome.withLock { $0! }.get()
    }

    /// Becomes the database's only writer, or says who is. Taken again (an epoch is
    /// held), the lock is this process's only if no other writer took an epoch meanwhile.
    private func takeWriterLock() throws {
        let connection = try connect()
        let rows = try run(connection, "SELECT pg_try_advisory_lock(\(PostgresStore.writerLockKey))")
        guard let row = rows.first, try row.decode(Bool.self) else {
            try? connection.close().wait()
            throw WriterLockHeld(location: location)
        }
        let held = shared.withLock { s in s.epoch }
        if held != 0 {
            let current: Int64?
            do {
                current = try run(connection, "SELECT epoch FROM writer_epoch WHERE id = 1").first?.decode(Int64.self)
            } catch {
                try? connection.close().wait()
                throw error
            }
            guard current == held else {
                try? connection.close().wait()
                throw StoreFailure(.superseded, supersededReason)
            }
            // The feed slot went with the old connection too: this node's changes go on
            // numbered in it, so it must be the same one.
            let slot = shared.withLock { s in s.slot }
            guard (try? lockFeedSlot(slot, on: connection)) == true else {
                try? connection.close().wait()
                throw StoreFailure(.superseded, "another node took feed slot \(slot), in which this node numbers its changes")
            }
            // Beat at once: after a long restart of the server the last beat is old, and
            // a waiting node would take this writer for a silent one.
            try? beat(on: connection)
        }
        hold(connection)
    }

    /// Keeps `connection`, which holds the writer lock, and watches it. Its beats need
    /// not wait for the disk.
    private func hold(_ connection: PostgresConnection) {
        _ = try? run(connection, "SET synchronous_commit = off")
        shared.withLock { s in s.lockHolder = connection }
        watchWriterLock(connection)
    }

    /// Says that this writer is alive now (`writer_beat`), if its epoch is still the one.
    private func beat(on connection: PostgresConnection) throws {
        var binds = Binds()
        try run(connection, "UPDATE writer_beat SET beat = now() WHERE id = 1 AND epoch = \(binds.add(shared.withLock { s in s.epoch }))", binds)
    }

    /// Says that this writer is alive every `beatSeconds` (`writer_beat`, on the lock's
    /// connection, not waiting for the disk), until the store is shut down. A writer that
    /// stops answering (its machine gone, the process stopped, the network cut) stops
    /// beating, and a waiting node ends its sessions and takes over (`WriterLock.wait`);
    /// the epoch fences it if it wakes.
    private func startBeating() {
        let thread = Thread { [weak self] in
            nameCurrentThread("writer-beat")
            while let store = self, !store.shared.withLock({ s in s.isShutDown }) {
                if let connection = store.shared.withLock({ s in s.lockHolder }), !connection.isClosed {
                    do {
                        // Any deciding node trims, so that the log stays short when the
                        // writer is gone.
                        if store.isWriter { try store.beat(on: connection) }
                        if store.allNodesDecide {
                            try store.trimFollowed(on: connection)
                            store.listenIfDeaf()
                        }
                    } catch {
                        store.logger.debug("a writer beat failed", metadata: ["error": "\(PostgresStore.describe(error))"])
                    }
                }
                Thread.sleep(forTimeInterval: PostgresStore.beatSeconds)
            }
        }
        thread.start()
    }

    /// Takes the next writer epoch (holding the writer lock), and removes the previous
    /// writer's address. The increment waits for a commit of the previous writer that
    /// holds a share lock on the row, so what this process reads next includes it, and
    /// every commit of the previous writer that reaches the row later fails its fence.
    private func takeEpoch(_ connection: PostgresConnection) throws -> Int64 {
        // One statement, so one transaction: the next epoch, this node's first beat, and
        // the previous writer's address gone, at once. Where the previous writer accepted
        // connections is not where this one will: relaying nodes wait for this writer's own
        // address (`advertise`, once it serves) instead of relaying to the old one, or to a
        // new process bound there that is not serving yet, with the old credential; with
        // three statements, a relaying node could read the old address after the epoch
        // moved on.
        var binds = Binds()
        let rows = try runCommitted(
            connection,
            PostgresQuery(
                unsafeSQL: """
                    WITH taken AS (UPDATE writer_epoch SET epoch = epoch + 1, since = now() WHERE id = 1 RETURNING epoch),
                    beat AS (INSERT INTO writer_beat (id, node, epoch, beat) SELECT 1, \(binds.add(PostgresStore.nodeName)), epoch, now() FROM taken
                             ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, epoch = EXCLUDED.epoch, beat = EXCLUDED.beat),
                    gone AS (DELETE FROM writer_node)
                    SELECT epoch FROM taken
                    """, binds: binds.bindings))
        guard let taken = try rows.first?.decode(Int64.self) else {
            throw OpenError(description: "the store \(location) has no writer_epoch row: it was changed by hand")
        }
        logger.debug("took the writer epoch", metadata: ["epoch": "\(taken)"])
        return taken
    }

    /// The SELECT of every commit (the commit's writes are its WITH clauses): it fails
    /// (SQLSTATE `CCW01`), and the commit with it, unless this process's epoch is still
    /// the database's, and holds the row so the next writer's increment waits for the
    /// commit.
    func fence(_ binds: inout Binds) -> String {
        let (epoch, slot, slotEpoch) = shared.withLock { s in (s.epoch, s.slot, s.slotEpoch) }
        let slotFence = "chatcore_slot_fence(\(binds.add(Int64(slot)))::int, \(binds.add(slotEpoch)))"
        guard isWriter else { return "SELECT " + slotFence }
        let writerFence = "chatcore_fence(\(binds.add(epoch)))"
        return "SELECT " + (allNodesDecide ? writerFence + ", " + slotFence : writerFence)
    }

    /// The clause that moves on the versions of the chats a batch changes, or raises
    /// `CCC01` (`chatcore_claim`); nil when it changes none.
    static func claim(_ versions: [ChatVersion], _ binds: inout Binds) -> String? {
        guard !versions.isEmpty else { return nil }
        return "chatcore_claim(\(binds.add(versions.map(\.chat)))::bigint[], \(binds.add(versions.map(\.version)))::bigint[])"
    }

    /// SQLSTATEs of a commit that lost to another node's and may be decided again: the
    /// claim's (`chatcore_claim`), a key another node inserted first (unique_violation),
    /// and two commits that locked each other's chats (deadlock_detected) or were
    /// serialised (serialization_failure).
    static let conflictStates: Set<String> = ["CCC01", "23505", "40P01", "40001"]

    /// The SQLSTATE of a failed fence.
    static let supersededState = "CCW01"

    var supersededReason: String {
        "another chatcore process became the writer of \(location): this one stops (what it holds in memory may be behind the store); its clients connect to the node serving now"
    }

    /// When the connection holding the writer lock closes (PostgreSQL restarted), the lock
    /// is taken again at once, not at the next commit: relaying nodes waiting for it give
    /// the writer a moment (`WriterLock.wait`), so an idle writer stays the writer.
    private func watchWriterLock(_ connection: PostgresConnection) {
        connection.closeFuture.whenComplete { [weak self] _ in
            guard let store = self else { return }
            DispatchQueue.global().async {
                guard !store.shared.withLock({ s in s.isShutDown }) else { return }
                do {
                    try store.checkWriterLock()
                } catch {
                    store.logger.error("the writer lock could not be taken again", metadata: ["error": "\(error)"])
                    if let failure = error as? StoreFailure, failure.kind == .superseded { store.onSuperseded?(failure.description) }
                }
            }
        }
    }

    /// After the server restarted, the lock went with the old connection: take it again
    /// before writing (and stop if another process took it meanwhile).
    private func checkWriterLock() throws {
        try relocking.withLock { _ in try takeWriterLockAgainIfLost() }
    }

    private func takeWriterLockAgainIfLost() throws {
        let (holder, shutDown) = shared.withLock { s in (s.lockHolder, s.isShutDown) }
        // A store shut down (the service stopping) let its lock go on purpose: a commit or
        // a follow still running then fails instead of taking the lock, and a new epoch,
        // again.
        if shutDown { throw StoreFailure(.other, "the store \(location) was shut down (the service is stopping)") }
        guard holder == nil || holder!.isClosed else { return }
        logger.warning("the connection holding the writer lock was lost: taking it again", metadata: ["store": "\(location)"])
        if let holder { try? holder.close().wait() }
        shared.withLock { s in s.lockHolder = nil }
        do {
            try takeWriterLock()
        } catch is WriterLockHeld {
            throw StoreFailure(.superseded, supersededReason)
        }
    }

    // MARK: statements

    /// Runs one statement and returns its rows.
    @discardableResult
    func run(_ connection: PostgresConnection, _ sql: String, _ binds: Binds = Binds()) throws -> PostgresQueryResult {
        try wait(for: connection.query(PostgresQuery(unsafeSQL: sql, binds: binds.bindings), logger: logger), on: connection)
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
    func runCommitted(_ connection: PostgresConnection, _ query: PostgresQuery) throws -> PostgresQueryResult {
        let answer = connection.query(query, logger: logger)
        let confirmation = connection.query(PostgresQuery(unsafeSQL: ""), logger: logger)
        let rows = try wait(for: answer, on: connection)
        _ = try wait(for: confirmation, on: connection)
        return rows
    }

    /// Bound values of one statement; `add` returns the placeholder that names each.
    struct Binds {
        var bindings = PostgresBindings()
        private(set) var count = 0

        init() {}

        mutating func add(_ value: Int64) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: Int64?) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: String) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: String?) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: Bool) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: Double) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: [Int64]) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: [String]) -> String {
            bindings.append(value)
            return next()
        }
        mutating func add(_ value: [Int32]) -> String {
            bindings.append(value)
            return next()
        }

        mutating func next() -> String {
            count += 1
            return "$\(count)"
        }
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

    // MARK: migrations

    /// How many search rows a node takes at once (`takeNumbers`): a round trip on the
    /// engine thread every 16,384 messages (with 1,024, 59 of them in the benchmark's
    /// 60,000 sends, under load), and what is left of a block when the node stops is a gap
    /// no larger than a search's first window (`PostgresSearchIndex.firstWindow`). It is
    /// the increment of the sequence `search_row` (`v7-numbers`): changing it is a
    /// migration that alters the sequence.
    static let searchRowBlock: Int64 = 16_384

    /// Named, append-only migrations, applied in order under a transaction-level advisory
    /// lock (two processes starting at once do not both apply one). Never edit one that
    /// has shipped: add the next.
    static let migrations: [(name: String, sql: [String])] = [
        (
            "v1-chatcore",
            [
                """
                CREATE TABLE "user" (
                    "number" bigint PRIMARY KEY,
                    "userId" text NOT NULL UNIQUE,
                    "regId" bigint NOT NULL UNIQUE
                )
                """,
                """
                CREATE TABLE endpoint (
                    id bigint PRIMARY KEY,
                    "user" bigint NOT NULL,
                    description text NOT NULL,
                    nickname text NOT NULL,
                    "isLegacyDelegate" boolean NOT NULL,
                    ordinal bigint NOT NULL
                )
                """,
                #"CREATE INDEX endpoint_by_user ON endpoint("user", ordinal)"#,
                """
                CREATE TABLE chat (
                    "number" bigint PRIMARY KEY,
                    subject text NOT NULL,
                    "isOneToOne" boolean NOT NULL,
                    "invitePolicy" text NOT NULL,
                    "isDefunct" boolean NOT NULL,
                    data text,
                    "lastMessage" bigint NOT NULL,
                    "lastActivity" bigint NOT NULL
                )
                """,
                """
                CREATE TABLE member (
                    chat bigint NOT NULL,
                    "user" bigint NOT NULL,
                    "isActive" boolean NOT NULL,
                    "isAdmin" boolean NOT NULL,
                    "joinedAt" bigint NOT NULL,
                    "leftAt" bigint,
                    "isHidden" boolean NOT NULL,
                    "localData" text,
                    "privateData" text,
                    "deliveredUpTo" bigint NOT NULL,
                    "readUpTo" bigint NOT NULL,
                    "numUnread" bigint NOT NULL,
                    PRIMARY KEY (chat, "user")
                )
                """,
                #"CREATE INDEX member_by_user ON member("user")"#,
                """
                CREATE TABLE message (
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    sender bigint NOT NULL,
                    tag text NOT NULL,
                    content text,
                    data text,
                    "timestamp" bigint NOT NULL,
                    "isControl" boolean NOT NULL,
                    "neverCountsUnread" boolean NOT NULL,
                    "isRecalled" boolean NOT NULL,
                    "changeSeq" bigint NOT NULL,
                    "searchRow" bigint NOT NULL,
                    "thumbName" text,
                    "thumbBlob" text,
                    "fileName" text,
                    "fileBlob" text,
                    "fileSize" bigint,
                    attachment text,
                    PRIMARY KEY (chat, id)
                )
                """,
                #"CREATE INDEX message_by_change ON message(chat, "changeSeq")"#,
                #"CREATE INDEX message_by_tag ON message(chat, tag, id)"#,
                #"CREATE INDEX message_by_search_row ON message("searchRow") WHERE "searchRow" > 0"#,
                """
                CREATE TABLE message_ref (
                    chat bigint NOT NULL,
                    source bigint NOT NULL,
                    tag text NOT NULL,
                    target bigint NOT NULL,
                    PRIMARY KEY (chat, source, tag)
                )
                """,
                #"CREATE INDEX message_ref_by_target ON message_ref(chat, target, tag, source)"#,
                """
                CREATE TABLE message_user (
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    "user" bigint NOT NULL,
                    "localData" text,
                    "isDeleted" boolean NOT NULL,
                    "thumbDetached" boolean NOT NULL,
                    "fileDownloaded" boolean NOT NULL,
                    PRIMARY KEY (chat, id, "user")
                )
                """,
                """
                CREATE TABLE ref_count (
                    chat bigint NOT NULL,
                    target bigint NOT NULL,
                    tag text NOT NULL,
                    count bigint NOT NULL,
                    newest bigint NOT NULL,
                    PRIMARY KEY (chat, target, tag)
                )
                """,
                """
                CREATE TABLE range_change (
                    chat bigint NOT NULL,
                    "lastSeq" bigint NOT NULL,
                    "firstSeq" bigint NOT NULL,
                    "firstId" bigint NOT NULL,
                    "lastId" bigint NOT NULL,
                    PRIMARY KEY (chat, "lastSeq")
                )
                """,
                "CREATE TABLE blob (hash text PRIMARY KEY, uses bigint NOT NULL)",
                "CREATE TABLE counter (name text PRIMARY KEY, value bigint NOT NULL)",
                #"INSERT INTO counter (name, value) VALUES ('changeSeq', 0), ('searchRow', 0)"#
            ]
        ),
        (
            "v2-writer-address",
            [
                // Where the node holding the writer lock accepts connections (other nodes
                // relay theirs there).
                "CREATE TABLE writer_node (id int PRIMARY KEY CHECK (id = 1), address text NOT NULL, since timestamptz NOT NULL DEFAULT now())"
            ]
        ),
        (
            "v3-writer-epoch",
            [
                // Each writer takes the next epoch; its commits check it (see the type's doc).
                "CREATE TABLE writer_epoch (id int PRIMARY KEY CHECK (id = 1), epoch bigint NOT NULL, since timestamptz NOT NULL DEFAULT now())",
                "INSERT INTO writer_epoch (id, epoch) VALUES (1, 0)",
                // FOR SHARE, not FOR KEY SHARE: the increment (an UPDATE of a non-key column)
                // must wait for the commits holding it.
                """
                CREATE FUNCTION chatcore_fence(expected bigint) RETURNS void LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM 1 FROM writer_epoch WHERE id = 1 AND epoch = expected FOR SHARE;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'another chatcore process became the writer (epoch % is not the current one)', expected
                            USING ERRCODE = 'CCW01';
                    END IF;
                END
                $$
                """,
                // The writer's heartbeat (a row of its own: beats must not wait for commits).
                "CREATE TABLE writer_beat (id int PRIMARY KEY CHECK (id = 1), node text NOT NULL, epoch bigint NOT NULL, beat timestamptz NOT NULL)"
            ]
        ),
        (
            "v4-node-credential",
            [
                // What a node relaying its standard input/output session to the writer shows
                // it (made by each writer when it advertises; see `advertise`).
                "ALTER TABLE writer_node ADD COLUMN credential text NOT NULL DEFAULT ''"
            ]
        ),
        (
            "v5-search-in-the-database",
            [
                // The search index, written in each commit (`PostgresSearchIndex`): a row per
                // searchable message with its keys (`SearchText.keys`), found through GIN.
                """
                CREATE TABLE message_search (
                    chat bigint NOT NULL,
                    id bigint NOT NULL,
                    "searchRow" bigint NOT NULL,
                    keys int4[] NOT NULL,
                    PRIMARY KEY (chat, id)
                )
                """,
                "CREATE INDEX message_search_by_key ON message_search USING gin (keys)",
                // Searches read the newest rows first, a window of search rows at a time.
                #"CREATE INDEX message_search_by_row ON message_search ("searchRow")"#,
                // Messages up to `searchIndexFrom` (those of a store from before this
                // migration) are added by the index's refill, which has got as far as
                // `searchIndexUpTo`; later ones are added by their commits.
                #"INSERT INTO counter (name, value) SELECT 'searchIndexFrom', value FROM counter WHERE name = 'searchRow'"#,
                #"INSERT INTO counter (name, value) VALUES ('searchIndexUpTo', 0)"#
            ]
        ),
        (
            "v6-chat-versions",
            [
                // Each chat's version (`StoreBatch.chatVersions`), in a table of its own: a
                // commit's clauses may not touch one row twice, and the chat's row is written
                // by another clause. A chat the store does not have yet is at 0.
                "CREATE TABLE chat_version (chat bigint PRIMARY KEY, version bigint NOT NULL)",
                #"INSERT INTO chat_version (chat, version) SELECT "number", 1 FROM chat"#,
                // Moves each chat on from the version the commit was decided on, or raises
                // `CCC01` (the commit conflicts) when another commit moved one first. The
                // UPDATE takes the rows' locks: a commit on the same chat from another node
                // waits for this one, then finds the version moved.
                """
                CREATE FUNCTION chatcore_claim(chats bigint[], expected bigint[]) RETURNS void LANGUAGE plpgsql AS $$
                DECLARE
                    moved bigint;
                    made bigint;
                BEGIN
                    UPDATE chat_version v SET version = v.version + 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE v.chat = c.chat AND v.version = c.version AND c.version > 0;
                    GET DIAGNOSTICS moved = ROW_COUNT;
                    INSERT INTO chat_version (chat, version) SELECT c.chat, 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE c.version = 0 ON CONFLICT (chat) DO NOTHING;
                    GET DIAGNOSTICS made = ROW_COUNT;
                    IF moved + made <> cardinality(chats) THEN
                        RAISE EXCEPTION 'another chatcore node committed first to a chat this commit changes' USING ERRCODE = 'CCC01';
                    END IF;
                END
                $$
                """
            ]
        ),
        (
            "v7-numbers",
            [
                // New chats' and users' numbers, and search rows (`takeNumbers`): deciding
                // nodes that numbered them from memory would take the same ones. Each sequence
                // goes on after the highest number stored. The search rows' moves on by a block
                // at a time, and its last value replaces the counter `searchRow`, which every
                // commit of every node would otherwise write.
                "CREATE SEQUENCE chat_number AS bigint",
                #"SELECT setval('chat_number', coalesce((SELECT max("number") FROM chat), 0) + 1, false)"#,
                "CREATE SEQUENCE user_number AS bigint",
                #"SELECT setval('user_number', coalesce((SELECT max("number") FROM "user"), 0) + 1, false)"#,
                // INCREMENT BY is `searchRowBlock`, written out: a migration's text never changes.
                "CREATE SEQUENCE search_row AS bigint MINVALUE 0 INCREMENT BY 16384",
                #"SELECT setval('search_row', greatest((SELECT value FROM counter WHERE name = 'searchRow'), (SELECT coalesce(max("searchRow"), 0) FROM message)))"#,
                "DELETE FROM counter WHERE name = 'searchRow'"
            ]
        ),
        (
            "v8-claims-in-chat-order",
            [
                // v6's claim locked the version rows in whatever order its plan read them, so
                // two commits claiming overlapping chats in different orders could each hold
                // one the other waits for, until PostgreSQL broke the deadlock after
                // `deadlock_timeout` (a second). Locking them in chat order first, every commit
                // waits only for commits that hold a lower chat, never in a circle; a row
                // another commit moved on while this one waited is then found moved (each
                // statement of the function reads what is committed when it starts).
                """
                CREATE OR REPLACE FUNCTION chatcore_claim(chats bigint[], expected bigint[]) RETURNS void LANGUAGE plpgsql AS $$
                DECLARE
                    moved bigint;
                    made bigint;
                BEGIN
                    PERFORM 1 FROM chat_version WHERE chat = ANY(chats) ORDER BY chat FOR UPDATE;
                    UPDATE chat_version v SET version = v.version + 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE v.chat = c.chat AND v.version = c.version AND c.version > 0;
                    GET DIAGNOSTICS moved = ROW_COUNT;
                    INSERT INTO chat_version (chat, version) SELECT c.chat, 1 FROM unnest(chats, expected) AS c(chat, version)
                        WHERE c.version = 0 ORDER BY c.chat ON CONFLICT (chat) DO NOTHING;
                    GET DIAGNOSTICS made = ROW_COUNT;
                    IF moved + made <> cardinality(chats) THEN
                        RAISE EXCEPTION 'another chatcore node committed first to a chat this commit changes' USING ERRCODE = 'CCC01';
                    END IF;
                END
                $$
                """
            ]
        ),
        (
            "v9-all-nodes-decide",
            [
                // What each deciding node's commits changed, for the others to follow
                // (`othersActivity`; docs/several-deciding-nodes.md): one row per commit,
                // numbered in commit order per slot, kept a minute (`trimFollowed`).
                """
                CREATE TABLE node_commit (
                    "number" bigserial PRIMARY KEY, slot int NOT NULL, at timestamptz NOT NULL DEFAULT now(), "feedUpTo" bigint NOT NULL,
                    chats bigint[] NOT NULL, users bigint[] NOT NULL, "rewrittenChat" bigint[] NOT NULL, "rewrittenId" bigint[] NOT NULL,
                    "insertedChat" bigint[] NOT NULL, "insertedId" bigint[] NOT NULL, "memberChat" bigint[] NOT NULL, "memberUser" bigint[] NOT NULL)
                """,
                "CREATE INDEX node_commit_slot ON node_commit (slot, \"number\")",
                "CREATE INDEX node_commit_at ON node_commit (at)",
                // Per slot, the last row trimmed: a follower that had not read it fell behind.
                "CREATE TABLE node_commit_trimmed (slot int PRIMARY KEY, \"upTo\" bigint NOT NULL)",
                // Who has a session on the node of each slot.
                "CREATE TABLE node_online (slot int NOT NULL, \"user\" bigint NOT NULL, PRIMARY KEY (slot, \"user\"))",
                // Typing and chat events (never stored otherwise), kept a minute.
                """
                CREATE TABLE node_event (
                    "number" bigserial PRIMARY KEY, slot int NOT NULL, at timestamptz NOT NULL DEFAULT now(), kind text NOT NULL,
                    "user" bigint NOT NULL, chat bigint NOT NULL, tag text, data text)
                """,
                // Each feed slot's epoch: a node taking a slot moves it on, and the commits of
                // a node that lost its slot fail (`CCW01`), as a writer's do after a takeover.
                "CREATE TABLE slot_epoch (slot int PRIMARY KEY, epoch bigint NOT NULL)",
                "INSERT INTO slot_epoch (slot, epoch) SELECT s, 0 FROM generate_series(0, 7) s",
                """
                CREATE FUNCTION chatcore_slot_fence(which int, expected bigint) RETURNS void LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM 1 FROM slot_epoch WHERE slot = which AND epoch = expected FOR SHARE;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'another chatcore node took feed slot % (epoch % is not the current one)', which, expected
                            USING ERRCODE = 'CCW01';
                    END IF;
                END
                $$
                """
            ]
        ),
        (
            "v10-notify-followers",
            [
                // Every deciding node listens on chatcore_follow (`listenIfDeaf`) and reads the
                // others' doings when told of them, instead of looking every few milliseconds:
                // "c" and the slot for a commit, "t" and the slot for who is connected or a
                // transient event (one notification per transaction and payload).
                """
                CREATE FUNCTION chatcore_notify_followers() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF TG_OP = 'DELETE' THEN
                        PERFORM pg_notify('chatcore_follow', TG_ARGV[0] || OLD.slot::text);
                    ELSE
                        PERFORM pg_notify('chatcore_follow', TG_ARGV[0] || NEW.slot::text);
                    END IF;
                    RETURN NULL;
                END
                $$
                """,
                "CREATE TRIGGER node_commit_notifies AFTER INSERT ON node_commit FOR EACH ROW EXECUTE FUNCTION chatcore_notify_followers('c')",
                "CREATE TRIGGER node_online_notifies AFTER INSERT OR DELETE ON node_online FOR EACH ROW EXECUTE FUNCTION chatcore_notify_followers('t')",
                "CREATE TRIGGER node_event_notifies AFTER INSERT ON node_event FOR EACH ROW EXECUTE FUNCTION chatcore_notify_followers('t')",
                // Each slot's events after a number, by the index (as node_commit_slot for commits).
                "CREATE INDEX node_event_slot ON node_event (slot, \"number\")"
            ]
        ),
        (
            "v11-no-credential-in-the-database",
            [
                // v4's credential made a session of any user for whoever read it (any role
                // that could SELECT writer_node, or saw a relay's first line): it is blanked
                // and never written again (the column stays, empty, for nodes of an older
                // release, whose relayed --user sessions are then refused). Nodes vouch for
                // relayed users with a key given to them out of band (--node-key-file); the
                // writer advertises only a random value of its own, to which their tokens
                // are bound.
                "ALTER TABLE writer_node ADD COLUMN instance text NOT NULL DEFAULT ''",
                "UPDATE writer_node SET credential = ''"
            ]
        )
    ]

    /// Says where this node (the writer) accepts connections, for the other nodes, and
    /// its `instance`: a random value, not a secret, to which the tokens of nodes relaying
    /// a trusted standard input/output session here are bound (empty: this writer accepts
    /// none, it has no node key).
    public func advertise(_ address: String, instance: String) throws {
        try withConnection { connection in
            var binds = Binds()
            try runCommitted(
                connection,
                PostgresQuery(
                    unsafeSQL: """
                        INSERT INTO writer_node (id, address, instance, since) VALUES (1, \(binds.add(address)), \(binds.add(instance)), now())
                        ON CONFLICT (id) DO UPDATE SET address = EXCLUDED.address, instance = EXCLUDED.instance, since = EXCLUDED.since
                        """, binds: binds.bindings))
        }
    }

    /// The writer lock of a database, taken by a node that waited for it (`wait`), and
    /// where the writer is meanwhile (`writerAddress`).
    public final class WriterLock: Sendable {
        let connection: PostgresConnection

        private init(connection: PostgresConnection) {
            self.connection = connection
        }

        /// Blocks until this process holds the writer lock: the writer stopped or died
        /// (PostgreSQL releases a session's lock when its connection ends), or it has not
        /// said it is alive (`writer_beat`) for `takeoverAfter` seconds — its machine is
        /// gone, the process stopped, the network cut it off — and this node ends the
        /// writer's sessions (by its `application_name`), which releases the lock and
        /// rolls back what it had in flight. The epoch fences that writer if it wakes.
        /// A connection lost while waiting (PostgreSQL restarted) is made again and the
        /// wait goes on: a relaying node outlives a restart of the database.
        public static func wait(location: Location, logger: Logger, takeoverAfter: Double = 10) throws -> WriterLock {
            var lost = false
            while true {
                let connection = try PostgresStore.connect(location, id: 1_000_000, patience: .seconds(3600), logger: logger)
                if lost {
                    // The server restarted: the writer takes its lock again at once;
                    // asking now could take it from a writer that is alive.
                    Thread.sleep(forTimeInterval: 2)
                }
                do {
                    while true {
                        let taken = try ask(connection, PostgresQuery(unsafeSQL: "SELECT pg_try_advisory_lock(\(PostgresStore.writerLockKey))"), logger: logger)
                        if try taken.first?.decode(Bool.self) == true { return WriterLock(connection: connection) }
                        try endSilentWriter(connection, after: takeoverAfter, logger: logger)
                        Thread.sleep(forTimeInterval: 0.2)
                    }
                } catch {
                    try? connection.close().wait()
                    lost = true
                    logger.warning(
                        "lost the connection waiting for the writer lock: waiting again",
                        metadata: ["store": "\(location)", "error": "\(PostgresStore.describe(error))"])
                    Thread.sleep(forTimeInterval: 0.2)
                }
            }
        }

        /// One statement of the waiting connection, which fails (instead of waiting for
        /// ever) when the connection closes under it (PostgreSQL restarted).
        private static func ask(_ connection: PostgresConnection, _ query: PostgresQuery, logger: Logger) throws -> PostgresQueryResult {
            try PostgresStore.wait(for: connection.query(query, logger: logger), on: connection, patience: .seconds(60))
        }

        /// Ends the sessions of a writer whose last beat is more than `seconds` old (by
        /// the server's clock, the same for every node). Nothing when the database has no
        /// beat yet (a new store, or one of an older release being migrated).
        private static func endSilentWriter(_ connection: PostgresConnection, after seconds: Double, logger: Logger) throws {
            var binds = Binds()
            let query = PostgresQuery(
                unsafeSQL: """
                    SELECT node, extract(epoch FROM now() - beat)::float8 FROM writer_beat
                    WHERE id = 1 AND now() - beat > make_interval(secs => \(binds.add(seconds)))
                    """, binds: binds.bindings)
            guard let rows = try? ask(connection, query, logger: logger), let row = rows.first else { return }
            let (node, silent) = try row.decode((String, Double).self)
            var named = Binds()
            let ended = try ask(
                connection,
                PostgresQuery(
                    unsafeSQL: """
                        SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
                        WHERE application_name = \(named.add(node)) AND pid <> pg_backend_pid()
                        """, binds: named.bindings), logger: logger)
            let count = try ended.first?.decode(Int64.self) ?? 0
            if count > 0 {
                logger.warning(
                    "the writer has not said it is alive: ending its sessions to take over",
                    metadata: ["writer": "\(node)", "silentSeconds": "\(Int(silent))", "sessionsEnded": "\(count)"])
            }
        }

        /// Where the writer accepts connections now, as it advertised (nil: none yet, or
        /// the database cannot be read).
        public static func writerAddress(location: Location, logger: Logger) -> String? {
            // The instance's column exists only once a writer of this release migrated
            // the database: not asked for here.
            try? advertised("address", location: location, logger: logger)?.decode(String.self)
        }

        /// Where the writer accepts connections now and its instance, to which node
        /// tokens for relayed standard input/output sessions are bound, as it advertised
        /// (nil: none yet, or the database cannot be read).
        public static func writer(location: Location, logger: Logger) -> (address: String, instance: String)? {
            try? advertised("address, instance", location: location, logger: logger)?.decode((String, String).self)
        }

        /// The `columns` of what the writer advertised (`advertise`), read on a connection
        /// of its own.
        private static func advertised(_ columns: String, location: Location, logger: Logger) -> PostgresRow? {
            guard let connection = try? PostgresStore.connect(location, id: 1_000_001, patience: .seconds(5), logger: logger) else { return nil }
            defer { try? connection.close().wait() }
            // The table exists once a writer migrated the database.
            let query = PostgresQuery(unsafeSQL: "SELECT \(columns) FROM writer_node WHERE id = 1")
            return (try? PostgresStore.wait(for: connection.query(query, logger: logger), on: connection, patience: connectionPatience))?.first
        }
    }

    func migrate(_ connection: PostgresConnection) throws {
        try run(connection, "BEGIN")
        try run(connection, "SELECT pg_advisory_xact_lock(\(PostgresStore.writerLockKey + 1))")
        try run(connection, "CREATE TABLE IF NOT EXISTS chatcore_migration (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
        let applied = Set(try run(connection, "SELECT name FROM chatcore_migration").map { try $0.decode(String.self) })
        for migration in PostgresStore.migrations where !applied.contains(migration.name) {
            logger.info("applying a store migration", metadata: ["migration": "\(migration.name)"])
            for statement in migration.sql { try run(connection, statement) }
            var binds = Binds()
            try run(connection, "INSERT INTO chatcore_migration (name) VALUES (\(binds.add(migration.name)))", binds)
        }
        try run(connection, "COMMIT")
    }
}
