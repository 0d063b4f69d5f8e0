/// The rows the store keeps, as the engine reads and writes them. Each has one mapping to
/// its table (in the store implementation); the engine's records hold them.

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

    /// The uri a user has in their own view (§3).
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

/// An endpoint a user registered (`endpointUpdate`): kept until it is deregistered.
/// Sessions that never register are endpoints too, but only while they are connected:
/// they are not stored.
public struct EndpointRow: Sendable, Equatable {
    /// The endpoint's id (a random 63-bit number, docs/protocol.md §3 `endpointId`).
    public var id: Int64
    public var user: Int64
    public var description: String
    public var nickname: String
    public var isLegacyDelegate: Bool
    /// Registration order (endpointsGet lists the oldest first).
    public var ordinal: Int64
    /// What the application's server wakes the device with (`endpointUpdate`'s
    /// `pushToken`; nil: none).
    public var pushToken: String?

    public init(id: Int64, user: Int64, description: String, nickname: String, isLegacyDelegate: Bool, ordinal: Int64) {
        self.id = id
        self.user = user
        self.description = description
        self.nickname = nickname
        self.isLegacyDelegate = isLegacyDelegate
        self.ordinal = ordinal
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
    /// The timestamp of the newest message without flag N (0 before the first).
    public var lastActivity: Int64
    /// Who may pin messages (`PinPolicy`'s raw value).
    public var pinPolicy = "AdminsOnly"
    /// The pinned messages, the newest pin first, one per line: the message id, who pinned
    /// it and when the pin ends (0: never), separated by spaces (nil: none).
    public var pins: String?

    public init(
        number: Int64, subject: String, isOneToOne: Bool, invitePolicy: String, isDefunct: Bool, data: String?, lastMessage: Int64,
        lastActivity: Int64 = 0
    ) {
        self.number = number
        self.subject = subject
        self.isOneToOne = isOneToOne
        self.invitePolicy = invitePolicy
        self.isDefunct = isDefunct
        self.data = data
        self.lastMessage = lastMessage
        self.lastActivity = lastActivity
    }
}

/// The columns of a chat a change may write.
public enum ChatColumn: String, Sendable, CaseIterable {
    case subject, isDefunct, data, lastMessage, lastActivity, pins
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
    /// Incoming messages after `readUpTo` without flag N, kept exact with every change.
    public var numUnread: Int64
    /// Of those, the messages that mention them (`MessageRow.mentionedUsers`).
    public var numUnreadMentions: Int64 = 0
    /// Muted by an admin (`participantMute`) until this time (seconds since 1970; 0: for
    /// ever), or not muted (nil).
    public var mutedUntil: Int64?
    /// Banned by an admin (`participantBan`): nobody can invite them back.
    public var isBanned = false

    public init(
        chat: Int64, user: Int64, isActive: Bool, isAdmin: Bool, joinedAt: Int64, leftAt: Int64?, isHidden: Bool,
        localData: String?, privateData: String? = nil, deliveredUpTo: Int64, readUpTo: Int64, numUnread: Int64 = 0
    ) {
        self.chat = chat
        self.user = user
        self.isActive = isActive
        self.isAdmin = isAdmin
        self.joinedAt = joinedAt
        self.leftAt = leftAt
        self.isHidden = isHidden
        self.localData = localData
        self.privateData = privateData
        self.deliveredUpTo = deliveredUpTo
        self.readUpTo = readUpTo
        self.numUnread = numUnread
    }
}

/// The columns of a membership a change may write.
public enum MemberColumn: String, Sendable, CaseIterable {
    case isActive, isAdmin, joinedAt, leftAt, isHidden, localData, privateData, deliveredUpTo, readUpTo, numUnread, numUnreadMentions, mutedUntil,
        isBanned
}

/// A message's outgoing reference.
public struct RefRow: Sendable, Equatable, Hashable {
    public var tag: String
    public var target: Int64

    public init(tag: String, target: Int64) {
        self.tag = tag
        self.target = target
    }
}

/// How many messages refer to one message with one tag, and the newest of them.
public struct RefCountRow: Sendable, Equatable {
    public var chat: Int64
    public var target: Int64
    public var tag: String
    /// 0: no message refers to it any more (the row goes).
    public var count: Int64
    public var newest: Int64

