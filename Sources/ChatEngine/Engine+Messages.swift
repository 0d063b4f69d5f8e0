import ChatProtocol
import Foundation
import Storage

#if canImport(Glibc)
    import Glibc
#endif

/// Messages (§6): sending, states, reading, private delete, recall, typing,
/// and chat events.
extension Engine {
    /// content (UTF-8) + data (compact JSON) + thumb, in bytes.
    static let maxMessageBytes = 71_680
    /// Application data that is not a message's own (a chat's `data`, a member's
    /// `localData` and `privateData`, a user's `localData` of a message, a `chatEvent`'s
    /// `data`) is at most this many bytes of compact JSON each, as much as a message's
    /// content and data together. Only the line bounded them before: chats' values are
    /// read at every start-up, one user's values of 1,000 messages made a window answer of
    /// a gigabyte, and an event is copied to every endpoint of every participant.
    static let maxDataBytes = 71_680

    /// Why `value`, given as `field`, is over `maxDataBytes` (nil when it is not).
    func dataTooLarge(_ value: JSONValue?, field: String) -> String? {
        guard let size = value?.byteCount, size > Engine.maxDataBytes else { return nil }
        return "'\(field)' is \(size) bytes, over the limit of \(Engine.maxDataBytes)"
    }

    // MARK: finding things

    /// The chat, when `user` takes part in it (otherwise it is not found: docs/protocol.md §2).
    func chat(_ chatId: String, of user: Int64) throws -> (ChatRecord, MemberRecord) {
        // Only the service's own spelling names a chat ("7", never "07" or "+7").
        if let number = Int64(chatId), chatId.utf8.first != UInt8(ascii: "+"), chatId.utf8.first != UInt8(ascii: "0"),
            let chat = directory.chats[number], let member = chat.activeMember(user)
        {
            return (chat, member)
        }
        throw ProtocolError.notFound("chat '\(chatId)' was not found")
    }

    /// A message `member` can see (not one whose attachments are being stored, but for its sender).
    func message(_ id: Int64, in chat: ChatRecord, seenBy member: MemberRecord) throws -> MessageRecord {
        guard id >= member.joinedAt, let message = try loadMessage(id, in: chat), message.isSeen(by: member.user) else {
            throw ProtocolError.notFound("message \(id) was not found in chat '\(chat.chatId)'")
        }
        return message
    }

    func now() -> Int64 {
        clock()
    }

    // MARK: posting

    /// Adds a message to the chat's history (records and store only; announcing is the
    /// caller's). The chat must have been passed to `willChange` first; the targets of
    /// `refs` must be loaded (`send` checked them). A `pending` message (its attachments
    /// are to be stored) is its sender's alone until they are: it counts as unread, moves
    /// the chat's activity and is found by search from then (`attachmentsStored`).
    @discardableResult
    func append(
        to chat: ChatRecord, sender: Int64, tag: String, content: String? = nil, data: JSONValue? = nil, refs: [MessageRef] = [],
        targets: [MessageRecord] = [], isControl: Bool = false, neverCountsUnread: Bool = false, pending: Bool = false,
        externalId: String? = nil, mentions: [Int64] = [], mentionsAll: Bool = false, batch: Batch, changes: PendingChanges
    ) -> MessageRecord {
        for target in targets { willChange(target, in: chat, changes) }
        directory.changeSeq += 1
        let timestamp = max(now(), lastTimestamp(of: chat))
        let message = MessageRecord(
            chat: chat.number, id: chat.lastMessage + 1, sender: sender, tag: tag, content: content, data: data,
            refs: refs, timestamp: timestamp, isControl: isControl, neverCountsUnread: neverCountsUnread,
            changeSeq: directory.changeSeq, mentioned: mentions, mentionsAll: mentionsAll)
        message.externalId = externalId
        if mentionsAll || !mentions.isEmpty {
            message.mentionedUsers = chat.members.values.filter { $0.isActive && message.mentions($0.user) }.map(\.user).sorted()
        }
        chat.lastMessage = message.id
        chat.lastTimestamp = timestamp
        if pending {
            message.attached.attachment = .sending
            chat.pendingSends[message.id] = sender
        } else if !neverCountsUnread {
            chat.lastActivity = max(chat.lastActivity, timestamp)
        }
        for target in targets {
            for ref in refs where ref.messageId == target.id {
                let counted = target.refBy[ExactText(ref.tag)] ?? (0, 0)
                target.refBy[ExactText(ref.tag)] = (counted.count + 1, message.id)
                batch.changedReferences(to: target, tag: ref.tag)
            }
        }
        if !pending { index(message, in: chat, batch: batch) }
        batch.changed(message)
        batch.changed(chat)
        for member in chat.members.values where member.isActive {
            if member.isHidden {
                member.isHidden = false
                batch.changed(member, of: chat)
            }
            if member.hasUnread(message) { countNewUnread(message, for: member, in: chat, batch: batch) }
        }
        return message
    }

