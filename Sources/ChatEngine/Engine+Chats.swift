import ChatProtocol
import Storage

/// Chats and their participants (§5).
extension Engine {
    /// Participants of one chat, the local user included.
    static let maxParticipants = 250

    /// Why an invitee list cannot be used.
    enum InviteeProblem: Error {
        case invalidInvitee(String)
        case invalidParameter(String)
    }

    /// Resolves invitees to users: the ids of users that already exist, and user ids of
    /// users to create once everything else is known to be valid.
    func resolve(_ invitees: [Invitee], inviter: Int64) throws(InviteeProblem) -> [InviteeTarget] {
        var targets: [InviteeTarget] = []
        var seenNumbers = Set<Int64>()
        var seenNewIds = Set<ExactText>()
        var newRegIds = Set<Int64>()
        for (index, invitee) in invitees.enumerated() {
            switch (invitee.regId, invitee.userId) {
            case (let regId?, nil):
                guard let user = directory.users.find(regId: regId) else {
                    throw .invalidInvitee("'invitees[\(index)].regId' \(regId) is not a known user")
                }
                guard user.number != inviter else { throw .invalidInvitee("'invitees[\(index)]' is yourself") }
                guard seenNumbers.insert(user.number).inserted else { throw .invalidInvitee("'invitees[\(index)]' is given twice") }
                targets.append(.existing(user.number))
            case (nil, let userId?):
                if let user = directory.users.find(userId: userId) {
                    guard user.number != inviter else { throw .invalidInvitee("'invitees[\(index)]' is yourself") }
                    guard seenNumbers.insert(user.number).inserted else { throw .invalidInvitee("'invitees[\(index)]' is given twice") }
                    targets.append(.existing(user.number))
                } else {
                    guard seenNewIds.insert(ExactText(userId)).inserted else { throw .invalidInvitee("'invitees[\(index)]' is given twice") }
                    // Made, it would take a regId another user has (63 bits: a search
                    // can find two ids that share one): this request fails, not the
                    // commit of everyone's.
                    let regId = RegId.derive(userId)
                    guard directory.users.find(regId: regId) == nil, newRegIds.insert(regId).inserted else {
                        throw .invalidInvitee("'invitees[\(index)]' cannot be made a user: the regId derived from its id is another user's")
                    }
                    targets.append(.new(userId))
                }
            default:
                throw .invalidParameter("'invitees[\(index)]' must have exactly one of 'regId' and 'userId'")
            }
        }
        return targets
    }

    enum InviteeTarget {
        case existing(Int64)
        case new(String)

        var isNew: Bool {
            if case .new = self { true } else { false }
        }
    }

    /// Takes numbers for the new users among `targets` in one round trip to the store.
    private func reserveNumbers(for targets: [InviteeTarget]) {
        reserveNumbers(for: .user, count: targets.filter(\.isNew).count)
    }

    func user(for target: InviteeTarget, batch: Batch) -> Int64 {
        switch target {
        case .existing(let number): number
        case .new(let userId): directory.users.ensure(userId: userId, batch: &batch.store) { newNumber(for: .user, after: $0) }.number
        }
    }

    // MARK: chatStart

