import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Reads lines from a file descriptor on a thread of its own, so a test can wait for the
/// next line with a deadline.
///
/// The stream owns its descriptor: the reading thread closes it when reading ends, and
/// nothing else may. Transcripts run in parallel in one process, so a number closed
/// under a reading thread is soon another transcript's socket or pipe, and the thread
/// would read (and lose) that transcript's lines: under ASan about one `make asan` in
/// three failed with "no line came within 30 s" while the server had written the line.
/// Give it a `dup` of a descriptor used for anything else.
final class LineStream: @unchecked Sendable {
    private let condition = NSCondition()
    private var lines: [String] = []
    private var closed = false
    private var partial: [UInt8] = []
    let descriptor: Int32

    init(descriptor: Int32) {
        self.descriptor = descriptor
        let thread = Thread { [self] in readLoop() }
        thread.start()
    }

    private func readLoop() {
        var buffer = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = buffer.withUnsafeMutableBytes { read(descriptor, $0.baseAddress, $0.count) }
            if count < 0 && errno == EINTR { continue }
            if count <= 0 { break }
            condition.lock()
            for byte in buffer[0..<count] {
                if byte == 0x0A {
                    lines.append(String(decoding: partial, as: UTF8.self))
                    partial.removeAll(keepingCapacity: true)
                } else {
                    partial.append(byte)
                }
            }
            condition.broadcast()
            condition.unlock()
        }
        Glibc.close(descriptor)
        condition.lock()
        if !partial.isEmpty { lines.append(String(decoding: partial, as: UTF8.self)) }
        closed = true
        condition.broadcast()
        condition.unlock()
    }

    enum Next: Equatable {
        case line(String)
        case endOfStream
        case timedOut
    }

    /// How long a transcript waits for a line: long, because CI's virtual disk can stall a
    /// synced commit for seconds right after a build has written gigabytes (a line that
    /// should come never passes for one that came late).
    static let patience: TimeInterval = 30

    func next(timeout: TimeInterval = LineStream.patience) -> Next {
        let deadline = Date(timeIntervalSinceNow: timeout)
        condition.lock()
        defer { condition.unlock() }
        while lines.isEmpty && !closed {
            if !condition.wait(until: deadline) { return lines.isEmpty ? .timedOut : .line(lines.removeFirst()) }
        }
        if lines.isEmpty { return .endOfStream }
        return .line(lines.removeFirst())
    }

    /// Lines so far, without waiting (for diagnostics).
    func drain() -> [String] {
        condition.lock()
        defer { condition.unlock() }
        let taken = lines
        lines.removeAll()
        return taken
    }
}

/// A connection to the server on loopback or a Unix socket.
final class SocketConnection {
    let descriptor: Int32
    let stream: LineStream

    init(tcpPort: Int) throws {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { throw FixtureError("socket() failed") }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(tcpPort).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard result == 0 else {
            Glibc.close(fd)
            throw FixtureError("connect to 127.0.0.1:\(tcpPort) failed: errno \(errno)")
        }
        descriptor = fd
        stream = LineStream(descriptor: dup(fd))
    }

    init(unixPath: String) throws {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { throw FixtureError("socket() failed") }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(unixPath.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: address.sun_path) else { throw FixtureError("socket path too long") }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            for (index, byte) in bytes.enumerated() { raw[index] = byte }
        }
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        guard result == 0 else {
            Glibc.close(fd)
            throw FixtureError("connect to \(unixPath) failed: errno \(errno)")
        }
        descriptor = fd
        stream = LineStream(descriptor: dup(fd))
    }

    func send(_ bytes: [UInt8]) throws {
        try writeAll(descriptor, bytes)
    }

    func shutdownWrite() {
        shutdown(descriptor, Int32(SHUT_WR))
    }

    /// Closes the connection: the stream reads to its end, then closes its own copy.
    func close() {
        shutdown(descriptor, Int32(SHUT_RDWR))
        Glibc.close(descriptor)
    }
}

func writeAll(_ descriptor: Int32, _ bytes: [UInt8]) throws {
    var offset = 0
    while offset < bytes.count {
        let written = bytes.withUnsafeBytes { write(descriptor, $0.baseAddress! + offset, bytes.count - offset) }
        if written < 0 {
            if errno == EINTR { continue }
            throw FixtureError("write failed: errno \(errno)")
        }
        offset += written
    }
}

struct FixtureError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}
