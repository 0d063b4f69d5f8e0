import ChatMetrics
import Foundation
import Logging
import NIOCore
import NIOPosix
import NIOSSL
import Threads

/// What a node that does not hold the store's writer lock serves: every connection it
/// accepts is relayed, byte for byte, to the node that does (the writer), so that one
/// engine decides for every session of the deployment. Clients cannot tell the difference
/// (authentication, answers and events are the writer's). When the writer goes away this
/// node takes the lock, `handOver()` closes what it relayed (clients connect again and
/// catch up with the change feed) but keeps listening: connections accepted while the node
/// reads the store wait, nothing read from them, and are served once it serves
/// (`serve(with:)`), on the same listeners.
///
/// A `tls://` listener of this node ends its clients' TLS here (with this node's own
/// certificate); the link to the writer is over TLS when the writer's relay listener is,
/// the writer's certificate verified (`WriterLink`).
public final class FollowerProxy: Sendable {
    private let group: MultiThreadedEventLoopGroup
    /// Where the writer accepts connections now (nil: no node is serving yet). Called
    /// off the event loops: it may ask the database.
    private let writer: @Sendable () -> Listener?
    /// Whom this node believes to be the writer over TLS.
    private let trust: WriterTrust?
    /// What this node's own `tls://` listeners present (nil: it has none).
    private let tls: TLSIdentity?
    private let logger: Logger
    /// Relayed connections open at once (`--max-sessions`, fitted to the descriptors).
    private let admitted: ConnectionLimit
    /// The listeners and the relayed connections open now.
    private struct Open {
        var listeners: [(listener: Listener, channel: Channel)] = []
        var connections: [ObjectIdentifier: Channel] = [:]
        var mode = Mode.relaying
        /// Connections accepted while the node takes over (`Mode.holding`).
        var held: [(channel: Channel, listener: Listener)] = []
        /// The local addresses of this proxy's own connections to the writer: one
        /// accepted from such an address is this node relaying to itself (the writer
        /// advertised an address that, from here, is this node).
        var ownUpstreams: Set<String> = []
    }

    /// What a connection accepted now is for.
    private enum Mode {
        /// Relayed to the writer.
        case relaying
        /// Held, nothing read, until the node serves (it took the writer lock and reads
        /// the store).
        case holding
        /// Served by the node itself.
        case serving(@Sendable (Channel, Listener) -> EventLoopFuture<Void>)
    }

    private let open = Locked(Open())
    /// The last answer of `writer` and when it came: connections waiting for a writer ask
    /// every 200 ms, and each answer costs a database connection, so it is shared. Its
    /// lock is held while `writer` is asked (one at a time; the others take its answer).
    private let lastLookup = Locked<(address: Listener?, at: NIODeadline)?>(nil)
    /// When a writer that could not be trusted was last said in the log: once every
    /// few seconds, not at every try of every connection.
    private let lastDistrust = Locked<NIODeadline?>(nil)

    public init(
        group: MultiThreadedEventLoopGroup, writer: @escaping @Sendable () -> Listener?, trust: WriterTrust?, tls: TLSIdentity? = nil,
        maxConnections: Int = 10_000, logger: Logger
    ) {
        self.group = group
        self.writer = writer
        self.trust = trust
        self.tls = tls
        self.admitted = ConnectionLimit(maxConnections)
        self.logger = logger
    }

    /// Starts accepting at `listener` (one that speaks lines, over TLS or not); returns the
    /// bound channel.
    public func bind(_ listener: Listener) async throws -> Channel {
        precondition(listener.framing == .lines, "a relaying node relays lines")
        precondition(!listener.tls || tls != nil, "a TLS listener needs the node's TLSIdentity")
        let tls = listener.tls ? self.tls : nil
        let bootstrap = ServerBootstrap(group: group)
            .serverChannelOption(.backlog, value: 256)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            // Nothing is read from a client before its relay to the writer is up.
            .childChannelOption(.autoRead, value: false)
            .childChannelOption(.allowRemoteHalfClosure, value: true)
            .childChannelInitializer { [self] channel in
                enum Then {
                    case relay, hold
                    case serve(@Sendable (Channel, Listener) -> EventLoopFuture<Void>)
                }
                // Decided and noted at once: a connection is either held before the node
                // serves, and handed over then, or served by it.
                let then = open.withLock { open -> Then in
                    switch open.mode {
                    case .relaying: return .relay
                    case .serving(let serve): return .serve(serve)
                    case .holding:
                        open.held.append((channel, listener))
                        return .hold
                    }
                }
                if case .serve(let serve) = then { return serve(channel, listener) }
                // Nothing is read before the connection is relayed or served, but what a
                // client that ends its input sent is read at once: held until then.
                do {
                    try channel.pipeline.syncOperations.addHandler(HeldInput())
                } catch {
                    return channel.close()
                }
                if case .hold = then {
                    guard admitted.admit(channel) else {
                        logger.warning("refusing a connection while taking over: --max-sessions reached", metadata: ["maxSessions": "\(admitted.limit)"])
                        return channel.close()
                    }
                    return channel.eventLoop.makeSucceededVoidFuture()
                }
                if refuseIfOwn(channel) { return channel.close() }
                guard admitted.admit(channel) else {
                    logger.warning("refusing a connection to relay: --max-sessions reached", metadata: ["maxSessions": "\(admitted.limit)"])
                    return channel.close()
                }
                track(channel)
                if let tls {
                    do {
                        try channel.pipeline.syncOperations.addHandler(NIOSSLServerHandler(context: tls.context))
                    } catch {
                        return channel.close()
                    }
                }
                ServiceMetrics.relayedConnectionsAccepted.increment()
                ServiceMetrics.relayedConnections.increment()
                channel.closeFuture.whenComplete { _ in ServiceMetrics.relayedConnections.decrement() }
                DispatchQueue.global().async { self.relay(channel) }
                return channel.eventLoop.makeSucceededVoidFuture()
            }
        let channel = try await bootstrap.bind(listening: listener.address)
        open.withLock { $0.listeners.append((listener, channel)) }
        return channel
    }

