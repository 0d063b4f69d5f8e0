import Foundation

#if canImport(Glibc)
    import Glibc
#endif

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