    public init(chat: Int64, target: Int64, tag: String, count: Int64, newest: Int64) {
        self.chat = chat
        self.target = target
        self.tag = tag
        self.count = count
        self.newest = newest
    }
}

/// Where a message that mentions a user is among that user's mentions (newest first).
public struct MentionPosition: Sendable, Equatable, Comparable {
    public var timestamp: Int64
    public var chat: Int64
    public var id: Int64

    public init(timestamp: Int64, chat: Int64, id: Int64) {
        self.timestamp = timestamp
        self.chat = chat
        self.id = id
    }

    public static func < (a: MentionPosition, b: MentionPosition) -> Bool {
        (a.timestamp, a.chat, a.id) < (b.timestamp, b.chat, b.id)
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
    /// Their reactions to the message, one per line: when it was given (microseconds
    /// since 1970), a space, the reaction (`"1700000000123456 👍"`; nil: none).
    public var reactions: String?

    public init(chat: Int64, id: Int64, user: Int64, localData: String?, isDeleted: Bool) {
        self.chat = chat
        self.id = id
        self.user = user
        self.localData = localData
        self.isDeleted = isDeleted
    }
}

/// A message whose own latest change is at `changeSeq` (the change feed).
public struct MessageChangeRow: Sendable, Equatable {
    public var chat: Int64
    public var id: Int64
    public var changeSeq: Int64

    public init(chat: Int64, id: Int64, changeSeq: Int64) {
        self.chat = chat
        self.id = id
        self.changeSeq = changeSeq
    }
}

/// Many messages changed at once (a read or delivery mark moving over them): message
/// `firstId + k` changed at `firstSeq + k`, up to `lastId`. Written once, however many
/// messages it covers.
public struct RangeChangeRow: Sendable, Equatable {
    public var chat: Int64
    public var firstSeq: Int64
    public var firstId: Int64
    public var lastId: Int64

    public init(chat: Int64, firstSeq: Int64, firstId: Int64, lastId: Int64) {
        self.chat = chat
        self.firstSeq = firstSeq
        self.firstId = firstId
        self.lastId = lastId
    }

    public var lastSeq: Int64 { firstSeq + lastId - firstId }

    /// When message `id` changed in this range (nil: it is not in it).
    public func seq(of id: Int64) -> Int64? {
        id >= firstId && id <= lastId ? firstSeq + id - firstId : nil
    }
}

/// Where each deciding process's changes sit in the change feed
/// (docs/several-deciding-nodes.md): a process numbers its changes in its own slot, the
/// 2^56 positions above `base(of:)`, and commits them in order, so whatever a snapshot
/// shows of one slot is everything of it up to some position. A feed token holds one
/// position per slot. One process alone (and every SQLite store) is slot 0, whose
/// positions are the plain numbers the feed always had.
public enum FeedSlots {
    /// How many slots a store may have: a token of that many positions fits in the 256
    /// bytes a token may take.
    public static let count = 8

    /// The position before the slot's first.
    public static func base(of slot: Int) -> Int64 { Int64(slot) << 56 }

    public static func slot(of position: Int64) -> Int { Int(position >> 56) }

    /// The counter a slot's last committed position is kept in.
    public static func counterName(of slot: Int) -> String { slot == 0 ? "changeSeq" : "changeSeq.\(slot)" }

    /// Every slot's last committed position, from the store's counters by name.
    public static func positions(in counters: [String: Int64]) -> [Int: Int64] {
        var positions: [Int: Int64] = [:]
        for slot in 0..<count {
            if let position = counters[counterName(of: slot)] { positions[slot] = position }
        }
        return positions
    }
}

/// Counters kept with the data they count.
public struct StoreCounters: Sendable, Equatable {
    /// The change feed's position the committing process's slot (`slot`) has got to:
    /// every message change it makes takes the next number. Read from the store: slot 0's.
    public var changeSeq: Int64
    public var slot: Int
    /// The newest message's row in the search index.
    public var searchRow: Int64

    public init(changeSeq: Int64 = 0, slot: Int = 0, searchRow: Int64 = 0) {
        self.changeSeq = changeSeq
        self.slot = slot
        self.searchRow = searchRow
    }

    /// The counters the store has by name (slot 0's position).
    public init(named counters: [String: Int64]) {
        self.init(changeSeq: counters[FeedSlots.counterName(of: 0)] ?? 0, searchRow: counters["searchRow"] ?? 0)
    }