    func start(_ request: ChatStart, user: Int64, session: EngineSession, batch: Batch) throws {
        func failed(_ reason: ChatStartFailure, _ detail: String) {
            batch.emit(.chatStartFailed(ChatStartFailed(cookie: request.cookie, reason: reason, detail: detail)), to: session)
        }
        let targets: [InviteeTarget]
        do {
            targets = try resolve(request.invitees, inviter: user)
        } catch {
            switch error {
            case .invalidInvitee(let detail): return failed(.invalidInvitee, detail)
            case .invalidParameter(let detail): return failed(.invalidParameter, detail)
            }
        }
        for (value, field) in [(request.data, "data"), (request.localData, "localData"), (request.privateData, "privateData")] {
            if let reason = dataTooLarge(value, field: field) { return failed(.invalidParameter, reason) }
        }
        let isOneToOne = request.isOneToOne ?? false
        if targets.isEmpty { return failed(.invalidParameter, "'invitees' is empty: a chat needs at least one invitee") }
        try quotas.take(1, of: .chats, by: user)
        try quotas.take(targets.filter(\.isNew).count, of: .newUsers, by: user)
        if targets.count + 1 > Engine.maxParticipants {
            return failed(.tooManyParticipants, "\(targets.count) invitees and you are more than \(Engine.maxParticipants) participants")
        }
        if isOneToOne {
            guard targets.count == 1 else {
                return failed(.invalidParameter, "a one-to-one chat needs exactly one invitee, not \(targets.count)")
            }
            if case .existing(let other) = targets[0], oneToOne(between: user, and: other) == nil, blocks(user, other) || blocks(other, user) {
                return failed(
                    .blocked,
                    blocks(user, other)
                        ? "you block that user: unblock them (userBlock with unblock) to start a one-to-one chat"
                        : "that user does not accept one-to-one chats from you")
            }
            if case .existing(let other) = targets[0], let existing = oneToOne(between: user, and: other) {
                // Starting it again shows a hidden one-to-one chat (as bbmcore does).
                if let member = existing.activeMember(user), member.isHidden {
                    let changes = PendingChanges()
                    willChange(existing, changes)
                    member.isHidden = false
                    batch.changed(member, of: existing)
                    publish(changes, batch: batch)
                }
                batch.emit(
                    .chatStartFailed(
                        ChatStartFailed(
                            cookie: request.cookie, reason: .alreadyExists, chatId: existing.chatId,
                            detail: "you already have one-to-one chat '\(existing.chatId)' with that user")), to: session)
                return
            }
        } else if request.subject == nil {
            return failed(.invalidParameter, "'subject' is required unless 'isOneToOne' is true")
        }

        reserveNumbers(for: targets)
        let number = newNumber(for: .chat, after: directory.lastChatNumber)
        directory.lastChatNumber = max(directory.lastChatNumber, number)
        let chat = ChatRecord(
            number: number, subject: request.subject ?? "", isOneToOne: isOneToOne,
            invitePolicy: request.invitePolicy ?? .participantsOnly, pinPolicy: request.pinPolicy ?? (isOneToOne ? .participantsOnly : .adminsOnly),
            data: request.data)
        directory.chats[chat.number] = chat
        let starter = MemberRecord(user: user, isAdmin: true, joinedAt: 1)
        starter.localData = request.localData
        starter.privateData = request.privateData
        chat.members[user] = starter
        directory.chatsOfUser[user, default: []].insert(chat.number)
        var invited: [Int64] = []
        for target in targets {
            let number = self.user(for: target, batch: batch)
            chat.members[number] = MemberRecord(user: number, isAdmin: false, joinedAt: 1)
            directory.chatsOfUser[number, default: []].insert(chat.number)
            invited.append(number)
        }
        let changes = PendingChanges()
        for number in invited {
            append(
                to: chat, sender: user, tag: "Join", data: systemData("Join", userUri: uri(number)), neverCountsUnread: true,
                batch: batch, changes: changes)
        }
        batch.changed(chat)
        for member in chat.members.values { batch.changed(member, of: chat) }
        // The answer is the chat's listAdd carrying the cookie, to the requesting session.
        for member in chat.activeMembers where isOnline(member.user) {
            try introduce(chat, to: member, answering: member.user == user ? (session, request.cookie) : nil, batch: batch)
        }
        try markDelivered(chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    /// The one-to-one chat of two users that is not Defunct, if there is one.
    func oneToOne(between user: Int64, and other: Int64) -> ChatRecord? {
        for number in directory.chatsOfUser[user] ?? [] {
            guard let chat = directory.chats[number], chat.isOneToOne, !chat.isDefunct, chat.activeMember(other) != nil else { continue }
            return chat
        }
        return nil
    }

    /// `{"<Tag>":{"userUri":...}}`, the data of Join, Leave and Remove messages.
    func systemData(_ tag: String, userUri: String, admin: Bool? = nil) -> JSONValue {
        var fields: [(String, JSONValue)] = [("userUri", .string(userUri))]
        if let admin { fields.append(("admin", .bool(admin))) }
        return .object([(tag, .object(fields))])
    }

    /// Everything a member who just got a chat needs: the chat, its other participants,
    /// and the messages they see.
    /// With `answering`, that session's `listAdd chat` carries the request's cookie.
    func introduce(_ chat: ChatRecord, to member: MemberRecord, answering: (session: EngineSession, cookie: String?)? = nil, batch: Batch) throws {
        let element = renderChat(chat, for: member)
        for session in sessions(of: member.user) {
            let cookie = session === answering?.session ? answering?.cookie : nil
            batch.emit(.listAdd(.chat(ListAddChat(cookie: cookie, elements: [element]))), to: session)
        }
        let others = chat.activeMembers.filter { $0.user != member.user }.map { renderParticipant(chat, $0) }
        if !others.isEmpty {
            emit(.listAdd(.chatParticipant(ListAddChatParticipant(elements: others))), toUser: member.user, batch: batch)
        }
        let visible = try loadMessages(in: chat, max(member.joinedAt, 1)...chat.lastMessage).filter { $0.isSeen(by: member.user) }
            .map { renderMessage($0, in: chat, for: member.user) }
        for chunk in visible.chunked(Engine.chunkSize) {
            emit(.listAdd(.chatMessage(ListAddChatMessage(elements: chunk))), toUser: member.user, batch: batch)
        }
    }

    // MARK: membership changes

    func invite(_ request: ChatInvite, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        if chat.isOneToOne { throw ProtocolError.notPermitted("chat '\(chat.chatId)' is one-to-one: nobody can be invited") }
        if chat.invitePolicy == .adminsOnly && !member.isAdmin {
            throw ProtocolError.notPermitted("only admins may invite to chat '\(chat.chatId)' (invitePolicy AdminsOnly)")
        }
        let targets: [InviteeTarget]
        do {
            targets = try resolve(request.invitees, inviter: user)
        } catch {
            switch error {
            case .invalidInvitee(let reason), .invalidParameter(let reason): throw ProtocolError.invalid(reason)
            }
        }
        for (index, target) in targets.enumerated() {
            if case .existing(let number) = target, chat.members[number]?.isBanned == true {
                throw ProtocolError.notPermitted(
                    "'invitees[\(index)]' is banned from chat '\(chat.chatId)': an admin must unban them (participantBan with unban) first")
            }
        }
        let fresh = targets.filter { target in
            if case .existing(let number) = target { return chat.activeMember(number) == nil }
            return true
        }
        try quotas.take(targets.filter(\.isNew).count, of: .newUsers, by: user)
        if chat.activeMembers.count + fresh.count > Engine.maxParticipants {
            throw ProtocolError.invalid("chat '\(chat.chatId)' would have more than \(Engine.maxParticipants) participants")
        }
        guard !fresh.isEmpty else {
            // Nothing would change: say so rather than stay silent.
            throw ProtocolError.invalid(
                request.invitees.count == 1
                    ? "'invitees[0]' is already a participant of chat '\(chat.chatId)'"
                    : "every invitee is already a participant of chat '\(chat.chatId)'")
        }
        reserveNumbers(for: fresh)
        let changes = PendingChanges()
        willChange(chat, changes)
        let existing = chat.activeMembers
        var joined: [MemberRecord] = []
        var posted: [MessageRecord] = []
        for target in fresh {
            let number = self.user(for: target, batch: batch)
            let join = append(
                to: chat, sender: user, tag: "Join", data: systemData("Join", userUri: uri(number)), neverCountsUnread: true,
                batch: batch, changes: changes)
            posted.append(join)
            let newMember: MemberRecord
            if let former = chat.members[number] {
                former.isActive = true
                former.isAdmin = false
                former.joinedAt = join.id
                former.leftAt = nil
                former.readUpTo = max(former.readUpTo, join.id - 1)
                former.deliveredUpTo = max(former.deliveredUpTo, join.id - 1)
                newMember = former
            } else {
                newMember = MemberRecord(user: number, isAdmin: false, joinedAt: join.id)
                newMember.readUpTo = join.id - 1
                newMember.deliveredUpTo = join.id - 1
                chat.members[number] = newMember
            }
            // Nothing after the Join yet: nothing unread.
            newMember.numUnread = 0
            directory.chatsOfUser[number, default: []].insert(chat.number)
            batch.changed(newMember, of: chat)
            joined.append(newMember)
        }
        let participants = joined.map { renderParticipant(chat, $0) }
        for member in existing where isOnline(member.user) {
            emit(.listAdd(.chatParticipant(ListAddChatParticipant(elements: participants))), toUser: member.user, batch: batch)
            let elements = posted.map { renderMessage($0, in: chat, for: member.user) }
            emit(.listAdd(.chatMessage(ListAddChatMessage(elements: elements))), toUser: member.user, batch: batch)
        }
        for member in joined where isOnline(member.user) {
            try introduce(chat, to: member, batch: batch)
        }
        try markDelivered(chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    func leave(_ request: ChatLeave, user: Int64, batch: Batch) throws {
        var leaving: [ChatRecord] = []
        for chatId in request.chatIds {
            let (chat, _) = try chat(chatId, of: user)
            if !leaving.contains(where: { $0 === chat }) { leaving.append(chat) }
        }
        for chat in leaving {
            let changes = PendingChanges()
            willChange(chat, changes)
            let message = append(
                to: chat, sender: user, tag: "Leave", data: systemData("Leave", userUri: uri(user)), neverCountsUnread: true,
                batch: batch, changes: changes)
            depart(user, from: chat, at: message, batch: batch)
            if chat.isOneToOne && !chat.isDefunct {
                chat.isDefunct = true
            }
            try announceNew([message], in: chat, batch: batch, changes: changes)
            publish(changes, batch: batch)
        }
    }

    /// Takes `user` out of the chat at `message` (their Leave or Remove): their endpoints
    /// lose the chat, everyone else's lose the participant.
    func depart(_ user: Int64, from chat: ChatRecord, at message: MessageRecord, batch: Batch) {
        guard let member = chat.members[user] else { return }
        member.isActive = false
        member.leftAt = message.id
        member.isHidden = false
        batch.changed(member, of: chat)
        directory.chatsOfUser[user]?.remove(chat.number)
        stopTyping(user: user, chat: chat, batch: batch)
        emit(.listRemove(.chat(ListRemoveChat(elements: [ChatKey(chatId: chat.chatId)]))), toUser: user, batch: batch)
        let key = ChatParticipantKey(chatId: chat.chatId, userUri: uri(user))
        for other in chat.activeMembers {
            emit(.listRemove(.chatParticipant(ListRemoveChatParticipant(elements: [key]))), toUser: other.user, batch: batch)
        }
    }

    /// The admin-only participant requests check the same things. `formerToo`: the target
    /// may be someone who left or was removed (a ban).
    func administered(_ chatId: String, target userUri: String, user: Int64, formerToo: Bool = false) throws -> (ChatRecord, MemberRecord) {
        let (chat, member) = try chat(chatId, of: user)
        if chat.isOneToOne { throw ProtocolError.notPermitted("chat '\(chat.chatId)' is one-to-one: it has no admins to act") }
        guard member.isAdmin else { throw ProtocolError.notPermitted("only admins of chat '\(chat.chatId)' may do this") }
        guard let number = self.user(fromURI: userUri, viewer: user), let target = chat.members[number], formerToo || target.isActive else {
            throw ProtocolError.notFound(
                "'userUri' \(userUri) is not \(formerToo ? "a participant or former participant" : "a participant") of chat '\(chat.chatId)'")
        }
        return (chat, target)
    }

    func remove(_ request: ParticipantRemove, user: Int64, batch: Batch) throws {
        let (chat, target) = try administered(request.chatId, target: request.userUri, user: user)
        if target.user == user { throw ProtocolError.invalid("'userUri' is yourself: use chatLeave") }
        let changes = PendingChanges()
        willChange(chat, changes)
        let message = append(
            to: chat, sender: user, tag: "Remove", data: systemData("Remove", userUri: uri(target.user)),
            neverCountsUnread: true, batch: batch, changes: changes)
        depart(target.user, from: chat, at: message, batch: batch)
        try announceNew([message], in: chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    func setAdmin(chatId: String, userUri: String, admin: Bool, user: Int64, batch: Batch) throws {
        let (chat, target) = try administered(chatId, target: userUri, user: user)
        guard target.isAdmin != admin else { return }
        let changes = PendingChanges()
        willChange(chat, changes)
        let message = append(
            to: chat, sender: user, tag: "Admin", data: systemData("Admin", userUri: uri(target.user), admin: admin),
            neverCountsUnread: true, batch: batch, changes: changes)
        let was = renderParticipant(chat, target)
        target.isAdmin = admin
        // Admins are never muted.
        if admin { target.mutedUntil = nil }
        batch.changed(target, of: chat)
        announceChange(of: target, in: chat, was: was, batch: batch)
        try announceNew([message], in: chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    func hide(_ request: ChatHide, user: Int64, batch: Batch) throws {
        var targets: [(ChatRecord, MemberRecord)] = []
        for chatId in request.chatIds { targets.append(try chat(chatId, of: user)) }
        let changes = PendingChanges()
        for (chat, member) in targets where !member.isHidden {
            willChange(chat, changes)
            member.isHidden = true
            batch.changed(member, of: chat)
        }
        publish(changes, batch: batch)
    }

    /// `requestListChange` on `chat`: subject (posts a Subject message), data, localData.
    func changeChats(_ request: RequestListChangeChat, user: Int64, batch: Batch) throws {
        var targets: [(ChatRecord, MemberRecord, ChatSettable)] = []
        for (index, element) in request.elements.enumerated() {
            let (chat, member) = try chat(element.chatId, of: user)
            if element.subject == nil && element.data == nil && element.localData == nil {
                throw ProtocolError.invalid("'elements[\(index)]' changes nothing: give 'subject', 'data' or 'localData'")
            }
            for (value, field) in [(element.data?.value, "data"), (element.localData?.value, "localData")] {
                if let reason = dataTooLarge(value, field: "elements[\(index)].\(field)") { throw ProtocolError(.tooLarge, reason) }
            }
            if element.subject != nil && chat.isDefunct {
                throw ProtocolError.notPermitted("chat '\(chat.chatId)' is Defunct: its subject cannot change")
            }
            targets.append((chat, member, element))
        }
        for (chat, member, element) in targets {
            let changes = PendingChanges()
            willChange(chat, changes)
            var posted: [MessageRecord] = []
            if let subject = element.subject, !sameBytes(subject, chat.subject) {
                chat.subject = subject
                posted.append(
                    append(
                        to: chat, sender: user, tag: "Subject", content: subject, neverCountsUnread: true,
                        batch: batch, changes: changes))
            }
            if let data = element.data {
                chat.data = data.value
            }
            if let localData = element.localData {
                member.localData = localData.value
                batch.changed(member, of: chat)
            }
            batch.changed(chat)
            try announceNew(posted, in: chat, batch: batch, changes: changes)
            publish(changes, batch: batch)
        }
    }

    /// Chats whose deliveries one batch marks for users who came online, at most: a user
    /// in 2,000 chats with something new in each held the engine (and their own sign-in's
    /// answer) for seconds; now the rest follows in later batches, between other users'
    /// work. A batch also stops after `pageTime`. Its commit writes each chat's rows, and
    /// another user's request in the same batch waits for it: 26 chats a page took 25 ms
    /// to commit on average, holding another user's send up to 100 ms.
    static let deliveriesPerBatch = 8

    /// A user's endpoint authenticated: everything in their chats counts as delivered, the
    /// first chats' in this batch, the others' in the batches after (`deliverDue`).
    func deliverPending(to user: Int64, batch: Batch) throws {
        let due = (directory.chatsOfUser[user] ?? []).filter { number in
            guard let chat = directory.chats[number], let member = chat.members[user] else { return false }
            return member.deliveredUpTo < chat.lastMessage
        }
        guard !due.isEmpty else { return }
        timed.deliveriesDue.append((user, due.sorted()))
        try deliverDue(batch: batch)
    }

    /// Marks the deliveries of up to `deliveriesPerBatch` chats of the users waiting for
    /// them, oldest first; asks for another batch when some are left.
    func deliverDue(batch: Batch) throws {
        let changes = PendingChanges()
        defer { publish(changes, batch: batch) }
        var budget = Engine.deliveriesPerBatch
        let deadline = ContinuousClock.now + Engine.pageTime
        while budget > 0, !timed.deliveriesDue.isEmpty, budget == Engine.deliveriesPerBatch || ContinuousClock.now < deadline {
            let user = timed.deliveriesDue[0].user
            let number = timed.deliveriesDue[0].chats.removeFirst()
            if timed.deliveriesDue[0].chats.isEmpty { timed.deliveriesDue.removeFirst() }
            budget -= 1
            guard let chat = directory.chats[number] else { continue }
            try markDelivered(chat, only: user, batch: batch, changes: changes)
        }
        if !timed.deliveriesDue.isEmpty { put(.deliverDue) }
    }
}
