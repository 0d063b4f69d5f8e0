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

extension ListenAddress {
    /// What would keep the service from listening here, in one sentence that says what to
    /// do, or nil: checked before the store is opened, so that a port in use or a
    /// directory that is not there stops the start at once (the address is bound for real
    /// later; a program that takes it in between is still reported then).
    public func problem() -> String? {
        switch self {
        case .tcp(_, 0):
            return nil
        case .tcp(let host, let port):
            var hints = addrinfo()
            hints.ai_flags = AI_PASSIVE
            hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
            var found: UnsafeMutablePointer<addrinfo>?
            guard getaddrinfo(host, String(port), &hints, &found) == 0, let first = found else {
                return "cannot listen on \(self): \(host) is not an address or a name this machine resolves; give an IP address or a resolvable name"
            }
            defer { freeaddrinfo(found) }
            var entry: UnsafeMutablePointer<addrinfo>? = first
            while let info = entry {
                let probe = socket(info.pointee.ai_family, info.pointee.ai_socktype, info.pointee.ai_protocol)
                if probe >= 0 {
                    var on: Int32 = 1
                    setsockopt(probe, SOL_SOCKET, SO_REUSEADDR, &on, socklen_t(MemoryLayout<Int32>.size))
                    let bound = bind(probe, info.pointee.ai_addr, info.pointee.ai_addrlen)
                    let failure = errno
                    close(probe)
                    if bound != 0 {
                        switch failure {
                        case EADDRINUSE:
                            return "cannot listen on \(self): the port is in use (another chatcore, or another program): stop it, or choose another --listen"
                        case EACCES:
                            return "cannot listen on \(self): ports below 1024 need privileges; choose a port from 1024 up"
                        case EADDRNOTAVAIL:
                            return "cannot listen on \(self): this machine has no such address; use one of its own, or 0.0.0.0 for every one"
                        default:
                            return "cannot listen on \(self): \(String(cString: strerror(failure)))"
                        }
                    }
                }
                entry = info.pointee.ai_next
            }
            return nil
        case .unix(let path):
            let directory = (path as NSString).deletingLastPathComponent
            let parent = directory.isEmpty ? "." : directory
            var isDirectory: ObjCBool = false
            guard FileManager.default.fileExists(atPath: parent, isDirectory: &isDirectory), isDirectory.boolValue else {
                return "cannot listen on \(self): the directory \(parent) does not exist; make it, or choose another path"
            }
            guard access(parent, W_OK | X_OK) == 0 else {
                return "cannot listen on \(self): this user may not make files in \(parent); choose a directory it owns"
            }
            guard path.utf8.count < 108 else {
                return "cannot listen on \(self): a Unix socket's path may have at most 107 bytes; choose a shorter one"
            }
            var status = stat()
            guard lstat(path, &status) == 0 else { return nil }
            guard status.st_mode & S_IFMT == S_IFSOCK else {
                return "cannot listen on \(self): the path exists and is not a socket; remove it, or choose another path"
            }
            // A socket file: one that answers belongs to a process serving it (one that does
            // not is left from a process that stopped, and is replaced).
            let probe = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
            guard probe >= 0 else { return nil }
            defer { close(probe) }
            var address = sockaddr_un()
            address.sun_family = sa_family_t(AF_UNIX)
            withUnsafeMutableBytes(of: &address.sun_path) { bytes in
                for (index, byte) in path.utf8.enumerated() { bytes[index] = byte }
            }
            let connected = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(probe, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
            }
            return connected == 0
                ? "cannot listen on \(self): another process serves this socket; stop it, or choose another path" : nil
        }
    }
}