    /// `member` has one more message they have not read (`MemberRecord.hasUnread`): it is
    /// counted, and when the application is notified (`NotificationPolicy`) a
    /// notification for them is written with it: due at once when they are connected
    /// nowhere, after the policy's delay when they are (sent only if they have not read it
    /// by then), none for a message the service posts.
    func countNewUnread(_ message: MessageRecord, for member: MemberRecord, in chat: ChatRecord, batch: Batch) {
        member.countUnread(message)
        batch.changed(member, of: chat)
        // A user is not woken by someone they block.
        guard let policy = notificationPolicy, !message.isSystem, !blocks(member.user, message.sender) else { return }
        let now = Engine.milliseconds()
        let due: Int64
        if !isConnectedAnywhere(member.user) {
            due = now
        } else if let delay = policy.unreadDelay {
            due = now + delay.wholeMilliseconds
        } else {
            return
        }
        if batch.notifications.isEmpty, let written = policy.written { batch.whenCommitted(written) }
        batch.notifications.append(NotificationRow(key: NotificationKey(chat: chat.number, id: message.id, user: member.user), created: now, due: due))
    }

    /// Makes a message's text searchable.
    func index(_ message: MessageRecord, in chat: ChatRecord, batch: Batch) {
        guard let content = message.content, !message.isSystem else { return }
        message.searchRow = newNumber(for: .searchRow, after: searches.lastRow)
        searches.lastRow = max(searches.lastRow, message.searchRow)
        batch.searchAdds.append(SearchEntry(row: message.searchRow, chat: chat.number, id: message.id, text: content))
    }

    /// Sends `listAdd chatMessage` to every connected member who sees the new messages,
    /// and marks them delivered to recipients that are connected.
    /// With `answering`, that session's `listAdd chatMessage` carries the request's cookie
    /// (the answer to a send). `except`: a member who has them already (the sender of a
    /// message whose attachments were just stored).
    func announceNew(
        _ messages: [MessageRecord], in chat: ChatRecord, answering: (session: EngineSession, cookie: String?)? = nil,
        except: Int64? = nil, batch: Batch, changes: PendingChanges
    ) throws {
        guard !messages.isEmpty else { return }
        // Each as its sender sees it now, if online: the delivery below changes it from this
        // for them alone.
        var sendersSeeNow: [Int64: ChatMessage] = [:]
        // What the last session without a cookie was sent, in one event: members who see
        // the messages alike (in a group, all but their sender) get its bytes again.
        var lastAlike: [ChatMessage]?
        // Members for whom the new messages render alike (in a group, most recipients) share
        // one rendering: what tells them apart is known without rendering (`ViewerKind`).
        var lastRendered: (kinds: [ViewerKind], elements: [ChatMessage])?
        // Per member, kept from one to the next (no arrays made and freed for each).
        var kinds: [ViewerKind] = []
        for member in chat.members.values where member.isActive && member.user != except {
            let sessions = sessions(of: member.user)
            guard !sessions.isEmpty else { continue }
            // Most members see every new message: then they are `messages` itself.
            let seesAll = messages.allSatisfy { $0.id >= member.joinedAt && $0.isSeen(by: member.user) }
            let visible = seesAll ? messages : messages.filter { $0.id >= member.joinedAt && $0.isSeen(by: member.user) }
            guard !visible.isEmpty else { continue }
            kinds.removeAll(keepingCapacity: true)
            for message in visible { kinds.append(ViewerKind(message, member, blocksSender: blocks(member.user, message.sender))) }
            let elements: [ChatMessage]
            if let last = lastRendered, kinds.allSatisfy(\.isShared), last.kinds == kinds {
                elements = last.elements
            } else {
                elements = visible.map { renderMessage($0, in: chat, for: member.user) }
                lastRendered = (kinds, elements)
            }
            for (message, element) in zip(visible, elements) where message.sender == member.user { sendersSeeNow[message.id] = element }
            for session in sessions {
                let cookie = session === answering?.session ? answering?.cookie : nil
                if cookie == nil && elements.count <= Engine.chunkSize {
                    if let lastAlike, lastAlike == elements {
                        batch.emitLastAgain(to: session)
                    } else {
                        batch.emit(.listAdd(.chatMessage(ListAddChatMessage(elements: elements))), to: session, sameAsLast: false)
                        lastAlike = elements
                    }
                    continue
                }
                for chunk in elements.chunked(Engine.chunkSize) {
                    batch.emit(.listAdd(.chatMessage(ListAddChatMessage(cookie: cookie, elements: chunk))), to: session)
                }
            }
        }
        try markDelivered(chat, batch: batch, changes: changes, sendersSeeNow: sendersSeeNow)
    }

