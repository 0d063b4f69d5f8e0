import ArgumentParser
import Attachments
import ChatEngine
import ChatMetrics
import ChatServer
import ChatSession
import Dispatch
import Foundation
import Logging
import Metrics
import NIOCore
import NIOPosix
import PostgresStorage
import Prometheus
import SQLiteStorage
import ServiceLifecycle
import Storage
import Threads

#if canImport(Glibc)
    import Glibc
#endif

/// `chatcore serve`: the long-running service.
struct Serve: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Run the service on standard input/output and/or sockets.",
        discussion: """
            Standard input/output is one session. It is served when --user is given (the session \
            is then already authenticated as that user: the spawning parent is trusted) or when no \
            --listen is given (the session must send authToken). At the end of standard input every \
            answer is written and, unless sockets are being served, the process exits 0.

            Each --listen accepts connections, one session each, all sharing one store. Socket \
            sessions authenticate with authToken: JWTs signed with --auth-secret-file (see \
            `chatcore token`), or any token with --insecure-no-auth (loopback and Unix sockets only).
            """
    )

    @Option(name: .long, help: "Serve standard input/output as this user, already authenticated.")
    var user: String?

    @Option(name: .long, help: ArgumentHelp("Accept connections at HOST:PORT (TCP; [::1]:PORT for IPv6) or unix:PATH. Repeatable.", valueName: "address"))
    var listen: [String] = []

    @Option(
        name: .long,
        help: ArgumentHelp("Where the store lives (created if missing). Default: $XDG_DATA_HOME/chatcore, else ~/.local/share/chatcore.", valueName: "dir"))
    var dataDir: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Keep everything in this PostgreSQL database instead of SQLite in --data-dir: postgres://USER@HOST[:PORT]/DATABASE[?sslmode=MODE&sslrootcert=CA_FILE] (libpq's modes; default prefer), or postgres://USER@/DATABASE?host=SOCKET_DIR. No password here: --store-password-file or PGPASSWORD.",
            valueName: "url"))
    var store: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres: the address other nodes relay their connections to while this node is the writer (HOST:PORT or unix:PATH). Default: the first --listen as bound (127.0.0.1 for 0.0.0.0). Without --listen the node listens on 127.0.0.1 on a free port for the sessions of other nodes on this machine, and advertises that.",
            valueName: "address"))
    var advertise: String?

    @Flag(
        name: .long,
        help:
            "With --store postgres: every node decides for its own sessions, following the others' commits, instead of relaying its connections to the writer. Give it to every node of the database (experimental: docs/several-deciding-nodes.md)."
    )
    var allNodesDecide = false

    @Option(name: .long, help: ArgumentHelp("A file holding the PostgreSQL password of --store (trailing whitespace removed).", valueName: "file"))
    var storePasswordFile: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres, on a node waiting to be the writer: take over from a writer that has not said it is alive (it does every second) for this long, ending its database sessions. At least 3.",
            valueName: "seconds"))
    var writerTimeout: Double = 10

    @Option(name: .long, help: ArgumentHelp("A file whose bytes, as they are (at least 32), are the HMAC key for authToken JWTs (HS256).", valueName: "file"))
    var authSecretFile: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "A JWKS file (JSON Web Key Set): authToken JWTs signed RS256 or ES256 by one of its keys are accepted. Read again on SIGHUP. Give --auth-audience with it.",
            valueName: "file"))
    var authJwks: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "A token's 'aud' must name this (the identity provider's name for this service): other applications of the same provider cannot sign in here. Without it, --auth-jwks starts with a warning.",
            valueName: "audience"))
    var authAudience: String?

    @Option(name: .long, help: ArgumentHelp("A token's 'iss' must be this (the identity provider).", valueName: "issuer"))
    var authIssuer: String?

    @Option(name: .long, help: ArgumentHelp("Seconds by which a token's exp, nbf and iat may be off this machine's clock.", valueName: "seconds"))
    var authLeeway: Double = TokenPolicy.defaultLeeway

    @Option(name: .long, help: ArgumentHelp("A token valid for longer than this (exp from iat) is refused.", valueName: "seconds"))
    var authMaxLifetime: Double = TokenPolicy.defaultMaxLifetime

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres: a file whose bytes (at least 32) every node of the database is given, never stored in it. A node relaying its standard input/output session (--user) to the writer vouches for its user with it.",
            valueName: "file"))
    var nodeKeyFile: String?

    @Flag(name: .long, help: "Accept any authToken. Refuses to listen on anything but loopback addresses and Unix sockets.")
    var insecureNoAuth = false

    @Option(
        name: .long,
        help: ArgumentHelp(
            "The only directory socket sessions may attach files from (after resolving links). Without it they attach nothing; standard input/output may name any readable file.",
            valueName: "dir"))
    var attachmentsDir: String?

    @Option(name: .long, help: "A longer line is skipped without being buffered and answered with TooLarge.")
    var maxLineBytes: Int = 1 << 20

    @Option(name: .long, help: "Requests of one session that may wait in the engine before its input is paused.")
    var maxRequestsInFlight: Int = 1024

    @Option(name: .long, help: "Unread output of a socket session above which its input is paused.")
    var outputHighWater: Int = 1 << 20

    @Option(name: .long, help: "Unread output of a socket session above which it is disconnected.")
    var maxOutputBytes: Int = 64 << 20

    @Option(
        name: .long,
        help:
            "Unread output of all socket sessions together above which a session behind by more than its share (this over the sessions open, at least --output-high-water) is disconnected when more is written to it. Default: 4 × --max-output-bytes."
    )
    var maxOutputTotal: Int?

    @Option(name: .long, help: "Bytes of unfinished lines all socket sessions together may hold; the line that would go over is refused (TooLarge).")
    var maxInputTotal: Int = 256 << 20

    @Option(
        name: .long, help: "Socket connections open at once; further ones are closed when accepted. Lowered to what the file descriptor limit leaves room for.")
    var maxSessions: Int = 10_000

    @Option(name: .long, help: ArgumentHelp("Close a socket connection that sends nothing for this many seconds (0: never).", valueName: "seconds"))
    var idleTimeout: Int = 0

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Close a socket connection whose authToken has not been accepted this many seconds after it connected, or after its token expired (0: never).",
            valueName: "seconds"))
    var authTimeout: Int = 60

    @Option(name: .long, help: ArgumentHelp("Serve Prometheus metrics at http://ADDR/metrics (HOST:PORT).", valueName: "ADDR"))
    var metrics: String?

    @Option(name: .long, help: ArgumentHelp("Memory for messages kept in memory (the hot ones; the store has them all), in MiB.", valueName: "MiB"))
    var cacheMb: Int = Engine.defaultCacheBytes >> 20

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Requests of one user per second, with a burst of ten seconds' worth; past it they are refused (RateLimited). 0: no limit.", valueName: "n"))
    var maxRequestsPerSecond: Double = QuotaLimits().requestsPerSecond

    @Option(name: .long, help: ArgumentHelp("Chats one user may start per minute (the minute's worth at once). 0: no limit.", valueName: "n"))
    var maxChatsPerMinute: Double = QuotaLimits().chatsPerMinute

    @Option(name: .long, help: ArgumentHelp("Users one user's invitations may make per minute (invitees chatcore did not know). 0: no limit.", valueName: "n"))
    var maxNewUsersPerMinute: Double = QuotaLimits().newUsersPerMinute

    @Option(
        name: .long,
        help: ArgumentHelp("Chat events and typing notices of one user per second, with a burst of ten seconds' worth. 0: no limit.", valueName: "n"))
    var maxEventsPerSecond: Double = QuotaLimits().eventsPerSecond

    @Option(name: .long, help: ArgumentHelp("Candidates one search checks at most; past it, it answers what it found, marked incomplete.", valueName: "n"))
    var maxSearchCandidates: Int = SearchBudget.defaultCandidates

    @Option(
        name: .long, help: ArgumentHelp("Bytes of text one search checks at most; past it, it answers what it found, marked incomplete.", valueName: "bytes"))
    var maxSearchBytes: Int = SearchBudget.defaultBytes

    @Option(
        name: .long,
        help: "Endpoints one user may have at once: registered ones (endpointUpdate) and connected sessions. A session past it waits in setupState Full.")
    var maxEndpoints: Int = 100

    @Option(name: .long, help: "trace, debug, info, notice, warning, error or critical. Logs go to standard error.")
    var logLevel: Logger.Level = .info

    /// `--max-output-total`, or four times `--max-output-bytes` (at most `Int.max`).
    var outputTotalLimit: Int {
        if let maxOutputTotal { return maxOutputTotal }
        let (four, overflow) = maxOutputBytes.multipliedReportingOverflow(by: 4)
        return overflow ? .max : four
    }

    func validate() throws {
        if let user, user.isEmpty || user.utf8.count > 128 { throw ValidationError("--user must be 1 to 128 bytes") }
        guard maxLineBytes > 0 else { throw ValidationError("--max-line-bytes must be positive") }
        guard maxRequestsInFlight > 0 else { throw ValidationError("--max-requests-in-flight must be positive") }
        guard maxSessions > 0 else { throw ValidationError("--max-sessions must be positive") }
        guard maxInputTotal > 0 else { throw ValidationError("--max-input-total must be positive") }
        for (value, flag) in [
            (maxRequestsPerSecond, "--max-requests-per-second"), (maxChatsPerMinute, "--max-chats-per-minute"),
            (maxNewUsersPerMinute, "--max-new-users-per-minute"), (maxEventsPerSecond, "--max-events-per-second")
        ] {
            guard value >= 0, value.isFinite else { throw ValidationError("\(flag) must be 0 (no limit) or positive") }
        }
        guard maxSearchCandidates > 0, maxSearchBytes > 0 else { throw ValidationError("--max-search-candidates and --max-search-bytes must be positive") }
        guard maxEndpoints > 0 else { throw ValidationError("--max-endpoints must be positive") }
        // Past 1 TiB, MiB to bytes would lose high bits (2^44 MiB became 0: no cache).
        guard cacheMb >= 0, cacheMb <= 1 << 20 else { throw ValidationError("--cache-mb must be 0 to 1048576 (1 TiB)") }
        guard idleTimeout >= 0 else { throw ValidationError("--idle-timeout must not be negative") }
        guard authTimeout >= 0 else { throw ValidationError("--auth-timeout must not be negative") }
        guard writerTimeout >= 3, writerTimeout <= 86_400 else {
            throw ValidationError("--writer-timeout must be 3 to 86400 seconds (the writer beats every second)")
        }
        guard outputHighWater > 0, maxOutputBytes >= outputHighWater else {
            throw ValidationError("--max-output-bytes must be at least --output-high-water, which must be positive")
        }
        if let maxOutputTotal, maxOutputTotal < outputHighWater {
            throw ValidationError("--max-output-total must be at least --output-high-water")
        }
        if (authSecretFile != nil || authJwks != nil) && insecureNoAuth {
            throw ValidationError("--insecure-no-auth accepts any token: it excludes --auth-secret-file and --auth-jwks")
        }
        guard authLeeway >= 0, authLeeway <= 600 else { throw ValidationError("--auth-leeway must be 0 to 600 seconds") }
        guard authMaxLifetime > 0 else { throw ValidationError("--auth-max-lifetime must be positive") }
        for text in listen {
            guard let address = ListenAddress(text) else {
                throw ValidationError("--listen \(text): expected HOST:PORT or unix:PATH")
            }
            if insecureNoAuth && !address.isLoopbackOnly() {
                throw ValidationError("--insecure-no-auth refuses to listen on \(text): only loopback addresses and Unix sockets")
            }
        }
        if let metrics {
            guard case .tcp? = ListenAddress(metrics) else { throw ValidationError("--metrics \(metrics): expected HOST:PORT") }
        }
        if store != nil, advertise == nil, let first = listen.first, case .tcp(let host, _)? = ListenAddress(first), host == "0.0.0.0" || host == "::" {
            // It would be advertised as loopback: a node on another machine configured the
            // same way would relay every connection to itself.
            throw ValidationError(
                "--listen \(first) with --store needs --advertise HOST:PORT, the address other nodes reach this one at (a wildcard listener would be advertised as loopback, where a node on another machine reaches only itself)"
            )
        }
        if !listen.isEmpty && authSecretFile == nil && authJwks == nil && !insecureNoAuth {
            throw ValidationError("sockets need --auth-secret-file or --auth-jwks (or --insecure-no-auth on loopback): no one could authenticate")
        }
    }

    func run() async throws {
        signal(SIGPIPE, SIG_IGN)
        LoggingSystem.bootstrap { label in
            var handler = StreamLogHandler.standardError(label: label)
            handler.logLevel = logLevel
            return handler
        }
        let logger = Logger(label: "chatcore")
        // Before anything is counted: metrics are made on first use.
        let registry: PrometheusCollectorRegistry? = metrics == nil ? nil : PrometheusCollectorRegistry()
        if let registry {
            var factory = PrometheusMetricsFactory(registry: registry)
            factory.valueHistogramBuckets = ServiceMetrics.valueBuckets
            factory.durationHistogramBuckets = ServiceMetrics.durationBuckets
            MetricsSystem.bootstrap(factory)
            ServiceMetrics.register()
        }

        if authJwks != nil && authAudience == nil {
            // Every application of an identity provider gets tokens signed by its keys:
            // without the audience, any of them signs its users in here. Refusing to start
            // would break every deployment configured before the flag existed: it is said.
            logger.warning(
                "--auth-jwks without --auth-audience: a token the identity provider made for any of its applications signs in here; give --auth-audience (the 'aud' it puts in tokens for this service)"
            )
        }
        let authenticator: Authenticator
        if authSecretFile != nil || authJwks != nil {
            var secret: [UInt8]?
            if let authSecretFile {
                do {
                    secret = try Authenticator.loadSecret(path: authSecretFile)
                } catch {
                    throw ValidationError("cannot read --auth-secret-file: \(error)")
                }
                Serve.warnIfOthersMayRead(authSecretFile, what: "--auth-secret-file: whoever reads it can sign in as any user", logger: logger)
            }
            do {
                authenticator = try await Authenticator(
                    mode: .keys(secret: secret, jwksPath: authJwks),
                    policy: TokenPolicy(audience: authAudience, issuer: authIssuer, leeway: authLeeway, maxLifetime: authMaxLifetime))
            } catch {
                throw ValidationError(authSecretFile != nil && authJwks == nil ? "--auth-secret-file: \(error)" : "\(error)")
            }
        } else {
            authenticator = try await Authenticator(mode: insecureNoAuth ? .insecure : .unconfigured)
        }

        var nodeKey: NodeKey?
        if let nodeKeyFile {
            do {
                nodeKey = try NodeKey.load(path: nodeKeyFile)
            } catch {
                throw ValidationError("--node-key-file: \(error)")
            }
            Serve.warnIfOthersMayRead(nodeKeyFile, what: "--node-key-file: whoever reads it can relay a session as any user", logger: logger)
            if case .keys(let secret?, _) = authenticator.mode, nodeKey!.isKey(secret) {
                throw ValidationError("--node-key-file and --auth-secret-file must differ: the node key is for nodes only")
            }
        }

        let directory = URL(fileURLWithPath: try dataDir ?? Serve.defaultDataDirectory(), isDirectory: true)
        // Metrics are served from the start, while this node waits for the store or
        // relays to the node that decides too (`chatcore_deciding`).
        // The metrics and the sockets share one group of event loops, made for the first.
        let loops = EventLoops(threads: listen.isEmpty ? 1 : System.coreCount)
        var services: [ServiceGroupConfiguration.ServiceConfiguration] = []
        if let registry, let metrics, case .tcp(let host, let port)? = ListenAddress(metrics) {
            let endpoint = MetricsEndpoint(registry: registry) {
                ServiceMetrics.storeBytes.record(Serve.bytes(in: directory))
            }
            do {
                let channel = try await endpoint.bind(host: host, port: port, group: loops.group)
                services.append(.init(service: MetricsService(channel: channel)))
                logger.info(
                    "serving metrics",
                    metadata: [
                        "address": "\(metrics)", "bound": "\(channel.localAddress.map { "\($0)" } ?? metrics)",
                        "port": "\(channel.localAddress?.port ?? port)"
                    ])
            } catch {
                logger.critical("cannot serve metrics", metadata: ["address": "\(metrics)", "error": "\(error)"])
                throw ExitCode(1)
            }
        }
        // The node runs from inside the group, so that SIGTERM and SIGINT stop it cleanly
        // from the store's opening on (a signal that comes while it starts stops it once
        // it can). Not first thing: with the signals trapped before the authenticator's
        // set-up, ASan builds stalled 30 s at times in transcripts.
        services.append(.init(service: KeyReloadService(authenticator: authenticator, logger: logger)))
        let stop = StopState()
        let node = NodeService(
            serve: self, authenticator: authenticator, nodeKey: nodeKey, directory: directory, loops: loops, stop: stop, logger: logger)
        services.append(.init(service: node, successTerminationBehavior: .gracefullyShutdownGroup, failureTerminationBehavior: .gracefullyShutdownGroup))
        let group = ServiceGroup(configuration: .init(services: services, gracefulShutdownSignals: [.sigterm, .sigint], logger: logger))
        try await group.run()
        if stop.exitCode != 0 { throw ExitCode(stop.exitCode) }
    }

    /// How often a node that follows the other deciding nodes looks at what they did when
    /// it has nothing else to do (before each batch it always does), when the store cannot
    /// tell it when they did something; and when it can (PostgreSQL's notifications), for
    /// when its connection for them broke until it is made again.
    static let followInterval = Duration.milliseconds(5)
    static let followIntervalWhenTold = Duration.milliseconds(50)

    /// This node's standard input/output session, relayed to the writer of the shared
    /// store (which may still be starting: its address is awaited for
    /// `FollowerProxy.writerPatience`). Returns the exit code: 0 once the input ended and
    /// the writer answered all of it, 1 when the writer went first (the session is over:
    /// its client starts chatcore again, which then serves by itself or relays to the
    /// next writer).
    func relayStandardIO(_ location: PostgresStore.Location, nodeKey: NodeKey?, logger: Logger) async -> Int32 {
        if user != nil && nodeKey == nil {
            logger.critical(
                "another node is the writer of the store: relaying a session started as --user to it needs --node-key-file (the same file on every node)")
            return 1
        }
        let deadline = ContinuousClock.now + .nanoseconds(FollowerProxy.writerPatience.nanoseconds)
        var relay: StdioRelay?
        var problem = "no writer has said where it accepts connections"
        while relay == nil {
            if let writer = PostgresStore.WriterLock.writer(location: location, logger: logger) {
                if let address = ListenAddress(writer.address) {
                    if user != nil && writer.instance.isEmpty {
                        logger.critical(
                            "the writer node was started without --node-key-file: it accepts no session relayed as a --user; give every node the same --node-key-file"
                        )
                        return 1
                    }
                    let first = user.map { StdioRelay.trustedStart(user: $0, token: nodeKey!.vouch(for: $0, to: writer.instance)) } ?? []
                    do {
                        relay = try StdioRelay(to: address, first: first, logger: logger)
                        logger.info("another node is the writer of the store: relaying standard input/output to it", metadata: ["writer": "\(address)"])
                    } catch {
                        problem = "\(error)"
                    }
                } else {
                    problem = "the writer advertised an address that is not one: \(writer.address)"
                }
            }
            if relay == nil {
                guard ContinuousClock.now < deadline else {
                    logger.critical("another node is the writer of the store, and it cannot be reached: \(problem)", metadata: ["store": "\(location)"])
                    return 1
                }
                try? await Task.sleep(for: .milliseconds(200))
            }
        }
        guard let relay else { return 1 }
        // At a stop, the writer answers what it was sent, within the flush deadline.
        let outcome = OneShot<StdioRelay.Outcome?>()
        let ended = await withGracefulShutdownHandler {
            await outcome.wait {
                Thread {
                    nameCurrentThread("relay")
                    outcome.resume(relay.run())
                }.start()
            }
        } onGracefulShutdown: {
            logger.info("stopping: the writer answers what it was sent")
            relay.endInput()
            Task {
                try? await Task.sleep(for: .seconds(StopState.flushSeconds))
                outcome.resume(nil)
            }
        }
        switch ended {
        case .answered?, .outputClosed?, nil:
            return 0
        case .writerGone?:
            logger.critical("the writer node closed the relayed session (it stopped or died): start chatcore again to serve it or relay to the next writer")
            return 1
        }
    }

    /// Where other nodes reach a bound address: its real port, and loopback for a
    /// wildcard host.
    static func reachable(_ address: ListenAddress, port: Int?) -> String {
        switch address {
        case .unix: return address.description
        case .tcp(let host, let requested):
            let reachableHost = host == "0.0.0.0" ? "127.0.0.1" : host == "::" ? "::1" : host
            return ListenAddress.tcp(host: reachableHost, port: port ?? requested).description
        }
    }

    /// While another node holds the store's writer lock, relays every connection to it
    /// (FollowerProxy) on `loops`, the event loops the metrics use and the node's own
    /// sockets will; returns once this node holds the lock (the writer stopped or died),
    /// with the relayed connections closed and the addresses free again.
    func follow(_ location: PostgresStore.Location, loops: MultiThreadedEventLoopGroup, logger: Logger) async throws -> PostgresStore.WriterLock {
        let proxy = FollowerProxy(
            group: loops,
            writer: {
                PostgresStore.WriterLock.writerAddress(location: location, logger: logger).flatMap(ListenAddress.init)
            }, maxConnections: Serve.sessionsThatFit(maxSessions, relaying: true, logger: logger), logger: logger)
        for text in listen {
            let channel = try await proxy.bind(ListenAddress(text)!)
            logger.info("listening (relaying to the writer node)", metadata: ["address": "\(text)", "port": "\(channel.localAddress?.port ?? 0)"])
        }
        logger.info("another node is the writer of the store: relaying connections to it until it stops", metadata: ["store": "\(location)"])
        let taken = OneShot<Result<PostgresStore.WriterLock, Error>>()
        let writerTimeout = self.writerTimeout
        let lock = try await withGracefulShutdownHandler {
            try await taken.wait {
                Thread {
                    nameCurrentThread("writer-lock")
                    taken.resume(Result { try PostgresStore.WriterLock.wait(location: location, logger: logger, takeoverAfter: writerTimeout) })
                }.start()
            }.get()
        } onGracefulShutdown: {
            // Until this node serves by itself, a stop just ends the process: it holds
            // nothing that must be written. `_exit`, not `exit`: the writer-lock thread
            // may be taking over meanwhile, and `exit` can wait for ever on what that
            // thread holds. Once it holds the lock, a stop is the writer's (the group
            // stops the services it runs).
            logger.info("stopping (relaying node)")
            proxy.stop()
            fflush(nil)
            Glibc._exit(0)
        }
        proxy.stop()
        logger.info("this node holds the writer lock now: serving by itself (relayed clients connect again)")
        return lock
    }

    static func defaultDataDirectory() throws -> String {
        if let xdg = try utf8Environment("XDG_DATA_HOME"), !xdg.isEmpty { return xdg + "/chatcore" }
        let home = try utf8Environment("HOME").flatMap { $0.isEmpty ? nil : $0 } ?? NSHomeDirectory()
        return home + "/.local/share/chatcore"
    }

    /// Says in the log when users other than the file's owner may read a secret (as ssh
    /// does for keys; only a warning, since some deployments mount secrets 0644).
    static func warnIfOthersMayRead(_ path: String, what: String, logger: Logger) {
        guard let mode = permissions(of: path), mode & 0o077 != 0 else { return }
        logger.warning(
            "other users of this machine may read \(what): chmod 600 it",
            metadata: ["path": "\(path)", "mode": "\(String(mode, radix: 8))"])
    }

    /// The permission bits of what is at `path` (nil: nothing is there).
    static func permissions(of path: String) -> mode_t? {
        var status = stat()
        return stat(path, &status) == 0 ? status.st_mode & 0o777 : nil
    }

    struct DataDirectoryError: Error, CustomStringConvertible {
        let description: String
    }

    /// The data directory holds every message (the store, the search index, attachments):
    /// chatcore makes it readable by its own user only (0700). One that exists keeps its
    /// mode (an operator may share it on purpose), and the log says so when others may
    /// read it: before, a new store was readable by every user of the machine (0755
    /// directory, 0644 files).
    static func prepareDataDirectory(_ directory: URL, logger: Logger) throws {
        if let mode = permissions(of: directory.path) {
            if mode & 0o077 != 0 {
                logger.notice(
                    "other users of this machine may read the data directory, and so every message: chmod 700 it to keep them out",
                    metadata: ["dataDir": "\(directory.path)", "mode": "\(String(mode, radix: 8))"])
            }
            return
        }
        do {
            try FileManager.default.createDirectory(at: directory.deletingLastPathComponent(), withIntermediateDirectories: true)
        } catch {
            throw DataDirectoryError(description: "cannot create the data directory \(directory.path): \(error.localizedDescription)")
        }
        guard mkdir(directory.path, 0o700) == 0 || errno == EEXIST else {
            throw DataDirectoryError(description: "cannot create the data directory \(directory.path): \(String(cString: strerror(errno)))")
        }
    }

    /// An environment variable that names a path: Swift would read bytes that are not
    /// UTF-8 as U+FFFD, naming another directory, so such a value is refused.
    static func utf8Environment(_ name: String) throws -> String? {
        guard let raw = getenv(name) else { return nil }
        guard let value = String(validatingCString: raw) else {
            throw ValidationError("$\(name) is not UTF-8: give --data-dir, or set it in UTF-8")
        }
        return value
    }

    /// Bytes of the files directly in the data directory (the store, its log, the search
    /// index; attachments live in a directory of their own).
    static func bytes(in directory: URL) -> Int64 {
        let names = (try? FileManager.default.contentsOfDirectory(atPath: directory.path)) ?? []
        return names.reduce(Int64(0)) { total, name in
            let attributes = try? FileManager.default.attributesOfItem(atPath: directory.appendingPathComponent(name).path)
            guard attributes?[.type] as? FileAttributeType == .typeRegular else { return total }
            return total + ((attributes?[.size] as? NSNumber)?.int64Value ?? 0)
        }
    }

    /// Descriptors kept for everything but socket sessions: the store's files and the
    /// search index's, PostgreSQL connections, attachments being copied, listeners, event
    /// loops, standard input/output.
    static let descriptorsKept = 128

    /// The socket sessions the file descriptor limit leaves room for, at most `wanted`.
    /// The soft limit is raised to the hard one first (Debian's soft limit is 1,024).
    /// Past the limit, accepting a connection fails while it waits, and NIO retries at
    /// once for as long as it waits, taking a whole core; below it, a connection past
    /// `--max-sessions` is accepted and closed at once. A node that relays its sessions to
    /// the writer of a shared store takes two descriptors for each.
    static func sessionsThatFit(_ wanted: Int, relaying: Bool, logger: Logger) -> Int {
        let resource = __rlimit_resource_t(RLIMIT_NOFILE.rawValue)
        var limit = rlimit()
        guard getrlimit(resource, &limit) == 0 else { return wanted }
        if limit.rlim_cur < limit.rlim_max {
            var raised = limit
            raised.rlim_cur = limit.rlim_max
            if setrlimit(resource, &raised) == 0 { limit = raised }
        }
        guard limit.rlim_cur != rlim_t.max else { return wanted }  // RLIM_INFINITY
        let room = max(1, (Int(clamping: limit.rlim_cur) - descriptorsKept) / (relaying ? 2 : 1))
        guard wanted > room else { return wanted }
        logger.warning(
            "the file descriptor limit leaves room for fewer socket sessions than --max-sessions: raise it (ulimit -n)",
            metadata: ["maxSessions": "\(wanted)", "servingAtMost": "\(room)", "fileDescriptorLimit": "\(limit.rlim_cur)"])
        return room
    }

}

extension Logger.Level: @retroactive ExpressibleByArgument {}
