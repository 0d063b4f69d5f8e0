import ChatEngine
import ChatSession
import ChatWire
import Dispatch
import Foundation
import Logging
import NIOCore
import NIOHTTP1
import NIOPosix
import NIOSSL
import NIOWebSocket
import Synchronization
import Threads

/// TCP and Unix socket listeners (SwiftNIO): one session per connection, all sessions on
/// one engine.
public final class SocketServer: Sendable {
    public struct Limits: Sendable {
        public var session: Session.Limits
        /// Output a client has not read yet, above which its input is paused.
        public var outputHighWater: Int
        /// Output a client has not read yet, above which it is disconnected.
        public var maxOutputBytes: Int
        /// Output not read yet by all clients together, above which a client behind by
        /// more than its share (this over the connections open, at least
        /// `outputHighWater`) is disconnected when more is written to it: without it, one
        /// user's endpoints that never read, each kept under `maxOutputBytes`, could
        /// together hold gigabytes.
        public var maxOutputTotal: Int
        /// Connections open at once; more are closed as soon as they are accepted.
        public var maxSessions: Int
        /// A connection that sends nothing for this long is closed (nil: never).
        public var idleTimeout: TimeAmount?
        /// A connection whose token has not been accepted this long after it was accepted
        /// is closed (nil: never), so that connections that never sign in cannot hold
        /// `maxSessions` places for ever.
        public var authTimeout: TimeAmount?
        /// Bytes of lines not yet ended that all connections together may hold: past it,
        /// the line that would go over is refused as too large.
        public var maxBufferedInput: Int
        /// The `Origin`s whose pages may open a WebSocket (nil: any; a client that sends
        /// no `Origin`, not a browser, always may).
        public var allowedOrigins: Set<String>?

        public init(
            session: Session.Limits = .init(), outputHighWater: Int = 1 << 20, maxOutputBytes: Int = 64 << 20,
            maxOutputTotal: Int = 256 << 20, maxSessions: Int = 10_000, idleTimeout: TimeAmount? = nil, authTimeout: TimeAmount? = nil,
            maxBufferedInput: Int = 256 << 20, allowedOrigins: Set<String>? = nil
        ) {
            self.session = session
            self.outputHighWater = outputHighWater
            self.maxOutputBytes = maxOutputBytes
            self.maxOutputTotal = maxOutputTotal
            self.maxSessions = maxSessions
            self.idleTimeout = idleTimeout
            self.authTimeout = authTimeout
            self.maxBufferedInput = maxBufferedInput
            self.allowedOrigins = allowedOrigins
        }
    }

    private let group: MultiThreadedEventLoopGroup
    private let engine: Engine
    private let authenticator: Authenticator
    private let limits: Limits
    private let logger: Logger
    /// Connections open now, over every listener.
    private let sessions: ConnectionLimit
    /// Output written to every connection and not yet taken by its client.
    private let unread: UnreadOutput
    /// Partial lines held for every connection.
    private let buffered: BufferedInput
    /// The listeners and the open connections, for a shutdown that answers everyone.
    private let listeners = Locked<[Channel]>([])
    private let connections = Locked<[ObjectIdentifier: Channel]>([:])
    /// What the TLS listeners present (nil: there are none).
    private let tls: TLSIdentity?

    public init(
        group: MultiThreadedEventLoopGroup, engine: Engine, authenticator: Authenticator, limits: Limits, tls: TLSIdentity? = nil, logger: Logger
    ) {
        self.group = group
        self.tls = tls
        self.engine = engine
        self.authenticator = authenticator
        self.limits = limits
        self.logger = logger
        sessions = ConnectionLimit(limits.maxSessions)
        unread = UnreadOutput(limit: limits.maxOutputTotal, highWater: limits.outputHighWater, connections: sessions)
        buffered = BufferedInput(limit: limits.maxBufferedInput)
    }