    /// What a viewer's rendering of a message depends on besides the message itself
    /// (`renderMessage`): their own message, a rendering of theirs alone (a Gap is posted by
    /// each viewer; what they did to it for themselves), or a recipient's, told apart by
    /// whether they read it and whether it mentions them. A viewer who blocks its sender
    /// sees it flagged (`senderBlocked`), alone.
    enum ViewerKind: Equatable {
        case own
        case alone
        case recipient(read: Bool, mentioned: Bool)

        init(_ message: MessageRecord, _ member: MemberRecord, blocksSender: Bool) {
            if message.sender == member.user {
                self = .own
            } else if blocksSender || message.isGapForOthers || (!message.privateStates.isEmpty && message.privateStates[member.user] != nil) {
                self = .alone
            } else {
                self = .recipient(read: member.readUpTo >= message.id, mentioned: message.mentions(member.user))
            }
        }

        /// Other members of the same kind see the message exactly alike.
        var isShared: Bool {
            if case .recipient = self { true } else { false }
        }
    }

    /// Every connected member has now received everything up to the chat's last message:
    /// the senders' states move (§6). `sendersSeeNow`: messages just rendered for their
    /// senders, by id, not rendered again.
    func markDelivered(
        _ chat: ChatRecord, only user: Int64? = nil, batch: Batch, changes: PendingChanges,
        sendersSeeNow: [Int64: ChatMessage] = [:]
    ) throws {
        // A recipient's mark stops before a message they cannot see yet (its attachments
        // are being stored): it moves on once they can, and until then the marks say what
        // they were given.
        func deliverable(to member: MemberRecord) -> Int64 {
            guard !chat.pendingSends.isEmpty else { return chat.lastMessage }
            let hidden = chat.pendingSends.lazy.filter { $0.value != member.user }.map(\.key)
            return min(chat.lastMessage, (hidden.min() ?? .max) - 1)
        }
        let receiving = chat.members.values.filter { member in
            member.isActive && member.deliveredUpTo < deliverable(to: member) && isConnectedAnywhere(member.user)
                && (user == nil || member.user == user)
        }
        guard !receiving.isEmpty else { return }
        // Only the senders see a delivery: the messages are read if one of them is here,
        // someone online other than the member whose mark moves (counted once, not once
        // per member).
        let online = Array(chat.members.values.lazy.filter { $0.isActive && self.isOnline($0.user) }.prefix(2).map(\.user))
        // Every message as it was before any mark moves, then the marks.
        for member in receiving {
            let start = max(member.deliveredUpTo + 1, member.joinedAt)
            let last = deliverable(to: member)
            guard start <= last else { continue }
            let someoneSees = online.contains { $0 != member.user }
            try willChange(start...last, of: chat, by: member.user, .delivery, someoneSees: someoneSees, changes, sendersSeeNow: sendersSeeNow)
        }
        for member in receiving {
            member.deliveredUpTo = deliverable(to: member)
            batch.changed(member, of: chat)
        }
    }

