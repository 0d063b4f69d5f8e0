import Logging
import NIOCore
import NIOHTTP1
import NIOWebSocket

/// Why the service closes a session, in the log's words and as a WebSocket close code
/// (RFC 6455 §7.4): a browser's `close` event tells the page which.
struct CloseReason {
    let text: String
    let code: WebSocketErrorCode

    static let didNotSignIn = CloseReason(text: "it did not sign in within --auth-timeout", code: .policyViolation)
    static let idle = CloseReason(text: "it sent nothing for --idle-timeout", code: .policyViolation)
    static let finished = CloseReason(text: "the client finished sending, and every answer was written", code: .normalClosure)
    static let ended = CloseReason(
        text: "the service ended the session (its endpoint was deregistered, or the service is stopping)", code: .goingAway)
    static let stopping = CloseReason(text: "the service is stopping", code: .goingAway)
    static let notReading = CloseReason(text: "its client does not read its output (--max-output-bytes)", code: .policyViolation)
    static let behind = CloseReason(
        text: "its client is behind while the unread output of all clients is over --max-output-total", code: .policyViolation)
    static let binary = CloseReason(text: "it sent a binary frame: every request is one text frame", code: .unacceptableData)
    static let tooLarge = CloseReason(text: "it sent a message over --max-line-bytes", code: .messageTooLarge)
    static let silent = CloseReason(text: "it answered no ping for a minute", code: .goingAway)

    static func error(_ error: Error) -> CloseReason {
        CloseReason(text: "connection error: \(error)", code: .unexpectedServerError)
    }
}

/// A WebSocket's frames as the lines a `SessionHandler` reads and writes: each text frame
/// is one line, each line written one text frame. Pings are answered, and sent every
/// `pingInterval` (a client that answers none for two of them is closed); a binary frame
/// or a message over the line limit is refused with a close frame that says so; when the
/// service closes the session, a close frame with its reason goes first.
final class WebSocketLines: ChannelDuplexHandler {
    typealias InboundIn = WebSocketFrame
    typealias InboundOut = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = WebSocketFrame

    static let pingInterval = TimeAmount.seconds(30)

    /// Why the service is closing the session (the `SessionHandler`'s), asked when it
    /// closes, and told of this handler's own refusals (binary, too large, silent).
    private let reason: () -> CloseReason?
    private let refused: (CloseReason) -> Void
    private var closeSent = false
    /// The start of a line written without its end yet.
    private var partial: ByteBuffer?
    private var pinger: RepeatedTask?
    private var lastHeard = NIODeadline.now()

    init(reason: @escaping () -> CloseReason?, refused: @escaping (CloseReason) -> Void) {
        self.reason = reason
        self.refused = refused
    }

