import Logging
import NIOCore
import NIOHTTP1
import NIOPosix
import Prometheus
import Threads

/// Serves the registry's metrics in Prometheus' text format over HTTP (`GET /metrics`),
/// for `--metrics ADDR`. Anything else is 404; only GET and HEAD are served.
public final class MetricsEndpoint: Sendable {
    private let registry: PrometheusCollectorRegistry
    private let beforeScrape: @Sendable () -> Void
    /// Connections served at once (`Slots`).
    private let slots = Slots(16)
    /// A connection with nothing read or written for this long is closed.
    static let idleTimeout = TimeAmount.seconds(60)
    /// A connection whose request has not arrived whole this long after it connected, or
    /// after its last answer, is closed: connections that say nothing cannot hold the
    /// port's places.
    static let requestTimeout = TimeAmount.seconds(5)

    /// `beforeScrape` runs before each answer (to record values measured on demand).
    public init(registry: PrometheusCollectorRegistry, beforeScrape: @escaping @Sendable () -> Void = {}) {
        self.registry = registry
        self.beforeScrape = beforeScrape
    }

    /// Starts listening; returns the bound channel (its local address has the real port).
    public func bind(host: String, port: Int, group: EventLoopGroup) async throws -> Channel {
        let registry = self.registry
        let beforeScrape = self.beforeScrape
        return try await ServerBootstrap(group: group)
            .serverChannelOption(.backlog, value: 64)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .childChannelInitializer { [self] channel in
                // A scraper needs one connection: a few are served at once, and one that
                // sends nothing for a minute is closed, so connections to this port cannot
                // take the descriptors the sessions need; when all are taken, the one that
                // has waited longest for a request makes room for the newcomer.
                guard self.slots.admit(channel) else { return channel.close() }
                let slots = self.slots
                return channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.addHandler(IdleStateHandler(allTimeout: MetricsEndpoint.idleTimeout))
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline()
                    try channel.pipeline.syncOperations.addHandler(
                        ScrapeHandler(registry: registry, beforeScrape: beforeScrape) { awaiting in
                            slots.mark(channel, awaitingRequest: awaiting)
                        })
                }
            }
            .bind(host: host, port: port).get()
    }
}

/// The metrics port's connections, at most `limit`: when all are taken, a new one takes
/// the place of the one that has waited longest for a request (they are closed after
/// `requestTimeout` anyway); with none waiting, it is refused.
final class Slots: Sendable {
    private let limit: Int
    private let open = Locked<[ObjectIdentifier: (channel: Channel, awaitingSince: NIODeadline?)]>([:])

    init(_ limit: Int) {
        self.limit = limit
    }

    func admit(_ channel: Channel) -> Bool {
        let key = ObjectIdentifier(channel)
        let (admitted, evicted) = open.withLock { open -> (Bool, Channel?) in
            var evicted: Channel?
            if open.count >= limit {
                guard let oldest = open.filter({ $0.value.awaitingSince != nil }).min(by: { $0.value.awaitingSince! < $1.value.awaitingSince! }) else {
                    return (false, nil)
                }
                evicted = open.removeValue(forKey: oldest.key)?.channel
            }
            open[key] = (channel, .now())
            return (true, evicted)
        }
        evicted?.close(promise: nil)
        if admitted {
            channel.closeFuture.whenComplete { _ in self.open.withLock { _ = $0.removeValue(forKey: key) } }
        }
        return admitted
    }

    func mark(_ channel: Channel, awaitingRequest: Bool) {
        open.withLock { open in
            open[ObjectIdentifier(channel)]?.awaitingSince = awaitingRequest ? .now() : nil
        }
    }
}