    /// Starts listening; returns the bound channel (its local address has the real port).
    public func bind(_ listener: Listener) async throws -> Channel {
        let logger = self.logger
        let bootstrap = ServerBootstrap(group: group)
            .serverChannelOption(.backlog, value: 256)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            // When accepting fails (out of file descriptors), the operator hears why. NIO
            // retries at once while connections wait (the listener stays readable), taking
            // a core: `--max-sessions` is fitted to the descriptor limit so that sessions
            // alone never get there (`Serve.sessionsThatFit`).
            .serverChannelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.addHandler(AcceptFailureLog(logger: logger))
                }
            }
            .childChannelOption(.autoRead, value: true)
            // A client that shuts down its write side still gets every answer.
            .childChannelOption(.allowRemoteHalfClosure, value: true)
            .childChannelOption(.writeBufferWaterMark, value: .init(low: limits.outputHighWater / 2, high: limits.outputHighWater))
            .childChannelInitializer { [self] channel in
                serve(channel, from: listener)
            }
        let channel = try await bootstrap.bind(listening: listener.address)
        listeners.withLock { $0.append(channel) }
        return channel
    }

    /// Takes over a listener another part bound (a relaying node's, when the node takes
    /// over from the writer: its address stays open throughout): closed with the others
    /// at a stop. Its connections are handed over one by one (`serveHandedOver`).
    public func adopt(listening channel: Channel) {
        listeners.withLock { $0.append(channel) }
    }

    /// Serves a connection accepted by an adopted listener, nothing read from it yet
    /// (`autoRead` off): set as this server's own, then read.
    public func serveHandedOver(_ channel: Channel, from listener: Listener) -> EventLoopFuture<Void> {
        channel.setOption(.allowRemoteHalfClosure, value: true).flatMap {
            channel.setOption(.writeBufferWaterMark, value: .init(low: self.limits.outputHighWater / 2, high: self.limits.outputHighWater))
        }.flatMap {
            self.serve(channel, from: listener)
        }.map {
            // What it sent (and its end) while it was held, then the rest.
            HeldInput.release(channel)
        }.flatMap {
            channel.setOption(.autoRead, value: true)
        }.flatMapError { error in
            channel.close(promise: nil)
            return channel.eventLoop.makeFailedFuture(error)
        }
    }

    /// A session on `channel`, accepted at `listener`: admitted (`--max-sessions`), then
    /// its pipeline set up (TLS, idle time, lines or a WebSocket upgrade).
    private func serve(_ channel: Channel, from listener: Listener) -> EventLoopFuture<Void> {
        precondition(!listener.tls || tls != nil, "a TLS listener needs the server's TLSIdentity")
        let tls = listener.tls ? self.tls : nil
        let engine = self.engine
        let authenticator = self.authenticator
        let limits = self.limits
        let logger = self.logger
        let transport: Transport =
            listener.framing != .lines ? .webSocket : channel.localAddress?.protocol == .unix ? .unix : .tcp
        guard sessions.admit(channel) else {
            logger.warning("refusing a connection: --max-sessions reached", metadata: ["maxSessions": "\(limits.maxSessions)"])
            return channel.close()
        }
        let key = ObjectIdentifier(channel)
        connections.withLock { $0[key] = channel }
        channel.closeFuture.whenComplete { _ in
            self.connections.withLock { _ = $0.removeValue(forKey: key) }
        }
        let session: @Sendable () -> SessionHandler = {
            SessionHandler(
                engine: engine, authenticator: authenticator, transport: transport, limits: limits,
                unreadByAll: self.unread, bufferedByAll: self.buffered, logger: logger)
        }
        return channel.eventLoop.makeCompletedFuture {
            if let tls {
                try channel.pipeline.syncOperations.addHandler(NIOSSLServerHandler(context: tls.context))
            }
            if let idle = limits.idleTimeout {
                try channel.pipeline.syncOperations.addHandler(IdleStateHandler(readTimeout: idle))
            }
            switch listener.framing {
            case .lines:
                try channel.pipeline.syncOperations.addHandler(session())
            case .webSocket(let path):
                try Self.upgradeToWebSocket(channel, path: path, limits: limits, logger: logger, session: session)
            }
        }
    }

    /// Sets up `channel` to be upgraded from HTTP/1.1 to a WebSocket at `path` (refused with
    /// a status that says why otherwise: `WebSocketRefusal`), then to carry a session whose
    /// lines are text frames (`WebSocketLines`). A connection not upgraded within the
    /// sign-in time (10 s at most) is closed: before it is, it costs a socket and an HTTP
    /// parser, and nothing else.
    private static func upgradeToWebSocket(
        _ channel: Channel, path: String, limits: Limits, logger: Logger, session: @escaping @Sendable () -> SessionHandler
    ) throws {
        let origins = limits.allowedOrigins
        let maxMessage = limits.session.maxLineBytes
        let upgraded = NIOLoopBoundBox(false, eventLoop: channel.eventLoop)
        let upgrader = NIOWebSocketServerUpgrader(
            maxFrameSize: maxMessage, automaticErrorHandling: true,
            shouldUpgrade: { channel, head in
                channel.eventLoop.makeSucceededFuture(WebSocketRefusal.refusal(of: head, path: path, origins: origins) == nil ? HTTPHeaders() : nil)
            },
            upgradePipelineHandler: { channel, _ in
                channel.pipeline.removeHandler(name: "websocket-refusal").flatMapThrowing {
                    upgraded.value = true
                    let handler = session()
                    let lines = WebSocketLines(reason: { [unowned handler] in handler.closeReason }, refused: { [unowned handler] in handler.closeReason = $0 })
                    try channel.pipeline.syncOperations.addHandler(
                        NIOWebSocketFrameAggregator(minNonFinalFragmentSize: 1, maxAccumulatedFrameCount: 1 << 16, maxAccumulatedFrameSize: maxMessage))
                    try channel.pipeline.syncOperations.addHandler(lines)
                    try channel.pipeline.syncOperations.addHandler(handler)
                }
            })
        try channel.pipeline.syncOperations.configureHTTPServerPipeline(withServerUpgrade: (upgraders: [upgrader], completionHandler: { _ in }))
        try channel.pipeline.syncOperations.addHandler(WebSocketRefusal(path: path, origins: origins, logger: logger), name: "websocket-refusal")
        let patience = min(limits.authTimeout ?? .seconds(10), .seconds(10))
        channel.eventLoop.scheduleTask(in: patience) {
            if !upgraded.value { channel.close(promise: nil) }
        }
    }

    /// Stops accepting connections (reading stops through `Engine.beginShutdown`).
    public func stopAccepting() {
        for listener in listeners.withLock({ $0 }) { listener.close(promise: nil) }
    }

    /// Writes out what every connection has been answered and closes it; gives up on
    /// clients that do not read by `deadline`. Call after the engine has drained.
    public func flushAndCloseAll(deadline: NIODeadline) {
        let open = connections.withLock { Array($0.values) }
        // Only the output is shut: a client still sending would otherwise be reset, and
        // a reset can discard answers it has not read yet. It reads every answer, then
        // EOF; the process exits after.
        let shut = open.map { channel in
            channel.eventLoop.flatSubmit {
                channel.read()  // input paused by backpressure is read (and dropped) again
                return SessionHandler.flushThenClose(channel, outputOnly: true)
            }
        }
        for future in shut where !Self.wait(for: future, until: deadline) { break }
        // Exiting closes every socket, and a socket closed with input it has not read
        // makes the client's next read fail with a reset in place of EOF, even after it
        // has every answer. So linger: until each client has taken in everything written
        // to it (nothing left in the kernel's send queue) and had a moment to read its
        // EOF, or has closed, within the deadline.
        var lingering = open
        var drainedSince: [ObjectIdentifier: NIODeadline] = [:]
        while !lingering.isEmpty && NIODeadline.now() < deadline {
            lingering.removeAll { channel in
                guard channel.isActive, let unread = Self.unreadByPeer(channel) else { return true }
                guard unread == 0 else {
                    drainedSince[ObjectIdentifier(channel)] = nil
                    return false
                }
                let since = drainedSince[ObjectIdentifier(channel)] ?? .now()
                drainedSince[ObjectIdentifier(channel)] = since
                return NIODeadline.now() - since >= Self.eofGrace
            }
            if !lingering.isEmpty { usleep(10_000) }
        }
    }

    /// How long a client that has read every answer is given to read its EOF.
    static let eofGrace = TimeAmount.milliseconds(200)

    private static func wait(for future: EventLoopFuture<Void>, until deadline: NIODeadline) -> Bool {
        let remaining = deadline - .now()
        guard remaining > .zero else { return false }
        let outcome = Outcome<Void>()
        future.whenComplete(outcome.complete)
        return outcome.wait(until: .now + .nanoseconds(remaining.nanoseconds)) != nil
    }

    /// Bytes written to the socket that its peer has not taken in yet (for a Unix socket,
    /// not yet read by the client; for TCP, not yet acknowledged); nil when unknown.
    private static func unreadByPeer(_ channel: Channel) -> Int? {
        guard let provider = channel as? SocketOptionProvider else { return nil }
        // SO_MEMINFO: the socket's memory counters (linux/sock_diag.h), of which
        // SK_MEMINFO_WMEM_ALLOC (2) and SK_MEMINFO_WMEM_QUEUED (5) hold what is unsent.
        typealias MemInfo = (UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32)
        let future: EventLoopFuture<MemInfo> = provider.unsafeGetSocketOption(level: SocketOptionLevel(SOL_SOCKET), name: SocketOptionName(SO_MEMINFO))
        guard let info = try? future.wait() else { return nil }
        return Int(info.2) + Int(info.5)
    }
}

