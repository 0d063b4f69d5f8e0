import ArgumentParser
import Attachments
import ChatEngine
import ChatMetrics
import ChatServer
import ChatSession
import Foundation
import Logging
import NIOCore
import NIOPosix
import Notifier
import PostgresStorage
import SQLiteStorage
import ServiceLifecycle
import Storage
import Threads

/// This node: it opens the store (or relays to the node that decides, then takes over
/// from it), then runs the store, engine, sockets and standard input/output as a group
/// of services that stop in order.
struct NodeService: Service {
    let serve: Serve
    /// Where notifications of offline recipients go (nil: nowhere).
    let notifier: NotifierSettings?
    let authenticator: Authenticator
    let nodeKey: NodeKey?
    /// What the TLS listeners present (nil: there are none).
    let tls: TLSIdentity?
    /// Whom this node believes to be the writer of a shared store over TLS (nil: no store
    /// is shared).
    let trust: WriterTrust?
    let directory: URL
    let loops: EventLoops
    let stop: StopState
    let logger: Logger

    func run() async throws {
        try await serve.runNode(
            authenticator: authenticator, nodeKey: nodeKey, tls: tls, trust: trust, notifierSettings: notifier, directory: directory, loops: loops,
            stop: stop, logger: logger)
    }
}

/// The event loops the metrics, the relaying proxy and the sockets share, made when one
/// of them first needs them.
final class EventLoops: Sendable {
    private let threads: Int
    private let made = Locked<MultiThreadedEventLoopGroup?>(nil)

    init(threads: Int) { self.threads = threads }

    var group: MultiThreadedEventLoopGroup {
        made.withLock { made in
            if let made { return made }
            let group = MultiThreadedEventLoopGroup(numberOfThreads: threads)
            made = group
            return group
        }
    }
}

