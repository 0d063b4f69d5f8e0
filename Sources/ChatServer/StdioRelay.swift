import ChatProtocol
import ChatWire
import Foundation
import Logging
import NIOCore
import NIOPosix
import Threads

#if canImport(Glibc)
    import Glibc
#endif

/// The standard input/output session of a node that is not the writer of a shared store:
/// relayed, byte for byte, to the writer over a socket, so that the writer's engine decides
/// for it as for every other session of the deployment (what `FollowerProxy` does for
/// socket connections). A session started trusted (`--user`) is started so there too: the
/// first line the writer reads is an `authToken` carrying a token this node signed with the
/// node key (`--node-key-file`, never in the database) for that user and that writer,
/// which makes that connection the session of that user, as if it were the writer's own
/// standard input/output.
///
/// Blocking threads, as `StdioTransport`: standard input may be a regular file, which
/// epoll cannot watch. Over TLS (the writer's relay listener is `tls://`), those threads
/// talk to one end of a socket pair, and the other end is joined to a TLS connection to
/// the writer on an event loop (`WriterLink`: the writer's certificate is verified before
/// a byte of the session is sent).
public final class StdioRelay: Sendable {
    /// How a relay ended.
    public enum Outcome: Equatable, Sendable {
        /// Standard input ended (or the relay was told to end it), and the writer
        /// answered everything it was sent and closed the connection.
        case answered
        /// The writer's connection ended while standard input was still open: the
        /// writer stopped or died. The session is over; its client starts it again.
        case writerGone
        /// Standard output could not be written any more.
        case outputClosed
    }

    private let socket: Int32
    private let input: Int32
    private let output: Int32
    private let logger: Logger
    private let inputEnded = Locked(false)

    private init(socket: Int32, logger: Logger, input: Int32, output: Int32) {
        self.socket = socket
        self.input = input
        self.output = output
        self.logger = logger
    }

    /// Connects to the writer's relay listener `writer` (over TLS, verified against
    /// `trust`, when it is `tls://`; on `group`, made only then) and sends `first` (the node token's line,
    /// or nothing) before anything of standard input.
    public static func connect(
        to writer: Listener, trust: WriterTrust?, group: @autoclosure () -> EventLoopGroup, first: [UInt8], logger: Logger, input: Int32 = 0, output: Int32 = 1
    ) async throws -> StdioRelay {
        signal(SIGPIPE, SIG_IGN)
        let socket = writer.tls ? try await tunnel(to: writer, trust: trust, group: group()) : try connect(writer.address)
        guard writeAll(socket, first) else {
            Glibc.close(socket)
            throw RelayError(description: "the writer at \(writer) closed the connection at once")
        }
        return StdioRelay(socket: socket, logger: logger, input: input, output: output)
    }