/// Logs why accepting a connection failed: once, then at most once a minute with how
/// many more failed (while out of file descriptors, every try fails).
private final class AcceptFailureLog: ChannelInboundHandler {
    typealias InboundIn = Channel

    private let logger: Logger
    private var lastLogged: NIODeadline?
    private var unlogged = 0

    init(logger: Logger) { self.logger = logger }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        let now = NIODeadline.now()
        if let lastLogged, now - lastLogged < .minutes(1) {
            unlogged += 1
            return
        }
        lastLogged = now
        var metadata: Logger.Metadata = ["error": "\(error)"]
        if unlogged > 0 { metadata["failedSinceLastLogged"] = "\(unlogged)" }
        unlogged = 0
        let hint =
            (error as? IOError).map { [EMFILE, ENFILE].contains($0.errnoCode) } == true
            ? "out of file descriptors: raise the limit (ulimit -n) or lower --max-sessions; connections wait until it can" : "connections wait until it can"
        logger.warning("cannot accept connections: \(hint)", metadata: metadata)
    }
}

/// Output written to the connections of one server and not yet taken by their clients,
/// against `Limits.maxOutputTotal`: while the total is over it, each connection may keep
/// its fair share of it unread (at least `outputHighWater`), so that the clients that do
/// not read are the ones disconnected.
final class UnreadOutput: Sendable {
    private let limit: Int
    private let highWater: Int
    /// The connections the total is shared among.
    private let connections: ConnectionLimit
    private let bytes = Atomic<Int>(0)

