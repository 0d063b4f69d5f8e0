import Foundation
import JWTKit
import Protocol
import Wire

/// Checks `authToken` JWTs and issues them for `chatcore token` (§3), with
/// vapor's jwt-kit.
///
/// A token is accepted when its header's `alg` is HS256 and it is signed with the secret
/// (`--auth-secret-file`), or its `alg` is RS256 or ES256 and it is signed by a key of the
/// JWKS file (`--auth-jwks`, chosen by `kid`, every key of that kind when the token names
/// none); its `sub` equals the claimed user id, its `exp` has not passed and its `nbf`
/// (if any) has. `alg: none` and every other algorithm are refused. With `insecure` any
/// token is accepted (the server allows that on loopback and Unix sockets only).
public final class Authenticator: Sendable {
    public enum Mode: Sendable {
        /// Tokens signed with these keys.
        case keys(secret: [UInt8]?, jwksPath: String?)
        case insecure
        /// No key was configured: authentication over a socket is impossible.
        case unconfigured
    }

    /// What can be said of a token at once.
    public enum Check: Sendable {
        case accepted
        case refused(SetupErrorCode)
        /// Its signature must be checked (`verify`), which takes a moment.
        case verify
    }

    public let mode: Mode
    private let hmac: JWTKeyCollection?
    /// The JWKS keys, replaced whole by `reloadKeys` (under `lock`: read from any thread).
    nonisolated(unsafe) private var jwks: JWTKeyCollection?
    private let lock = NSLock()

    public struct AuthenticatorError: Error, CustomStringConvertible {
        public let description: String
    }

    public init(mode: Mode) async throws {
        self.mode = mode
        guard case .keys(let secret, let jwksPath) = mode else {
            hmac = nil
            return
        }
        if let secret {
            hmac = await JWTKeyCollection().add(hmac: Authenticator.hmacKey(secret), digestAlgorithm: .sha256)
        } else {
            hmac = nil
        }
        if let jwksPath { jwks = try await Authenticator.loadJWKS(path: jwksPath).collection }
    }

    /// Reads the JWKS file again (SIGHUP): its keys replace the old ones, which stay when
    /// the file cannot be used. Returns how many keys it has.
    @discardableResult
    public func reloadKeys() async throws -> Int {
        guard case .keys(_, let jwksPath?) = mode else { return 0 }
        let loaded = try await Authenticator.loadJWKS(path: jwksPath)
        lock.withLock { jwks = loaded.collection }
        return loaded.count
    }

