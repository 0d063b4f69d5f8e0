import ChatProtocol
import Storage

/// The tags only the service posts (§6): a client sending one gets `ReservedTag`,
/// and a reference may not point at a message carrying one.
let reservedTags = MessageFilter.reservedTags

/// One user's place in one chat (engine thread only). Kept after they leave: their
/// delivery and read marks still decide the states of messages they received.
///
/// Every membership is in memory (it is per chat and per user, not per message);
/// `stored` is what the store has, so a commit writes just the columns that changed.
final class MemberRecord {
    let user: Int64
    var isActive: Bool
    var isAdmin: Bool
    /// The first message id this member sees.
    var joinedAt: Int64
    /// The message that announced their leaving or removal.
    var leftAt: Int64?
    var isHidden: Bool
    var localData: JSONValue?
    /// The starter's `privateData` from `chatStart` (shown to this member only).
    var privateData: JSONValue?
    var deliveredUpTo: Int64
    var readUpTo: Int64
    /// Incoming messages after `readUpTo` without flag N, kept exact (and stored) with
    /// every change that moves it.
    var numUnread: Int64 = 0
    /// Of those, the messages that mention them (`MessageRecord.mentions(_:)`).
    var numUnreadMentions: Int64 = 0
    /// Muted until this time (seconds since 1970; 0: for ever), or not (nil): read
    /// through `mute(now:)`, which says whether the time is up.
    var mutedUntil: Int64?
    /// Banned: nobody can invite them back until they are unbanned.
    var isBanned = false
    /// The row as the store has it (nil: not stored yet).
    var stored: MemberRow?

    init(user: Int64, isAdmin: Bool, joinedAt: Int64) {
        self.user = user
        self.isActive = true
        self.isAdmin = isAdmin
        self.joinedAt = joinedAt
        self.leftAt = nil
        self.isHidden = false
        self.localData = nil
        self.deliveredUpTo = 0
        self.readUpTo = 0
    }

    init(_ row: MemberRow) {
        user = row.user
        isActive = row.isActive
        isAdmin = row.isAdmin
        joinedAt = row.joinedAt
        leftAt = row.leftAt
        isHidden = row.isHidden
        localData = row.localData.map { JSONValue(compactJSON: $0) }
        privateData = row.privateData.map { JSONValue(compactJSON: $0) }
        deliveredUpTo = row.deliveredUpTo
        readUpTo = row.readUpTo
        numUnread = row.numUnread
        numUnreadMentions = row.numUnreadMentions
        mutedUntil = row.mutedUntil
        isBanned = row.isBanned
        stored = row
    }

    func row(chat: Int64) -> MemberRow {
        var row = MemberRow(
            chat: chat, user: user, isActive: isActive, isAdmin: isAdmin, joinedAt: joinedAt, leftAt: leftAt, isHidden: isHidden,
            localData: localData?.json, privateData: privateData?.json, deliveredUpTo: deliveredUpTo, readUpTo: readUpTo, numUnread: numUnread)
        row.numUnreadMentions = numUnreadMentions
        row.mutedUntil = mutedUntil
        row.isBanned = isBanned
        return row
    }

    /// Their mute at `now` (seconds since 1970): nil when not muted or when its time is
    /// up, otherwise when it ends (nil inside: for ever).
    func mute(now: Int64) -> Int64?? {
        guard let until = mutedUntil else { return nil }
        if until == 0 { return .some(nil) }
        return until > now ? .some(until) : nil
    }

    /// Whether this member received message `id` (was in the chat when it was posted).
    func received(_ id: Int64) -> Bool {
        id >= joinedAt && (leftAt.map { id < $0 } ?? true)
    }

    /// `message` counts in their unread counts: they received it, have not read it, and it
    /// counts as unread for them.
    func hasUnread(_ message: MessageRecord) -> Bool {
        received(message.id) && readUpTo < message.id && message.countsUnread(for: user)
    }

    /// `message` is one more they have not read (`hasUnread`): counted, and in their unread
    /// mentions when it mentions them.
    func countUnread(_ message: MessageRecord) {
        numUnread += 1
        if message.mentions(user) { numUnreadMentions += 1 }
    }

    /// The ids this member received that are not read yet: `(readUpTo, last]` within their time in the chat.
    func unreadRange(last: Int64) -> ClosedRange<Int64>? {
        let start = max(readUpTo + 1, joinedAt, 1)
        let end = leftAt.map { min($0 - 1, last) } ?? last
        return start <= end ? start...end : nil
    }
}

