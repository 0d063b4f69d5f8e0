import ChatWire
import Crypto
import Foundation
import Threads

/// The key every node of a deployment is given out of band (`--node-key-file`), never
/// written to the database: a node proves with it that the standard input/output session
/// it relays to the writer really was started as a user (`--user`).
///
/// The relaying node vouches for its user with a short-lived token (HS256 over the node
/// key) naming the user, the writer it is for (the instance the writer advertised: a
/// random value per writer, public, which binds a token to one writer) and a random id.
/// The writer accepts each id once (`NodeTokens`), so neither a database reader (who sees
/// no key) nor a network observer (who sees a token already used, or one for another
/// writer) can act as anyone.
public struct NodeKey: Sendable {
    let key: SymmetricKey

    /// At least this many bytes: a key shorter than SHA-256's output is guessable sooner.
    public static let minimumBytes = 32
    /// How long a token vouching for a user is valid: the relay uses it at once.
    public static let tokenLifetime: Double = 60
    /// Every node token says it is one (`iss`), so that it can never be taken for a user's.
    static let issuer = "chatcore-node"

    public struct KeyError: Error, CustomStringConvertible {
        public let description: String
    }

    public init(bytes: [UInt8]) throws {
        guard bytes.count >= NodeKey.minimumBytes else {
            throw KeyError(description: "the node key has \(bytes.count) bytes: at least \(NodeKey.minimumBytes) are needed (head -c 32 /dev/urandom > FILE)")
        }
        key = SymmetricKey(data: bytes)
    }

    /// Whether `bytes` are this key (the node key must not also be the users' secret).
    public func isKey(_ bytes: [UInt8]) -> Bool {
        key.withUnsafeBytes { $0.elementsEqual(bytes) }
    }

    /// The key in a file, its bytes as they are.
    public static func load(path: String) throws -> NodeKey {
        try NodeKey(bytes: KeyFile.read(path, what: "node key"))
    }

    /// A token vouching that this node's session is `user`'s, for the writer `instance`.
    public func vouch(for user: String, to instance: String, now: Date = Date()) -> String {
        let issued = Int64(now.timeIntervalSince1970.rounded(.down))
        var id = [UInt8](repeating: 0, count: 16)
        var generator = SystemRandomNumberGenerator()
        for index in id.indices { id[index] = UInt8.random(in: 0...255, using: &generator) }
        var claims = JSONWriter(capacity: 256)
        claims.beginObject()
        claims.key("iss")
        claims.string(NodeKey.issuer)
        claims.key("aud")
        claims.string(instance)
        claims.key("sub")
        claims.string(user)
        claims.key("iat")
        claims.integer(issued)
        claims.key("exp")
        claims.integer(issued + Int64(NodeKey.tokenLifetime))
        claims.key("jti")
        claims.string(id.map { String(format: "%02x", $0) }.joined())
        claims.endObject()
        let signingInput = Base64URL.encode(Array(#"{"alg":"HS256","typ":"JWT"}"#.utf8)) + "." + Base64URL.encode(claims.bytes)
        let signature = HMAC<SHA256>.authenticationCode(for: Array(signingInput.utf8), using: key)
        return signingInput + "." + Base64URL.encode(Array(signature))
    }

    /// The claims of `token` when this key signed it, else nil (constant-time check).
    func claims(of token: String) -> JSONTree? {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let signature = Base64URL.decode(parts[2]),
            let header = Base64URL.decodeJSON(parts[0]), header["alg"]?.stringValue == "HS256", header["crit"] == nil
        else { return nil }
        let signingInput = Array(token.utf8.prefix(parts[0].utf8.count + 1 + parts[1].utf8.count))
        guard HMAC<SHA256>.isValidAuthenticationCode(signature, authenticating: signingInput, using: key) else { return nil }
        return Base64URL.decodeJSON(parts[1])
    }
}

/// The node tokens a writer accepts: signed with the node key, for this writer
/// (`instance`), not expired, each at most once.
public final class NodeTokens: Sendable {
    private let key: NodeKey
    /// Random per writer, advertised in the database beside its address: it binds a
    /// token to this writer (it is not a secret).
    public let instance: String
    /// The ids of the tokens accepted and not yet expired, with their expiry.
    private let used = Locked<[String: Int64]>([:])
    /// Tokens accepted within one lifetime, at most: a node makes one per relayed session.
    static let maxRemembered = 100_000

    public init(key: NodeKey) {
        self.key = key
        var generator = SystemRandomNumberGenerator()
        instance = (0..<16).map { _ in String(format: "%02x", UInt8.random(in: 0...255, using: &generator)) }.joined()
    }

    /// True when `token` is a node's word that this session is `userId`'s: then it is
    /// used up.
    public func accept(_ token: String, userId: String, now: Date = Date()) -> Bool {
        guard let claims = key.claims(of: token), claims["iss"]?.stringValue == NodeKey.issuer,
            claims["aud"]?.stringValue == instance, let sub = claims["sub"]?.stringValue, sub.utf8.elementsEqual(userId.utf8),
            let id = claims["jti"]?.stringValue, case .number(let expText)? = claims["exp"], let exp = Int64(expText),
            case .number(let iatText)? = claims["iat"], let iat = Int64(iatText)
        else { return false }
        let seconds = Int64(now.timeIntervalSince1970)
        let leeway = Int64(TokenPolicy.defaultLeeway)
        guard exp > seconds, exp - iat <= Int64(NodeKey.tokenLifetime), iat <= seconds + leeway else { return false }
        return used.withLock { used in
            if used.count >= NodeTokens.maxRemembered { used = used.filter { $0.value > seconds } }
            guard used.count < NodeTokens.maxRemembered, used[id] == nil else { return false }
            used[id] = exp
            return true
        }
    }
}

/// base64url without padding (RFC 7515 §2), as JWTs spell their parts.
enum Base64URL {
    static func encode(_ bytes: [UInt8]) -> String {
        Data(bytes).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    static func decode(_ part: Substring) -> [UInt8]? {
        guard part.utf8.allSatisfy({ $0 != UInt8(ascii: "=") && $0 != UInt8(ascii: "+") && $0 != UInt8(ascii: "/") }) else { return nil }
        var standard = part.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while standard.utf8.count % 4 != 0 { standard += "=" }
        return Data(base64Encoded: standard).map { [UInt8]($0) }
    }

    /// The JSON object a part holds; nil when it is not one, or names a member twice (a
    /// second reader could take the other one).
    static func decodeJSON(_ part: Substring) -> JSONTree? {
        guard let bytes = decode(part), let tree = try? JSONTree.parse(bytes), case .object(let members) = tree,
            Set(members.map(\.0)).count == members.count
        else { return nil }
        return tree
    }
}

/// Files that hold keys: read whole, their bytes as they are (stripping trailing
/// whitespace would change about one random key in 64).
enum KeyFile {
    static func read(_ path: String, what: String) throws -> [UInt8] {
        let data: Data
        do {
            data = try Data(contentsOf: URL(fileURLWithPath: path))
        } catch {
            throw NodeKey.KeyError(
                description: "cannot read the \(what) file \(path): \((error as NSError).localizedFailureReason ?? error.localizedDescription)")
        }
        return [UInt8](data)
    }
}