    /// Closes every relayed connection (and its relay) and holds the connections accepted
    /// from now on; returns the listeners, which stay open, for the node to serve on
    /// (`serve(with:)`). Called once this node holds the writer lock.
    public func handOver() -> [(listener: Listener, channel: Channel)] {
        let (listening, connected) = open.withLock { open -> ([(listener: Listener, channel: Channel)], [Channel]) in
            open.mode = .holding
            defer { open.connections = [:] }
            return (open.listeners, Array(open.connections.values))
        }
        for channel in connected { try? channel.close().wait() }
        return listening
    }

    /// From now on `serve` serves what the listeners accept; the connections held since
    /// `handOver()` are handed to it first (those that went away meanwhile are closed).
    public func serve(with serve: @escaping @Sendable (Channel, Listener) -> EventLoopFuture<Void>) {
        let held = open.withLock { open -> [(channel: Channel, listener: Listener)] in
            open.mode = .serving(serve)
            defer { open.held = [] }
            return open.held
        }
        for (channel, listener) in held {
            channel.eventLoop.execute { _ = serve(channel, listener) }
        }
    }

    /// Stops accepting and closes every relayed connection (and its relay), and waits
    /// until the listeners (their addresses can be bound again) and the connections are
    /// closed: the event loops go on serving the node. Once: later calls do nothing.
    public func stop() {
        let (listening, connected) = open.withLock { open -> ([Channel], [Channel]) in
            defer {
                open.listeners = []
                open.connections = [:]
                open.held = []
            }
            return (open.listeners.map(\.channel), Array(open.connections.values) + open.held.map(\.channel))
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
        guard let writer = currentWriter() else {
            tryAgain("no node serves the store yet")
            return
        }
        let address = writer.address
        if case .unix = address, open.withLock({ $0.listeners.contains { $0.channel.localAddress.map { "unix:\($0.pathname ?? "")" } == address.description } })
        {
            logger.error("the writer's advertised address is this node's own socket: refusing to relay to it", metadata: ["address": "\(address)"])
            client.close(promise: nil)
            return
        }
        WriterLink.connect(to: writer, trust: trust, on: client.eventLoop).whenComplete { result in
            switch result {
            case .failure(let error as WriterLinkError):
                self.sayDistrust(error)
                tryAgain("\(error)")
            case .failure(let error):
                tryAgain("cannot reach the writer node at \(writer): \(error)")
            case .success(let upstream):
                self.track(upstream)
                if let local = FollowerProxy.ipAddress(upstream.localAddress) {
                    self.open.withLock { _ = $0.ownUpstreams.insert(local) }
                    upstream.closeFuture.whenComplete { _ in self.open.withLock { _ = $0.ownUpstreams.remove(local) } }
                }
                Splice.join(client, to: upstream, stillWanted: { self.isOpen(client) }).whenComplete { _ in }
            }
        }
    }

    /// Says in the log, at once but not more than every 5 s, that the writer could not
    /// be trusted (a certificate that is not, or not for its address): an operator's
    /// mistake or someone in between, not a writer that is starting.
    private func sayDistrust(_ error: WriterLinkError) {
        let now = NIODeadline.now()
        let say = lastDistrust.withLock { last in
            guard last.map({ now - $0 >= .seconds(5) }) ?? true else { return false }
            last = now
            return true
        }
        if say { logger.error("cannot relay to the writer node", metadata: ["problem": "\(error)"]) }
    }

    /// Where the writer accepts connections: `writer`'s answer, asked again once it is
    /// 200 ms old.
    private func currentWriter() -> Listener? {
        lastLookup.withLock { lastLookup in
            if let lastLookup, NIODeadline.now() - lastLookup.at < .milliseconds(200) { return lastLookup.address }
            let address = writer()
            lastLookup = (address, .now())
            return address
        }
    }
}