    /// What a commit writes: each counter by name.
    public var named: [(name: String, value: Int64)] {
        [(FeedSlots.counterName(of: slot), changeSeq), ("searchRow", searchRow)]
    }
}

/// What is per user and per chat: all the engine reads at start-up.
public struct StoreDirectory: Sendable {
    public var users: [UserRecord] = []
    /// The settings of the users who changed any (`UserSettingsRow`).
    public var userSettings: [UserSettingsRow] = []
    public var endpoints: [EndpointRow] = []
    public var chats: [ChatRow] = []
    public var members: [MemberRow] = []
    public var counters = StoreCounters()
    /// Every feed slot's last committed position (`FeedSlots`).
    public var feedPositions: [Int: Int64] = [:]
    /// Each chat's version (`StoreBatch.chatVersions`), for a store that several deciding
    /// processes share; a chat left out has version 0. Empty for a store only one process
    /// writes (SQLite).
    public var chatVersions: [Int64: Int64] = [:]

    public init() {}
}

/// What a user chose for themselves, and when they were last seen: kept for the users
/// who changed any of it (a user without a row has the defaults).
public struct UserSettingsRow: Sendable, Equatable {
    public var user: Int64
    /// Nobody sees their presence, and they see nobody's (`presenceSet.hidden`).
    public var presenceHidden: Bool
    /// When they last came online or went offline (seconds since 1970), as far as the
    /// service saw.
    public var lastActive: Int64?
    /// The users they block (`userBlock`), ascending.
    public var blocked: [Int64]

    public init(user: Int64, presenceHidden: Bool = false, lastActive: Int64? = nil, blocked: [Int64] = []) {
        self.user = user
        self.presenceHidden = presenceHidden
        self.lastActive = lastActive
        self.blocked = blocked
    }

    /// `blocked` as the stores keep it: the numbers, separated by spaces.
    public var storedBlocked: String { blocked.map(String.init).joined(separator: " ") }

    public static func blocked(stored text: String) -> [Int64] {
        text.split(separator: " ").compactMap { Int64($0) }
    }
}

/// A chat and the version a decision about it was made on (`StoreBatch.chatVersions`).
public struct ChatVersion: Sendable, Equatable {
    public var chat: Int64
    public var version: Int64

    public init(chat: Int64, version: Int64) {
        self.chat = chat
        self.version = version
    }
}

/// A row written with only some of its columns.
public struct Update<Row: Sendable, Column: Hashable & Sendable>: Sendable {
    public var row: Row
    public var columns: Set<Column>

    public init(_ row: Row, columns: Set<Column>) {
        self.row = row
        self.columns = columns
    }
}

/// The writes of one group commit: new rows whole, changed rows by their changed columns.
public struct StoreBatch: Sendable {
    /// Users, endpoints, chats and memberships.
    public var directory = DirectoryWrites()
    /// New messages with their references.
    public var newMessages: [MessageRow] = []
    public var messageUpdates: [Update<MessageRow, MessageColumn>] = []
    /// Messages whose outgoing references go (recalled).
    public var droppedReferences: [(chat: Int64, id: Int64)] = []
    /// Changes of a message's own `changeSeq` without reading it: (chat, id, seq).
    public var touches: [(chat: Int64, id: Int64, seq: Int64)] = []
    public var rangeChanges: [RangeChangeRow] = []
    /// Reference counts as they now are (count 0: the row goes).
    public var refCounts: [RefCountRow] = []
    public var privateStates: [MessageUserRow] = []
    /// How many more (or fewer) messages hold on to each stored content.
    public var blobUses: [String: Int64] = [:]
    /// The counters as they now are (nil: unchanged).
    public var counters: StoreCounters?
    /// Notifications for recipients of the new messages (`NotificationOutbox`), appended.
    public var notifications: [NotificationRow] = []
    /// Every chat the batch changes (its row, members, messages or their states), with the
    /// version the decision was made on (0: a chat the store does not have yet). A store
    /// that several deciding processes share applies the batch only if each chat is still
    /// at that version, and moves it on by one; otherwise nothing of it is applied and the
    /// commit fails with `StoreFailure.Kind.conflict`. Empty for a store only one process
    /// writes (SQLite: `ChatStore.comparesChatVersions`).
    public var chatVersions: [ChatVersion] = []
    /// The feed slot of the process committing it (`FeedSlots`; not stored).
    public var feedSlot = 0
    /// This commit's place among the engine's commits (increasing; not stored).
    public var sequence: Int64 = 0
    /// The commit still in flight that this one follows (`ChatStore.commitsInFlight`), if
    /// any: this one is applied only once that one is, and not at all if it failed.
    public var follows: Int64?

