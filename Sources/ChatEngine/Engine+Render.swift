import ChatProtocol
import Storage

/// Rendering elements per viewer, and turning "before" and "after" renderings into the
/// `listChange` events (§4). Handlers change records; what each user sees
/// changing is always derived here, from the records, never computed on the side.
extension Engine {
    // MARK: sessions

    func sessions(of user: Int64) -> [EngineSession] {
        directory.sessionsByUser[user] ?? []
    }

    func isOnline(_ user: Int64) -> Bool {
        !(directory.sessionsByUser[user]?.isEmpty ?? true)
    }

    func emit(_ event: Event, toUser user: Int64, batch: Batch) {
        for session in sessions(of: user) { batch.emit(event, to: session) }
    }

    func uri(_ user: Int64) -> String {
        if let known = directory.uris[user] { return known }
        if directory.uris.count >= Directory.urisKept { directory.uris.removeAll(keepingCapacity: true) }
        let made = UserRecord.uriPrefix + String(user)
        directory.uris[user] = made
        return made
    }

    /// The user a uri in `viewer`'s request names: `bbmpim://user/id/0` is the viewer.
    func user(fromURI uri: String, viewer: Int64) -> Int64? {
        uri == UserRecord.localURI ? viewer : UserRecord.number(fromURI: uri)
    }

    // MARK: elements

    func renderChat(_ chat: ChatRecord, for member: MemberRecord) -> Chat {
        var flags = ""
        if member.isAdmin { flags += "A" }
        if member.isHidden { flags += "H" }
        if chat.isOneToOne { flags += "O" }
        // The newest message this member sees: one whose attachments are being stored is
        // its sender's alone until they are.
        var last = chat.lastMessage
        if !chat.pendingSends.isEmpty {
            while let sender = chat.pendingSends[last], sender != member.user { last -= 1 }
        }
        // Pins of messages from before they joined are not theirs to see.
        let pinned = chat.pins.isEmpty ? [] : chat.pins.map(\.message).filter { $0 >= member.joinedAt }
        return Chat(
            chatId: chat.chatId, subject: chat.subject, state: chat.isDefunct ? .defunct : .ready, flags: flags,
            lastMessage: last, numMessages: last >= member.joinedAt ? last - member.joinedAt + 1 : 0,
            numUnread: member.numUnread, numUnreadMentions: member.numUnreadMentions, lastActivity: chat.lastActivity, invitePolicy: chat.invitePolicy,
            pinPolicy: chat.pinPolicy, pinnedMessages: pinned.isEmpty ? nil : pinned, muted: member.mutedUntil == nil ? nil : true,
            mutedUntil: member.mutedUntil.flatMap { $0 == 0 ? nil : $0 }, data: chat.data, localData: member.localData,
            privateData: member.privateData)
    }

    /// A participant as the other members see them. A mute is shown until its end is
    /// taken (`endMutes`), so that every rendering agrees with the events sent.
    func renderParticipant(_ chat: ChatRecord, _ member: MemberRecord) -> ChatParticipant {
        ChatParticipant(
            chatId: chat.chatId, userUri: uri(member.user), state: .joined, flags: member.isAdmin ? "A" : "",
            muted: member.mutedUntil == nil ? nil : true, mutedUntil: member.mutedUntil.flatMap { $0 == 0 ? nil : $0 })
    }

    /// The state of `message` as its sender sees it: the furthest any recipient got, and
    /// whether they all got equally far.
    func senderState(_ message: MessageRecord, in chat: ChatRecord) -> (MessageState, Bool) {
        var best: MessageState = .sent
        var first: MessageState?
        var partial = false
        for member in chat.members.values where member.user != message.sender && member.received(message.id) {
            let state = recipientState(message, member)
            if let first, first != state { partial = true }
            if first == nil { first = state }
            if rank(state) > rank(best) { best = state }
        }
        return (best, partial)
    }

    /// How far one recipient got with a message.
    func recipientState(_ message: MessageRecord, _ member: MemberRecord) -> MessageState {
        if member.readUpTo >= message.id { return .read }
        if member.deliveredUpTo >= message.id { return .delivered }
        return .sent
    }

