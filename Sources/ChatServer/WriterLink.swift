import NIOCore
import NIOPosix
import NIOSSL
import NIOTLS
import Threads

/// Whom a node that relays to the writer of a shared store believes to be the writer when
/// the writer's relay listener is TLS (`tls://`): certificates signed by `--node-tls-ca`'s,
/// or by the system's trusted roots without it, for the host name (or IP address) the
/// writer advertised. A certificate that is not, or is not for that name, ends the
/// connection before a byte of a session crosses it.
public final class WriterTrust: Sendable {
    private let configuration: TLSConfiguration
    /// `--node-tls-ca`, or nil for the system's roots (for the log and errors).
    public let caFile: String?
    /// The context, made at once from `--node-tls-ca`, and from the system's roots only
    /// when a writer is first reached over TLS: reading them at every start of every node
    /// of a shared store would cost each one, and a machine without them could not start
    /// a node that never relays over TLS.
    private let made: Locked<NIOSSLContext?>

    /// Reads `caFile` (PEM, one certificate or more); throws, naming it, when it cannot
    /// serve.
    public init(caFile: String?) throws {
        var configuration = TLSConfiguration.makeClientConfiguration()
        configuration.minimumTLSVersion = .tlsv12
        configuration.certificateVerification = .fullVerification
        configuration.trustRoots =
            try caFile.map { .certificates(try TLSIdentity.certificates(in: $0, called: "the certificates")) } ?? .default
        self.configuration = configuration
        self.caFile = caFile
        made = Locked(caFile == nil ? nil : try WriterTrust.context(configuration, caFile: caFile))
    }

    /// The context connections to the writer are made with.
    func context() throws -> NIOSSLContext {
        try made.withLock { made in
            if let made { return made }
            let context = try WriterTrust.context(configuration, caFile: caFile)
            made = context
            return context
        }
    }

    private static func context(_ configuration: TLSConfiguration, caFile: String?) throws -> NIOSSLContext {
        do {
            return try NIOSSLContext(configuration: configuration)
        } catch {
            throw TLSIdentityError("cannot trust the certificates in \(caFile ?? "the system's trust store (give --node-tls-ca)"): \(error)")
        }
    }

    /// What the node trusts, as the log and errors say it.
    var trusted: String { caFile.map { "--node-tls-ca \($0)" } ?? "the system's trusted roots (no --node-tls-ca)" }
}

/// A connection to the writer's relay listener, made for a relayed connection or a relayed
/// standard input/output session: over TLS when the writer's listener is (the writer's
/// certificate verified against `WriterTrust` before the connection is handed over), plain
/// otherwise.
enum WriterLink {
    /// How long a writer's TLS handshake may take.
    static let handshakeTimeout: TimeAmount = .seconds(10)

    /// Connects to `writer` on `eventLoop`; the channel is handed over once it may carry a
    /// session (connected, and over TLS the writer's certificate verified).
    static func connect(to writer: Listener, trust: WriterTrust?, on eventLoop: EventLoop) -> EventLoopFuture<Channel> {
        var bootstrap = ClientBootstrap(group: eventLoop)
            .channelOption(.allowRemoteHalfClosure, value: true)
            .connectTimeout(.seconds(5))
        let verified = eventLoop.makePromise(of: Void.self)
        if writer.tls {
            guard let trust else {
                return eventLoop.makeFailedFuture(
                    WriterLinkError("the writer's relay listener is TLS (\(writer)), and this node was given nothing to verify it with"))
            }
            guard case .tcp(let host, _) = writer.address else {
                return eventLoop.makeFailedFuture(WriterLinkError("a TLS relay listener is a TCP address: \(writer)"))
            }
            let context: NIOSSLContext
            do {
                context = try trust.context()
            } catch {
                return eventLoop.makeFailedFuture(WriterLinkError("the writer at \(writer) cannot be verified: \(error)", untrusted: true))
            }
            bootstrap = bootstrap.channelInitializer { channel in
                do {
                    // An IP address is not a name to send (SNI): NIOSSL then checks the
                    // certificate names the address connected to.
                    let name = WriterLink.isIPAddress(host) ? nil : host
                    try channel.pipeline.syncOperations.addHandler(NIOSSLClientHandler(context: context, serverHostname: name))
                    try channel.pipeline.syncOperations.addHandler(HandshakeWatcher(verified, writer: writer, trust: trust))
                    return channel.eventLoop.makeSucceededVoidFuture()
                } catch {
                    return channel.eventLoop.makeFailedFuture(error)
                }
            }
        } else {
            verified.succeed()
        }
        let connecting: EventLoopFuture<Channel>
        switch writer.address {
        case .tcp(let host, let port): connecting = bootstrap.connect(host: host, port: port)
        case .unix(let path): connecting = bootstrap.connect(unixDomainSocketPath: path)
        }
        connecting.whenFailure { verified.fail($0) }
        return connecting.flatMap { channel in
            let timeout = channel.eventLoop.scheduleTask(in: handshakeTimeout) {
                verified.fail(
                    WriterLinkError("the writer at \(writer) did not finish its TLS handshake within \(handshakeTimeout.nanoseconds / 1_000_000_000) s"))
            }
            return verified.futureResult.map { channel }.flatMapErrorThrowing { error in
                channel.close(promise: nil)
                throw error
            }.always { _ in timeout.cancel() }
        }
    }

    static func isIPAddress(_ host: String) -> Bool {
        var v4 = in_addr()
        var v6 = in6_addr()
        return inet_pton(AF_INET, host, &v4) == 1 || inet_pton(AF_INET6, host, &v6) == 1
    }
}

public struct WriterLinkError: Error, CustomStringConvertible {
    public let description: String
    /// The writer answered, and could not be believed to be the writer (its certificate):
    /// an operator's mistake, or someone in between — not a writer that is starting.
    public let untrusted: Bool
    init(_ description: String, untrusted: Bool = false) {
        self.description = description
        self.untrusted = untrusted
    }
}

/// Completes `verified` when the TLS handshake with the writer is done (its certificate
/// verified), or fails it with what went wrong in words; then steps out of the pipeline.
private final class HandshakeWatcher: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer

    private let verified: EventLoopPromise<Void>
    private let writer: Listener
    private let trust: WriterTrust

    init(_ verified: EventLoopPromise<Void>, writer: Listener, trust: WriterTrust) {
        self.verified = verified
        self.writer = writer
        self.trust = trust
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if case TLSUserEvent.handshakeCompleted = event {
            verified.succeed()
            context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
        }
        context.fireUserInboundEventTriggered(event)
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        verified.fail(WriterLinkError("the writer at \(writer) is not trusted (\(trust.trusted)): \(HandshakeWatcher.describe(error))", untrusted: true))
        context.close(promise: nil)
    }

    func channelInactive(context: ChannelHandlerContext) {
        verified.fail(WriterLinkError("the writer at \(writer) closed the connection during the TLS handshake"))
        context.fireChannelInactive()
    }

    /// NIOSSL's errors in words: which check failed.
    private static func describe(_ error: Error) -> String {
        if let error = error as? NIOSSLExtraError, error == .failedToValidateHostname {
            return "its certificate is not for the address it advertised"
        }
        return switch error {
        case NIOSSLError.handshakeFailed(let reason):
            "\(reason)".contains("CERTIFICATE_VERIFY_FAILED")
                ? "its certificate is not signed by a certificate this node trusts, or has expired" : "the TLS handshake failed: \(reason)"
        default:
            "\(error)"
        }
    }
}