extension Serve {
    func runNode(
        authenticator: Authenticator, nodeKey: NodeKey?, tls: TLSIdentity?, trust: WriterTrust?, notifierSettings: NotifierSettings?, directory: URL,
        loops: EventLoops, stop: StopState, logger: Logger
    ) async throws {
        let store: OpenedStore
        // The listeners of the relaying this node did before it took over, still open.
        var handedOver: HandedOver?
        let opening = ContinuousClock.now
        do {
            try Serve.prepareDataDirectory(directory, logger: logger)
            if let storePasswordFile = storage.storePasswordFile {
                Serve.warnIfOthersMayRead(storePasswordFile, what: "--store-password-file: the database's password", logger: logger)
            }
            do {
                store = try OpenedStore.open(
                    self.storage.store, passwordFile: storage.storePasswordFile, directory: directory, logger: logger, allNodesDecide: storage.allNodesDecide)
            } catch is PostgresStore.WriterLockHeld where storage.allNodesDecide {
                // Another node is the writer: this one decides beside it.
                store = try OpenedStore.open(
                    self.storage.store, passwordFile: storage.storePasswordFile, directory: directory, logger: logger, allNodesDecide: true,
                    besideTheWriter: true)
            } catch let held as PostgresStore.WriterLockHeld {
                ServiceMetrics.deciding.record(0)
                // Another node is the writer. Without --listen this node's one session is
                // standard input/output: relayed to the writer, and this process ends
                // with it. With --listen: relay every connection to the writer until it
                // goes, then be it.
                if listen.isEmpty {
                    stop.fail(await relayStandardIO(held.location, nodeKey: nodeKey, trust: trust, loops: loops, logger: logger))
                    return
                }
                guard user == nil else {
                    logger.critical(
                        "\(held); a node that is not the writer relays either its standard input/output (without --listen) or its socket connections (with --listen, without --user), not both"
                    )
                    throw ExitCode(1)
                }
                let (lock, listeners) = try await follow(held.location, trust: trust, tls: tls, loops: loops.group, logger: logger)
                handedOver = listeners
                store = try OpenedStore.open(
                    self.storage.store, passwordFile: storage.storePasswordFile, directory: directory, logger: logger, writerLock: lock)
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
            requestsPerSecond: quotas.maxRequestsPerSecond, chatsPerMinute: quotas.maxChatsPerMinute,
            newUsersPerMinute: quotas.maxNewUsersPerMinute, eventsPerSecond: quotas.maxEventsPerSecond,
            searchCandidates: quotas.maxSearchCandidates, searchBytes: quotas.maxSearchBytes, endpointsPerUser: limits.maxEndpoints)
        var clock = Engine.wallClock
        if let fixed = ProcessInfo.processInfo.environment["CHATCORE_FIXED_TIME"].flatMap(Int64.init) {
            // For golden transcripts: every message gets this timestamp.
            logger.warning("CHATCORE_FIXED_TIME is set: every timestamp is \(fixed)")
            clock = { fixed }
        }
        // The store's failure stops the node's services (exit 1), once they run.
        let stopper = Stopper()
        let stopForStore: @Sendable (String) -> Void = { reason in
            logger.critical("stopping: \(reason)")
            stop.fail(1)
            stopper.stop()
        }
        // Notifications are written by the engine's commits and sent by the notifier.
        var notifier: Notifier?
        var notificationPolicy: NotificationPolicy?
        if let notifierSettings, let outbox = store.chatStore as? NotificationOutbox {
            let made = Notifier(settings: notifierSettings, outbox: outbox, logger: logger)
            notifier = made
            notificationPolicy = NotificationPolicy(
                unreadDelay: notify.notifyUnreadDelay > 0 ? .milliseconds(Int64(notify.notifyUnreadDelay * 1000)) : nil, written: { made.wake() })
        }
        let engine = try Engine(
            store: store.chatStore, coordination: store.coordination, logger: logger, searchIndex: searchIndex, attachments: attachments,
            attachmentsDirectory: allowedDirectory, cacheBytes: cacheMb << 20, quotas: quotaLimits, notifications: notificationPolicy, clock: clock,
            onFatalStoreError: stopForStore)
        // Read before the engine thread starts: its state is then that thread's.
        let (chats, users) = (engine.chatCount, engine.userCount)
        engine.start()
        engine.sweepUnusedBlobs()
        var followEvery: Duration?
        if engine.followsOthers {
            let told = store.coordination.wakeWhenOthersAct { [weak engine] in engine?.othersActed() }
            followEvery = told ? Serve.followIntervalWhenTold : Serve.followInterval
        }
        ServiceMetrics.deciding.record(1)
        logger.info(
            "store ready",
            metadata: [
                "store": "\(store.description)", "dataDir": "\(directory.path)", "openedIn": "\(ContinuousClock.now - opening)",
                "chats": "\(chats)", "users": "\(users)",
                "wholeFileCheck": "\(store.wholeFileCheck)"
            ])

        let sessionLimits = Session.Limits(
            maxRequestsInFlight: limits.maxRequestsInFlight, maxLineBytes: limits.maxLineBytes,
            authTimeout: auth.authTimeout > 0 ? .seconds(auth.authTimeout) : nil)
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
        // The listener other nodes relay to speaks lines (`relayListener`), or is one on
        // loopback for them.
        if store.isShared, Serve.relayListener(among: listening) == nil { listening.append("127.0.0.1:0") }
        let advertisedListener = Serve.relayListener(among: listening)
        let relayedOnly = listen.isEmpty && !listening.isEmpty
        if !listening.isEmpty {
            let sockets = SocketServer(
                group: loops.group, engine: engine, authenticator: authenticator,
                limits: .init(
                    session: sessionLimits, outputHighWater: limits.outputHighWater, maxOutputBytes: limits.maxOutputBytes,
                    maxOutputTotal: limits.outputTotalLimit,
                    maxSessions: Serve.sessionsThatFit(limits.maxSessions, relaying: store.isShared, logger: logger),
                    idleTimeout: limits.idleTimeout > 0 ? .seconds(Int64(limits.idleTimeout)) : nil,
                    authTimeout: auth.authTimeout > 0 ? .seconds(Int64(auth.authTimeout)) : nil, maxBufferedInput: limits.maxInputTotal,
                    allowedOrigins: self.listening.allowedOrigins.map(Set.init)),
                tls: tls, logger: logger)
            server = sockets
            for text in listening {
                let listener = Listener(text)!
                let address = listener.address
                do {
                    let channel: Channel
                    if let open = handedOver?.listener(text) {
                        sockets.adopt(listening: open)
                        channel = open
                    } else {
                        channel = try await sockets.bind(listener)
                    }
                    let bound = channel.localAddress.map { "\($0)" } ?? text
                    logger.info(
                        relayedOnly ? "listening for sessions relayed by other nodes" : "listening",
                        metadata: ["address": "\(listener)", "bound": "\(bound)", "port": "\(channel.localAddress?.port ?? 0)"])
                    if case .postgres(let database) = store, database.isWriter, listener == advertisedListener {
                        let reached =
                            (relayedOnly ? nil : storage.advertise.flatMap(ListenAddress.init)) ?? Serve.reachable(address, port: channel.localAddress?.port)
                        let advertised = Listener(address: reached, tls: listener.tls).description
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
            // What the kept listeners accepted while the store opened, then all they accept.
            handedOver?.proxy.serve { channel, listener in sockets.serveHandedOver(channel, from: listener) }
        }

        // Opening read only what start-up needs. After a crash (or a store of an older
        // release, or files changed since the last clean stop: a copy, a restore) the
        // rest of the file is checked now, at the lowest priority: a damaged
        // store stops the service, as it would refuse to start. After a clean stop that
        // left the files as they are, it is not read whole at all (on 10M messages that
        // is 45 s of reading at every start).
        store.checkInBackground { damage in
            guard let damage else {
                logger.info("the whole store was checked: no damage")
                return
            }
            logger.critical("the store is damaged (quick_check: \(damage)); restore it from a backup or move it away")
            stop.fail(1)
            stopper.stop()
        }
        if case .postgres(let database) = store {
            // Another node took the writer lock (this one's lock connection was lost):
            // stop now, not at the next commit, so no client reads what may be behind.
            database.onSuperseded = stopForStore
        }

        // Stopped in the reverse order: input first, the store last.
        var services: [ServiceGroupConfiguration.ServiceConfiguration] = [
            .init(service: StoreService(store: store, stop: stop)),
            .init(service: EngineService(engine: engine, followEvery: followEvery, stop: stop))
        ]
        if let notifier {
            logger.info("notifying the application's server of offline recipients", metadata: ["url": "\(notifierSettings?.url ?? "")"])
            services.append(.init(service: NotifierService(notifier: notifier, engine: engine)))
        }
        if let server { services.append(.init(service: SocketsService(server: server, engine: engine, stop: stop))) }
        if let stdio {
            // Sessions relayed here go to the node that takes over.
            let endsTheNode = server == nil || relayedOnly
            services.append(
                .init(
                    service: StdioService(stdio: stdio, engine: engine, server: server, stop: stop, endsTheNode: endsTheNode, logger: logger),
                    successTerminationBehavior: endsTheNode ? .gracefullyShutdownGroup : .cancelGroup))
        }
        let group = ServiceGroup(configuration: .init(services: services, logger: logger))
        stopper.attach(group)
        try await group.run()
        if let failure = engine.storeFailure {
            logger.critical("stopped: \(failure)")
            stop.fail(1)
        }
        logger.info("stopped: every answer decided was written", metadata: ["exitCode": "\(stop.exitCode)"])
    }
}