    /// The newest message's timestamp (timestamps never decrease along a chat's ids): read
    /// once after start-up, then kept.
    func lastTimestamp(of chat: ChatRecord) -> Int64 {
        if let known = chat.lastTimestamp { return known }
        let known = chat.lastMessage > 0 ? ((try? loadMessage(chat.lastMessage, in: chat))??.timestamp ?? 0) : 0
        chat.lastTimestamp = known
        return known
    }

    // MARK: requests

    func send(_ request: ChatMessageSend, user: Int64, session: EngineSession, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        try requireNotMuted(member, in: chat, doing: "send messages")
        if reservedTags.contains(request.tag) {
            throw ProtocolError(.reservedTag, "the tag '\(request.tag)' is reserved for messages the service posts")
        }
        if chat.isDefunct {
            throw ProtocolError.notPermitted("chat '\(chat.chatId)' is Defunct: the other party left")
        }
        if request.tag == "Text" && request.content == nil {
            throw ProtocolError.invalid("'content' is required for tag Text")
        }
        let size = (request.content?.utf8.count ?? 0) + (request.data?.json.utf8.count ?? 0)
        if size > Engine.maxMessageBytes {
            throw ProtocolError(.tooLarge, "'content' and 'data' are \(size) bytes together, over the limit of \(Engine.maxMessageBytes)")
        }
        let refs = request.ref ?? []
        var tags = Set<ExactText>()
        var targets: [MessageRecord] = []
        for (index, ref) in refs.enumerated() {
            guard tags.insert(ExactText(ref.tag)).inserted else {
                throw ProtocolError.invalid("'ref[\(index)].tag' \(ref.tag) is given twice: at most one reference per tag")
            }
            guard ref.messageId >= member.joinedAt, let target = try loadMessage(ref.messageId, in: chat) else {
                throw ProtocolError.invalid("'ref[\(index)].messageId' \(ref.messageId) is not a message of chat '\(chat.chatId)'")
            }
            if target.isSystem {
                throw ProtocolError.invalid("'ref[\(index)].messageId' \(ref.messageId) is a system message (\(target.tag)): it cannot be referenced")
            }
            // Edit means "draw my newest Edit instead of the original": only the sender of
            // a message may edit it, and a recalled message stays recalled. Quote and
            // Thread may point at anyone's message.
            if ref.tag == "Edit" {
                guard target.sender == user else {
                    throw ProtocolError.notPermitted(
                        "'ref[\(index)]' is an Edit of message \(ref.messageId), which you did not send: only its sender can edit it")
                }
                guard !target.isRecalled else {
                    throw ProtocolError.notPermitted("'ref[\(index)]' is an Edit of message \(ref.messageId), which was recalled")
                }
            }
            if !targets.contains(where: { $0 === target }) { targets.append(target) }
        }
        let mentions = try mentioned(by: request, in: chat, member: member)
        // A resend (its externalId already used by this sender in this chat) is answered
        // with the message it names; nothing is posted, no file opened.
        if let externalId = request.externalId {
            try commitIfChanged(chat, batch: batch)
            let earlier: Int64?
            do {
                earlier = try store.message(chat: chat.number, sender: user, externalId: externalId)
            } catch {
                throw unreadable(error)
            }
            if let earlier, let message = try loadMessage(earlier, in: chat) {
                let element = renderMessage(message, in: chat, for: user)
                batch.emit(.listAdd(.chatMessage(ListAddChatMessage(cookie: request.cookie, elements: [element]))), to: session)
                return
            }
        }
        // Files last: everything else is known to be fine, so an opened file is always used.
        let (thumb, file) = try admitAttachments(request, session: session)
        let total = size + Int(thumb?.size ?? 0)
        if total > Engine.maxMessageBytes {
            if let thumb { Glibc.close(thumb.descriptor) }
            if let file { Glibc.close(file.descriptor) }
            throw ProtocolError(.tooLarge, "'content', 'data' and 'thumb' are \(total) bytes together, over the limit of \(Engine.maxMessageBytes)")
        }
        let changes = PendingChanges()
        willChange(chat, changes)
        let attaches = thumb != nil || file != nil
        let message = append(
            to: chat, sender: user, tag: request.tag, content: request.content, data: request.data, refs: refs,
            targets: targets, isControl: request.control ?? false, neverCountsUnread: request.neverCountUnread ?? false,
            pending: attaches, externalId: request.externalId, mentions: mentions, mentionsAll: request.mentionsAll ?? false, batch: batch,
            changes: changes)
        if attaches {
            message.attached.thumb = thumb.map { StoredFile(name: $0.name, blob: nil, size: $0.size) }
            message.attached.file = file.map { StoredFile(name: $0.name, blob: nil, size: $0.size) }
            storeAttachments(of: message, in: chat, thumb: thumb, file: file, request: request, session: session, batch: batch)
        }
        stopTyping(user: user, chat: chat, batch: batch)
        try announceNew([message], in: chat, answering: (session, request.cookie), batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    /// Refuses a message that is not there for everyone to act on (react to, pin): one
    /// recalled, or one never sent (its attachments being stored, or failed).
    func requireStanding(_ message: MessageRecord) throws {
        if message.isRecalled { throw ProtocolError.notPermitted("message \(message.id) was recalled") }
        if message.isPending || message.isGapForOthers {
            throw ProtocolError.notPermitted("message \(message.id) was not sent: its attachments are not stored")
        }
    }

    /// The members a send mentions by name, ascending: each a current member of the chat
    /// (mentioning is not a way to reach anyone else). Mentioning everyone is for admins.
    private func mentioned(by request: ChatMessageSend, in chat: ChatRecord, member: MemberRecord) throws -> [Int64] {
        if request.mentionsAll == true && !member.isAdmin {
            throw ProtocolError.notPermitted("'mentionsAll' is for the admins of chat '\(chat.chatId)'")
        }
        var users = Set<Int64>()
        for (index, name) in (request.mentions ?? []).enumerated() {
            // A userUri, or a regId (a decimal string, as the service writes them).
            let regId = name.utf8.first == UInt8(ascii: "0") ? nil : Int64(name)
            let number = regId.map { directory.users.find(regId: $0)?.number } ?? user(fromURI: name, viewer: member.user)
            guard let number, chat.activeMember(number) != nil else {
                throw ProtocolError.invalid("'mentions[\(index)]' \(name) is not a participant of chat '\(chat.chatId)'")
            }
            users.insert(number)
        }
        return users.sorted()
    }

    func read(_ request: ChatMessageRead, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        let target = try message(request.messageId, in: chat, seenBy: member)
        guard target.id > member.readUpTo else { return }
        let changes = PendingChanges()
        willChange(chat, changes)
        // Only the newly read range is visited: reading one message at a time through a
        // long backlog stays linear, and a long backlog is one mark (one row), however
        // many messages it covers.
        let start = max(member.readUpTo + 1, member.joinedAt)
        let range = start...target.id
        var unread: Int64 = 0
        var mentions: Int64 = 0
        for message in try loadMessages(in: chat, range) where message.countsUnread(for: user) {
            unread += 1
            if message.mentions(user) { mentions += 1 }
        }
        try willChange(range, of: chat, by: user, .read, someoneSees: true, changes)
        member.numUnread = max(0, member.numUnread - unread)
        member.numUnreadMentions = max(0, member.numUnreadMentions - mentions)
        member.readUpTo = target.id
        member.deliveredUpTo = max(member.deliveredUpTo, target.id)
        batch.changed(member, of: chat)
        publish(changes, batch: batch)
    }

    func stateGet(_ request: ChatMessageStateGet, user: Int64) throws -> Event {
        let (chat, member) = try chat(request.chatId, of: user)
        let message = try message(request.messageId, in: chat, seenBy: member)
        guard message.sender == user else {
            throw ProtocolError.notPermitted("message \(message.id) was not sent by you: only the sender sees its states")
        }
        let states = chat.members.values
            .filter { $0.user != user && $0.received(message.id) }
            .sorted { $0.user < $1.user }
            .map { RecipientState(userUri: uri($0.user), state: recipientState(message, $0)) }
        return .chatMessageState(ChatMessageStateEvent(cookie: request.cookie, chatId: chat.chatId, messageId: message.id, states: states))
    }

    func deletePrivately(_ request: ChatMessageDelete, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        let message = try message(request.id, in: chat, seenBy: member)
        guard message.privateStates[user]?.isDeleted != true else { return }
        let changes = PendingChanges()
        willChange(message, in: chat, changes)
        releaseDownload(of: message, in: chat, for: user, batch: batch)
        // Their reactions stay: the others saw them given.
        message.privateStates[user] = PrivateState(localData: nil, isDeleted: true, reactions: message.privateStates[user]?.reactions ?? [])
        batch.changedPrivately(message, for: user)
        publish(changes, batch: batch)
    }

    func destroy(_ request: ChatMessageDestroy, user: Int64, session: EngineSession, line: Int, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        let changes = PendingChanges()
        if let id = request.messageId {
            let message = try message(id, in: chat, seenBy: member)
            guard message.sender == user else {
                throw ProtocolError.notPermitted("message \(id) was not sent by you: only its sender can recall it")
            }
            guard !message.isSystem else {
                throw ProtocolError.notPermitted("message \(id) is a system message (\(message.tag)): it cannot be recalled")
            }
            guard !message.isRecalled else {
                throw ProtocolError.invalid("message \(id) was already recalled")
            }
            // A message that failed to send is its sender's alone: destroying it is ignored
            // (as bbmcore does), not refused.
            guard message.attached.attachment != .failed else { return }
            try recall([message], in: chat, batch: batch, changes: changes)
            publish(changes, batch: batch)
            return
        }
        if chat.isDefunct {
            throw ProtocolError.notPermitted("chat '\(chat.chatId)' is Defunct: nothing can be posted into it")
        }
        // Every own message not recalled yet, up to the last one now: the store finds them,
        // a page at a time.
        try recallAll(
            RecallInProgress(
                chat: chat.number, user: user, session: session, cookie: request.cookie, line: line, from: 1,
                upTo: chat.lastMessage), batch: batch)
    }

    /// A recall of everything a user sent in a chat (`chatMessageDestroy` without
    /// `messageId`), a page of messages per batch: a user with 100,000 messages in a chat
    /// held the engine from everyone else for seconds.
    struct RecallInProgress {
        let chat: Int64
        let user: Int64
        let session: EngineSession
        let cookie: String?
        let line: Int
        /// The next id to look from, and the last one the request covers.
        var from: Int64
        let upTo: Int64
    }

    /// Messages one batch recalls: each page's commit writes their rows (and the next
    /// page waits for it), and another user's request in the same batch waits for both
    /// (in a release build beside a recall of 20,000, 200 a page held one up to 224 ms,
    /// 50 a page up to 74 ms).
    static let recallPage = 20

    /// Recalls the next page; the last page posts the `Shred`. Until then the session's
    /// later requests wait, and the next page is decided once this one is committed.
    func recallAll(_ recall: RecallInProgress, batch: Batch) throws {
        guard let chat = directory.chats[recall.chat], chat.activeMember(recall.user) != nil else {
            throw ProtocolError.notFound("chat \(recall.chat) is no longer yours")
        }
        var filter = MessageFilter(firstId: recall.from, lastId: recall.upTo, sender: recall.user)
        filter.onlyRecallable = true
        let ids = try matchingIds(in: chat, filter, from: recall.from, ascending: true, limit: Engine.recallPage + 1, batch: batch)
        let page = Array(ids.prefix(Engine.recallPage))
        let changes = PendingChanges()
        try self.recall(try loadMessages(in: chat, ids: page), in: chat, batch: batch, changes: changes)
        if ids.count > page.count, let last = page.last {
            publish(changes, batch: batch)
            var rest = recall
            rest.from = last + 1
            continueLater(.continueRecall(rest), for: recall.session, batch: batch)
            return
        }
        willChange(chat, changes)
        let shred = append(to: chat, sender: recall.user, tag: "Shred", neverCountsUnread: true, batch: batch, changes: changes)
        try announceNew([shred], in: chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    /// The next page of a recall of everything (`recallAll`).
    func recallContinues(_ recall: RecallInProgress, batch: Batch) {
        resume(ChatMessageDestroy.name, cookie: recall.cookie, line: recall.line, session: recall.session, batch: batch) {
            try recallAll(recall, batch: batch)
        }
    }

    /// Recalls messages for everyone; the `refBy` of what they referred to is recomputed
    /// (count down, newest the newest remaining source).
    private func recall(_ messages: [MessageRecord], in chat: ChatRecord, batch: Batch, changes: PendingChanges) throws {
        let recalling = messages.filter { !$0.isRecalled && $0.attached.attachment != .failed }
        guard !recalling.isEmpty else { return }
        // The store answers which references remain: it must have this chat as it is.
        try commitIfChanged(chat, batch: batch)
        let recalled = Set(recalling.map(\.id))
        var affected: [RefRow] = []
        for message in recalling {
            willChange(message, in: chat, changes)
            for ref in message.refs where !affected.contains(where: { $0.target == ref.messageId && sameBytes($0.tag, ref.tag) }) {
                affected.append(RefRow(tag: ref.tag, target: ref.messageId))
            }
        }
        let targets = try loadMessages(in: chat, ids: affected.map(\.target))
        for ref in affected {
            guard let target = targets.first(where: { $0.id == ref.target }) else { continue }
            willChange(target, in: chat, changes)
            let remaining: (count: Int64, newest: Int64?)
            do {
                remaining = try store.references(chat: chat.number, to: target.id, tag: ref.tag, excluding: recalled)
            } catch {
                throw unreadable(error)
            }
            target.refBy[ExactText(ref.tag)] = remaining.newest.map { (remaining.count, $0) }
            batch.changedReferences(to: target, tag: ref.tag)
        }
        var unseen: [MessageRecord] = []
        for message in recalling {
            if message.searchRow > 0 {
                batch.searchRemovals.append(message.searchRow)
                message.searchRow = 0
            }
            let wasPending = message.isPending
            releaseAttachments(of: message, in: chat, batch: batch)
            unpin(message, in: chat, changes)
            // An unread mention of it is no longer one.
            for member in chat.members.values where member.isActive && member.hasUnread(message) && message.mentions(member.user) {
                willChange(chat, changes)
                member.numUnreadMentions = max(0, member.numUnreadMentions - 1)
                batch.changed(member, of: chat)
            }
            message.refs = []
            message.content = nil
            message.data = nil
            message.isRecalled = true
            // Its reactions go with it.
            for (user, state) in message.privateStates where !state.reactions.isEmpty {
                message.privateStates[user]?.reactions = []
                message.reactionsChanged()
                batch.changedPrivately(message, for: user)
            }
            if wasPending {
                // Recalled while its attachments were being stored: it was never sent.
                // The others see a Gap in its place from now on, as for one that failed.
                message.attached.attachment = .failed
                chat.pendingSends[message.id] = nil
                unseen.append(message)
            }
            batch.changed(message)
        }
        // One sender recalls only their own messages: the others get them at once.
        if let sender = unseen.first?.sender {
            try announceNew(unseen, in: chat, except: sender, batch: batch, changes: changes)
        }
    }

    func setLocalData(_ request: RequestListChangeChatMessage, user: Int64, batch: Batch) throws {
        var targets: [(ChatRecord, MessageRecord, JSONValue?)] = []
        for (index, element) in request.elements.enumerated() {
            let (chat, member) = try chat(element.chatId, of: user)
            let message = try message(element.messageId, in: chat, seenBy: member)
            guard let localData = element.localData else {
                throw ProtocolError.invalid("'elements[\(index)]' changes nothing: only 'localData' can be set on a chatMessage")
            }
            if let reason = dataTooLarge(localData.value, field: "elements[\(index)].localData") { throw ProtocolError(.tooLarge, reason) }
            targets.append((chat, message, localData.value))
        }
        let changes = PendingChanges()
        for (chat, message, localData) in targets {
            willChange(message, in: chat, changes)
            var state = message.privateStates[user] ?? PrivateState()
            state.localData = localData
            message.privateStates[user] = state
            batch.changedPrivately(message, for: user)
        }
        publish(changes, batch: batch)
    }

    // MARK: typing and events

    func startTyping(_ request: ChatTyping, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        try requireNotMuted(member, in: chat, doing: "type")
        typingStarted(user, in: chat, batch: batch)
        tellOthers(.typing(user: user, chat: chat.number))
    }

    /// `user` is typing in `chat` (here or on another node): members are told when they
    /// were not typing there yet, and it ends `typingSeconds` from now unless said again.
    func typingStarted(_ user: Int64, in chat: ChatRecord, batch: Batch) {
        let entry = TypingEntry(user: user, chat: chat.number)
        let isNew = timed.typing[entry] == nil
        let ends = monotonicSeconds() + Engine.typingSeconds
        timed.typing[entry] = ends
        scheduleTick(due: ends)
        guard isNew else { return }
        let element = Typing(userUri: uri(user), chatId: chat.chatId)
        for member in chat.members.values where member.isActive && member.user != user {
            emit(.listAdd(.typing(ListAddTyping(elements: [element]))), toUser: member.user, batch: batch)
        }
    }

    func stopTyping(user: Int64, chat: ChatRecord, batch: Batch) {
        guard timed.typing.removeValue(forKey: TypingEntry(user: user, chat: chat.number)) != nil else { return }
        let key = TypingKey(userUri: uri(user), chatId: chat.chatId)
        for member in chat.members.values where member.isActive && member.user != user {
            emit(.listRemove(.typing(ListRemoveTyping(elements: [key]))), toUser: member.user, batch: batch)
        }
    }

    func expireTyping(batch: Batch) {
        let now = monotonicSeconds()
        for (entry, expiry) in timed.typing where expiry <= now {
            if let chat = directory.chats[entry.chat] {
                stopTyping(user: entry.user, chat: chat, batch: batch)
            } else {
                timed.typing[entry] = nil
            }
        }
        if !timed.typing.isEmpty { scheduleTick() }
    }

    static let typingSeconds = 5.0

    func monotonicSeconds() -> Double {
        Double(DispatchTime.now().uptimeNanoseconds) / 1e9
    }

    /// Makes sure a tick comes when the earliest timed work is due: `due`, when the caller
    /// has just added work due then (nothing else is looked at), or else the earliest of all.
    func scheduleTick(due: Double? = nil) {
        let earliest =
            due
            ?? [timed.typing.values.min(), timed.pinEnds.values.map(\.due).min(), timed.muteEnds.values.map(\.due).min(), presence.dueAt]
            .compactMap { $0 }.min()
        guard let earliest, earliest < timed.tickAt ?? .infinity else { return }
        timed.tickAt = earliest
        let delay = max(0.01, earliest - monotonicSeconds())
        DispatchQueue.global().asyncAfter(deadline: .now() + delay) { [self] in tick() }
    }

    func sendEvent(_ request: ChatEventSend, user: Int64, session: EngineSession, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        try requireNotMuted(member, in: chat, doing: "send chat events")
        if let reason = dataTooLarge(request.data, field: "data") { throw ProtocolError(.tooLarge, reason) }
        let event = Event.chatEvent(ChatEvent(chatId: chat.chatId, senderUri: uri(user), tag: request.tag, data: request.data))
        for member in chat.members.values where member.isActive {
            for other in sessions(of: member.user) where other !== session { batch.emit(event, to: other) }
        }
        tellOthers(.chatEvent(user: user, chat: chat.number, tag: request.tag, data: request.data?.json))
    }
}

/// One user typing in one chat.
struct TypingEntry: Hashable {
    let user: Int64
    let chat: Int64
}