    /// One end of a socket pair whose other end is joined to a TLS connection to `writer`,
    /// made and verified before this returns.
    private static func tunnel(to writer: Listener, trust: WriterTrust?, group: EventLoopGroup) async throws -> Int32 {
        var ends: [Int32] = [-1, -1]
        guard socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &ends) == 0 else { throw RelayError(description: "socketpair: errno \(errno)") }
        let eventLoop = group.next()
        let upstream: Channel
        do {
            upstream = try await WriterLink.connect(to: writer, trust: trust, on: eventLoop).get()
        } catch {
            Glibc.close(ends[0])
            Glibc.close(ends[1])
            throw error
        }
        do {
            let bridge = try await ClientBootstrap(group: eventLoop)
                .channelOption(.allowRemoteHalfClosure, value: true)
                .channelOption(.autoRead, value: false)
                .withConnectedSocket(ends[1]).get()
            try await eventLoop.flatSubmit { Splice.join(bridge, to: upstream) }.get()
        } catch {
            upstream.close(promise: nil)
            Glibc.close(ends[0])
            throw RelayError(description: "cannot relay to the writer at \(writer): \(error)")
        }
        return ends[0]
    }

    /// The first line of a session started trusted as `user`: its `authToken` carries this
    /// node's word for it (`NodeKey.vouch`; see `Session`).
    public static func trustedStart(user: String, token: String) -> [UInt8] {
        var writer = JSONWriter(capacity: 512)
        Request.authToken(AuthToken(userId: user, authToken: token)).encode(to: &writer)
        return writer.bytes
    }

    struct RelayError: Error, CustomStringConvertible {
        let description: String
    }

    /// Relays both ways until the writer closes the connection.
    public func run() -> Outcome {
        let upstream = Thread { [self] in
            nameCurrentThread("stdin")
            relayInput()
        }
        upstream.start()
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 64 * 1024, alignment: 16)
        defer { buffer.deallocate() }
        while true {
            let count = read(socket, buffer.baseAddress, buffer.count)
            if count < 0 && errno == EINTR { continue }
            if count <= 0 { break }
            guard StdioRelay.writeAll(output, UnsafeRawBufferPointer(rebasing: buffer[0..<count])) else {
                logger.warning("standard output is closed: ending the relayed session")
                shutdown(socket, Int32(SHUT_RDWR))
                return .outputClosed
            }
        }
        return inputEnded.withLock { $0 } ? .answered : .writerGone
    }

    /// Ends the session as the end of standard input would (SIGTERM): the writer answers
    /// what it was sent, then closes.
    public func endInput() {
        inputEnded.withLock { $0 = true }
        shutdown(socket, Int32(SHUT_WR))
    }

    private func relayInput() {
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 64 * 1024, alignment: 16)
        defer { buffer.deallocate() }
        while !inputEnded.withLock({ $0 }) {
            let count = read(input, buffer.baseAddress, buffer.count)
            if count < 0 && errno == EINTR { continue }
            if count < 0 { logger.error("reading standard input failed", metadata: ["errno": "\(errno)"]) }
            if count <= 0 { break }
            // A write that fails: the writer went (`run` sees its connection end).
            guard StdioRelay.writeAll(socket, UnsafeRawBufferPointer(rebasing: buffer[0..<count])) else { return }
        }
        endInput()
    }

    private static func writeAll(_ descriptor: Int32, _ bytes: [UInt8]) -> Bool {
        bytes.withUnsafeBytes { writeAll(descriptor, $0) }
    }

    private static func writeAll(_ descriptor: Int32, _ bytes: UnsafeRawBufferPointer) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let written = write(descriptor, bytes.baseAddress! + offset, bytes.count - offset)
            if written < 0 && errno == EINTR { continue }
            if written <= 0 { return false }
            offset += written
        }
        return true
    }

    /// A blocking stream socket connected to `address`.
    private static func connect(_ address: ListenAddress) throws -> Int32 {
        switch address {
        case .unix(let path):
            let descriptor = Glibc.socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
            guard descriptor >= 0 else { throw RelayError(description: "socket: errno \(errno)") }
            var socketAddress = sockaddr_un()
            socketAddress.sun_family = sa_family_t(AF_UNIX)
            let bytes = Array(path.utf8)
            guard bytes.count < MemoryLayout.size(ofValue: socketAddress.sun_path) else {
                Glibc.close(descriptor)
                throw RelayError(description: "the socket path \(path) is too long")
            }
            withUnsafeMutableBytes(of: &socketAddress.sun_path) { raw in
                raw.copyBytes(from: bytes)
                raw[bytes.count] = 0
            }
            let connected = withUnsafePointer(to: &socketAddress) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                    Glibc.connect(descriptor, $0, socklen_t(MemoryLayout<sockaddr_un>.size))
                }
            }
            guard connected == 0 else {
                let error = errno
                Glibc.close(descriptor)
                throw RelayError(description: "cannot connect to \(address): errno \(error)")
            }
            return descriptor
        case .tcp(let host, let port):
            var hints = addrinfo()
            hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
            var found: UnsafeMutablePointer<addrinfo>?
            guard getaddrinfo(host, String(port), &hints, &found) == 0, let first = found else {
                throw RelayError(description: "cannot resolve \(host)")
            }
            defer { freeaddrinfo(first) }
            var candidate: UnsafeMutablePointer<addrinfo>? = first
            var lastError: Int32 = 0
            while let entry = candidate {
                let descriptor = Glibc.socket(entry.pointee.ai_family, entry.pointee.ai_socktype, entry.pointee.ai_protocol)
                if descriptor >= 0 {
                    if Glibc.connect(descriptor, entry.pointee.ai_addr, entry.pointee.ai_addrlen) == 0 {
                        var on: Int32 = 1
                        setsockopt(descriptor, Int32(IPPROTO_TCP), TCP_NODELAY, &on, socklen_t(MemoryLayout<Int32>.size))
                        return descriptor
                    }
                    lastError = errno
                    Glibc.close(descriptor)
                }
                candidate = entry.pointee.ai_next
            }
            throw RelayError(description: "cannot connect to \(address): errno \(lastError)")
        }
    }
}
