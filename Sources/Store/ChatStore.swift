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

/// Why a commit failed, in the words the engine decides by.
public struct StoreFailure: Error, CustomStringConvertible, Sendable {
    public enum Kind: Sendable {
        /// The disk is full: nothing was written, and commits work again once space is freed.
        case full
        /// An I/O error (a failed write or sync): what reached the disk is unknown until
        /// the store is opened again (SQLite recovers its WAL then), and the open store
        /// may refuse every later commit. The service must stop.
        case io
        /// Anything else: nothing of the commit was applied.
        case other
    }

    public let kind: Kind
    public let description: String

    public init(_ kind: Kind, _ description: String) {
        self.kind = kind
        self.description = description
    }
}

/// The text index behind `search` (PROTOCOL.md §9). It is derived from the messages: it
/// may lag behind commits (additions are handed over and written in the background) and
/// lose its tail in a crash; the engine re-adds what it lacks at start-up.
public protocol MessageSearchIndex: AnyObject, Sendable {
    /// The highest search row in the index.
    func indexedUpTo() throws -> Int64

    /// Hands over committed messages' text, and rows whose text is gone (recalled).
    func add(_ entries: [SearchEntry], removing rows: [Int64])

    /// Waits until everything handed over is written.
    func waitUntilWritten() throws

    /// Messages of `chats` whose text contains `text` case-insensitively (at least three
    /// characters), newest first (descending search row), below `belowRow` when given;
    /// everything handed over before the call is taken into account.
    func searchMessages(containing text: String, chats: [Int64], belowRow: Int64?, limit: Int) throws -> [SearchHit]
}

/// A message found by `searchMessages`.
public struct SearchHit: Sendable, Equatable {
    public var chat: Int64
    public var id: Int64
    /// The message's position in the search index (newer is larger).
    public var row: Int64

    public init(chat: Int64, id: Int64, row: Int64) {
        self.chat = chat
        self.id = id
        self.row = row
    }
}

/// A message's text entering the search index.
public struct SearchEntry: Sendable, Equatable {
    public var row: Int64
    public var chat: Int64
    public var id: Int64
    public var text: String

    public init(row: Int64, chat: Int64, id: Int64, text: String) {
        self.row = row
        self.chat = chat
        self.id = id
        self.text = text
    }
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

    /// The uri a user has in their own view (PROTOCOL.md §3).
    public static let localURI = uriPrefix + "0"
    /// `"bbmpim://user/id/0"` as JSON bytes, quotes included.
    public static let quotedLocalURI = Array("\"\(localURI)\"".utf8)

    /// A user's uri as JSON bytes, quotes included.
    public static func quotedURI(_ number: Int64) -> [UInt8] {
        Array("\"\(uriPrefix)\(number)\"".utf8)
    }

    public static let uriPrefix = "bbmpim://user/id/"

    /// The number in a uri of this service, or nil when it is not one.
    public static func number(fromURI uri: String) -> Int64? {
        guard uri.hasPrefix(uriPrefix) else { return nil }
        let digits = uri.dropFirst(uriPrefix.count)
        guard !digits.isEmpty, digits.count <= 18, digits.allSatisfy({ $0.isASCII && $0.isNumber }), digits.first != "0" else { return nil }
        return Int64(digits)
    }
}

/// A chat as the store keeps it. Per-user parts are in `MemberRow`.
public struct ChatRow: Sendable, Equatable {
    public var number: Int64
    public var subject: String
    public var isOneToOne: Bool
    public var invitePolicy: String
    public var isDefunct: Bool
    /// Compact JSON, or nil.
    public var data: String?
    /// The newest message id (ids are consecutive from 1 and never reused).
    public var lastMessage: Int64

    public init(number: Int64, subject: String, isOneToOne: Bool, invitePolicy: String, isDefunct: Bool, data: String?, lastMessage: Int64) {
        self.number = number
        self.subject = subject
        self.isOneToOne = isOneToOne
        self.invitePolicy = invitePolicy
        self.isDefunct = isDefunct
        self.data = data
        self.lastMessage = lastMessage
    }
}

/// One user's place in one chat, also after they left (their read and delivery marks
/// still decide the states of the messages they received).
public struct MemberRow: Sendable, Equatable {
    public var chat: Int64
    public var user: Int64
    public var isActive: Bool
    public var isAdmin: Bool
    /// The first message id this member sees (their `Join`, or 1 for a chat's starters).
    public var joinedAt: Int64
    /// The id of the message that announced their leaving, when they left.
    public var leftAt: Int64?
    public var isHidden: Bool
    public var localData: String?
    /// The chat's privateData (compact JSON), kept for its starter only (protocol v2 §5).
    public var privateData: String?
    /// Every message up to this id was received by one of their sessions / marked read.
    public var deliveredUpTo: Int64
    public var readUpTo: Int64

