import ChatMetrics
import Foundation
import Logging
import NIOCore
import NIOPosix
import Threads

/// What a node that does not hold the store's writer lock serves: every connection it
/// accepts is relayed, byte for byte, to the node that does (the writer), so that one
/// engine decides for every session of the deployment. Clients cannot tell the difference
/// (authentication, answers and events are the writer's). When the writer goes away this
/// node takes the lock, `stop()` closes what it relayed (clients connect again and catch
/// up with the change feed), and the node serves by itself.
public final class FollowerProxy: Sendable {
    private let group: MultiThreadedEventLoopGroup
    /// Where the writer accepts connections now (nil: no node is serving yet). Called
    /// off the event loops: it may ask the database.
    private let writer: @Sendable () -> ListenAddress?
    private let logger: Logger
    /// Relayed connections open at once (`--max-sessions`, fitted to the descriptors).
    private let admitted: ConnectionLimit
    /// The listeners and the relayed connections open now.
    private struct Open {
        var listeners: [Channel] = []
        var connections: [ObjectIdentifier: Channel] = [:]
        /// The local addresses of this proxy's own connections to the writer: one
        /// accepted from such an address is this node relaying to itself (the writer
        /// advertised an address that, from here, is this node).
        var ownUpstreams: Set<String> = []
    }

    private let open = Locked(Open())
    /// The last answer of `writer` and when it came: connections waiting for a writer ask
    /// every 200 ms, and each answer costs a database connection, so it is shared. Its
    /// lock is held while `writer` is asked (one at a time; the others take its answer).
    private let lastLookup = Locked<(address: ListenAddress?, at: NIODeadline)?>(nil)

    public init(group: MultiThreadedEventLoopGroup, writer: @escaping @Sendable () -> ListenAddress?, maxConnections: Int = 10_000, logger: Logger) {
        self.group = group
        self.writer = writer
        self.admitted = ConnectionLimit(maxConnections)
        self.logger = logger
    }

    /// Starts accepting at `address`; returns the bound channel.
    public func bind(_ address: ListenAddress) async throws -> Channel {
        let bootstrap = ServerBootstrap(group: group)
            .serverChannelOption(.backlog, value: 256)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            // Nothing is read from a client before its relay to the writer is up.
            .childChannelOption(.autoRead, value: false)
            .childChannelOption(.allowRemoteHalfClosure, value: true)
            .childChannelInitializer { [self] channel in
                if refuseIfOwn(channel) { return channel.close() }
                guard admitted.admit(channel) else {
                    logger.warning("refusing a connection to relay: --max-sessions reached", metadata: ["maxSessions": "\(admitted.limit)"])
                    return channel.close()
                }
                track(channel)
                ServiceMetrics.relayedConnectionsAccepted.increment()
                ServiceMetrics.relayedConnections.increment()
                channel.closeFuture.whenComplete { _ in ServiceMetrics.relayedConnections.decrement() }
                DispatchQueue.global().async { self.relay(channel) }
                return channel.eventLoop.makeSucceededVoidFuture()
            }
        let channel = try await bootstrap.bind(listening: address)
        open.withLock { $0.listeners.append(channel) }
        return channel
    }

    /// Stops accepting and closes every relayed connection (and its relay), and waits
    /// until the listeners (their addresses can be bound again) and the connections are
    /// closed: the event loops go on serving the node. Once: later calls do nothing.
    public func stop() {
        let (listening, connected) = open.withLock { open -> ([Channel], [Channel]) in
            defer {
                open.listeners = []
                open.connections = [:]
            }
            return (open.listeners, Array(open.connections.values))
        }
        for listener in listening { try? listener.close().wait() }
        for channel in connected { try? channel.close().wait() }
    }

    /// Whether `client` is this proxy's own connection to the writer, coming back: said,
    /// and then the caller closes it (which closes the connection it relayed, and so on
    /// back to the first client), instead of relaying it again without end.
    private func refuseIfOwn(_ client: Channel) -> Bool {
        guard let remote = FollowerProxy.ipAddress(client.remoteAddress), open.withLock({ $0.ownUpstreams.contains(remote) }) else { return false }
        logger.error(
            "the writer's advertised address reaches this node itself: refusing to relay to it (give the writer an --advertise address other nodes reach it at)",
            metadata: ["address": "\(client.localAddress.map { "\($0)" } ?? "?")"])
        return true
    }

    /// An IP address and port as text; nil for anything else. A Unix socket's client end
    /// has no name, so every one would look like every other (a relay to a writer on a
    /// Unix socket that is this node's own is refused by its path instead).
    private static func ipAddress(_ address: SocketAddress?) -> String? {
        switch address {
        case .v4?, .v6?: address.map { "\($0)" }
        default: nil
        }
    }

    private func track(_ channel: Channel) {
        let key = ObjectIdentifier(channel)
        open.withLock { $0.connections[key] = channel }
        channel.closeFuture.whenComplete { _ in
            self.open.withLock { _ = $0.connections.removeValue(forKey: key) }
        }
    }

    /// How long a connection waits for a writer that can be reached, and so does a
    /// relayed standard input/output session: the writer may be starting (it advertises
    /// where it accepts connections once it serves) or taking over from one that went.
    public static let writerPatience: TimeAmount = .seconds(30)