    func handlerAdded(context: ChannelHandlerContext) {
        let bound = NIOLoopBound((self, context), eventLoop: context.eventLoop)
        pinger = context.eventLoop.scheduleRepeatedTask(initialDelay: Self.pingInterval, delay: Self.pingInterval) { _ in
            let (handler, context) = bound.value
            handler.ping(context)
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        pinger?.cancel()
        pinger = nil
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        // A client that takes in its output is there, pong or not: while the service holds
        // its input back (back-pressure), its pongs wait unread.
        if context.channel.isWritable { lastHeard = .now() }
        context.fireChannelWritabilityChanged()
    }

    private func ping(_ context: ChannelHandlerContext) {
        guard !closeSent, context.channel.isActive else { return }
        if NIODeadline.now() - lastHeard > Self.pingInterval * 2 {
            refuse(context, .silent)
            return
        }
        let frame = WebSocketFrame(fin: true, opcode: .ping, data: context.channel.allocator.buffer(capacity: 0))
        context.writeAndFlush(wrapOutboundOut(frame), promise: nil)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = unwrapInboundIn(data)
        lastHeard = .now()
        switch frame.opcode {
        case .text:
            guard !closeSent else { return }
            var line = frame.unmaskedData
            line.writeInteger(UInt8(ascii: "\n"))
            context.fireChannelRead(wrapInboundOut(line))
        case .binary:
            refuse(context, .binary)
        case .ping:
            guard !closeSent else { return }
            context.writeAndFlush(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .pong, data: frame.unmaskedData)), promise: nil)
        case .connectionClose:
            // The client closes: its close frame is answered with the same code, then the
            // connection ends (the session sees it end as on TCP).
            if !closeSent {
                closeSent = true
                var data = frame.unmaskedData
                let code = data.readSlice(length: 2) ?? context.channel.allocator.buffer(capacity: 0)
                let bound = NIOLoopBound(context, eventLoop: context.eventLoop)
                context.writeAndFlush(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .connectionClose, data: code)))
                    .whenComplete { _ in bound.value.close(promise: nil) }
            } else {
                context.close(promise: nil)
            }
        default:
            break
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        if error is NIOWebSocketError {
            // `WebSocketProtocolErrorHandler` sent the close frame (1009 for a frame over the
            // limit, 1002 for a broken one).
            closeSent = true
        } else if let error = error as? NIOWebSocketFrameAggregator.Error {
            refuse(context, error == .accumulatedFrameSizeIsTooLarge ? .tooLarge : CloseReason(text: "\(error)", code: .protocolError))
            return
        }
        context.fireErrorCaught(error)
    }

    private func refuse(_ context: ChannelHandlerContext, _ reason: CloseReason) {
        guard !closeSent else { return }
        refused(reason)
        // Through this handler's own `close`: the close frame goes first.
        close(context: context, mode: .all, promise: nil)
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        var buffer = unwrapOutboundIn(data)
        guard !closeSent else {
            promise?.fail(ChannelError.outputClosed)
            return
        }
        var lines: [ByteBuffer] = []
        while let newline = buffer.readableBytesView.firstIndex(of: UInt8(ascii: "\n")) {
            var line = buffer.readSlice(length: newline - buffer.readerIndex)!
            buffer.moveReaderIndex(forwardBy: 1)
            if var start = partial {
                start.writeBuffer(&line)
                line = start
                partial = nil
            }
            lines.append(line)
        }
        if buffer.readableBytes > 0 {
            if partial == nil { partial = context.channel.allocator.buffer(capacity: buffer.readableBytes) }
            partial!.writeBuffer(&buffer)
        }
        guard !lines.isEmpty else {
            // Nothing whole to send (an empty write orders a close after what went before).
            promise?.succeed(())
            return
        }
        for (index, line) in lines.enumerated() {
            context.write(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .text, data: line)), promise: index == lines.count - 1 ? promise : nil)
        }
    }

    func close(context: ChannelHandlerContext, mode: CloseMode, promise: EventLoopPromise<Void>?) {
        guard !closeSent, context.channel.isActive, mode != .input else {
            context.close(mode: mode, promise: promise)
            return
        }
        closeSent = true
        let reason = self.reason() ?? .stopping
        var data = context.channel.allocator.buffer(capacity: 125)
        data.write(webSocketErrorCode: reason.code)
        // A control frame carries at most 125 bytes.
        data.writeBytes(reason.text.utf8.prefix(123))
        let bound = NIOLoopBound(context, eventLoop: context.eventLoop)
        context.writeAndFlush(wrapOutboundOut(WebSocketFrame(fin: true, opcode: .connectionClose, data: data))).whenComplete { _ in
            bound.value.close(mode: mode, promise: promise)
        }
    }
}

/// Answers an HTTP request that was not upgraded to a WebSocket, and closes: the wrong
/// path (404), an `Origin` not allowed (403), or not a WebSocket request at all (426).
final class WebSocketRefusal: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let path: String
    private let origins: Set<String>?
    private let logger: Logger

    init(path: String, origins: Set<String>?, logger: Logger) {
        self.path = path
        self.origins = origins
        self.logger = logger
    }

    /// Why a request for an upgrade is refused (nil: it is not).
    static func refusal(of head: HTTPRequestHead, path: String, origins: Set<String>?) -> (HTTPResponseStatus, String)? {
        let requested = head.uri.split(separator: "?", maxSplits: 1, omittingEmptySubsequences: false).first.map(String.init) ?? head.uri
        if requested != path {
            return (.notFound, "no WebSocket of chatcore at \(requested): it listens at \(path)")
        }
        if let origins, let origin = head.headers.first(name: "Origin"), !origins.contains(origin) {
            return (.forbidden, "a page from \(origin) may not connect: it is not in --ws-allowed-origins")
        }
        return nil
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard case .head(let head) = unwrapInboundIn(data) else { return }
        let (status, text) =
            Self.refusal(of: head, path: path, origins: origins)
            ?? (.upgradeRequired, "this is a WebSocket endpoint of chatcore: connect with a WebSocket client")
        logger.info("refusing a WebSocket request", metadata: ["status": "\(status.code)", "reason": "\(text)", "uri": "\(head.uri)"])
        var headers = HTTPHeaders()
        headers.add(name: "Content-Type", value: "text/plain; charset=utf-8")
        headers.add(name: "Content-Length", value: "\(text.utf8.count + 1)")
        headers.add(name: "Connection", value: "close")
        if status == .upgradeRequired {
            headers.add(name: "Upgrade", value: "websocket")
        }
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: .http1_1, status: status, headers: headers))), promise: nil)
        context.write(wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(string: text + "\n")))), promise: nil)
        let bound = NIOLoopBound(context, eventLoop: context.eventLoop)
        context.writeAndFlush(wrapOutboundOut(.end(nil))).whenComplete { _ in bound.value.close(promise: nil) }
    }
}
