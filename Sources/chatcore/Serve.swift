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
import Notifier
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

    @OptionGroup(title: "Configuration") var configuration: ConfigurationOptions
    @OptionGroup(title: "Listening") var listening: ListenOptions
    @OptionGroup(title: "Authentication") var auth: AuthOptions
    @OptionGroup(title: "Store and nodes") var storage: StoreOptions
    @OptionGroup(title: "Limits of sessions") var limits: LimitOptions
    @OptionGroup(title: "Quotas per user") var quotas: QuotaOptions
    @OptionGroup(title: "Observability") var observability: ObservabilityOptions
    @OptionGroup(title: "Notifications") var notify: NotifyOptions

    // The options by the names the service reads them by.
    var user: String? { listening.user }
    var listen: [String] { listening.listen }
    var attachmentsDir: String? { listening.attachmentsDir }
    var dataDir: String? { storage.dataDir }
    var cacheMb: Int { storage.cacheMb }
    var metrics: String? { observability.metrics }
    var logLevel: Logger.Level { observability.logLevel }
    var logFormat: LogFormat { observability.logFormat }

    func validate() throws {
        if let user, user.isEmpty || user.utf8.count > 128 { throw ValidationError("--user must be 1 to 128 bytes") }
        guard limits.maxLineBytes > 0 else { throw ValidationError("--max-line-bytes must be positive") }
        guard limits.maxRequestsInFlight > 0 else { throw ValidationError("--max-requests-in-flight must be positive") }
        guard limits.maxSessions > 0 else { throw ValidationError("--max-sessions must be positive") }
        guard limits.maxInputTotal > 0 else { throw ValidationError("--max-input-total must be positive") }
        for (value, flag) in [
            (quotas.maxRequestsPerSecond, "--max-requests-per-second"), (quotas.maxChatsPerMinute, "--max-chats-per-minute"),
            (quotas.maxNewUsersPerMinute, "--max-new-users-per-minute"), (quotas.maxEventsPerSecond, "--max-events-per-second")
        ] {
            guard value >= 0, value.isFinite else { throw ValidationError("\(flag) must be 0 (no limit) or positive") }
        }
        guard quotas.maxSearchCandidates > 0, quotas.maxSearchBytes > 0 else {
            throw ValidationError("--max-search-candidates and --max-search-bytes must be positive")
        }
        guard limits.maxEndpoints > 0 else { throw ValidationError("--max-endpoints must be positive") }
        // Past 1 TiB, MiB to bytes would lose high bits (2^44 MiB became 0: no cache).
        guard cacheMb >= 0, cacheMb <= 1 << 20 else { throw ValidationError("--cache-mb must be 0 to 1048576 (1 TiB)") }
        guard limits.idleTimeout >= 0 else { throw ValidationError("--idle-timeout must not be negative") }
        guard auth.authTimeout >= 0 else { throw ValidationError("--auth-timeout must not be negative") }
        guard storage.writerTimeout >= 3, storage.writerTimeout <= 86_400 else {
            throw ValidationError("--writer-timeout must be 3 to 86400 seconds (the writer beats every second)")
        }
        guard limits.outputHighWater > 0, limits.maxOutputBytes >= limits.outputHighWater else {
            throw ValidationError("--max-output-bytes must be at least --output-high-water, which must be positive")
        }
        if let maxOutputTotal = limits.maxOutputTotal, maxOutputTotal < limits.outputHighWater {
            throw ValidationError("--max-output-total must be at least --output-high-water")
        }
        if (auth.authSecretFile != nil || auth.authJwks != nil) && auth.insecureNoAuth {
            throw ValidationError("--insecure-no-auth accepts any token: it excludes --auth-secret-file and --auth-jwks")
        }
        guard auth.authLeeway >= 0, auth.authLeeway <= 600 else { throw ValidationError("--auth-leeway must be 0 to 600 seconds") }
        guard auth.authMaxLifetime > 0 else { throw ValidationError("--auth-max-lifetime must be positive") }
        for text in listen {
            guard let address = Listener(text)?.address else {
                throw ValidationError("--listen \(text): expected HOST:PORT, unix:PATH, ws://HOST:PORT[/PATH], tls://HOST:PORT or wss://HOST:PORT[/PATH]")
            }
            if auth.insecureNoAuth && !address.isLoopbackOnly() {
                throw ValidationError("--insecure-no-auth refuses to listen on \(text): only loopback addresses and Unix sockets")
            }
        }
        if let metrics {
            guard case .tcp? = ListenAddress(metrics) else { throw ValidationError("--metrics \(metrics): expected HOST:PORT") }
        }
        if storage.store == nil, storage.advertise != nil || storage.nodeTlsCa != nil {
            throw ValidationError("--\(storage.advertise != nil ? "advertise" : "node-tls-ca") is for nodes of a shared store: give --store postgres://…")
        }
        let relayListener = Serve.relayListener(among: listen)
        if let advertise = storage.advertise {
            guard let address = ListenAddress(advertise) else { throw ValidationError("--advertise \(advertise): expected HOST:PORT or unix:PATH") }
            if relayListener?.tls == true, case .unix = address {
                throw ValidationError("--advertise \(advertise): the relay listener is \(relayListener!), which other nodes reach at a HOST:PORT")
            }
        }
        if storage.store != nil, storage.advertise == nil, let first = relayListener, case .tcp(let host, _) = first.address,
            host == "0.0.0.0" || host == "::"
        {
            // It would be advertised as loopback: a node on another machine configured the
            // same way would relay every connection to itself.
            throw ValidationError(
                "--listen \(first) with --store needs --advertise HOST:PORT, the address other nodes reach this one at (a wildcard listener would be advertised as loopback, where a node on another machine reaches only itself)"
            )
        }
        if let url = notify.notifyUrl {
            guard let parsed = URL(string: url), ["http", "https"].contains(parsed.scheme?.lowercased() ?? ""), parsed.host != nil else {
                throw ValidationError("--notify-url \(url): expected an http:// or https:// URL")
            }
            guard notify.notifySecretFile != nil else {
                throw ValidationError(
                    "--notify-url needs --notify-secret-file: the application's server must be able to tell chatcore's requests from anyone's")
            }
        }
        guard notify.notifyPreview >= 0 else { throw ValidationError("--notify-preview must not be negative") }
        guard notify.notifyUnreadDelay >= 0, notify.notifyUnreadDelay.isFinite else { throw ValidationError("--notify-unread-delay must not be negative") }
        guard notify.notifyMaxQueued > 0, notify.notifyBatch > 0 else { throw ValidationError("--notify-max-queued and --notify-batch must be positive") }
        guard notify.notifyTimeout > 0, notify.notifyTimeout <= 600 else { throw ValidationError("--notify-timeout must be above 0 and at most 600 seconds") }
        guard notify.notifyLongestRetry >= 1, notify.notifyLongestRetry <= 86_400 else {
            throw ValidationError("--notify-longest-retry must be 1 to 86400 seconds")
        }
        if storage.store != nil, !storage.allNodesDecide, let webSocket = listen.first(where: { Listener($0)?.framing != .lines }) {
            // A node that is not the writer relays its connections' bytes to the writer's
            // first listener, which speaks lines.
            throw ValidationError(
                "--listen \(webSocket) with --store needs --all-nodes-decide: a node that relays to the writer relays bytes, and the writer's sessions are lines"
            )
        }
        let secured = listen.filter { Listener($0)?.tls == true }
        if !secured.isEmpty && (listening.tlsCert == nil || listening.tlsKey == nil) {
            throw ValidationError("--listen \(secured[0]) needs --tls-cert and --tls-key: the certificate it presents and its key")
        }
        if secured.isEmpty && (listening.tlsCert != nil || listening.tlsKey != nil) {
            throw ValidationError("--tls-cert and --tls-key are for tls:// and wss:// listeners: give one (--listen tls://HOST:PORT)")
        }
        if let origins = listening.allowedOrigins {
            for origin in origins where URL(string: origin)?.host == nil {
                throw ValidationError("--ws-allowed-origins: \(origin) is not an origin (scheme://host[:port])")
            }
        }
        if !listen.isEmpty && auth.authSecretFile == nil && auth.authJwks == nil && !auth.insecureNoAuth {
            throw ValidationError("sockets need --auth-secret-file or --auth-jwks (or --insecure-no-auth on loopback): no one could authenticate")
        }
    }

    func run() async throws {
        signal(SIGPIPE, SIG_IGN)
        let (level, format) = (logLevel, logFormat)
        LoggingSystem.bootstrap { label in
            switch format {
            case .json:
                return JSONLogHandler(label: label, level: level)
            case .text:
                var handler = StreamLogHandler.standardError(label: label)
                handler.logLevel = level
                return handler
            }
        }
        let logger = Logger(label: "chatcore")
        if auth.insecureNoAuth {
            logger.warning("--insecure-no-auth: any token signs in, as any user it names; use it on a development machine only")
        }
        // Before the store is opened: an address that cannot be listened on stops the start
        // with one line, and leaves the store untouched.
        for text in listen + (metrics.map { [$0] } ?? []) {
            if let problem = (Listener(text)?.address ?? ListenAddress(text))?.problem() {
                FileHandle.standardError.write(Data("chatcore: \(problem)\n".utf8))
                throw ExitCode(1)
            }
        }
        // The TLS listeners' certificate and key, before the store too.
        var tls: TLSIdentity?
        if let certificate = listening.tlsCert, let key = listening.tlsKey {
            do {
                tls = try TLSIdentity(certificate: certificate, key: key)
            } catch {
                FileHandle.standardError.write(Data("chatcore: \(error)\n".utf8))
                throw ExitCode(1)
            }
        }
        // Whom a node of a shared store believes to be the writer over TLS.
        var trust: WriterTrust?
        if storage.store != nil {
            do {
                trust = try WriterTrust(caFile: storage.nodeTlsCa)
            } catch {
                FileHandle.standardError.write(Data("chatcore: --node-tls-ca: \(error)\n".utf8))
                throw ExitCode(1)
            }
        }
        // Before anything is counted: metrics are made on first use.
        let registry: PrometheusCollectorRegistry? = metrics == nil ? nil : PrometheusCollectorRegistry()
        let process = registry.map { ProcessMetrics(registry: $0, version: Chatcore.version) }
        if let registry {
            MetricsSystem.bootstrap(DescribedMetricsFactory(registry: registry))
            ServiceMetrics.register()
        }

        if auth.authJwks != nil && auth.authAudience == nil {
            // Every application of an identity provider gets tokens signed by its keys:
            // without the audience, any of them signs its users in here. Refusing to start
            // would break every deployment configured before the flag existed: it is said.
            logger.warning(
                "--auth-jwks without --auth-audience: a token the identity provider made for any of its applications signs in here; give --auth-audience (the 'aud' it puts in tokens for this service)"
            )
        }
        let authenticator: Authenticator
        if auth.authSecretFile != nil || auth.authJwks != nil {
            var secret: [UInt8]?
            if let authSecretFile = auth.authSecretFile {
                do {
                    secret = try Authenticator.loadSecret(path: authSecretFile)
                } catch {
                    throw ValidationError("cannot read --auth-secret-file: \(error)")
                }
                Serve.warnIfOthersMayRead(authSecretFile, what: "--auth-secret-file: whoever reads it can sign in as any user", logger: logger)
            }
            do {
                authenticator = try await Authenticator(
                    mode: .keys(secret: secret, jwksPath: auth.authJwks),
                    policy: TokenPolicy(audience: auth.authAudience, issuer: auth.authIssuer, leeway: auth.authLeeway, maxLifetime: auth.authMaxLifetime))
            } catch {
                throw ValidationError(auth.authSecretFile != nil && auth.authJwks == nil ? "--auth-secret-file: \(error)" : "\(error)")
            }
        } else {
            authenticator = try await Authenticator(mode: auth.insecureNoAuth ? .insecure : .unconfigured)
        }

        var nodeKey: NodeKey?
        if let nodeKeyFile = storage.nodeKeyFile {
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

        var notifier: NotifierSettings?
        if let url = notify.notifyUrl, let secretFile = notify.notifySecretFile {
            let secret: Data
            do {
                secret = try Data(contentsOf: URL(fileURLWithPath: secretFile))
            } catch {
                throw ValidationError("--notify-secret-file \(secretFile): \(error.localizedDescription)")
            }
            guard secret.count >= 32 else { throw ValidationError("--notify-secret-file \(secretFile): at least 32 bytes, it has \(secret.count)") }
            Serve.warnIfOthersMayRead(
                secretFile, what: "--notify-secret-file: whoever reads it can send the application's server notifications as chatcore", logger: logger)
            var settings = NotifierSettings(url: url, secret: [UInt8](secret))
            settings.previewLength = notify.notifyPreview
            settings.maxQueued = notify.notifyMaxQueued
            settings.batchSize = notify.notifyBatch
            settings.timeout = .milliseconds(Int64(notify.notifyTimeout * 1000))
            settings.longestRetry = .milliseconds(Int64(notify.notifyLongestRetry * 1000))
            notifier = settings
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
                process?.update()
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
        services.append(.init(service: KeyReloadService(authenticator: authenticator, tls: tls, logger: logger)))
        let stop = StopState()
        let node = NodeService(
            serve: self, notifier: notifier, authenticator: authenticator, nodeKey: nodeKey, tls: tls, trust: trust, directory: directory, loops: loops,
            stop: stop, logger: logger)
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
    func relayStandardIO(_ location: PostgresStore.Location, nodeKey: NodeKey?, trust: WriterTrust?, loops: EventLoops, logger: Logger) async -> Int32 {
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
                if let address = Serve.advertisedRelayListener(writer.address) {
                    if user != nil && writer.instance.isEmpty {
                        logger.critical(
                            "the writer node was started without --node-key-file: it accepts no session relayed as a --user; give every node the same --node-key-file"
                        )
                        return 1
                    }
                    let first = user.map { StdioRelay.trustedStart(user: $0, token: nodeKey!.vouch(for: $0, to: writer.instance)) } ?? []
                    do {
                        relay = try await StdioRelay.connect(to: address, trust: trust, group: loops.group, first: first, logger: logger)
                        logger.info("another node is the writer of the store: relaying standard input/output to it", metadata: ["writer": "\(address)"])
                    } catch let error as WriterLinkError where error.untrusted {
                        // Not a writer that is starting: waiting would not help.
                        logger.critical("another node is the writer of the store, and it cannot be relayed to: \(error)", metadata: ["store": "\(location)"])
                        return 1
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
    static func reachable(_ address: ListenAddress, port: Int?) -> ListenAddress {
        switch address {
        case .unix: return address
        case .tcp(let host, let requested):
            let reachableHost = host == "0.0.0.0" ? "127.0.0.1" : host == "::" ? "::1" : host
            return .tcp(host: reachableHost, port: port ?? requested)
        }
    }

    /// The listener other nodes relay their sessions to while this node is the writer of a
    /// shared store: one that speaks lines, the first `tls://` one (the link between nodes
    /// is then encrypted, and the writer's certificate verified), else the first plain one.
    /// Nil: there is none (a node of a shared store then opens one on loopback).
    static func relayListener(among listen: [String]) -> Listener? {
        let lines = listen.compactMap(Listener.init).filter { $0.framing == .lines }
        return lines.first(where: \.tls) ?? lines.first
    }

    /// The relay listener a writer advertised (`relayListener`, as other nodes reach it);
    /// nil for text that is none.
    static func advertisedRelayListener(_ text: String) -> Listener? {
        Listener(text).flatMap { $0.framing == .lines ? $0 : nil }
    }

    /// While another node holds the store's writer lock, relays every connection to it
    /// (FollowerProxy) on `loops`, the event loops the metrics use and the node's own
    /// sockets will; returns once this node holds the lock (the writer stopped or died),
    /// with the relayed connections closed and the addresses free again.
    func follow(
        _ location: PostgresStore.Location, trust: WriterTrust?, tls: TLSIdentity?, loops: MultiThreadedEventLoopGroup, logger: Logger
    ) async throws -> (PostgresStore.WriterLock, HandedOver) {
        let proxy = FollowerProxy(
            group: loops,
            writer: {
                PostgresStore.WriterLock.writerAddress(location: location, logger: logger).flatMap(Serve.advertisedRelayListener)
            }, trust: trust, tls: tls, maxConnections: Serve.sessionsThatFit(limits.maxSessions, relaying: true, logger: logger), logger: logger)
        for text in listen {
            let channel = try await proxy.bind(Listener(text)!)
            logger.info("listening (relaying to the writer node)", metadata: ["address": "\(text)", "port": "\(channel.localAddress?.port ?? 0)"])
        }
        logger.info("another node is the writer of the store: relaying connections to it until it stops", metadata: ["store": "\(location)"])
        let taken = OneShot<Result<PostgresStore.WriterLock, Error>>()
        let writerTimeout = self.storage.writerTimeout
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
        // The listeners stay open: a client that connects again meanwhile waits for this
        // node to serve, instead of finding nothing there.
        let listeners = proxy.handOver()
        logger.info("this node holds the writer lock now: serving by itself (relayed clients connect again)")
        return (lock, HandedOver(proxy: proxy, listeners: listeners))
    }

    /// The listeners a node that relayed keeps when it takes over, and the proxy holding
    /// what they accept until the node serves.
    struct HandedOver {
        let proxy: FollowerProxy
        let listeners: [(listener: Listener, channel: Channel)]

        /// The open listener for `--listen` `text`, if it was one of the proxy's.
        func listener(_ text: String) -> Channel? {
            listeners.first { $0.listener == Listener(text) }?.channel
        }
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