    private func rank(_ state: MessageState) -> Int {
        switch state {
        case .sending, .failed: 0
        case .sent: 1
        case .delivered: 2
        case .read: 3
        }
    }

    /// A message as `viewer` sees it (a member who sees it: `MessageRecord.isSeen(by:)`).
    func renderMessage(_ message: MessageRecord, in chat: ChatRecord, for viewer: Int64) -> ChatMessage {
        let own = message.sender == viewer
        if !own && message.isGapForOthers {
            // BBMDS's Gap: "the message history contains a gap at this position", posted
            // by the viewer, Sent, no content. Nothing of the message that failed.
            return ChatMessage(
                chatId: chat.chatId, messageId: message.id, senderUri: uri(viewer), tag: "Gap", flags: "N", state: .sent, stateIsPartial: false,
                timestamp: message.timestamp)
        }
        let privateState = message.privateStates[viewer]
        let deleted = privateState?.isDeleted ?? false
        var flags = ""
        if message.isControl { flags += "C" }
        if deleted { flags += "D" }
        if !own { flags += "I" }
        if message.neverCountsUnread { flags += "N" }
        let state: MessageState
        var partial = false
        if own {
            switch message.attached.attachment {
            case .sending: state = .sending
            case .failed: state = .failed
            case .stored, nil: (state, partial) = senderState(message, in: chat)
            }
        } else {
            state = (chat.members[viewer]?.readUpTo ?? 0) >= message.id ? .read : .delivered
        }
        let hidesBody = deleted || message.isRecalled
        var refBy: [RefBy]?
        if !message.refBy.isEmpty {
            refBy = message.refBy.keys.sorted { $0.text.utf8.lexicographicallyPrecedes($1.text.utf8) }.compactMap { tag in
                guard let counted = message.refBy[tag], counted.count > 0 else { return nil }
                return RefBy(tag: tag.text, newestRef: counted.newest, count: counted.count)
            }
        }
        // Attachments (§7): the sender sees the stored copy; a recipient the
        // thumb at once, and the file's name until they download it, then their copy.
        var thumb: String?
        var file: String?
        var fileSize: Int64?
        var fileState: FileState?
        if !hidesBody, let attachments = attachmentWork.store {
            if let stored = message.attached.thumb, stored.blob != nil, privateState?.thumbDetached != true {
                thumb = attachments.messagePath(chat: chat.number, id: message.id, kind: "thumb", name: stored.name)
            }
            if let stored = message.attached.file, stored.blob != nil {
                fileSize = stored.size
                if own {
                    file = attachments.messagePath(chat: chat.number, id: message.id, kind: "file", name: stored.name)
                    fileState = .done
                } else {
                    // Set only once their download is Done (as bbmcore does): a path before
                    // that would be taken for a downloaded file.
                    let mine = privateState?.fileState ?? .available
                    fileState = mine
                    file = mine == .done ? attachments.downloadPath(user: viewer, chat: chat.number, id: message.id, name: stored.name) : nil
                }
            }
        }
        // Reactions, mentions and pins: most messages have none, and each viewer of each
        // message is rendered here, so each is looked at only when there is something.
        var reactions: [ReactionCount]?
        var mentions: [String]?
        var mentionsAll: Bool?
        var mentioned: Bool?
        var pinned: Pin?
        if !hidesBody {
            if !message.privateStates.isEmpty {
                let tallies = message.reactionTallies
                if !tallies.isEmpty {
                    let mine = privateState?.reactions ?? []
                    reactions = tallies.map { tally in
                        ReactionCount(reaction: tally.text, count: tally.count, mine: mine.contains { sameBytes($0.text, tally.text) })
                    }
                }
            }
            if message.mentionsAll || !message.mentioned.isEmpty {
                mentions = message.mentioned.isEmpty ? nil : message.mentioned.map(uri)
                mentionsAll = message.mentionsAll ? true : nil
                mentioned = message.mentions(viewer) ? true : nil
            }
            let pins = chat.pins
            if !pins.isEmpty, let pin = pins.first(where: { $0.message == message.id }) {
                pinned = Pin(byUri: uri(pin.by), until: pin.until)
            }
        }
        return ChatMessage(
            chatId: chat.chatId, messageId: message.id, senderUri: uri(message.sender), tag: message.tag,
            content: hidesBody ? nil : message.content, data: hidesBody ? nil : message.data,
            localData: deleted ? nil : privateState?.localData, thumb: thumb, file: file, fileSize: fileSize,
            fileState: fileState, flags: flags, state: state, stateIsPartial: partial,
            recall: message.isRecalled ? .recalled : nil, ref: message.refs.isEmpty ? nil : message.refs,
            refBy: refBy, reactions: reactions, mentions: mentions, mentionsAll: mentionsAll, mentioned: mentioned, pinned: pinned,
            senderBlocked: !own && blocks(viewer, message.sender) ? true : nil, timestamp: message.timestamp, externalId: message.externalId)
    }

