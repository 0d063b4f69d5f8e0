/// What the engine needs from durable storage, in the engine's words.
///
/// The engine keeps the small, hot state (users, and later chats and participants) in
/// memory, loaded once at start-up, and hands every decision's writes to `commit` as one
/// batch: one transaction, durable when `commit` returns (group commit). Only an
/// implementation knows how that is stored; SQLite (`SQLiteStore`) is the default.
public protocol ChatStore: AnyObject, Sendable {
    /// Everything the engine keeps in memory, as last committed.
    func loadSnapshot() throws -> StoreSnapshot

    /// Applies the batch atomically and durably. On error nothing of it was applied.
    func commit(_ batch: StoreBatch) throws
}

/// A user as the store keeps them.
///
/// `number` is the `n` of the user's uri (`bbmpim://user/id/<n>`), assigned in order of
/// first appearance; `regId` is derived from the user id alone (`RegId.derive`).
public struct UserRecord: Sendable, Hashable {
    public let number: Int64
    public let userId: String
    public let regId: Int64

    public init(number: Int64, userId: String, regId: Int64) {
        self.number = number
        self.userId = userId
        self.regId = regId
    }

    public var uri: String { UserRecord.uriPrefix + String(number) }

    public static let uriPrefix = "bbmpim://user/id/"

    /// The number in a uri of this service, or nil when it is not one.
    public static func number(fromURI uri: String) -> Int64? {
        guard uri.hasPrefix(uriPrefix) else { return nil }
        let digits = uri.dropFirst(uriPrefix.count)
        guard !digits.isEmpty, digits.count <= 18, digits.allSatisfy({ $0.isASCII && $0.isNumber }), digits.first != "0" else { return nil }
        return Int64(digits)
    }
}

/// The state loaded at start-up.
public struct StoreSnapshot: Sendable {
    public var users: [UserRecord]

    public init(users: [UserRecord] = []) {
        self.users = users
    }
}

/// The writes of one group commit.
public struct StoreBatch: Sendable {
    public var newUsers: [UserRecord] = []

    public init() {}

    public var isEmpty: Bool { newUsers.isEmpty }
}