    /// The keys of a JWKS file: RSA and EC keys with a `kid`; others (encryption keys,
    /// symmetric keys) are left out, a malformed key refuses the file.
    static func loadJWKS(path: String) async throws -> (collection: JWTKeyCollection, count: Int) {
        let data: Data
        do {
            data = try Data(contentsOf: URL(fileURLWithPath: path))
        } catch {
            throw AuthenticatorError(description: "cannot read the JWKS file \(path): \(error.localizedDescription)")
        }
        guard let file = try? JSONSerialization.jsonObject(with: data) as? [String: Any], let keys = file["keys"] as? [Any] else {
            throw AuthenticatorError(description: "the JWKS file \(path) is not a JSON object with a 'keys' array")
        }
        let collection = JWTKeyCollection()
        var count = 0
        for (index, entry) in keys.enumerated() {
            guard let key = entry as? [String: Any], let kty = key["kty"] as? String, kty == "RSA" || kty == "EC",
                  key["use"] as? String != "enc" else { continue }
            guard key["kid"] is String else {
                throw AuthenticatorError(description: "the JWKS file \(path): key \(index) has no 'kid'")
            }
            do {
                let jwk = try JSONDecoder().decode(JWK.self, from: try JSONSerialization.data(withJSONObject: key))
                try await collection.add(jwk: jwk)
            } catch {
                throw AuthenticatorError(description: "the JWKS file \(path): key \(index) cannot be used: \(error)")
            }
            count += 1
        }
        guard count > 0 else {
            throw AuthenticatorError(description: "the JWKS file \(path) has no RSA or EC signing key")
        }
        return (collection, count)
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

    /// The credential of the nodes of this deployment, when this node is the writer of a
    /// shared store (nil otherwise): a node relaying its standard input/output session to
    /// this one sends it as its first line's token, for the user that session was started
    /// as (`Session`). Under `lock`.
    nonisolated(unsafe) private var nodeCredential: [UInt8]?

    /// From now on, a session's first line may be an `authToken` carrying `credential`
    /// (see `nodeCredential`).
    public func acceptNodeCredential(_ credential: String) {
        lock.withLock { nodeCredential = Array(credential.utf8) }
    }

    /// True when `token` is the nodes' credential (compared in constant time).
    public func isNodeCredential(_ token: String) -> Bool {
        guard let credential = lock.withLock({ nodeCredential }) else { return false }
        let given = Array(token.utf8)
        guard given.count == credential.count else { return false }
        var difference: UInt8 = 0
        for (a, b) in zip(given, credential) { difference |= a ^ b }
        return difference == 0
    }

    /// What can be decided without checking a signature.
    public func check() -> Check {
        switch mode {
        case .insecure: .accepted
        case .unconfigured: .refused(.authNotConfigured)
        case .keys: .verify
        }
    }

    /// Checks a token for `userId`; nil when it is accepted.
    public func verify(token: String, userId: String, now: Date = Date()) async -> SetupErrorCode? {
        switch check() {
        case .accepted: return nil
        case .refused(let code): return code
        case .verify: break
        }
        // The header picks the keys; it and the claims are read with chatcore's own
        // bounded parser first (nesting is limited), then by jwt-kit.
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let header = Authenticator.decodePart(parts[0]), let claims = Authenticator.decodePart(parts[1]),
              case .object = claims, let alg = header["alg"]?.stringValue else {
            return .invalidToken
        }
        let keys: JWTKeyCollection?
        switch alg {
        case "HS256": keys = hmac
        case "RS256", "ES256": keys = lock.withLock { jwks }
        default: keys = nil
        }
        guard let keys else { return .invalidToken }
        let payload: TokenClaims
        do {
            payload = try await keys.verify(token, as: TokenClaims.self, iteratingKeys: header["kid"] == nil)
        } catch let error as JWTError where error.errorType == .claimVerificationFailure && error.failedClaim is ExpirationClaim {
            return .tokenExpired
        } catch {
            return .invalidToken
        }
        if now >= payload.exp.value { return .tokenExpired }
        if let notBefore = payload.nbf, notBefore.value > now { return .invalidToken }
        // Byte for byte: Swift's `==` would take "e\u{301}" for "\u{E9}" (another user).
        guard payload.sub.value.utf8.elementsEqual(userId.utf8) else { return .userIdMismatch }
        return nil
    }

    /// The JSON of a token part (base64url), when it is one.
    private static func decodePart(_ part: Substring) -> JSONTree? {
        guard part.utf8.allSatisfy({ $0 != UInt8(ascii: "=") }) else { return nil }
        var standard = part.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while standard.utf8.count % 4 != 0 { standard += "=" }
        guard let data = Data(base64Encoded: standard) else { return nil }
        return try? JSONTree.parse([UInt8](data))
    }

    /// The HMAC key for a secret. HMAC pads a key shorter than its block (64 bytes for
    /// SHA-256) with zeros, so a secret padded to 32 bytes signs exactly as the secret
    /// itself; jwt-kit asserts (in debug builds) that a key is at least 32 bytes.
    static func hmacKey(_ secret: [UInt8]) -> HMACKey {
        HMACKey(from: secret.count < 32 ? secret + [UInt8](repeating: 0, count: 32 - secret.count) : secret)
    }

    /// A token for `userId` (HS256, signed with `secret`) that expires `expiresIn` seconds
    /// from `now`.
    public static func issue(userId: String, secret: [UInt8], expiresIn: Int64, now: Date = Date()) async throws -> String {
        let keys = await JWTKeyCollection().add(hmac: hmacKey(secret), digestAlgorithm: .sha256)
        let issuedAt = Date(timeIntervalSince1970: now.timeIntervalSince1970.rounded(.down))
        let claims = TokenClaims(sub: SubjectClaim(value: userId), exp: ExpirationClaim(value: issuedAt.addingTimeInterval(Double(expiresIn))),
                                 iat: IssuedAtClaim(value: issuedAt))
        return try await keys.sign(claims)
    }
}

/// The claims chatcore reads: who (`sub`), until when (`exp`), from when (`nbf`).
struct TokenClaims: JWTPayload {
    var sub: SubjectClaim
    var exp: ExpirationClaim
    var nbf: NotBeforeClaim?
    var iat: IssuedAtClaim?

    init(sub: SubjectClaim, exp: ExpirationClaim, nbf: NotBeforeClaim? = nil, iat: IssuedAtClaim? = nil) {
        self.sub = sub
        self.exp = exp
        self.nbf = nbf
        self.iat = iat
    }

    /// Expiry and `nbf` are checked by `Authenticator.verify` against its clock.
    func verify(using algorithm: some JWTAlgorithm) async throws {}
}