    func key(_ chat: ChatRecord, _ message: MessageRecord) -> ChatMessageKey {
        ChatMessageKey(chatId: chat.chatId, messageId: message.id)
    }

    /// Who sees `message` now: the chat's current members who were there for it (only its
    /// sender while its attachments are being stored).
    func viewers(of message: MessageRecord, in chat: ChatRecord) -> [MemberRecord] {
        chat.members.values.filter { $0.isActive && $0.joinedAt <= message.id && message.isSeen(by: $0.user) }
    }
}

/// What one request is about to change: the elements as each connected viewer saw them
/// before. `Engine.publish` renders them again afterwards and sends the differences.
final class PendingChanges {
    fileprivate enum Entry {
        /// One message: it takes the next position of the change feed. `only`: the viewers
        /// it may change for, when not all of them (a mark moving: its sender, and a
        /// reader); `before` holds the renderings of those who are online.
        case message(ChatRecord, MessageRecord, before: [Int64: ChatMessage], only: [Int64]?)
        /// Many messages at once (a mark moving over them): one range of positions, one
        /// row in the store; the messages were read only if someone online sees them.
        case range(ChatRecord, ClosedRange<Int64>, [(message: MessageRecord, before: [Int64: ChatMessage])])
    }

    fileprivate var entries: [Entry] = []
    /// Where each message changed one by one is in `entries`.
    fileprivate var messageIndex: [Batch.RowKey: Int] = [:]
    fileprivate var chats: [(chat: ChatRecord, before: ChatsBefore)] = []
    fileprivate var chatIndex: Set<Int64> = []

    /// The message is recorded one by one for every viewer `move` by `user` may change it
    /// for (with their renderings if they are online).
    fileprivate func records(_ key: Batch.RowKey, _ move: MarkMove, by user: Int64) -> Bool {
        guard let index = messageIndex[key] else { return false }
        guard case .message(_, let message, _, let only?) = entries[index] else { return true }
        // `move.viewers(of:movedBy:)`, without making the array (once per member of a group
        // a new message is delivered to).
        switch move {
        case .delivery: return message.sender == user || only.contains(message.sender)
        case .read: return message.sender == user || (only.contains(message.sender) && only.contains(user))
        }
    }
}

/// A chat element as each online member saw it before a change: members of one kind
/// (`ChatViewerKind`) in a row share one rendering.
struct ChatsBefore {
    var renderings: [Chat] = []
    /// Each member's rendering in `renderings`, with the kind they were of (nil: theirs
    /// alone).
    var ofMember: [Int64: (rendering: Int, kind: ChatViewerKind?)] = [:]
}

/// What a member's chat element depends on besides the chat itself (`renderChat`):
/// members of one kind see the chat exactly alike. nil: the rendering is theirs alone
/// (data of their own, or a message being stored that only its sender sees yet).
struct ChatViewerKind: Equatable {
    let isAdmin: Bool
    let isHidden: Bool
    let joinedAt: Int64
    let numUnread: Int64
    let numUnreadMentions: Int64
    let mutedUntil: Int64?

    init?(_ chat: ChatRecord, _ member: MemberRecord) {
        guard chat.pendingSends.isEmpty, member.localData == nil, member.privateData == nil else { return nil }
        isAdmin = member.isAdmin
        isHidden = member.isHidden
        joinedAt = member.joinedAt
        numUnread = member.numUnread
        numUnreadMentions = member.numUnreadMentions
        mutedUntil = member.mutedUntil
    }
}

