/// What one `--listen` names: where to listen (`ListenAddress`) and how sessions speak
/// there — newline-delimited JSON on the socket, or one protocol message per WebSocket
/// text frame (for browsers, which cannot open a TCP socket).
///
/// Spelled `HOST:PORT`, `unix:PATH`, or `ws://HOST:PORT[/PATH]` (the path the upgrade
/// must ask for; `/` when none is given); `tls://HOST:PORT` and `wss://HOST:PORT[/PATH]`
/// are the same over TLS (`TLSIdentity`).
public struct Listener: Sendable, Equatable, CustomStringConvertible {
    public enum Framing: Sendable, Equatable {
        /// Newline-delimited JSON, as on standard input/output.
        case lines
        /// A WebSocket (RFC 6455) upgraded from an HTTP/1.1 request for `path`.
        case webSocket(path: String)
    }

    public var address: ListenAddress
    public var framing: Framing
    /// Sessions speak TLS first (TCP only).
    public var tls: Bool

    public init(address: ListenAddress, framing: Framing = .lines, tls: Bool = false) {
        self.address = address
        self.framing = framing
        self.tls = tls
    }

    public init?(_ text: String) {
        if text.hasPrefix("tls://") {
            guard let address = ListenAddress(String(text.dropFirst("tls://".count))), case .tcp = address else { return nil }
            self.init(address: address, tls: true)
            return
        }
        let tls = text.hasPrefix("wss://")
        guard tls || text.hasPrefix("ws://") else {
            guard let address = ListenAddress(text) else { return nil }
            self.init(address: address)
            return
        }
        let rest = text.dropFirst(tls ? "wss://".count : "ws://".count)
        let slash = rest.firstIndex(of: "/") ?? rest.endIndex
        let path = slash == rest.endIndex ? "/" : String(rest[slash...])
        // A path is what a request line carries: no spaces, no query.
        guard !path.contains(where: { $0 == " " || $0 == "?" || $0 == "#" }), let address = ListenAddress(String(rest[..<slash])),
            case .tcp = address
        else { return nil }
        self.init(address: address, framing: .webSocket(path: path), tls: tls)
    }

    public var description: String {
        switch framing {
        case .lines: return tls ? "tls://\(address)" : address.description
        case .webSocket(let path): return "\(tls ? "wss" : "ws")://\(address)\(path == "/" ? "" : path)"
        }
    }
}