/// What one user did to a message for themselves only.
struct PrivateState {
    var localData: JSONValue?
    var isDeleted = false
    /// They removed their copy of the thumb (for good).
    var thumbDetached = false
    /// Their copy of the file: nil (Available), Transferring, Done, or where a download
    /// failed (Failed, FailedAvailable: kept in memory only; read back, it is Available).
    var fileState: FileState?
    /// Their reactions to it, in the order they gave them.
    var reactions: [GivenReaction] = []
}

/// An attached thumb or file: its kept base name, its stored content (nil until stored).
struct StoredFile {
    var name: String
    var blob: String?
    var size: Int64
}

/// Where a message's attachments are: being stored (the sender sees `Sending`), stored,
/// or not storable (`Failed`).
enum AttachmentPhase: String {
    case sending = "Sending"
    case stored = "Stored"
    case failed = "Failed"
}

/// A message (engine thread only), read from the store when a request needs it and kept
/// in the engine's cache while it is hot; `stored` is its row as the store has it.
final class MessageRecord {
    /// A message's attachments: a thumbnail and a file, and where storing them is.
    struct Attached {
        var thumb: StoredFile?
        var file: StoredFile?
        var attachment: AttachmentPhase?
    }

    let chat: Int64
    let id: Int64
    let sender: Int64
    let tag: String
    var content: String?
    var data: JSONValue?
    var refs: [MessageRef]
    let timestamp: Int64
    let isControl: Bool
    let neverCountsUnread: Bool
    /// Its sender's own identifier of it (`chatMessageSend`'s `externalId`).
    var externalId: String?
    /// The members it mentions by name, ascending, and whether it mentions every member
    /// (constants: read for every viewer it is rendered for).
    let mentioned: [Int64]
    let mentionsAll: Bool
    /// Every member it mentions, for the store's list of each user's mentions: made when
    /// it is posted, written with it, not kept once stored.
    var mentionedUsers: [Int64] = []
    var isRecalled: Bool
    /// The feed position of its latest change of its own.
    var changeSeq: Int64
    /// Its row in the store's search index; 0 when its text is not indexed.
    var searchRow: Int64 = 0
    var attached = Attached()
    /// How many messages refer to this one, per tag, and the newest of them.
    /// By tag byte for byte, as the store keeps them (`ExactText`).
    var refBy: [ExactText: (count: Int64, newest: Int64)] = [:]
    var privateStates: [Int64: PrivateState] = [:]
    /// `reactionTallies` as last counted (nil: to be counted).
    var countedReactions: [ReactionTally]?
    /// What the store has in the columns a change may write (nil: not stored yet).
    var stored: MessageColumns?

    init(
        chat: Int64, id: Int64, sender: Int64, tag: String, content: String?, data: JSONValue?, refs: [MessageRef], timestamp: Int64,
        isControl: Bool, neverCountsUnread: Bool, changeSeq: Int64, mentioned: [Int64] = [], mentionsAll: Bool = false
    ) {
        self.mentioned = mentioned
        self.mentionsAll = mentionsAll
        self.chat = chat
        self.id = id
        self.sender = sender
        self.tag = tag
        self.content = content
        self.data = data
        // Kept in one order, by tag byte for byte, as the store gives them back (not by
        // Swift's `<`, which compares normalized text).
        self.refs = refs.sorted { $0.tag.utf8.lexicographicallyPrecedes($1.tag.utf8) }
        self.timestamp = timestamp
        self.isControl = isControl
        self.neverCountsUnread = neverCountsUnread
        self.isRecalled = false
        self.changeSeq = changeSeq
    }

    /// A message read from the store. `storing`: a worker is storing its attachments now
    /// (otherwise storing that was under way when a process stopped cannot go on: its
    /// source was an open file of that process, so it failed).
    init(_ row: MessageRow, storing: Bool) {
        chat = row.chat
        id = row.id
        sender = row.sender
        tag = row.tag
        content = row.content
        data = row.data.map { JSONValue(compactJSON: $0) }
        refs = row.refs.map { MessageRef(tag: $0.tag, messageId: $0.target) }
        timestamp = row.timestamp
        isControl = row.isControl
        neverCountsUnread = row.neverCountsUnread
        externalId = row.externalId
        mentioned = row.mentions.map { $0.split(separator: " ").compactMap { Int64($0) } } ?? []
        mentionsAll = row.mentionsAll
        isRecalled = row.isRecalled
        changeSeq = row.changeSeq
        searchRow = row.searchRow
        attached.thumb = row.attachments.thumbName.map { StoredFile(name: $0, blob: row.attachments.thumbBlob, size: 0) }
        attached.file = row.attachments.fileName.map { StoredFile(name: $0, blob: row.attachments.fileBlob, size: row.attachments.fileSize ?? 0) }
        attached.attachment = row.attachments.attachment.map { phase in
            switch AttachmentPhase(rawValue: phase) {
            case .stored: .stored
            case .sending where storing: .sending
            default: .failed
            }
        }
        for count in row.refCounts { refBy[ExactText(count.tag)] = (count.count, count.newest) }
        for state in row.privateStates {
            privateStates[state.user] = PrivateState(
                localData: state.localData.map { JSONValue(compactJSON: $0) }, isDeleted: state.isDeleted,
                thumbDetached: state.thumbDetached, fileState: state.fileDownloaded ? .done : nil, reactions: GivenReaction.read(state.reactions))
        }
        stored = MessageColumns(row)
    }