/// How a mark moving over messages (`Engine.willChange(_:of:by:_:someoneSees:_:sendersSeeNow:)`)
/// may change them: who sees what changes.
enum MarkMove {
    /// A recipient got them: only their senders see it (their state).
    case delivery
    /// A recipient read them: their senders and the reader see it.
    case read

    /// The viewers for whom `message` may change when `user`'s mark moves over it.
    func viewers(of message: MessageRecord, movedBy user: Int64) -> [Int64] {
        switch self {
        case .delivery: [message.sender]
        case .read: [message.sender, user]
        }
    }
}

extension Engine {
    /// A mark moving over more messages than this changes them as one range (one row in
    /// the store), not one by one (a row each, read first). At 64, a user in 2,000 chats
    /// of 50 signing in had 100,000 messages read and written, for seconds of other users'
    /// sends at 12–15 ms; as ranges, 2,000 rows, and those sends kept their 2 ms. The
    /// change feed reads the ranges after its position (each counts a message at its
    /// latest), so ranges are for moves over many messages, not a few.
    static let largeRange = 16

    /// Call before changing anything `message` shows to anyone. `only`: the change shows
    /// to these viewers alone (the others' renderings are neither taken now nor compared
    /// after). `renderedNow`: the message as each online viewer (of `only`) sees it now,
    /// when the caller has just rendered it for all of them (it is not rendered again).
    func willChange(
        _ message: MessageRecord, in chat: ChatRecord, _ changes: PendingChanges, renderedNow: [Int64: ChatMessage]? = nil,
        only: [Int64]? = nil
    ) {
        let key = Batch.RowKey(chat: chat.number, item: message.id)
        guard let index = changes.messageIndex[key] else {
            changes.messageIndex[key] = changes.entries.count
            changes.entries.append(.message(chat, message, before: before(message, in: chat, renderedNow: renderedNow, only: only), only: only))
            return
        }
        // Recorded already, perhaps for some of its viewers only: the others are still as
        // they were (what changed since changed for those only), so they are taken now.
        guard case .message(_, _, var before, let recorded?) = changes.entries[index] else { return }
        let missing = only?.filter { !recorded.contains($0) }
        if let missing, missing.isEmpty { return }
        for (viewer, element) in self.before(message, in: chat, renderedNow: renderedNow, only: missing) where before[viewer] == nil {
            before[viewer] = element
        }
        changes.entries[index] = .message(chat, message, before: before, only: missing.map { recorded + $0 })
    }

    /// `message` as each online viewer (of `only`, when given) sees it now: `renderedNow`
    /// when the caller has it.
    private func before(_ message: MessageRecord, in chat: ChatRecord, renderedNow: [Int64: ChatMessage]?, only: [Int64]?) -> [Int64: ChatMessage] {
        var before: [Int64: ChatMessage] = [:]
        guard let only else {
            if let renderedNow { return renderedNow }
            for member in viewers(of: message, in: chat) where isOnline(member.user) {
                before[member.user] = renderMessage(message, in: chat, for: member.user)
            }
            return before
        }
        if let renderedNow { return renderedNow }
        for user in only where before[user] == nil {
            if isOnline(user), let member = chat.members[user], member.isActive, member.joinedAt <= message.id, message.isSeen(by: user) {
                before[user] = renderMessage(message, in: chat, for: user)
            }
        }
        return before
    }