    public init() {}

    public var isEmpty: Bool {
        directory.isEmpty && newMessages.isEmpty && messageUpdates.isEmpty && droppedReferences.isEmpty && touches.isEmpty
            && rangeChanges.isEmpty && refCounts.isEmpty && privateStates.isEmpty && blobUses.isEmpty && counters == nil
            && notifications.isEmpty
    }
}

/// The writes of a group commit to users, endpoints, chats and memberships.
public struct DirectoryWrites: Sendable {
    public var newUsers: [UserRecord] = []
    /// Users' settings, written whole.
    public var userSettings: [UserSettingsRow] = []
    /// Endpoints registered or renamed (written whole), and endpoints deregistered (none
    /// of them written).
    public var endpoints: [EndpointRow] = []
    public var removedEndpoints: [Int64] = []
    /// The users whose endpoints `removedEndpoints` were (for the other deciding
    /// processes, who follow whose endpoints changed: `FollowedCommit.users`).
    public var endpointUsers: [Int64] = []
    public var newChats: [ChatRow] = []
    public var chatUpdates: [Update<ChatRow, ChatColumn>] = []
    /// New memberships, and members who come back (written whole).
    public var members: [MemberRow] = []
    public var memberUpdates: [Update<MemberRow, MemberColumn>] = []

    public init() {}

    public var isEmpty: Bool {
        newUsers.isEmpty && endpoints.isEmpty && removedEndpoints.isEmpty && newChats.isEmpty && chatUpdates.isEmpty && members.isEmpty
            && memberUpdates.isEmpty && userSettings.isEmpty
    }
}

// MARK: what changed

/// Whether a text column changed, byte for byte: Swift's `!=` on strings is canonical
/// equivalence, under which a value respelled ("caf\u{E9}" to "cafe\u{301}") would not be
/// written, and would come back as it was after a restart.
func differs(_ new: String?, _ old: String?) -> Bool {
    switch (new, old) {
    case (nil, nil): false
    case (let new?, let old?): !new.utf8.elementsEqual(old.utf8)
    default: true
    }
}

extension ChatRow {
    /// The columns whose values differ from `old`.
    public func columns(changedFrom old: ChatRow) -> Set<ChatColumn> {
        var columns: Set<ChatColumn> = []
        if differs(subject, old.subject) { columns.insert(.subject) }
        if isDefunct != old.isDefunct { columns.insert(.isDefunct) }
        if differs(data, old.data) { columns.insert(.data) }
        if lastMessage != old.lastMessage { columns.insert(.lastMessage) }
        if lastActivity != old.lastActivity { columns.insert(.lastActivity) }
        if pins != old.pins { columns.insert(.pins) }
        return columns
    }
}

extension MemberRow {
    /// The columns whose values differ from `old`.
    public func columns(changedFrom old: MemberRow) -> Set<MemberColumn> {
        var columns: Set<MemberColumn> = []
        if isActive != old.isActive { columns.insert(.isActive) }
        if isAdmin != old.isAdmin { columns.insert(.isAdmin) }
        if joinedAt != old.joinedAt { columns.insert(.joinedAt) }
        if leftAt != old.leftAt { columns.insert(.leftAt) }
        if isHidden != old.isHidden { columns.insert(.isHidden) }
        if differs(localData, old.localData) { columns.insert(.localData) }
        if differs(privateData, old.privateData) { columns.insert(.privateData) }
        if deliveredUpTo != old.deliveredUpTo { columns.insert(.deliveredUpTo) }
        if readUpTo != old.readUpTo { columns.insert(.readUpTo) }
        if numUnread != old.numUnread { columns.insert(.numUnread) }
        if numUnreadMentions != old.numUnreadMentions { columns.insert(.numUnreadMentions) }
        if mutedUntil != old.mutedUntil { columns.insert(.mutedUntil) }
        if isBanned != old.isBanned { columns.insert(.isBanned) }
        return columns
    }
}