    /// Whether `channel` is tracked: not closed, and the proxy not stopped.
    private func isOpen(_ channel: Channel) -> Bool {
        open.withLock { $0.connections[ObjectIdentifier(channel)] != nil }
    }

    /// Connects `client` to the writer and relays both ways. While no writer can be
    /// reached (none has advertised yet, or the one advertised does not answer), tries
    /// again every 200 ms, `client` waiting (nothing is read from it), and closes `client`
    /// after `writerPatience`.
    private func relay(_ client: Channel, deadline: NIODeadline = .now() + FollowerProxy.writerPatience) {
        let logger = self.logger
        @Sendable func tryAgain(_ problem: String) {
            guard NIODeadline.now() < deadline else {
                logger.warning("no writer node could be reached: closing a connection", metadata: ["problem": "\(problem)"])
                client.close(promise: nil)
                return
            }
            DispatchQueue.global().asyncAfter(deadline: .now() + 0.2) {
                // Unless the client went away, or the proxy stopped, meanwhile.
                if self.isOpen(client) { self.relay(client, deadline: deadline) }
            }
        }
        // Checked again here: accepting it may have come before its upstream was noted.
        if refuseIfOwn(client) {
            client.close(promise: nil)
            return
        }
        guard let address = currentWriter() else {
            tryAgain("no node serves the store yet")
            return
        }
        if case .unix = address, open.withLock({ $0.listeners.contains { $0.localAddress.map { "unix:\($0.pathname ?? "")" } == address.description } }) {
            logger.error("the writer's advertised address is this node's own socket: refusing to relay to it", metadata: ["address": "\(address)"])
            client.close(promise: nil)
            return
        }
        let bootstrap = ClientBootstrap(group: client.eventLoop)
            .channelOption(.allowRemoteHalfClosure, value: true)
            .connectTimeout(.seconds(5))
        let connecting: EventLoopFuture<Channel>
        switch address {
        case .tcp(let host, let port): connecting = bootstrap.connect(host: host, port: port)
        case .unix(let path): connecting = bootstrap.connect(unixDomainSocketPath: path)
        }
        connecting.whenComplete { result in
            switch result {
            case .failure(let error):
                tryAgain("cannot reach the writer node at \(address): \(error)")
            case .success(let upstream):
                self.track(upstream)
                if let local = FollowerProxy.ipAddress(upstream.localAddress) {
                    self.open.withLock { _ = $0.ownUpstreams.insert(local) }
                    upstream.closeFuture.whenComplete { _ in self.open.withLock { _ = $0.ownUpstreams.remove(local) } }
                }
                let toWriter = Relay(partner: upstream)
                let toClient = Relay(partner: client)
                do {
                    // On the client's event loop: a client that went away while this
                    // connected does not leave the upstream open.
                    try client.pipeline.syncOperations.addHandler(toWriter)
                    guard self.isOpen(client) else { throw ChannelError.ioOnClosedChannel }
                } catch {
                    client.close(promise: nil)
                    upstream.close(promise: nil)
                    return
                }
                upstream.pipeline.addHandler(toClient).whenComplete { added in
                    guard case .success = added else {
                        client.close(promise: nil)
                        upstream.close(promise: nil)
                        return
                    }
                    client.setOption(.autoRead, value: true).whenComplete { _ in }
                }
            }
        }
    }

    /// Where the writer accepts connections: `writer`'s answer, asked again once it is
    /// 200 ms old.
    private func currentWriter() -> ListenAddress? {
        lastLookup.withLock { lastLookup in
            if let lastLookup, NIODeadline.now() - lastLookup.at < .milliseconds(200) { return lastLookup.address }
            let address = writer()
            lastLookup = (address, .now())
            return address
        }
    }
}

/// Passes what one channel reads to its partner; reading pauses while the partner cannot
/// take more (its write buffer is above its high water mark); a half-close and a close
/// pass through.
private final class Relay: ChannelDuplexHandler, Sendable {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer

    let partner: Channel

    init(partner: Channel) {
        self.partner = partner
    }

    func handlerAdded(context: ChannelHandlerContext) {
        // When the partner can take more again, this side reads again.
        let ownChannel = context.channel
        partner.pipeline.addHandler(WritabilityWatcher(resume: ownChannel)).whenComplete { _ in }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        partner.write(unwrapInboundIn(data), promise: nil)
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        partner.flush()
        if !partner.isWritable {
            context.channel.setOption(.autoRead, value: false).whenComplete { _ in }
        }
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if case ChannelEvent.inputClosed = event {
            partner.close(mode: .output, promise: nil)
        }
        context.fireUserInboundEventTriggered(event)
    }

    func channelInactive(context: ChannelHandlerContext) {
        partner.close(promise: nil)
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        context.close(promise: nil)
    }
}

/// Resumes reading on `resume` when the channel it watches becomes writable again.
private final class WritabilityWatcher: ChannelInboundHandler, Sendable {
    typealias InboundIn = ByteBuffer

    let resume: Channel

    init(resume: Channel) {
        self.resume = resume
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable {
            resume.setOption(.autoRead, value: true).whenComplete { _ in }
        }
        context.fireChannelWritabilityChanged()
    }
}
