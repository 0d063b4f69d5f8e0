import ChatEngine
import ChatSession
import ChatWire
import Dispatch
import Foundation
import Logging
import NIOCore
import NIOPosix
import Synchronization
import Threads

/// Where to listen: `HOST:PORT` (TCP, `[::1]:PORT` for IPv6) or `unix:PATH`.
public enum ListenAddress: Sendable, CustomStringConvertible, Equatable {
    case tcp(host: String, port: Int)
    case unix(path: String)

    public init?(_ text: String) {
        if text.hasPrefix("unix:") {
            let path = String(text.dropFirst(5))
            guard !path.isEmpty else { return nil }
            self = .unix(path: path)
            return
        }
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]), (0...65535).contains(port) else {
            return nil
        }
        var host = String(text[..<colon])
        if host.hasPrefix("[") && host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
        guard !host.isEmpty else { return nil }
        self = .tcp(host: host, port: port)
    }

    public var description: String {
        switch self {
        case .tcp(let host, let port): return host.contains(":") ? "[\(host)]:\(port)" : "\(host):\(port)"
        case .unix(let path): return "unix:\(path)"
        }
    }

    /// True when every address the host resolves to is loopback (or it is a Unix socket).
    public func isLoopbackOnly() -> Bool {
        switch self {
        case .unix:
            return true
        case .tcp(let host, let port):
            guard let address = try? SocketAddress.makeAddressResolvingHost(host, port: port) else { return false }
            switch address {
            case .v4(let v4):
                return (UInt32(bigEndian: v4.address.sin_addr.s_addr) >> 24) == 127
            case .v6(let v6):
                var loopback = in6addr_loopback
                return withUnsafeBytes(of: v6.address.sin6_addr) { mine in
                    withUnsafeBytes(of: &loopback) { mine.elementsEqual($0) }
                }
            default:
                return false
            }
        }
    }
}

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

        public init(
            session: Session.Limits = .init(), outputHighWater: Int = 1 << 20, maxOutputBytes: Int = 64 << 20,
            maxOutputTotal: Int = 256 << 20, maxSessions: Int = 10_000, idleTimeout: TimeAmount? = nil, authTimeout: TimeAmount? = nil,
            maxBufferedInput: Int = 256 << 20
        ) {
            self.session = session
            self.outputHighWater = outputHighWater
            self.maxOutputBytes = maxOutputBytes
            self.maxOutputTotal = maxOutputTotal
            self.maxSessions = maxSessions
            self.idleTimeout = idleTimeout
            self.authTimeout = authTimeout
            self.maxBufferedInput = maxBufferedInput
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

    public init(group: MultiThreadedEventLoopGroup, engine: Engine, authenticator: Authenticator, limits: Limits, logger: Logger) {
        self.group = group
        self.engine = engine
        self.authenticator = authenticator
        self.limits = limits
        self.logger = logger
        sessions = ConnectionLimit(limits.maxSessions)
        unread = UnreadOutput(limit: limits.maxOutputTotal, highWater: limits.outputHighWater, connections: sessions)
        buffered = BufferedInput(limit: limits.maxBufferedInput)
    }

    /// Starts listening; returns the bound channel (its local address has the real port).
    public func bind(_ address: ListenAddress) async throws -> Channel {
        let engine = self.engine
        let authenticator = self.authenticator
        let limits = self.limits
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
                let transport: Transport = channel.localAddress?.protocol == .unix ? .unix : .tcp
                guard self.sessions.admit(channel) else {
                    logger.warning("refusing a connection: --max-sessions reached", metadata: ["maxSessions": "\(limits.maxSessions)"])
                    return channel.close()
                }
                let key = ObjectIdentifier(channel)
                self.connections.withLock { $0[key] = channel }
                channel.closeFuture.whenComplete { _ in
                    self.connections.withLock { _ = $0.removeValue(forKey: key) }
                }
                return channel.eventLoop.makeCompletedFuture {
                    if let idle = limits.idleTimeout {
                        try channel.pipeline.syncOperations.addHandler(IdleStateHandler(readTimeout: idle))
                    }
                    let handler = SessionHandler(
                        engine: engine, authenticator: authenticator, transport: transport, limits: limits,
                        unreadByAll: self.unread, bufferedByAll: self.buffered, logger: logger)
                    try channel.pipeline.syncOperations.addHandler(handler)
                }
            }
        let channel = try await bootstrap.bind(listening: address)
        listeners.withLock { $0.append(channel) }
        return channel
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

/// Connects one socket to one `Session`: bytes to lines to requests; events to bytes.
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

final class SessionHandler: ChannelDuplexHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let engine: Engine
    private let authenticator: Authenticator
    private let transport: Transport
    private let limits: SocketServer.Limits
    private let unreadByAll: UnreadOutput
    private let bufferedByAll: BufferedInput
    private let logger: Logger
    private var framer: LineFramer
    /// Whether lines may be `--max-line-bytes` long yet (once the session authenticated).
    private var fullLines = false
    private var session: Session?
    private var output: SocketOutput?
    /// A read was asked for while input was paused.
    private var readPending = false
    /// Closes the connection if it has not authenticated by then (`Limits.authTimeout`).
    private var authDeadline: Scheduled<Void>?
    /// Sessions are numbered in the log from 1, in the order they open.
    private static let opened = Atomic<Int>(0)
    private var number = 0
    private var openedAt = ContinuousClock.now
    /// Why the service closes the connection (nil: the client did, or it broke).
    var closeReason: String?

    init(
        engine: Engine, authenticator: Authenticator, transport: Transport, limits: SocketServer.Limits, unreadByAll: UnreadOutput,
        bufferedByAll: BufferedInput, logger: Logger
    ) {
        self.engine = engine
        self.authenticator = authenticator
        self.transport = transport
        self.limits = limits
        self.unreadByAll = unreadByAll
        self.bufferedByAll = bufferedByAll
        self.logger = logger
        self.framer = LineFramer(maxLineBytes: min(limits.session.maxLineBytesBeforeAuth, limits.session.maxLineBytes))
    }

    func handlerAdded(context: ChannelHandlerContext) {
        let output = SocketOutput(
            channel: context.channel, limits: limits, unreadByAll: unreadByAll, logger: logger,
            resume: NIOLoopBound(self, eventLoop: context.eventLoop))
        self.output = output
        session = Session(
            engine: engine, authenticator: authenticator, transport: transport, output: output, limits: limits.session, logger: logger)
        number = SessionHandler.opened.add(1, ordering: .relaxed).newValue
        openedAt = .now
        logger.info(
            "session opened",
            metadata: ["session": "\(number)", "transport": "\(transport)", "peer": "\(context.channel.remoteAddress.map { "\($0)" } ?? "?")"])
        if let timeout = limits.authTimeout {
            let handler = NIOLoopBound(self, eventLoop: context.eventLoop)
            let channel = context.channel
            authDeadline = context.eventLoop.scheduleTask(in: timeout) {
                guard let session = handler.value.session, !session.isAuthenticated else { return }
                handler.value.closeReason = "it did not sign in within --auth-timeout"
                channel.close(promise: nil)
            }
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard let session else { return }
        if !fullLines && session.isAuthenticated {
            fullLines = true
            framer.raiseLimit(to: limits.session.maxLineBytes)
        }
        let buffer = unwrapInboundIn(data)
        let before = framer.bufferedBytes
        buffer.withUnsafeReadableBytes { bytes in
            framer.feed(bytes) { session.receive($0) }
        }
        let after = framer.bufferedBytes
        if after != before && !bufferedByAll.change(by: after - before) {
            bufferedByAll.change(by: -after)
            framer.abandonPartialLine {
                if case .tooLarge(let number) = $0 {
                    session.refuseLine(
                        number: number, reason: "the service holds too much of its clients' unfinished lines: the line is refused (send it again later)")
                }
            }
        }
    }

    /// The input ended: a last line without a newline is still a line, and what was held
    /// of it no longer counts against the server's bound.
    private func finishLine() {
        bufferedByAll.change(by: -framer.bufferedBytes)
        framer.finish { session?.receive($0) }
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        session?.endOfInputChunk()
    }

    func channelInactive(context: ChannelHandlerContext) {
        if number > 0 {
            let seconds = (ContinuousClock.now - openedAt).components.seconds
            logger.info(
                "session closed",
                metadata: [
                    "session": "\(number)", "reason": "\(closeReason ?? "the client closed the connection, or it broke")",
                    "signedIn": "\(session?.isAuthenticated ?? false)", "seconds": "\(seconds)"
                ])
        }
        authDeadline?.cancel()
        authDeadline = nil
        finishLine()
        session?.close()
        session = nil
        // The output refers back to this handler (to resume reading): let go of it, and
        // of any partial line, so nothing of a closed connection stays.
        output = nil
        framer = LineFramer(maxLineBytes: 1)
        context.fireChannelInactive()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let event = event as? ChannelEvent, event == .inputClosed {
            // The client is done sending (shutdown of its write side): answer everything
            // it sent, then close.
            finishLine()
            closeReason = "the client finished sending, and every answer was written"
            let channel = context.channel
            session?.finishInput {
                channel.eventLoop.execute { _ = SessionHandler.flushThenClose(channel) }
            }
            return
        }
        if event is IdleStateHandler.IdleStateEvent {
            closeReason = "it sent nothing for --idle-timeout"
            context.close(promise: nil)
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    /// Closes (or with `outputOnly`, shuts the output of) the channel once everything
    /// written before has gone out (a write completes in order).
    static func flushThenClose(_ channel: Channel, outputOnly: Bool = false) -> EventLoopFuture<Void> {
        guard channel.isActive else { return channel.eventLoop.makeSucceededVoidFuture() }
        return channel.writeAndFlush(channel.allocator.buffer(capacity: 0))
            .flatMap { channel.close(mode: outputOnly ? .output : .all) }
            .recover { _ in }
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        closeReason = "connection error: \(error)"
        context.close(promise: nil)
    }

    // Backpressure: hold reads while the client does not read its output or the engine
    // has too much of this session's work.
    // Shutting down, input is read and dropped, so that a client still sending is not
    // blocked and nothing is left unread when the socket closes.
    private func mayRead(_ context: ChannelHandlerContext) -> Bool {
        engine.isShuttingDown || (context.channel.isWritable && (session?.wantsInput ?? true))
    }

    func read(context: ChannelHandlerContext) {
        if mayRead(context) {
            readPending = false
            context.read()
        } else {
            readPending = true
        }
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        resumeIfPossible(context)
        context.fireChannelWritabilityChanged()
    }

    func resumeIfPossible(_ context: ChannelHandlerContext) {
        if readPending && mayRead(context) {
            readPending = false
            context.read()
        }
    }

    private var contextForResume: ChannelHandlerContext?

    func handlerRemoved(context: ChannelHandlerContext) {
        contextForResume = nil
    }

    func channelRegistered(context: ChannelHandlerContext) {
        contextForResume = context
        context.fireChannelRegistered()
    }

    func channelActive(context: ChannelHandlerContext) {
        contextForResume = context
        context.fireChannelActive()
    }

    func engineCaughtUp() {
        if let context = contextForResume { resumeIfPossible(context) }
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
                let reason =
                    overMine
                    ? "its client does not read its output (--max-output-bytes)"
                    : "its client is behind while the unread output of all clients is over --max-output-total"
                logger.warning("closing a connection: \(reason)", metadata: ["queuedBytes": "\(total)"])
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
            resume.value.closeReason = "the service ended the session (its endpoint was deregistered, or the service is stopping)"
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
