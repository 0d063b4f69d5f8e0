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

        // From the store's opening on, SIGINT/SIGTERM never kill the process half started:
        // a signal that comes before the service can stop cleanly waits for it (then it
        // stops at once). Made here, not first thing: with the signal sources made before
        // the authenticator's set-up, ASan builds stalled 30 s at times in transcripts.
        Serve.signalSources.holdTermination()
        let directory = URL(fileURLWithPath: try dataDir ?? Serve.defaultDataDirectory(), isDirectory: true)
        // Metrics are served from the start, while this node waits for the store or
        // relays to the node that decides too (`chatcore_deciding`).
        // The metrics and the sockets share one group of event loops, made for the first.
        var group: MultiThreadedEventLoopGroup?
        func eventLoops() -> MultiThreadedEventLoopGroup {
            if let group { return group }
            let loops = MultiThreadedEventLoopGroup(numberOfThreads: listen.isEmpty ? 1 : System.coreCount)
            group = loops
            return loops
        }
        if let registry, let metrics, case .tcp(let host, let port)? = ListenAddress(metrics) {
            let loops = eventLoops()
            let endpoint = MetricsEndpoint(registry: registry) {
                ServiceMetrics.storeBytes.record(Serve.bytes(in: directory))
            }
            do {
                let channel = try await endpoint.bind(host: host, port: port, group: loops)
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
        let store: OpenedStore
        let opening = ContinuousClock.now
        do {
            try Serve.prepareDataDirectory(directory, logger: logger)
            if let storePasswordFile {
                Serve.warnIfOthersMayRead(storePasswordFile, what: "--store-password-file: the database's password", logger: logger)
            }
            do {
                store = try OpenedStore.open(self.store, passwordFile: storePasswordFile, directory: directory, logger: logger, allNodesDecide: allNodesDecide)
            } catch is PostgresStore.WriterLockHeld where allNodesDecide {
                // Another node is the writer: this one decides beside it.
                store = try OpenedStore.open(
                    self.store, passwordFile: storePasswordFile, directory: directory, logger: logger, allNodesDecide: true,
                    besideTheWriter: true)
            } catch let held as PostgresStore.WriterLockHeld {
                ServiceMetrics.deciding.record(0)
                // Another node is the writer. Without --listen this node's one session is
                // standard input/output: relayed to the writer, and this process ends
                // with it. With --listen: relay every connection to the writer until it
                // goes, then be it.
                if listen.isEmpty { throw ExitCode(relayStandardIO(held.location, nodeKey: nodeKey, logger: logger)) }
                guard user == nil else {
                    logger.critical(
                        "\(held); a node that is not the writer relays either its standard input/output (without --listen) or its socket connections (with --listen, without --user), not both"
                    )
                    throw ExitCode(1)
                }
                let lock = try await follow(held.location, loops: eventLoops(), logger: logger)
                store = try OpenedStore.open(self.store, passwordFile: storePasswordFile, directory: directory, logger: logger, writerLock: lock)
            }
        } catch let exit as ExitCode {
            throw exit
        } catch {
            logger.critical("cannot open the store", metadata: ["error": "\(error)"])
            throw ExitCode(1)
        }
        var allowedDirectory: String?
        if let attachmentsDir {
            var isDirectory: ObjCBool = false
            guard let resolved = AttachmentStore.realPath(attachmentsDir),
                FileManager.default.fileExists(atPath: resolved, isDirectory: &isDirectory), isDirectory.boolValue
            else {
                logger.critical("--attachments-dir must be an existing directory", metadata: ["path": "\(attachmentsDir)"])
                throw ExitCode(1)
            }
            // Socket sessions may attach what is in the attachments directory: with the
            // store in it, they could attach the store (or the secrets beside it); with it
            // in the data directory, they could fill the store's own files.
            if let data = AttachmentStore.realPath(directory.path),
                data == resolved || AttachmentStore.isInside(data, resolved) || AttachmentStore.isInside(resolved, data)
            {
                logger.critical(
                    "--attachments-dir and --data-dir must not be inside one another: give them separate directories",
                    metadata: ["attachmentsDir": "\(resolved)", "dataDir": "\(data)"])
                throw ExitCode(1)
            }
            allowedDirectory = resolved
        }
        let attachments: AttachmentStore
        let searchIndex: MessageSearchIndex
        do {
            attachments = try AttachmentStore(directory: directory)
            switch store {
            case .sqlite:
                // Derived from the store and kept beside it, out of its transactions: it is
                // refilled from the store when it lags.
                searchIndex = try SQLiteSearchIndex(directory: directory)
            case .postgres(let postgres):
                // In the database, written by each commit: shared by every node.
                searchIndex = PostgresSearchIndex(store: postgres)
            }
        } catch {
            logger.critical("cannot prepare the attachment store or the search index", metadata: ["error": "\(error)"])
            throw ExitCode(1)
        }
        let quotaLimits = QuotaLimits(
            requestsPerSecond: maxRequestsPerSecond, chatsPerMinute: maxChatsPerMinute,
            newUsersPerMinute: maxNewUsersPerMinute, eventsPerSecond: maxEventsPerSecond,
            searchCandidates: maxSearchCandidates, searchBytes: maxSearchBytes, endpointsPerUser: maxEndpoints)
        var clock = Engine.wallClock
        if let fixed = ProcessInfo.processInfo.environment["CHATCORE_FIXED_TIME"].flatMap(Int64.init) {
            // For golden transcripts: every message gets this timestamp.
            logger.warning("CHATCORE_FIXED_TIME is set: every timestamp is \(fixed)")
            clock = { fixed }
        }
        // The store's failure stops the service through `shutdown`, made once the engine is.
        let stopping = Locked<Shutdown?>(nil)
        let stopForStore: @Sendable (String) -> Void = { reason in
            logger.critical("stopping: \(reason)")
            stopping.withLock { $0 }?.run(exitCode: 1)
        }
        let engine = try Engine(
            store: store.chatStore, logger: logger, searchIndex: searchIndex, attachments: attachments,
            attachmentsDirectory: allowedDirectory, cacheBytes: cacheMb << 20, quotas: quotaLimits, clock: clock,
            onFatalStoreError: stopForStore)
        engine.start()
        engine.sweepUnusedBlobs()
        if engine.followsOthers {
            let told = store.chatStore.wakeWhenOthersAct { [weak engine] in engine?.othersActed() }
            Serve.followOthers(engine, every: told ? Serve.followIntervalWhenTold : Serve.followInterval)
        }
        ServiceMetrics.deciding.record(1)
        logger.info(
            "store ready",
            metadata: [
                "store": "\(store.description)", "dataDir": "\(directory.path)", "openedIn": "\(ContinuousClock.now - opening)",
                "chats": "\(engine.chatCount)", "users": "\(engine.userCount)",
                "wholeFileCheck": "\(store.wholeFileCheck)"
            ])

        let sessionLimits = Session.Limits(
            maxRequestsInFlight: maxRequestsInFlight, maxLineBytes: maxLineBytes,
            authTimeout: authTimeout > 0 ? .seconds(authTimeout) : nil)
        // The standard input/output session exists (and a --user is authenticated) before
        // any socket is accepted: the trusted user is always the first user of a new store.
        let stdio =
            user != nil || listen.isEmpty
            ? StdioTransport(engine: engine, authenticator: authenticator, limits: sessionLimits, trustedUser: user, logger: logger)
            : nil
        var server: SocketServer?
        // Other nodes of a shared store relay their sessions to the writer: one that has
        // nothing to listen on listens on loopback for them (nodes on this machine), and
        // ends, as a node of standard input/output does, at the end of its input.
        var listening = listen
        if store.isShared, listen.isEmpty { listening = ["127.0.0.1:0"] }
        let relayedOnly = listen.isEmpty && !listening.isEmpty
        if !listening.isEmpty {
            let sockets = SocketServer(
                group: eventLoops(), engine: engine, authenticator: authenticator,
                limits: .init(
                    session: sessionLimits, outputHighWater: outputHighWater, maxOutputBytes: maxOutputBytes,
                    maxOutputTotal: outputTotalLimit,
                    maxSessions: Serve.sessionsThatFit(maxSessions, relaying: store.isShared, logger: logger),
                    idleTimeout: idleTimeout > 0 ? .seconds(Int64(idleTimeout)) : nil,
                    authTimeout: authTimeout > 0 ? .seconds(Int64(authTimeout)) : nil, maxBufferedInput: maxInputTotal),
                logger: logger)
            server = sockets
            for text in listening {
                let address = ListenAddress(text)!
                do {
                    let channel = try await sockets.bind(address)
                    let bound = channel.localAddress.map { "\($0)" } ?? text
                    logger.info(
                        relayedOnly ? "listening for sessions relayed by other nodes" : "listening",
                        metadata: ["address": "\(address)", "bound": "\(bound)", "port": "\(channel.localAddress?.port ?? 0)"])
                    if case .postgres(let database) = store, database.isWriter, text == listening[0] {
                        let advertised = (relayedOnly ? nil : advertise) ?? Serve.reachable(address, port: channel.localAddress?.port)
                        // Nodes given the node key vouch for the users of the sessions
                        // they relay; without it, none can.
                        let tokens = nodeKey.map(NodeTokens.init)
                        if let tokens { authenticator.acceptNodeTokens(tokens) }
                        try database.advertise(advertised, instance: tokens?.instance ?? "")
                        logger.info("this node is the writer: other nodes relay their connections to it", metadata: ["advertised": "\(advertised)"])
                    }
                } catch {
                    // NIO's own words for this one are only its type's name.
                    let reason =
                        error is UnixDomainSocketPathWrongType
                        ? "the path exists and is not a socket (only a socket left by an earlier run is replaced)" : "\(error)"
                    logger.critical("cannot listen", metadata: ["address": "\(address)", "error": "\(reason)"])
                    throw ExitCode(1)
                }
            }
        }

        let shutdown = Shutdown(engine: engine, store: store, stdio: stdio, server: server, logger: logger)
        stopping.withLock { $0 = shutdown }
        // Opening read only what start-up needs. After a crash (or a store of an older
        // release) the rest of the file is checked now, at the lowest priority: a damaged
        // store stops the service, as it would refuse to start. After a clean stop that
        // left the files as they are, it is not read whole at all (on 10M messages that
        // is 45 s of reading at every start).
        store.checkInBackground { damage in
            guard let damage else { return }
            logger.critical("the store is damaged (quick_check: \(damage)); restore it from a backup or move it away")
            shutdown.run(exitCode: 1)
        }
        if case .postgres(let database) = store {
            // Another node took the writer lock (this one's lock connection was lost):
            // stop now, not at the next commit, so no client reads what may be behind.
            database.onSuperseded = stopForStore
        }
        installTerminationHandlers(shutdown: shutdown, logger: logger)
        installReloadHandler(authenticator: authenticator, logger: logger)

        if let stdio {
            await withCheckedContinuation { (done: CheckedContinuation<Void, Never>) in
                let thread = Thread {
                    nameCurrentThread("stdin")
                    stdio.run()
                    done.resume()
                }
                thread.start()
            }
            if relayedOnly {
                // Sessions relayed here go to the node that takes over.
                if let failure = engine.storeFailure { logger.critical("stopped: \(failure)") }
                logger.info("end of standard input: stopping (sessions relayed here end, and another node takes over)")
                shutdown.run(exitCode: engine.storeFailure == nil ? 0 : 1)
                while true { try await Task.sleep(for: .seconds(3600)) }
            }
            if server == nil {
                if let failure = engine.storeFailure {
                    logger.critical("stopped: \(failure)")
                    throw ExitCode(1)
                }
                logger.debug("end of standard input: every answer is written")
                store.closeCleanly()
                return
            }
            logger.info("end of standard input; still serving sockets")
        }
        // Serve sockets until a signal ends the process.
        while true { try await Task.sleep(for: .seconds(3600)) }
    }

    /// How often a node that follows the other deciding nodes looks at what they did when
    /// it has nothing else to do (before each batch it always does), when the store cannot
    /// tell it when they did something; and when it can (PostgreSQL's notifications), for
    /// when its connection for them broke until it is made again.
    static let followInterval = DispatchTimeInterval.milliseconds(5)
    static let followIntervalWhenTold = DispatchTimeInterval.milliseconds(50)

    /// Wakes the engine every `interval`, so that what the other nodes committed reaches
    /// this node's idle sessions.
    static func followOthers(_ engine: Engine, every interval: DispatchTimeInterval) {
        let timer = DispatchSource.makeTimerSource(queue: DispatchQueue.global())
        timer.schedule(deadline: .now() + interval, repeating: interval)
        timer.setEventHandler { engine.othersActed() }
        timer.resume()
        followTimer = timer
    }

    nonisolated(unsafe) static var followTimer: DispatchSourceTimer?

    /// This node's standard input/output session, relayed to the writer of the shared
    /// store (which may still be starting: its address is awaited for
    /// `FollowerProxy.writerPatience`). Returns the exit code: 0 once the input ended and
    /// the writer answered all of it, 1 when the writer went first (the session is over:
    /// its client starts chatcore again, which then serves by itself or relays to the
    /// next writer).
    private func relayStandardIO(_ location: PostgresStore.Location, nodeKey: NodeKey?, logger: Logger) -> Int32 {
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
                Thread.sleep(forTimeInterval: 0.2)
            }
        }
        guard let relay else { return 1 }
        Serve.signalSources.onTermination { number in
            logger.info("stopping: the writer answers what it was sent", metadata: ["signal": "\(number)"])
            relay.endInput()
            DispatchQueue.global().asyncAfter(deadline: .now() + Shutdown.flushSeconds) { _exit(0) }
        }
        switch relay.run() {
        case .answered, .outputClosed:
            return 0
        case .writerGone:
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
    private func follow(_ location: PostgresStore.Location, loops: MultiThreadedEventLoopGroup, logger: Logger) async throws -> PostgresStore.WriterLock {
        let proxy = FollowerProxy(
            group: loops,
            writer: {
                PostgresStore.WriterLock.writerAddress(location: location, logger: logger).flatMap(ListenAddress.init)
            }, maxConnections: Serve.sessionsThatFit(maxSessions, relaying: true, logger: logger), logger: logger)
        for text in listen {
            let channel = try await proxy.bind(ListenAddress(text)!)
            logger.info("listening (relaying to the writer node)", metadata: ["address": "\(text)", "port": "\(channel.localAddress?.port ?? 0)"])
        }
        // Until this node serves by itself, a signal just stops it: it holds nothing that
        // must be written. `_exit`, not `exit`: the writer-lock thread may be taking over
        // meanwhile, and `exit` can wait for ever on what that thread holds.
        Serve.signalSources.onTermination { number in
            logger.info("stopping (relaying node)", metadata: ["signal": "\(number)"])
            proxy.stop()
            fflush(nil)
            Glibc._exit(0)
        }
        logger.info("another node is the writer of the store: relaying connections to it until it stops", metadata: ["store": "\(location)"])
        let lock = try await withCheckedThrowingContinuation { (taken: CheckedContinuation<PostgresStore.WriterLock, Error>) in
            let thread = Thread {
                nameCurrentThread("writer-lock")
                do {
                    taken.resume(returning: try PostgresStore.WriterLock.wait(location: location, logger: logger, takeoverAfter: writerTimeout))
                } catch {
                    taken.resume(throwing: error)
                }
            }
            thread.start()
        }
        // A signal from now on waits for the writer's stop (it is kept until that is set).
        Serve.signalSources.holdNextTermination()
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

    /// SIGINT and SIGTERM: stop reading at once, answer everything accepted (requests not
    /// yet started are refused as "shutting down"), write it out, then exit 0.
    private func installTerminationHandlers(shutdown: Shutdown, logger: Logger) {
        Serve.signalSources.onTermination { number in
            logger.info("stopping", metadata: ["signal": "\(number)"])
            shutdown.run(exitCode: 0)
        }
    }

    /// SIGHUP: read the JWKS file again; on failure the keys in use stay.
    private func installReloadHandler(authenticator: Authenticator, logger: Logger) {
        signal(SIGHUP, SIG_IGN)
        let source = DispatchSource.makeSignalSource(signal: SIGHUP, queue: .global())
        source.setEventHandler {
            Task {
                do {
                    let count = try await authenticator.reloadKeys()
                    if count > 0 { logger.info("reloaded the JWKS file", metadata: ["keys": "\(count)"]) }
                } catch {
                    logger.error("the JWKS file was not reloaded: the keys in use stay", metadata: ["error": "\(error)"])
                }
            }
        }
        source.resume()
        Serve.signalSources.withLock { $0.append(source) }
    }

    static let signalSources = SignalSources()
}

/// Keeps the signal sources alive for the life of the process. SIGINT and SIGTERM have
/// one source each, made once (libdispatch on Linux does not deliver a signal again to a
/// source made after one for it was cancelled); what they do is set by each phase, and a
/// signal that comes while nothing is set is kept for the first action set.
final class SignalSources: @unchecked Sendable {
    private let lock = NSLock()
    private var sources: [DispatchSourceSignal] = []
    private var termination: (@Sendable (Int32) -> Void)?
    private var pendingTermination: Int32?
    private var terminationInstalled = false

    func withLock(_ body: (inout [DispatchSourceSignal]) -> Void) {
        lock.lock()
        body(&sources)
        lock.unlock()
    }

    /// Catches SIGINT and SIGTERM from now on, keeping one that comes before an action is
    /// set (`onTermination`).
    func holdTermination() {
        lock.lock()
        let install = !terminationInstalled
        terminationInstalled = true
        lock.unlock()
        guard install else { return }
        for number in [SIGINT, SIGTERM] {
            signal(number, SIG_IGN)
            let source = DispatchSource.makeSignalSource(signal: number, queue: .global())
            source.setEventHandler { [self] in
                lock.lock()
                let action = termination
                if action == nil { pendingTermination = number }
                lock.unlock()
                action?(number)
            }
            source.resume()
            withLock { $0.append(source) }
        }
    }

    /// SIGINT and SIGTERM from now on are kept for the next `onTermination` (between one
    /// phase's stop and the next's).
    func holdNextTermination() {
        lock.lock()
        termination = nil
        lock.unlock()
    }

    /// From now on SIGINT and SIGTERM call `action`; one that came before is acted on now.
    func onTermination(_ action: @escaping @Sendable (Int32) -> Void) {
        holdTermination()
        lock.lock()
        termination = action
        let pending = pendingTermination
        pendingTermination = nil
        lock.unlock()
        if let pending { action(pending) }
    }
}

extension Logger.Level: @retroactive ExpressibleByArgument {}

/// Ends the process cleanly: no more input is taken, every answer already decided
/// reaches its session (within a deadline for clients that do not read), then exit.
final class Shutdown: @unchecked Sendable {
    /// Clients that do not read their answers are given this long.
    static let flushSeconds = 5.0

    private let engine: Engine
    private let store: OpenedStore
    private let stdio: StdioTransport?
    private let server: SocketServer?
    private let logger: Logger
    private let started = NSLock()
    private var isRunning = false

    init(engine: Engine, store: OpenedStore, stdio: StdioTransport?, server: SocketServer?, logger: Logger) {
        self.engine = engine
        self.store = store
        self.stdio = stdio
        self.server = server
        self.logger = logger
    }

    func run(exitCode: Int32) {
        started.lock()
        let first = !isRunning
        isRunning = true
        started.unlock()
        guard first else { return }
        // Off the engine thread: a fatal store error is reported from it, and draining
        // waits for it.
        DispatchQueue.global().async { [self] in
            engine.beginShutdown()
            server?.stopAccepting()
            engine.drain()
            let deadline = Date(timeIntervalSinceNow: Shutdown.flushSeconds)
            stdio?.flushForShutdown(deadline: deadline)
            server?.flushAndCloseAll(deadline: .now() + .milliseconds(Int64(max(0, deadline.timeIntervalSinceNow) * 1000)))
            if exitCode == 0 && engine.storeFailure == nil && engine.stop(waitingAtMost: Shutdown.flushSeconds) { store.closeCleanly() }
            logger.info("stopped: every answer decided was written", metadata: ["exitCode": "\(exitCode)"])
            Glibc.exit(exitCode)
        }
    }
}