    init(limit: Int, highWater: Int, connections: ConnectionLimit) {
        self.limit = limit
        self.highWater = highWater
        self.connections = connections
    }

    /// Counts `count` more bytes for an output that now has `unread` bytes unread; false
    /// (and nothing counted) when that output is to be disconnected.
    func add(_ count: Int, unread: Int) -> Bool {
        guard bytes.add(count, ordering: .relaxed).newValue > limit else { return true }
        let share = max(highWater, limit / max(1, connections.count))
        if unread <= share { return true }
        bytes.subtract(count, ordering: .relaxed)
        return false
    }

    func remove(_ count: Int) {
        bytes.subtract(count, ordering: .relaxed)
    }
}

/// Bytes of partial lines all connections of a server hold, against
/// `Limits.maxBufferedInput`.
final class BufferedInput: Sendable {
    private let limit: Int
    private let bytes = Atomic<Int>(0)

    init(limit: Int) {
        self.limit = limit
    }

    /// Counts `delta` more (or fewer) bytes; false when a growth put the total over the
    /// limit (it is counted: the caller lets go of what it holds and says so).
    @discardableResult
    func change(by delta: Int) -> Bool {
        let total = bytes.add(delta, ordering: .relaxed).newValue
        return delta <= 0 || total <= limit
    }
}