    /// The message's own row as it now is (references included; counts and private states
    /// are rows of their own).
    var row: MessageRow {
        var row = MessageRow(
            chat: chat, id: id, sender: sender, tag: tag, content: content, data: data?.json,
            refs: refs.map { RefRow(tag: $0.tag, target: $0.messageId) }, timestamp: timestamp, isControl: isControl,
            neverCountsUnread: neverCountsUnread, isRecalled: isRecalled, changeSeq: changeSeq, searchRow: searchRow)
        row.attachments.thumbName = attached.thumb?.name
        row.attachments.thumbBlob = attached.thumb?.blob
        row.attachments.fileName = attached.file?.name
        row.attachments.fileBlob = attached.file?.blob
        row.attachments.fileSize = attached.file?.size
        row.attachments.attachment = attached.attachment?.rawValue
        row.externalId = externalId
        row.mentions = mentioned.isEmpty ? nil : mentioned.map(String.init).joined(separator: " ")
        row.mentionsAll = mentionsAll
        row.mentionedUsers = mentionedUsers
        return row
    }

    /// The stored contents this message holds on to.
    var blobs: [String] {
        [attached.thumb?.blob, attached.file?.blob].compactMap { $0 }
    }

    var isSystem: Bool { reservedTags.contains(tag) }

    /// Its attachments are being stored: only its sender sees it.
    var isPending: Bool { attached.attachment == .sending }

    /// Its attachments could not be stored (or it was recalled while they were being
    /// stored): its sender sees it `Failed`, everyone else a `Gap` in its place.
    var isGapForOthers: Bool { attached.attachment == .failed }

    /// Whether `viewer` (a member who was there for it) sees it at all.
    func isSeen(by viewer: Int64) -> Bool {
        sender == viewer || !isPending
    }

    /// It mentions `user` (by name, or every member), who did not send it, and it was not
    /// recalled.
    func mentions(_ user: Int64) -> Bool {
        user != sender && !isRecalled && (mentionsAll || mentioned.contains(user))
    }

    /// Counts towards `numUnread` of `user`. A message whose attachments are being stored
    /// counts from when they are (`Engine.attachmentsStored`); one whose storing failed
    /// never does (the others see a Gap).
    func countsUnread(for user: Int64) -> Bool {
        sender != user && !neverCountsUnread && attached.attachment != .sending && attached.attachment != .failed
    }

    /// What the record takes from the heap, as allocated: the object (what the store has
    /// inline), its texts (shared with what the store has, so counted once), its
    /// references and its tables. The cache's budget counts it.
    var footprint: Int {
        var bytes = MessageRecord.objectBytes + Heap.bytes(of: tag) + Heap.bytes(of: content) + Heap.bytes(of: data?.json) + Heap.bytes(of: externalId)
        if !mentioned.isEmpty { bytes += Heap.bytes(ofArray: mentioned.count, stride: MemoryLayout<Int64>.stride) }
        if !mentionedUsers.isEmpty { bytes += Heap.bytes(ofArray: mentionedUsers.count, stride: MemoryLayout<Int64>.stride) }
        if !refs.isEmpty {
            bytes += Heap.bytes(ofArray: refs.count, stride: MemoryLayout<MessageRef>.stride)
            for ref in refs { bytes += Heap.bytes(of: ref.tag) }
        }
        if !refBy.isEmpty {
            bytes += Heap.bytes(ofTable: refBy.count, stride: MemoryLayout<ExactText>.stride + MemoryLayout<(count: Int64, newest: Int64)>.stride)
            for tag in refBy.keys { bytes += Heap.bytes(of: tag.text) }
        }
        if !privateStates.isEmpty {
            bytes += Heap.bytes(ofTable: privateStates.count, stride: MemoryLayout<Int64>.stride + MemoryLayout<PrivateState>.stride)
            for state in privateStates.values {
                bytes += Heap.bytes(of: state.localData?.json)
                if !state.reactions.isEmpty {
                    bytes += Heap.bytes(ofArray: state.reactions.count, stride: MemoryLayout<GivenReaction>.stride)
                    for given in state.reactions { bytes += Heap.bytes(of: given.text) }
                }
            }
        }
        if let tallies = countedReactions, !tallies.isEmpty {
            bytes += Heap.bytes(ofArray: tallies.count, stride: MemoryLayout<ReactionTally>.stride)
        }
        if let thumb = attached.thumb { bytes += Heap.bytes(of: thumb.name) + Heap.bytes(of: thumb.blob) }
        if let file = attached.file { bytes += Heap.bytes(of: file.name) + Heap.bytes(of: file.blob) }
        if let attachments = stored?.attachments { bytes += Heap.bytes(ofObject: attachments) }
        return bytes
    }

