import ChatProtocol
import ChatWire
import Foundation
import JWTKit
import Threads

/// What a token must say besides its signature: who it is for and from, and how far
/// clocks may disagree.
public struct TokenPolicy: Sendable {
    /// `aud` must name this (a string, or an array holding it); nil: not checked.
    public var audience: String?
    /// `iss` must equal this; nil: not checked.
    public var issuer: String?
    /// Seconds by which `exp`, `nbf` and `iat` may be off the service's clock.
    public var leeway: Double
    /// A token valid for longer than this (from `iat`, else `nbf`, else now) is refused.
    public var maxLifetime: Double

    public static let defaultLeeway: Double = 30
    public static let defaultMaxLifetime: Double = 86_400

    public init(
        audience: String? = nil, issuer: String? = nil, leeway: Double = TokenPolicy.defaultLeeway,
        maxLifetime: Double = TokenPolicy.defaultMaxLifetime
    ) {
        self.audience = audience
        self.issuer = issuer
        self.leeway = leeway
        self.maxLifetime = maxLifetime
    }
}

/// Checks `authToken` JWTs and issues them for `chatcore token` (§3), with
/// vapor's jwt-kit for the signatures.
///
/// A token is accepted when its header's `alg` is HS256 and it is signed with the secret
/// (`--auth-secret-file`), or its `alg` is RS256 or ES256 and it is signed by a key of the
/// JWKS file (`--auth-jwks`) of that type: the key its `kid` names (a `kid` the file does
/// not hold is refused), or, with no `kid`, any key of that type. A header with `crit` is
/// refused (RFC 7515 §4.1.11: chatcore understands no extension), and so is an ES256
/// signature whose S is in the upper half of the curve's order (one token, one
/// signature). Its `sub` equals the claimed user id; `exp` has not passed, and `nbf` and
/// `iat` are not in the future, each by more than the leeway; it is valid for no longer
/// than the maximum lifetime; its `aud` and `iss` are this service's when they are set
/// (`TokenPolicy`). `alg: none` and every other algorithm are refused. With `insecure` any
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

    /// What a checked token came to.
    public enum Verdict: Sendable, Equatable {
        /// Accepted until `expires`; `keyId` names the JWKS key that signed it (nil: the
        /// secret), which the session loses with the key (`reloadKeys`).
        case accepted(expires: Date, keyId: String?)
        case refused(SetupErrorCode)
    }

    public let mode: Mode
    public let policy: TokenPolicy
    private let hmac: JWTKeyCollection?
    /// The JWKS keys, replaced whole by `reloadKeys`.
    private let jwks: Locked<JWKS?>
    /// What to call when a key a session was signed in with leaves the JWKS file, by
    /// session.
    private let keyHolders = Locked<[ObjectIdentifier: (keyId: String, lost: @Sendable () -> Void)]>([:])
    /// Node tokens for sessions other nodes relay here (set when this node is the writer
    /// of a shared store and has the node key).
    private let nodeTokens = Locked<NodeTokens?>(nil)

    /// A JWKS file's signing keys: jwt-kit's collection, and each key's type and `alg`
    /// by `kid`, which a token's header must agree with.
    struct JWKS: Sendable {
        var collection: JWTKeyCollection
        var keys: [String: (kty: String, alg: String?)]
    }

    public struct AuthenticatorError: Error, CustomStringConvertible {
        public let description: String
    }

    /// HMAC secrets shorter than this are refused: RFC 7518 §3.2 asks HS256 keys of at
    /// least 256 bits.
    public static let minimumSecretBytes = 32

    public init(mode: Mode, policy: TokenPolicy = TokenPolicy()) async throws {
        self.mode = mode
        self.policy = policy
        guard case .keys(let secret, let jwksPath) = mode else {
            hmac = nil
            jwks = Locked(nil)
            return
        }
        if let secret {
            hmac = await JWTKeyCollection().add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        } else {
            hmac = nil
        }
        jwks = Locked(try await jwksPath.asyncMap { try await Authenticator.loadJWKS(path: $0) })
    }

    /// Reads the JWKS file again (SIGHUP): its keys replace the old ones, which stay when
    /// the file cannot be used. Sessions signed in with a key that is gone lose their
    /// token (`watchKey`). Returns how many keys it has.
    @discardableResult
    public func reloadKeys() async throws -> Int {
        guard case .keys(_, let jwksPath?) = mode else { return 0 }
        let loaded = try await Authenticator.loadJWKS(path: jwksPath)
        jwks.withLock { $0 = loaded }
        let lost = keyHolders.withLock { holders in
            let gone = holders.filter { loaded.keys[$0.value.keyId] == nil }
            for key in gone.keys { holders[key] = nil }
            return gone.values.map(\.lost)
        }
        for call in lost { call() }
        return loaded.keys.count
    }

    /// Calls `lost` once if the key `keyId` leaves the JWKS file, until `unwatch(owner)`.
    public func watchKey(_ keyId: String, owner: ObjectIdentifier, lost: @escaping @Sendable () -> Void) {
        keyHolders.withLock { $0[owner] = (keyId, lost) }
    }

    public func unwatch(_ owner: ObjectIdentifier) {
        keyHolders.withLock { $0[owner] = nil }
    }

    /// The keys of a JWKS file: RSA and EC keys with a `kid`; others (encryption keys,
    /// symmetric keys) are left out, a malformed key refuses the file.
    static func loadJWKS(path: String) async throws -> JWKS {
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
        var kinds: [String: (kty: String, alg: String?)] = [:]
        for (index, entry) in keys.enumerated() {
            guard let key = entry as? [String: Any], let kty = key["kty"] as? String, kty == "RSA" || kty == "EC",
                key["use"] as? String != "enc"
            else { continue }
            guard let kid = key["kid"] as? String else {
                throw AuthenticatorError(description: "the JWKS file \(path): key \(index) has no 'kid'")
            }
            guard kinds[kid] == nil else {
                throw AuthenticatorError(description: "the JWKS file \(path): two keys have the kid '\(kid)'")
            }
            do {
                let jwk = try JSONDecoder().decode(JWK.self, from: try JSONSerialization.data(withJSONObject: key))
                try await collection.add(jwk: jwk)
            } catch {
                throw AuthenticatorError(description: "the JWKS file \(path): key \(index) cannot be used: \(error)")
            }
            kinds[kid] = (kty, key["alg"] as? String)
        }
        guard !kinds.isEmpty else {
            throw AuthenticatorError(description: "the JWKS file \(path) has no RSA or EC signing key")
        }
        return JWKS(collection: collection, keys: kinds)
    }

    /// Reads the secret from a file: its bytes as they are (a newline at the end is part
    /// of the key, as `chatcore token` reads it too), at least `minimumSecretBytes`.
    public static func loadSecret(path: String) throws -> [UInt8] {
        let bytes = try KeyFile.read(path, what: "secret")
        guard bytes.count >= minimumSecretBytes else {
            throw AuthenticatorError(
                description: "the secret file \(path) has \(bytes.count) bytes: HS256 needs at least \(minimumSecretBytes) (head -c 32 /dev/urandom > FILE)")
        }
        return bytes
    }

    // MARK: nodes

    /// From now on, a session's first line may be an `authToken` carrying a node token
    /// (`NodeTokens`): this node is the writer of a shared store.
    public func acceptNodeTokens(_ tokens: NodeTokens) {
        nodeTokens.withLock { $0 = tokens }
    }

    /// True when `token` is a node's word, for this writer, that its session is `userId`'s
    /// (each such token is accepted once).
    public func acceptsNodeToken(_ token: String, userId: String) -> Bool {
        guard let tokens = nodeTokens.withLock({ $0 }) else { return false }
        return tokens.accept(token, userId: userId)
    }

    // MARK: users

    /// What can be decided without checking a signature.
    public func check() -> Check {
        switch mode {
        case .insecure: .accepted
        case .unconfigured: .refused(.authNotConfigured)
        case .keys: .verify
        }
    }

    /// Checks a token for `userId`.
    public func verify(token: String, userId: String, now: Date = Date()) async -> Verdict {
        switch check() {
        case .accepted: return .accepted(expires: .distantFuture, keyId: nil)
        case .refused(let code): return .refused(code)
        case .verify: break
        }
        // The header and claims are read with chatcore's own bounded parser first
        // (nesting is limited, a member named twice refused), then by jwt-kit.
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let header = Base64URL.decodeJSON(parts[0]), let claims = Base64URL.decodeJSON(parts[1]),
            let alg = header["alg"]?.stringValue, header["crit"] == nil
        else {
            return .refused(.invalidToken)
        }
        let kid: String?
        switch header["kid"] {
        case nil: kid = nil
        case .string(let value)?: kid = value
        default: return .refused(.invalidToken)
        }
        let keys: JWTKeyCollection
        switch alg {
        case "HS256":
            guard let hmac else { return .refused(.invalidToken) }
            keys = hmac
        case "RS256", "ES256":
            guard let set = jwks.withLock({ $0 }) else { return .refused(.invalidToken) }
            let kty = alg == "RS256" ? "RSA" : "EC"
            if let kid {
                // jwt-kit would verify with the named key by that key's own algorithm,
                // whatever the header says, and fall back on other keys for an unknown kid.
                guard let named = set.keys[kid], named.kty == kty, named.alg == nil || named.alg == alg else { return .refused(.invalidToken) }
            } else if !set.keys.values.contains(where: { $0.kty == kty && ($0.alg == nil || $0.alg == alg) }) {
                return .refused(.invalidToken)
            }
            if alg == "ES256" {
                guard let signature = Base64URL.decode(parts[2]), Authenticator.isLowS(signature) else { return .refused(.invalidToken) }
            }
            keys = set.collection
        default:
            return .refused(.invalidToken)
        }
        do {
            _ = try await keys.verify(token, as: TokenClaims.self, iteratingKeys: kid == nil)
        } catch {
            return .refused(.invalidToken)
        }
        return judge(claims, userId: userId, now: now, keyId: alg == "HS256" ? nil : kid)
    }

    /// The claims of a token whose signature checked out, against the policy.
    func judge(_ claims: JSONTree, userId: String, now: Date, keyId: String?) -> Verdict {
        func time(_ name: String) -> Double?? {
            guard let value = claims[name] else { return .some(nil) }
            guard case .number(let text) = value, let seconds = Double(text), seconds.isFinite else { return nil }
            return .some(seconds)
        }
        let clock = now.timeIntervalSince1970
        guard let expOrNil = time("exp"), let exp = expOrNil, let nbf = time("nbf"), let iat = time("iat"),
            case .string(let sub)? = claims["sub"]
        else { return .refused(.invalidToken) }
        if clock >= exp + policy.leeway { return .refused(.tokenExpired) }
        if let nbf, nbf > clock + policy.leeway { return .refused(.invalidToken) }
        if let iat, iat > clock + policy.leeway { return .refused(.invalidToken) }
        if exp - (iat ?? nbf ?? clock) > policy.maxLifetime { return .refused(.invalidToken) }
        if let audience = policy.audience {
            switch claims["aud"] {
            case .string(let aud)?: guard aud == audience else { return .refused(.invalidToken) }
            case .array(let auds)?: guard auds.contains(.string(audience)) else { return .refused(.invalidToken) }
            default: return .refused(.invalidToken)
            }
        }
        if let issuer = policy.issuer, claims["iss"]?.stringValue != issuer { return .refused(.invalidToken) }
        // Byte for byte: Swift's `==` would take "e\u{301}" for "\u{E9}" (another user).
        guard sub.utf8.elementsEqual(userId.utf8) else { return .refused(.userIdMismatch) }
        return .accepted(expires: Date(timeIntervalSince1970: exp + policy.leeway), keyId: keyId)
    }

    /// P-256's order over two, big-endian: an ES256 signature's S must not exceed it.
    private static let halfOrder: [UInt8] = [
        0x7F, 0xFF, 0xFF, 0xFF, 0x80, 0x00, 0x00, 0x00, 0x7F, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
        0xDE, 0x73, 0x7D, 0x56, 0xD3, 0x8B, 0xCF, 0x42, 0x79, 0xDC, 0xE5, 0x61, 0x7E, 0x31, 0x92, 0xA8
    ]

    /// Whether an ES256 signature (R ‖ S, 32 bytes each) has S in the lower half.
    static func isLowS(_ signature: [UInt8]) -> Bool {
        guard signature.count == 64 else { return false }
        let s = signature[32...]
        return s.lexicographicallyPrecedes(halfOrder[...]) || s.elementsEqual(halfOrder)
    }

    /// A token for `userId` (HS256, signed with `secret`) that expires `expiresIn` seconds
    /// from `now`, for `audience` from `issuer` when given.
    public static func issue(
        userId: String, secret: [UInt8], expiresIn: Int64, audience: String? = nil, issuer: String? = nil,
        now: Date = Date()
    ) async throws -> String {
        let keys = await JWTKeyCollection().add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        let issuedAt = Date(timeIntervalSince1970: now.timeIntervalSince1970.rounded(.down))
        let claims = TokenClaims(
            sub: SubjectClaim(value: userId), exp: ExpirationClaim(value: issuedAt.addingTimeInterval(Double(expiresIn))),
            iat: IssuedAtClaim(value: issuedAt), aud: audience.map { AudienceClaim(value: [$0]) },
            iss: issuer.map { IssuerClaim(value: $0) })
        return try await keys.sign(claims)
    }
}

/// The claims jwt-kit decodes: who (`sub`), until when (`exp`), from when (`nbf`, `iat`),
/// for and from whom (`aud`, `iss`). They are judged by `Authenticator.judge`, from the
/// token's own JSON.
struct TokenClaims: JWTPayload {
    var sub: SubjectClaim
    var exp: ExpirationClaim
    var nbf: NotBeforeClaim?
    var iat: IssuedAtClaim?
    var aud: AudienceClaim?
    var iss: IssuerClaim?

    init(
        sub: SubjectClaim, exp: ExpirationClaim, nbf: NotBeforeClaim? = nil, iat: IssuedAtClaim? = nil, aud: AudienceClaim? = nil,
        iss: IssuerClaim? = nil
    ) {
        self.sub = sub
        self.exp = exp
        self.nbf = nbf
        self.iat = iat
        self.aud = aud
        self.iss = iss
    }

    func verify(using algorithm: some JWTAlgorithm) async throws {}
}

extension Optional {
    fileprivate func asyncMap<T>(_ transform: (Wrapped) async throws -> T) async rethrows -> T? {
        guard let self else { return nil }
        return try await transform(self)
    }
}