    /// Call before a mark of `user` moves over the messages `range` of `chat` (`move`: a
    /// delivery, a read): each message not sent by `user` may change for the viewers
    /// `move` names. A few are changed one by one; many as one range, read from the store
    /// only when `someoneSees` (a viewer other than `user`, or `user` for a read, is
    /// online). `sendersSeeNow`: messages the caller has just rendered for their senders,
    /// by id (`announceNew`'s).
    func willChange(
        _ range: ClosedRange<Int64>, of chat: ChatRecord, by user: Int64, _ move: MarkMove, someoneSees: Bool,
        _ changes: PendingChanges, sendersSeeNow: [Int64: ChatMessage] = [:]
    ) throws {
        func seenBySender(_ message: MessageRecord) -> [Int64: ChatMessage]? {
            sendersSeeNow[message.id].map { [message.sender: $0] }
        }
        if range.count <= Engine.largeRange {
            // Nothing to read when this request recorded them all already for whom this
            // shows to: a new message delivered to each member of a group is recorded for
            // its sender at the first of them (the others were each read from the cache
            // and looked up again, about 1 µs a member).
            if range.allSatisfy({ changes.records(Batch.RowKey(chat: chat.number, item: $0), move, by: user) }) { return }
            for message in try loadMessages(in: chat, range) where message.sender != user {
                willChange(message, in: chat, changes, renderedNow: seenBySender(message), only: move.viewers(of: message, movedBy: user))
            }
            return
        }
        var loaded: [(MessageRecord, [Int64: ChatMessage])] = []
        if someoneSees {
            for message in try loadMessages(in: chat, range) where message.sender != user {
                loaded.append((message, before(message, in: chat, renderedNow: seenBySender(message), only: move.viewers(of: message, movedBy: user))))
            }
        }
        changes.entries.append(.range(chat, range, loaded))
    }

    /// Call before changing anything the chat element shows to any member. Members of
    /// one kind in a row (most of a group's, before a new message) are rendered once.
    func willChange(_ chat: ChatRecord, _ changes: PendingChanges) {
        guard changes.chatIndex.insert(chat.number).inserted else { return }
        var before = ChatsBefore()
        before.ofMember.reserveCapacity(chat.members.count)
        var last: (kind: ChatViewerKind, rendering: Int)?
        for member in chat.members.values where member.isActive && isOnline(member.user) {
            let kind = ChatViewerKind(chat, member)
            if let kind, let last, last.kind == kind {
                before.ofMember[member.user] = (last.rendering, kind)
                continue
            }
            before.renderings.append(renderChat(chat, for: member))
            before.ofMember[member.user] = (before.renderings.count - 1, kind)
            if let kind { last = (kind, before.renderings.count - 1) }
        }
        changes.chats.append((chat, before))
    }