    /// What the object itself takes, measured once on one (its size is its class's).
    static let objectBytes = Heap.bytes(ofObject: sample)

    /// An empty record (for measuring).
    static var sample: MessageRecord {
        MessageRecord(
            chat: 0, id: 0, sender: 0, tag: "", content: nil, data: nil, refs: [], timestamp: 0, isControl: false,
            neverCountsUnread: false, changeSeq: 0)
    }
}

/// A chat (engine thread only): its members, and what it says of its messages (the
/// newest id, the last activity); the messages themselves are read on demand.
final class ChatRecord {
    let number: Int64
    let chatId: String
    var subject: String
    let isOneToOne: Bool
    var invitePolicy: InvitePolicy
    let pinPolicy: PinPolicy
    var isDefunct: Bool
    var data: JSONValue?
    /// The pinned messages, the newest pin first (at most `Engine.maxPinsPerChat`).
    var pins: [PinRecord] = []
    /// Everyone who was ever a member, by user number.
    var members: [Int64: MemberRecord] = [:]
    /// The newest message id (ids are consecutive from 1).
    var lastMessage: Int64 = 0
    /// The timestamp of the newest message without flag N.
    var lastActivity: Int64 = 0
    /// The newest message's timestamp, once known (`Engine.lastTimestamp(of:)`).
    var lastTimestamp: Int64?
    /// Messages whose attachments are being stored, by id, with their senders: only the
    /// sender sees them until they are (docs/protocol.md, "Attachments"). Memory only: a
    /// process that stops ends their storing, and they are read back as Failed.
    var pendingSends: [Int64: Int64] = [:]
    /// The row as the store has it (nil: not stored yet).
    var stored: ChatRow?
    /// The version the next commit that changes the chat expects the store to have
    /// (`StoreBatch.chatVersions`; 0: not stored yet).
    var version: Int64 = 0

    init(number: Int64, subject: String, isOneToOne: Bool, invitePolicy: InvitePolicy, pinPolicy: PinPolicy, data: JSONValue?) {
        self.number = number
        self.chatId = String(number)
        self.subject = subject
        self.isOneToOne = isOneToOne
        self.invitePolicy = invitePolicy
        self.pinPolicy = pinPolicy
        self.isDefunct = false
        self.data = data
    }

    init(_ row: ChatRow) {
        number = row.number
        chatId = String(row.number)
        subject = row.subject
        isOneToOne = row.isOneToOne
        invitePolicy = InvitePolicy(rawValue: row.invitePolicy) ?? .participantsOnly
        pinPolicy = PinPolicy(rawValue: row.pinPolicy) ?? .adminsOnly
        pins = PinRecord.read(row.pins)
        isDefunct = row.isDefunct
        data = row.data.map { JSONValue(compactJSON: $0) }
        lastMessage = row.lastMessage
        lastActivity = row.lastActivity
        stored = row
    }

    var row: ChatRow {
        var row = ChatRow(
            number: number, subject: subject, isOneToOne: isOneToOne, invitePolicy: invitePolicy.rawValue, isDefunct: isDefunct,
            data: data?.json, lastMessage: lastMessage, lastActivity: lastActivity)
        row.pinPolicy = pinPolicy.rawValue
        row.pins = PinRecord.stored(pins)
        return row
    }

    /// The members who currently take part.
    var activeMembers: [MemberRecord] {
        members.values.filter(\.isActive).sorted { $0.user < $1.user }
    }

    func activeMember(_ user: Int64) -> MemberRecord? {
        guard let member = members[user], member.isActive else { return nil }
        return member
    }
}

/// A string that equals another only when their UTF-8 bytes do (user ids, tags): Swift's
/// `==` on strings is canonical equivalence, the store's and identity providers' is not.
struct ExactText: Hashable {
    let text: String

    init(_ text: String) {
        self.text = text
    }

    static func == (lhs: ExactText, rhs: ExactText) -> Bool {
        sameBytes(lhs.text, rhs.text)
    }

    func hash(into hasher: inout Hasher) {
        var text = text
        text.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
    }
}
