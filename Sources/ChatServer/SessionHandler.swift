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

/// Connects one socket to one `Session`: bytes to lines to requests; events to bytes.
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
    var closeReason: CloseReason?

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
        // A handler added to a channel already active (a WebSocket's, after the upgrade)
        // sees no channelRegistered or channelActive: input paused for the engine is
        // resumed through this context.
        contextForResume = context
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
                handler.value.closeReason = .didNotSignIn
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
                    "session": "\(number)", "reason": "\(closeReason?.text ?? "the client closed the connection, or it broke")",
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
            closeReason = .finished
            let channel = context.channel
            session?.finishInput {
                channel.eventLoop.execute { _ = SessionHandler.flushThenClose(channel) }
            }
            return
        }
        if event is IdleStateHandler.IdleStateEvent {
            closeReason = .idle
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
        if closeReason == nil { closeReason = .error(error) }
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