    /// Stores what changed and sends each connected viewer what changed for them:
    /// message changes first, then chat changes (docs/protocol.md §4 ordering).
    func publish(_ changes: PendingChanges, batch: Batch) {
        var messageChanges: [Int64: [ChatMessageChange]] = [:]
        var userOrder: [Int64] = []
        func compare(_ message: MessageRecord, in chat: ChatRecord, _ before: [Int64: ChatMessage]) {
            // Those it was rendered for before, if they still see it: a mark moving over a
            // message of a big chat changes it for one or two of its members.
            for (user, old) in before {
                guard let member = chat.members[user], member.isActive, member.joinedAt <= message.id, message.isSeen(by: user) else { continue }
                let new = renderMessage(message, in: chat, for: member.user)
                guard let change = difference(old, new) else { continue }
                if messageChanges[member.user] == nil { userOrder.append(member.user) }
                messageChanges[member.user, default: []].append(change)
            }
        }
        for entry in changes.entries {
            switch entry {
            case .message(let chat, let message, let before, _):
                directory.changeSeq += 1
                message.changeSeq = directory.changeSeq
                batch.changed(message)
                compare(message, in: chat, before)
            case .range(let chat, let range, let loaded):
                // Messages also changed one by one in this request keep that position;
                // the others take one block of positions per stretch between them.
                var start = range.lowerBound
                for id in range.lowerBound...(range.upperBound + 1) {
                    let single = id <= range.upperBound && changes.messageIndex[Batch.RowKey(chat: chat.number, item: id)] != nil
                    guard single || id > range.upperBound else { continue }
                    if start < id {
                        batch.changed(RangeChangeRow(chat: chat.number, firstSeq: directory.changeSeq + 1, firstId: start, lastId: id - 1))
                        directory.changeSeq += id - start
                    }
                    start = id + 1
                }
                for (message, before) in loaded where changes.messageIndex[Batch.RowKey(chat: chat.number, item: message.id)] == nil {
                    compare(message, in: chat, before)
                }
            }
        }
        for user in userOrder {
            for chunk in messageChanges[user]!.chunked(Engine.chunkSize) {
                emit(.listChange(.chatMessage(ListChangeChatMessage(elements: chunk))), toUser: user, batch: batch)
            }
        }
        for (chat, before) in changes.chats {
            batch.changed(chat)
            // A new message changes most members' chat alike (its last message, their
            // unread count when they had read as far): a member of the kind the one before
            // was, before and now, has the same change, neither rendered nor compared
            // again, and alike changes share their bytes.
            // The distinct changes made, each with its event, and which of them the last
            // emit encoded and the last member had (with the rendering and kind it was
            // made for). Only their indices are copied from member to member.
            var made: [(change: ChatChange, event: Event)] = []
            var lastEmitted: Int?
            var last: (rendering: Int, kind: ChatViewerKind, change: Int?)?
            for member in chat.members.values where member.isActive {
                guard let was = before.ofMember[member.user] else { continue }
                let kind = was.kind == nil ? nil : ChatViewerKind(chat, member)
                let index: Int?
                if let kind, let known = last, known.rendering == was.rendering, known.kind == kind {
                    index = known.change
                } else {
                    if let change = difference(before.renderings[was.rendering], renderChat(chat, for: member)) {
                        // Alike with the one emitted last (a member of another kind in between
                        // may have had no change): its bytes are shared.
                        if let emitted = lastEmitted, made[emitted].change == change {
                            index = emitted
                        } else {
                            made.append((change, Event.listChange(.chat(ListChangeChat(elements: [change])))))
                            index = made.count - 1
                        }
                    } else {
                        index = nil
                    }
                    if let kind { last = (was.rendering, kind, index) }
                }
                guard let index else { continue }
                for session in sessions(of: member.user) {
                    if lastEmitted == index {
                        batch.emitLastAgain(to: session)
                    } else {
                        batch.emit(made[index].event, to: session, sameAsLast: false)
                        lastEmitted = index
                    }
                }
            }
        }
    }

    private func field<T: Equatable>(_ old: T?, _ new: T?) -> Nullable<T>? {
        if old == new { return nil }
        guard let new else { return .null }
        return .value(new)
    }

    /// Strings differ when their bytes do: Swift's `==` is canonical equivalence, under
    /// which a subject respelled ("caf\u{E9}" to "cafe\u{301}") would not be announced.
    private func field(_ old: String?, _ new: String?) -> Nullable<String>? {
        if sameBytes(old, new) { return nil }
        guard let new else { return .null }
        return .value(new)
    }

    /// What changed from `old` to `new` (nil: nothing). Each field is compared once: most
    /// elements compared have changed.
    func difference(_ old: ChatMessage, _ new: ChatMessage) -> ChatMessageChange? {
        let change = ChatMessageChange(
            chatId: new.chatId, messageId: new.messageId, senderUri: field(old.senderUri, new.senderUri), tag: field(old.tag, new.tag),
            content: field(old.content, new.content), data: field(old.data, new.data), localData: field(old.localData, new.localData),
            thumb: field(old.thumb, new.thumb), file: field(old.file, new.file), fileSize: field(old.fileSize, new.fileSize),
            fileState: field(old.fileState, new.fileState), flags: field(old.flags, new.flags), state: field(old.state, new.state),
            stateIsPartial: field(old.stateIsPartial, new.stateIsPartial), recall: field(old.recall, new.recall),
            ref: field(old.ref, new.ref), refBy: field(old.refBy, new.refBy), reactions: field(old.reactions, new.reactions),
            mentions: field(old.mentions, new.mentions), mentionsAll: field(old.mentionsAll, new.mentionsAll),
            mentioned: field(old.mentioned, new.mentioned), pinned: field(old.pinned, new.pinned),
            senderBlocked: field(old.senderBlocked, new.senderBlocked), timestamp: field(old.timestamp, new.timestamp),
            externalId: field(old.externalId, new.externalId))
        return change == ChatMessageChange(chatId: new.chatId, messageId: new.messageId) ? nil : change
    }