/// A session's output on a socket. Writes from other threads hop to the channel's event
/// loop; a client that lets more than `maxOutputBytes` pile up is disconnected, and so is
/// one behind by more than its share while all clients together have more than
/// `maxOutputTotal` unread (`UnreadOutput`).
final class SocketOutput: SessionOutput, Sendable {
    private let channel: Channel
    private let maxOutputBytes: Int
    private let unreadByAll: UnreadOutput
    private let logger: Logger
    private let resume: NIOLoopBound<SessionHandler>
    private let queued = Atomic<Int>(0)

    init(channel: Channel, limits: SocketServer.Limits, unreadByAll: UnreadOutput, logger: Logger, resume: NIOLoopBound<SessionHandler>) {
        self.channel = channel
        self.maxOutputBytes = limits.maxOutputBytes
        self.unreadByAll = unreadByAll
        self.logger = logger
        self.resume = resume
    }

    func write(_ bytes: UnsafeRawBufferPointer, flush: Bool) {
        let count = bytes.count
        if count > 0 {
            let total = queued.add(count, ordering: .relaxed).newValue
            let overMine = total > maxOutputBytes
            if overMine || !unreadByAll.add(count, unread: total) {
                let reason: CloseReason = overMine ? .notReading : .behind
                logger.warning("closing a connection: \(reason.text)", metadata: ["queuedBytes": "\(total)"])
                let resume = self.resume
                let closing = self.channel
                closing.eventLoop.execute {
                    resume.value.closeReason = reason
                    closing.close(promise: nil)
                }
                return
            }
        }
        let channel = self.channel
        let buffer = count > 0 ? channel.allocator.buffer(bytes: bytes) : nil
        let send: @Sendable () -> Void = { [self] in
            if let buffer {
                let promise = channel.eventLoop.makePromise(of: Void.self)
                promise.futureResult.whenComplete { _ in
                    self.queued.subtract(count, ordering: .relaxed)
                    self.unreadByAll.remove(count)
                }
                channel.write(buffer, promise: promise)
            }
            if flush { channel.flush() }
        }
        if channel.eventLoop.inEventLoop {
            send()
        } else {
            channel.eventLoop.execute(send)
        }
    }

    var backlog: Int { queued.load(ordering: .relaxed) }

    func closeAfterWritten() {
        // After the writes handed to the event loop before it (they run in order).
        let channel = self.channel
        let resume = self.resume
        channel.eventLoop.execute {
            resume.value.closeReason = .ended
            _ = SessionHandler.flushThenClose(channel)
        }
    }

    func resumeInput() {
        let resume = self.resume
        channel.eventLoop.execute { resume.value.engineCaughtUp() }
    }
}

extension ServerBootstrap {
    /// Binds a TCP host and port, or a Unix socket path (a socket file left there is
    /// replaced).
    func bind(listening address: ListenAddress) async throws -> Channel {
        switch address {
        case .tcp(let host, let port): try await bind(host: host, port: port).get()
        case .unix(let path): try await bind(unixDomainSocketPath: path, cleanupExistingSocketFile: true).get()
        }
    }
}