/// Answers one request at a time (NIO's pipelining handler holds the next until this one
/// is answered), and only while the client takes its answers: a client that sends
/// requests without reading the answers gets nothing more read or answered until it has
/// taken what was written (before, 20 s of that held 750 MB).
private final class ScrapeHandler: ChannelDuplexHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundIn = HTTPServerResponsePart
    typealias OutboundOut = HTTPServerResponsePart

    private let registry: PrometheusCollectorRegistry
    private let beforeScrape: @Sendable () -> Void
    private var head: HTTPRequestHead?
    /// A request complete while the client had not taken the answers before it.
    private var waiting: HTTPRequestHead?
    /// A read asked for while answers wait to be taken.
    private var readHeld = false
    /// Told whether the connection waits for a request (`Slots`).
    private let awaiting: (Bool) -> Void
    /// Closes the connection when its request has not come whole in time.
    private var requestDeadline: Scheduled<Void>?

    init(registry: PrometheusCollectorRegistry, beforeScrape: @escaping @Sendable () -> Void, awaiting: @escaping (Bool) -> Void) {
        self.registry = registry
        self.beforeScrape = beforeScrape
        self.awaiting = awaiting
    }

    func handlerAdded(context: ChannelHandlerContext) {
        awaitRequest(context)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        requestDeadline?.cancel()
    }

    /// From now on the next request must arrive whole within `requestTimeout`.
    private func awaitRequest(_ context: ChannelHandlerContext) {
        awaiting(true)
        requestDeadline?.cancel()
        let channel = context.channel
        requestDeadline = context.eventLoop.scheduleTask(in: MetricsEndpoint.requestTimeout) { channel.close(promise: nil) }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head(let head):
            awaiting(false)
            self.head = head
        case .body:
            break
        case .end:
            guard let head else { return }
            self.head = nil
            requestDeadline?.cancel()
            requestDeadline = nil
            if context.channel.isWritable {
                respond(to: head, context: context)
            } else {
                waiting = head
            }
        }
    }

    /// Reading goes on only while the client takes its answers and none waits.
    private func mayRead(_ context: ChannelHandlerContext) -> Bool {
        context.channel.isWritable && waiting == nil
    }

    func read(context: ChannelHandlerContext) {
        if mayRead(context) {
            context.read()
        } else {
            readHeld = true
        }
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable, let head = waiting {
            waiting = nil
            respond(to: head, context: context)
        }
        // The answer just written may have filled the buffer again.
        if readHeld && mayRead(context) {
            readHeld = false
            context.read()
        }
        context.fireChannelWritabilityChanged()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if event is IdleStateHandler.IdleStateEvent {
            context.close(promise: nil)
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    private func respond(to head: HTTPRequestHead, context: ChannelHandlerContext) {
        let path = head.uri.split(separator: "?", maxSplits: 1).first.map(String.init) ?? head.uri
        var status = HTTPResponseStatus.ok
        var body = context.channel.allocator.buffer(capacity: 0)
        var contentType = "text/plain; version=0.0.4; charset=utf-8"
        if head.method != .GET && head.method != .HEAD {
            status = .methodNotAllowed
            body.writeString("only GET /metrics is served\n")
            contentType = "text/plain; charset=utf-8"
        } else if path != "/metrics" {
            status = .notFound
            body.writeString("metrics are at /metrics\n")
            contentType = "text/plain; charset=utf-8"
        } else {
            beforeScrape()
            body.writeBytes(registry.emitToBuffer())
        }
        var headers = HTTPHeaders()
        headers.add(name: "Content-Type", value: contentType)
        headers.add(name: "Content-Length", value: "\(body.readableBytes)")
        let keepAlive = head.isKeepAlive
        if !keepAlive { headers.add(name: "Connection", value: "close") }
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
        if head.method != .HEAD { context.write(wrapOutboundOut(.body(.byteBuffer(body))), promise: nil) }
        let written = context.writeAndFlush(wrapOutboundOut(.end(nil)))
        if !keepAlive {
            let channel = context.channel
            written.whenComplete { _ in channel.close(promise: nil) }
        } else {
            awaitRequest(context)
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        context.close(promise: nil)
    }
}
