import Crypto
import Foundation
import Protocol
import Wire

/// Checks `authToken` JWTs (HS256) and issues them for `chatcore token` (PROTOCOL.md §3).
///
/// A token is accepted when its signature verifies with the secret, its header says
/// `alg: HS256`, its `sub` equals the claimed user id and its `exp` has not passed.
/// With `insecure` any token is accepted (loopback and Unix sockets only; the server
/// enforces that).
public struct Authenticator: Sendable {
    public enum Mode: Sendable {
        /// The key bytes (kept as bytes: `SymmetricKey` is not `Sendable`).
        case secret([UInt8])
        case insecure
        /// No secret was configured: authentication over a socket is impossible.
        case unconfigured
    }

    public let mode: Mode

    public init(mode: Mode) {
        self.mode = mode
    }

    /// Reads the secret from a file: its bytes, trailing whitespace and newlines removed.
    public static func loadSecret(path: String) throws -> [UInt8] {
        let data = try Data(contentsOf: URL(fileURLWithPath: path))
        var bytes = [UInt8](data)
        while let last = bytes.last, last == 0x20 || last == 0x09 || last == 0x0A || last == 0x0D { bytes.removeLast() }
        guard !bytes.isEmpty else {
            throw AuthenticatorError(description: "the secret file \(path) is empty")
        }
        return bytes
    }

    public struct AuthenticatorError: Error, CustomStringConvertible {
        public let description: String
    }

    /// Checks a token for `userId`; nil when it is accepted.
    public func verify(token: String, userId: String, now: Date = Date()) -> SetupErrorCode? {
        switch mode {
        case .insecure:
            return nil
        case .unconfigured:
            return .authNotConfigured
        case .secret(let key):
            return Authenticator.verify(token: token, userId: userId, key: SymmetricKey(data: key), now: now)
        }
    }

    static func verify(token: String, userId: String, key: SymmetricKey, now: Date) -> SetupErrorCode? {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3,
              let headerBytes = base64URLDecode(parts[0]),
              let payloadBytes = base64URLDecode(parts[1]),
              let signature = base64URLDecode(parts[2]) else {
            return .invalidToken
        }
        let signed = Array(token.utf8.prefix(parts[0].utf8.count + 1 + parts[1].utf8.count))
        guard HMAC<SHA256>.isValidAuthenticationCode(signature, authenticating: signed, using: key) else {
            return .invalidToken
        }
        guard let header = try? JSONTree.parse(headerBytes), header["alg"]?.stringValue == "HS256",
              let payload = try? JSONTree.parse(payloadBytes) else {
            return .invalidToken
        }
        guard let subject = payload["sub"]?.stringValue else { return .invalidToken }
        guard case .number(let expText)? = payload["exp"], let exp = Double(expText) else { return .invalidToken }
        if case .number(let nbfText)? = payload["nbf"], let nbf = Double(nbfText), nbf > now.timeIntervalSince1970 {
            return .invalidToken
        }
        guard exp > now.timeIntervalSince1970 else { return .tokenExpired }
        guard subject == userId else { return .userIdMismatch }
        return nil
    }

    /// A token for `userId` that expires `expiresIn` seconds from `now`.
    public static func issue(userId: String, secret: [UInt8], expiresIn: Int64, now: Date = Date()) -> String {
        let key = SymmetricKey(data: secret)
        let issuedAt = Int64(now.timeIntervalSince1970)
        let header = JSONValue.object(["alg": .string("HS256"), "typ": .string("JWT")])
        let payload = JSONValue.object(["sub": .string(userId), "iat": .integer(issuedAt), "exp": .integer(issuedAt + expiresIn)])
        let signingInput = base64URLEncode(Array(header.json.utf8)) + "." + base64URLEncode(Array(payload.json.utf8))
        let signature = HMAC<SHA256>.authenticationCode(for: Array(signingInput.utf8), using: key)
        return signingInput + "." + base64URLEncode(Array(signature))
    }

    static func base64URLEncode(_ bytes: [UInt8]) -> String {
        Data(bytes).base64EncodedString()
            .replacingOccurrences(of: "+", with: "-")
            .replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    static func base64URLDecode(_ text: Substring) -> [UInt8]? {
        guard text.utf8.allSatisfy({ $0 != UInt8(ascii: "=") }) else { return nil }
        var standard = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while standard.utf8.count % 4 != 0 { standard += "=" }
        return Data(base64Encoded: standard).map { [UInt8]($0) }
    }
}
