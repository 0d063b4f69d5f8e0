import Logging
import NIOCore
import NIOHTTP1
import NIOPosix
import Prometheus

/// Serves the registry's metrics in Prometheus' text format over HTTP (`GET /metrics`),
/// for `--metrics ADDR`. Anything else is 404; only GET and HEAD are served.
public final class MetricsEndpoint: Sendable {
    private let registry: PrometheusCollectorRegistry
    private let beforeScrape: @Sendable () -> Void

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
            .childChannelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline()
                    try channel.pipeline.syncOperations.addHandler(ScrapeHandler(registry: registry, beforeScrape: beforeScrape))
                }
            }
            .bind(host: host, port: port).get()
    }
}

private final class ScrapeHandler: ChannelInboundHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let registry: PrometheusCollectorRegistry
    private let beforeScrape: @Sendable () -> Void
    private var head: HTTPRequestHead?

    init(registry: PrometheusCollectorRegistry, beforeScrape: @escaping @Sendable () -> Void) {
        self.registry = registry
        self.beforeScrape = beforeScrape
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head(let head):
            self.head = head
        case .body:
            break
        case .end:
            guard let head else { return }
            self.head = nil
            respond(to: head, context: context)
        }
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
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        context.close(promise: nil)
    }
}