    public init(chat: Int64, user: Int64, isActive: Bool, isAdmin: Bool, joinedAt: Int64, leftAt: Int64?, isHidden: Bool,
                localData: String?, deliveredUpTo: Int64, readUpTo: Int64) {
        self.chat = chat
        self.user = user
        self.isActive = isActive
        self.isAdmin = isAdmin
        self.joinedAt = joinedAt
        self.leftAt = leftAt
        self.isHidden = isHidden
        self.localData = localData
        self.deliveredUpTo = deliveredUpTo
        self.readUpTo = readUpTo
    }
}

/// A message's outgoing reference.
public struct RefRow: Sendable, Equatable {
    public var tag: String
    public var target: Int64

    public init(tag: String, target: Int64) {
        self.tag = tag
        self.target = target
    }
}

/// A message as everyone sees it (per-user parts are in `MessageUserRow`).
public struct MessageRow: Sendable, Equatable {
    public var chat: Int64
    public var id: Int64
    public var sender: Int64
    public var tag: String
    public var content: String?
    public var data: String?
    public var refs: [RefRow]
    public var timestamp: Int64
    public var isControl: Bool
    public var neverCountsUnread: Bool
    public var isRecalled: Bool
    /// The change feed position of the message's latest change (PROTOCOL.md §4).
    public var changeSeq: Int64
    /// Its row in the search index, 0 when its text is not indexed.
    public var searchRow: Int64
    /// Attachments: sanitized base names, stored contents (SHA-256 hex, nil until
    /// stored), and `Sending`, `Stored` or `Failed` (nil without attachments).
    public var thumbName: String?
    public var thumbBlob: String?
    public var fileName: String?
    public var fileBlob: String?
    public var fileSize: Int64?
    public var attachment: String?

    public init(chat: Int64, id: Int64, sender: Int64, tag: String, content: String?, data: String?, refs: [RefRow], timestamp: Int64,
                isControl: Bool, neverCountsUnread: Bool, isRecalled: Bool, changeSeq: Int64, searchRow: Int64) {
        self.chat = chat
        self.id = id
        self.sender = sender
        self.tag = tag
        self.content = content
        self.data = data
        self.refs = refs
        self.timestamp = timestamp
        self.isControl = isControl
        self.neverCountsUnread = neverCountsUnread
        self.isRecalled = isRecalled
        self.changeSeq = changeSeq
        self.searchRow = searchRow
    }
}

/// What one user changed about a message for themselves only.
public struct MessageUserRow: Sendable, Equatable {
    public var chat: Int64
    public var id: Int64
    public var user: Int64
    public var localData: String?
    public var isDeleted: Bool
    public var thumbDetached = false
    public var fileDownloaded = false

    public init(chat: Int64, id: Int64, user: Int64, localData: String?, isDeleted: Bool) {
        self.chat = chat
        self.id = id
        self.user = user
        self.localData = localData
        self.isDeleted = isDeleted
    }
}

/// An endpoint a user registered (`endpointUpdate`): kept until it is deregistered.
/// Sessions that never register are endpoints too, but only while they are connected:
/// they are not stored.
public struct EndpointRow: Sendable, Equatable {
    /// The endpoint's id (a random 63-bit number, PROTOCOL.md §3 `endpointId`).
    public var id: Int64
    public var user: Int64
    public var description: String
    public var nickname: String
    public var isLegacyDelegate: Bool
    /// Registration order (endpointsGet lists the oldest first).
    public var ordinal: Int64

    public init(id: Int64, user: Int64, description: String, nickname: String, isLegacyDelegate: Bool, ordinal: Int64) {
        self.id = id
        self.user = user
        self.description = description
        self.nickname = nickname
        self.isLegacyDelegate = isLegacyDelegate
        self.ordinal = ordinal
    }
}

/// The state loaded at start-up.
public struct StoreSnapshot: Sendable {
    public var users: [UserRecord]
    public var endpoints: [EndpointRow] = []
    public var chats: [ChatRow]
    public var members: [MemberRow]
    /// Ordered by chat, then id.
    public var messages: [MessageRow]
    public var messageUsers: [MessageUserRow]

    public init(users: [UserRecord] = [], chats: [ChatRow] = [], members: [MemberRow] = [], messages: [MessageRow] = [], messageUsers: [MessageUserRow] = []) {
        self.users = users
        self.chats = chats
        self.members = members
        self.messages = messages
        self.messageUsers = messageUsers
    }
}

/// The writes of one group commit: rows to insert or replace whole.
public struct StoreBatch: Sendable {
    public var newUsers: [UserRecord] = []
    public var chats: [ChatRow] = []
    public var members: [MemberRow] = []
    public var messages: [MessageRow] = []
    public var messageUsers: [MessageUserRow] = []
    /// Endpoints registered or renamed (written whole), and endpoints deregistered.
    public var endpoints: [EndpointRow] = []
    public var removedEndpoints: [Int64] = []

    public init() {}

    public var isEmpty: Bool {
        newUsers.isEmpty && chats.isEmpty && members.isEmpty && messages.isEmpty && messageUsers.isEmpty && endpoints.isEmpty
            && removedEndpoints.isEmpty
    }
}
