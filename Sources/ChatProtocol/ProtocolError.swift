import ChatWire

/// A request that is not carried out: one of the wire error codes and a sentence naming
/// the field or limit (§2). Every layer throws this; `requestFailed(...)` is
/// the one place it becomes the `requestFailed` event.
public struct ProtocolError: Error, Sendable, Equatable {
    public let code: ErrorCode
    public let reason: String
    /// With `RateLimited`: when the same request would pass (nil: not by waiting).
    public let retryAfterMs: Int64?

    public init(_ code: ErrorCode, _ reason: String, retryAfterMs: Int64? = nil) {
        self.code = code
        self.reason = reason
        self.retryAfterMs = retryAfterMs
    }

    public init(_ failure: WireFailure) {
        switch failure.kind {
        case .parseError: self.init(.parseError, failure.reason)
        case .unknownRequest: self.init(.unknownRequest, failure.reason)
        case .invalidParameter: self.init(.invalidParameter, failure.reason)
        case .tooLarge: self.init(.tooLarge, failure.reason)
        case .internal: self.init(.internal, failure.reason)
        }
    }

    public static func invalid(_ reason: String) -> ProtocolError { ProtocolError(.invalidParameter, reason) }
    public static func notFound(_ reason: String) -> ProtocolError { ProtocolError(.notFound, reason) }
    public static func notPermitted(_ reason: String) -> ProtocolError { ProtocolError(.notPermitted, reason) }

    /// The answer to the request on `line`.
    public func requestFailed(request: String?, cookie: String?, line: Int) -> Event {
        .requestFailed(RequestFailed(request: request, cookie: cookie, error: code, reason: reason, line: Int64(line), retryAfterMs: retryAfterMs))
    }
}
