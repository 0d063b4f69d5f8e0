import Protocol
import Store

/// The tags only the service posts (PROTOCOL.md §6): a client sending one gets `ReservedTag`,
/// and a reference may not point at a message carrying one.
let reservedTags: Set<String> = ["Join", "Leave", "Subject", "Gap", "Shred", "Clear", "Admin", "Remove"]

/// One user's place in one chat (engine thread only). Kept after they leave: their
/// delivery and read marks still decide the states of messages they received.
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
    /// Incoming messages after `readUpTo` without flag N (derived, not stored).
    var numUnread: Int64 = 0

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
    }

    func row(chat: Int64) -> MemberRow {
        var row = MemberRow(chat: chat, user: user, isActive: isActive, isAdmin: isAdmin, joinedAt: joinedAt, leftAt: leftAt, isHidden: isHidden,
                            localData: localData?.json, deliveredUpTo: deliveredUpTo, readUpTo: readUpTo)
        row.privateData = privateData?.json
        return row
    }

    /// Whether this member received message `id` (was in the chat when it was posted).
    func received(_ id: Int64) -> Bool {
        id >= joinedAt && (leftAt.map { id < $0 } ?? true)
    }
}

/// What one user did to a message for themselves only.
struct PrivateState {
    var localData: JSONValue?
    var isDeleted = false
    /// They removed their copy of the thumb (for good).
    var thumbDetached = false
    /// Their copy of the file: nil (Available), Transferring, or Done.
    var fileState: FileState?
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

/// A message (engine thread only).
final class MessageRecord {
    let id: Int64
    let sender: Int64
    let tag: String
    var content: String?
    var data: JSONValue?
    var refs: [MessageRef]
    let timestamp: Int64
    let isControl: Bool
    let neverCountsUnread: Bool
    var isRecalled: Bool
    var changeSeq: Int64
    /// Its row in the store's search index; 0 when its text is not indexed.
    var searchRow: Int64 = 0
    var thumb: StoredFile?
    var file: StoredFile?
    var attachment: AttachmentPhase?
    /// The messages that reference this one, per tag, in ascending id order.
    var referencedBy: [String: [Int64]] = [:]
    var privateStates: [Int64: PrivateState] = [:]

    init(id: Int64, sender: Int64, tag: String, content: String?, data: JSONValue?, refs: [MessageRef], timestamp: Int64,
         isControl: Bool, neverCountsUnread: Bool, changeSeq: Int64) {
        self.id = id
        self.sender = sender
        self.tag = tag
        self.content = content
        self.data = data
        self.refs = refs
        self.timestamp = timestamp
        self.isControl = isControl
        self.neverCountsUnread = neverCountsUnread
        self.isRecalled = false
        self.changeSeq = changeSeq
    }

    init(_ row: MessageRow) {
        id = row.id
        sender = row.sender
        tag = row.tag
        content = row.content
        data = row.data.map { JSONValue(compactJSON: $0) }
        refs = row.refs.map { MessageRef(tag: $0.tag, messageId: $0.target) }
        timestamp = row.timestamp
        isControl = row.isControl
        neverCountsUnread = row.neverCountsUnread
        isRecalled = row.isRecalled
        changeSeq = row.changeSeq
        searchRow = row.searchRow
        thumb = row.thumbName.map { StoredFile(name: $0, blob: row.thumbBlob, size: 0) }
        file = row.fileName.map { StoredFile(name: $0, blob: row.fileBlob, size: row.fileSize ?? 0) }
        // Storing that was under way when the process stopped cannot go on: its source
        // was an open file of the old process.
        attachment = row.attachment.map { AttachmentPhase(rawValue: $0) == .stored ? .stored : .failed }
    }

    func row(chat: Int64) -> MessageRow {
        var row = MessageRow(chat: chat, id: id, sender: sender, tag: tag, content: content, data: data?.json,
                             refs: refs.map { RefRow(tag: $0.tag, target: $0.messageId) }, timestamp: timestamp, isControl: isControl,
                             neverCountsUnread: neverCountsUnread, isRecalled: isRecalled, changeSeq: changeSeq, searchRow: searchRow)
        row.thumbName = thumb?.name
        row.thumbBlob = thumb?.blob
        row.fileName = file?.name
        row.fileBlob = file?.blob
        row.fileSize = file?.size
        row.attachment = attachment?.rawValue
        return row
    }