    /// Every field of `new` as a change, for a viewer whose old rendering is unknown
    /// (a field without a value is null).
    func everything(_ new: ChatMessage) -> ChatMessageChange {
        func given<T>(_ value: T?) -> Nullable<T> { value.map { .value($0) } ?? .null }
        return ChatMessageChange(
            chatId: new.chatId, messageId: new.messageId, senderUri: .value(new.senderUri), tag: .value(new.tag), content: given(new.content),
            data: given(new.data), localData: given(new.localData), thumb: given(new.thumb), file: given(new.file), fileSize: given(new.fileSize),
            fileState: given(new.fileState), flags: given(new.flags), state: given(new.state), stateIsPartial: given(new.stateIsPartial),
            recall: given(new.recall), ref: given(new.ref), refBy: given(new.refBy), reactions: given(new.reactions),
            mentions: given(new.mentions), mentionsAll: given(new.mentionsAll), mentioned: given(new.mentioned), pinned: given(new.pinned),
            senderBlocked: given(new.senderBlocked), timestamp: given(new.timestamp),
            externalId: given(new.externalId))
    }

    /// What changed from `old` to `new` (nil: nothing).
    func difference(_ old: ChatParticipant, _ new: ChatParticipant) -> ChatParticipantChange? {
        let change = ChatParticipantChange(
            chatId: new.chatId, userUri: new.userUri, state: field(old.state, new.state), flags: field(old.flags, new.flags),
            muted: field(old.muted, new.muted), mutedUntil: field(old.mutedUntil, new.mutedUntil))
        return change == ChatParticipantChange(chatId: new.chatId, userUri: new.userUri) ? nil : change
    }

    /// `member`, rendered `was` before a change, as every other member sees them now: the
    /// difference, to each of them (`setAdmin`, a mute).
    func announceChange(of member: MemberRecord, in chat: ChatRecord, was: ChatParticipant, batch: Batch) {
        guard let change = difference(was, renderParticipant(chat, member)) else { return }
        for other in chat.activeMembers where other.user != member.user {
            emit(.listChange(.chatParticipant(ListChangeChatParticipant(elements: [change]))), toUser: other.user, batch: batch)
        }
    }

    /// Every field of `new` as a change (`everything(_:)` for a message).
    func everything(_ new: Chat) -> ChatChange {
        func given<T>(_ value: T?) -> Nullable<T> { value.map { .value($0) } ?? .null }
        return ChatChange(
            chatId: new.chatId, subject: given(new.subject), state: given(new.state), flags: given(new.flags), lastMessage: given(new.lastMessage),
            numMessages: given(new.numMessages), numUnread: given(new.numUnread), numUnreadMentions: given(new.numUnreadMentions),
            lastActivity: given(new.lastActivity),
            invitePolicy: given(new.invitePolicy), pinPolicy: given(new.pinPolicy), pinnedMessages: given(new.pinnedMessages),
            muted: given(new.muted), mutedUntil: given(new.mutedUntil), data: given(new.data),
            localData: given(new.localData))
    }

    /// What changed from `old` to `new` (nil: nothing).
    func difference(_ old: Chat, _ new: Chat) -> ChatChange? {
        let change = ChatChange(
            chatId: new.chatId, subject: field(old.subject, new.subject), state: field(old.state, new.state), flags: field(old.flags, new.flags),
            lastMessage: field(old.lastMessage, new.lastMessage), numMessages: field(old.numMessages, new.numMessages),
            numUnread: field(old.numUnread, new.numUnread), numUnreadMentions: field(old.numUnreadMentions, new.numUnreadMentions),
            lastActivity: field(old.lastActivity, new.lastActivity),
            invitePolicy: field(old.invitePolicy, new.invitePolicy), pinPolicy: field(old.pinPolicy, new.pinPolicy),
            pinnedMessages: field(old.pinnedMessages, new.pinnedMessages), muted: field(old.muted, new.muted),
            mutedUntil: field(old.mutedUntil, new.mutedUntil), data: field(old.data, new.data), localData: field(old.localData, new.localData))
        return change == ChatChange(chatId: new.chatId) ? nil : change
    }
}
