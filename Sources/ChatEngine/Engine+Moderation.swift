import ChatProtocol
import Logging
import Storage

/// Keeping a chat civil (docs/protocol.md §5): its admins mute and ban members, each with a
/// message the service posts (`Mute`, `Ban`, like `Admin` and `Remove`); a user blocks
/// another user.
extension Engine {
    /// How many users one user may block: their settings row holds them all.
    static let maxBlocked = 1000

    // MARK: mute

    func mute(_ request: ParticipantMute, user: Int64, batch: Batch) throws {
        let (chat, target) = try administered(request.chatId, target: request.userUri, user: user)
        if target.user == user { throw ProtocolError.invalid("'userUri' is yourself: an admin cannot mute themselves") }
        let unmute = request.unmute ?? false
        if unmute && request.until != nil { throw ProtocolError.invalid("'until' is given with 'unmute'") }
        if let until = request.until, until <= now() { throw ProtocolError.invalid("'until' \(until) is not in the future") }
        if target.isAdmin && !unmute {
            throw ProtocolError.notPermitted("'userUri' \(request.userUri) is an admin of chat '\(chat.chatId)': demote them first")
        }
        let until: Int64? = unmute ? nil : (request.until ?? 0)
        if unmute && target.mutedUntil == nil { return }
        let changes = PendingChanges()
        willChange(chat, changes)
        var fields: [(String, JSONValue)] = [("userUri", .string(uri(target.user))), ("muted", .bool(!unmute))]
        if let until, until != 0 { fields.append(("until", .integer(until))) }
        let message = append(
            to: chat, sender: user, tag: "Mute", data: .object([("Mute", .object(fields))]), neverCountsUnread: true,
            batch: batch, changes: changes)
        setMute(target, in: chat, until: until, batch: batch)
        try announceNew([message], in: chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    /// `member`'s mute becomes `until` (nil: none; 0: for ever): every other member is told
    /// the participant changed, the member their chat (through `willChange` of the caller).
    private func setMute(_ member: MemberRecord, in chat: ChatRecord, until: Int64?, batch: Batch) {
        let was = renderParticipant(chat, member)
        member.mutedUntil = until
        batch.changed(member, of: chat)
        if let until, until != 0 { scheduleMuteEnd(MemberKey(chat: chat.number, user: member.user), until: until) }
        announceChange(of: member, in: chat, was: was, batch: batch)
    }

    /// A mute that ends by itself at `until` is ended on time (`endMutes`); one whose time
    /// passed while the service was down, at once.
    func scheduleMuteEnd(_ key: MemberKey, until: Int64) {
        let due = monotonicSeconds() + Double(until - now())
        timed.muteEnds[key] = (due, until)
        scheduleTick(due: due)
    }

    /// Ends the mutes whose time is up: the member and everyone else see it end. No
    /// message is posted (the `Mute` message said until when).
    func endMutes(batch: Batch) {
        let now = monotonicSeconds()
        for (key, end) in timed.muteEnds where end.due <= now {
            timed.muteEnds[key] = nil
            guard let chat = directory.chats[key.chat], let member = chat.members[key.user], member.mutedUntil == end.until else { continue }
            let changes = PendingChanges()
            if member.isActive { willChange(chat, changes) }
            setMute(member, in: chat, until: nil, batch: batch)
            publish(changes, batch: batch)
        }
        if !timed.muteEnds.isEmpty { scheduleTick() }
    }

    /// Refuses what a muted member may not do in `chat` (send, react, type, chat events).
    func requireNotMuted(_ member: MemberRecord, in chat: ChatRecord, doing what: String) throws {
        guard let mute = member.mute(now: now()) else { return }
        let until = mute.map { "until \($0)" } ?? "until an admin unmutes you"
        throw ProtocolError.notPermitted("you are muted in chat '\(chat.chatId)' \(until): you cannot \(what)")
    }

    // MARK: ban

    func ban(_ request: ParticipantBan, user: Int64, batch: Batch) throws {
        let (chat, target) = try administered(request.chatId, target: request.userUri, user: user, formerToo: true)
        if target.user == user { throw ProtocolError.invalid("'userUri' is yourself: use chatLeave") }
        let unban = request.unban ?? false
        if target.isActive && target.isAdmin && !unban {
            throw ProtocolError.notPermitted("'userUri' \(request.userUri) is an admin of chat '\(chat.chatId)': demote them first")
        }
        guard target.isBanned == unban else { return }
        let changes = PendingChanges()
        willChange(chat, changes)
        let message = append(
            to: chat, sender: user, tag: "Ban", data: .object([("Ban", .object([("userUri", .string(uri(target.user))), ("banned", .bool(!unban))]))]),
            neverCountsUnread: true, batch: batch, changes: changes)
        target.isBanned = !unban
        target.mutedUntil = nil
        batch.changed(target, of: chat)
        if target.isActive && !unban { depart(target.user, from: chat, at: message, batch: batch) }
        try announceNew([message], in: chat, batch: batch, changes: changes)
        publish(changes, batch: batch)
    }

    // MARK: block

    func block(_ request: UserBlock, user: Int64, session: EngineSession, batch: Batch) throws {
        guard let other = self.user(fromURI: request.userUri, viewer: user), directory.users[other] != nil, knows(other, viewer: user, session: session)
        else {
            throw ProtocolError.notFound("'userUri' \(request.userUri) is not a user you know")
        }
        if other == user { throw ProtocolError.invalid("'userUri' is yourself") }
        var row = settings(of: user)
        let blocking = !(request.unblock ?? false)
        guard row.blocked.contains(other) != blocking else { return }
        if blocking {
            if row.blocked.count >= Engine.maxBlocked {
                throw ProtocolError(.tooLarge, "you block \(row.blocked.count) users, the limit (\(Engine.maxBlocked))")
            }
            row.blocked.insert(other, at: row.blocked.firstIndex { $0 > other } ?? row.blocked.endIndex)
        } else {
            row.blocked.removeAll { $0 == other }
        }
        change(settings: row, batch: batch)
        let change = UserChange(uri: uri(other), blocked: .some(blocking ? .value(true) : .null))
        emit(.listChange(.user(ListChangeUser(elements: [change]))), toUser: user, batch: batch)
    }

    /// Whether `user` blocks `other`. Asked for every viewer of every message rendered:
    /// nothing is hashed while nobody blocks anyone.
    @inline(__always)
    func blocks(_ user: Int64, _ other: Int64) -> Bool {
        !directory.blockers.isEmpty && (directory.blockers[other]?.contains(user) ?? false)
    }

    // MARK: settings

    /// What `user` chose for themselves (the defaults when nothing).
    func settings(of user: Int64) -> UserSettingsRow {
        directory.settings[user] ?? UserSettingsRow(user: user)
    }

    /// `user`'s settings become `row`, in memory now and in the store with the batch.
    func change(settings row: UserSettingsRow, batch: Batch) {
        adopt(settings: row, batch: batch)
        batch.changed(settings: row)
    }

    /// Memory takes `row`, changed here or by another node: when it hides or shows the
    /// user's presence, the sessions here are told (`hiddenChanged`).
    func adopt(settings row: UserSettingsRow, batch: Batch) {
        let wasHidden = settings(of: row.user).presenceHidden
        learn(settings: row)
        if wasHidden != row.presenceHidden { hiddenChanged(row.user, batch: batch) }
    }

    /// Memory takes `row` (written here, read at start-up or followed from another node).
    func learn(settings row: UserSettingsRow) {
        for old in directory.settings[row.user]?.blocked ?? [] {
            directory.blockers[old]?.remove(row.user)
            if directory.blockers[old]?.isEmpty == true { directory.blockers[old] = nil }
        }
        for other in row.blocked { directory.blockers[other, default: []].insert(row.user) }
        directory.settings[row.user] = row
    }
}