    /// The stored contents this message holds on to.
    var blobs: [String] {
        [thumb?.blob, file?.blob].compactMap { $0 }
    }

    var isSystem: Bool { reservedTags.contains(tag) }

    /// Counts towards `numUnread` of `user`.
    func countsUnread(for user: Int64) -> Bool {
        sender != user && !neverCountsUnread
    }
}

/// A chat (engine thread only): its members, and its messages in id order.
final class ChatRecord {
    let number: Int64
    let chatId: String
    var subject: String
    let isOneToOne: Bool
    var invitePolicy: InvitePolicy
    var isDefunct: Bool
    var data: JSONValue?
    /// Everyone who was ever a member, by user number.
    var members: [Int64: MemberRecord] = [:]
    /// `messages[i]` has id `i + 1`.
    var messages: [MessageRecord] = []
    /// Message ids per tag, ascending (the `tag` criterion).
    var idsByTag: [String: [Int64]] = [:]
    /// (change seq, message id) in seq order; an entry is stale when the message changed again.
    var changeLog: [(seq: Int64, id: Int64)] = []
    /// The timestamp of the newest message without flag N.
    var lastActivity: Int64 = 0

    init(number: Int64, subject: String, isOneToOne: Bool, invitePolicy: InvitePolicy, data: JSONValue?) {
        self.number = number
        self.chatId = String(number)
        self.subject = subject
        self.isOneToOne = isOneToOne
        self.invitePolicy = invitePolicy
        self.isDefunct = false
        self.data = data
    }

    init(_ row: ChatRow) {
        number = row.number
        chatId = String(row.number)
        subject = row.subject
        isOneToOne = row.isOneToOne
        invitePolicy = InvitePolicy(rawValue: row.invitePolicy) ?? .participantsOnly
        isDefunct = row.isDefunct
        data = row.data.map { JSONValue(compactJSON: $0) }
    }

    var row: ChatRow {
        ChatRow(number: number, subject: subject, isOneToOne: isOneToOne, invitePolicy: invitePolicy.rawValue, isDefunct: isDefunct,
                data: data?.json, lastMessage: lastMessage)
    }

    var lastMessage: Int64 { Int64(messages.count) }

    func message(_ id: Int64) -> MessageRecord? {
        guard id >= 1 && id <= lastMessage else { return nil }
        return messages[Int(id - 1)]
    }

    /// The members who currently take part.
    var activeMembers: [MemberRecord] {
        members.values.filter(\.isActive).sorted { $0.user < $1.user }
    }

    func activeMember(_ user: Int64) -> MemberRecord? {
        guard let member = members[user], member.isActive else { return nil }
        return member
    }

    /// Appends a message and keeps the indexes.
    func append(_ message: MessageRecord) {
        messages.append(message)
        idsByTag[message.tag, default: []].append(message.id)
        for ref in message.refs {
            self.message(ref.messageId)?.referencedBy[ref.tag, default: []].append(message.id)
        }
        if !message.neverCountsUnread { lastActivity = max(lastActivity, message.timestamp) }
        changeLog.append((message.changeSeq, message.id))
    }

    /// Records that `message` changed at `seq` (change feed).
    func touch(_ message: MessageRecord, seq: Int64) {
        message.changeSeq = seq
        changeLog.append((seq, message.id))
        if changeLog.count > 1024 && changeLog.count > 2 * messages.count {
            changeLog = changeLog.filter { self.message($0.id)?.changeSeq == $0.seq }
        }
    }

    /// Removes a recalled message's outgoing references from their targets' indexes.
    func dropReferences(of message: MessageRecord) {
        for ref in message.refs {
            guard let target = self.message(ref.messageId) else { continue }
            target.referencedBy[ref.tag]?.removeAll { $0 == message.id }
            if target.referencedBy[ref.tag]?.isEmpty == true { target.referencedBy[ref.tag] = nil }
        }
        message.refs = []
    }

    /// Recounts a member's unread messages from their read mark.
    func recountUnread(_ member: MemberRecord) {
        var count: Int64 = 0
        let start = max(member.readUpTo + 1, member.joinedAt, 1)
        let end = member.leftAt.map { min($0 - 1, lastMessage) } ?? lastMessage
        if start <= end {
            for id in start...end where messages[Int(id - 1)].countsUnread(for: member.user) { count += 1 }
        }
        member.numUnread = count
    }
}
