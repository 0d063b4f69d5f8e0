import ChatProtocol
import Storage

/// Presence (docs/protocol.md §4): whether a user is connected (here or on another
/// deciding node) and since when, shown as `online` and `lastActive` on the `user` elements
/// of the sessions that watch it (`presenceSet.watch`), for the users their user shares a
/// chat with, unless either of the two hides their presence. Changes are coalesced: looked
/// at once a `Presence.interval`, and a user whose last connection closed is shown offline
/// only when none came back within `Presence.grace`.
extension Engine {
    func setPresence(_ request: PresenceSet, user: Int64, session: EngineSession, batch: Batch) throws {
        guard request.watch != nil || request.hidden != nil else { throw ProtocolError.invalid("give 'watch', 'hidden' or both") }
        if let hidden = request.hidden, hidden != settings(of: user).presenceHidden {
            var row = settings(of: user)
            row.presenceHidden = hidden
            change(settings: row, batch: batch)
        }
        if let watch = request.watch, watch != session.watchesPresence {
            session.watchesPresence = watch
            if watch {
                let elements = peers(of: user).map { presenceChange(of: $0, seenBy: user, peer: true) }
                for chunk in elements.chunked(Engine.chunkSize) { batch.emit(.listChange(.user(ListChangeUser(elements: chunk))), to: session) }
            }
        }
    }

    /// `user` hid their presence or showed it again (here, or on another node): their peers
    /// who watch here see theirs go or come back, their own sessions that watch see every
    /// peer's (connected or not), and every session of theirs the global `presenceHidden`.
    func hiddenChanged(_ user: Int64, batch: Batch) {
        let hidden = settings(of: user).presenceHidden
        let peers = peers(of: user)
        for peer in peers where isOnline(peer) {
            let change = presenceChange(of: user, seenBy: peer, peer: true)
            for session in sessions(of: peer) where session.watchesPresence {
                batch.emit(.listChange(.user(ListChangeUser(elements: [change]))), to: session)
            }
        }
        let elements = peers.map { presenceChange(of: $0, seenBy: user, peer: true) }
        for session in sessions(of: user) {
            batch.emit(.listChange(.global(ListChangeGlobal(elements: [GlobalChange(name: "presenceHidden", value: .value(.bool(hidden)))]))), to: session)
            guard session.watchesPresence else { continue }
            for chunk in elements.chunked(Engine.chunkSize) { batch.emit(.listChange(.user(ListChangeUser(elements: chunk))), to: session) }
        }
    }

    /// The users who share a chat with `user` now (never `user`), ascending.
    func peers(of user: Int64) -> [Int64] {
        var numbers: Set<Int64> = []
        for number in directory.chatsOfUser[user] ?? [] {
            for member in directory.chats[number]?.activeMembers ?? [] where member.user != user { numbers.insert(member.user) }
        }
        return numbers.sorted()
    }

    /// Whether `viewer` sees `user`'s presence: they share a chat, and neither hides it.
    /// `peer`: they are known to share one (taken from `peers(of:)`), not looked for again.
    func seesPresence(of user: Int64, viewer: Int64, peer: Bool = false) -> Bool {
        guard user != viewer, !settings(of: user).presenceHidden, !settings(of: viewer).presenceHidden else { return false }
        if peer { return true }
        let (fewer, other) = (directory.chatsOfUser[user]?.count ?? 0) <= (directory.chatsOfUser[viewer]?.count ?? 0) ? (user, viewer) : (viewer, user)
        for number in directory.chatsOfUser[fewer] ?? [] where directory.chats[number]?.activeMember(other) != nil { return true }
        return false
    }

    /// What `viewer` is shown of `user` now: online and lastActive, or nothing (both null).
    func presenceChange(of user: Int64, seenBy viewer: Int64, peer: Bool = false) -> UserChange {
        var change = UserChange(uri: uri(user))
        if seesPresence(of: user, viewer: viewer, peer: peer) {
            let (online, since) = shownPresence(of: user)
            change.online = .value(online)
            change.lastActive = since.map { .value($0) } ?? .null
        } else {
            change.online = .null
            change.lastActive = .null
        }
        return change
    }

    /// What is shown of `user`: online or not, and since when (nil: never seen).
    func shownPresence(of user: Int64) -> (online: Bool, since: Int64?) {
        if let shown = presence.shown[user] { return (shown.online, shown.since) }
        return (false, settings(of: user).lastActive)
    }

    /// `user`'s connections here or elsewhere may have changed: looked at within a
    /// `Presence.interval`.
    func presenceMayHaveChanged(of user: Int64) {
        if isConnectedAnywhere(user) {
            presence.changed[user] = .some(nil)
        } else if presence.changed[user] ?? nil == nil {
            presence.changed[user] = .some((monotonicSeconds(), now()))
        }
        guard presence.dueAt == nil else { return }
        let due = monotonicSeconds() + Presence.interval
        presence.dueAt = due
        scheduleTick(due: due)
    }

    /// Shows the users whose connections changed as they are now (`Presence`): those who
    /// came online at once, those who left once the grace is over; the time a user went
    /// offline is kept in their settings.
    func showPresence(batch: Batch) {
        let clock = monotonicSeconds()
        guard let due = presence.dueAt else { return }
        guard due <= clock else { return scheduleTick(due: due) }
        presence.dueAt = nil
        var waiting: [Int64: (monotonic: Double, wall: Int64)?] = [:]
        var earliest: Double?
        var changes: [(user: Int64, online: Bool, since: Int64)] = []
        for (user, offlineSince) in presence.changed {
            let online = isConnectedAnywhere(user)
            let wasOnline = presence.shown[user]?.online ?? false
            if online == wasOnline { continue }
            if online {
                changes.append((user, true, now()))
                continue
            }
            let since = offlineSince ?? (clock, now())
            if clock - since.monotonic < Presence.grace {
                waiting[user] = .some(since)
                earliest = min(earliest ?? since.monotonic + Presence.grace, since.monotonic + Presence.grace)
                continue
            }
            changes.append((user, false, since.wall))
        }
        presence.changed = waiting
        if let earliest {
            presence.dueAt = earliest
            scheduleTick(due: earliest)
        }
        for change in changes.sorted(by: { $0.user < $1.user }) {
            if change.online {
                presence.shown[change.user] = (true, change.since)
            } else {
                // Shown from their settings from now on: memory holds the online only.
                presence.shown[change.user] = nil
                var row = settings(of: change.user)
                row.lastActive = change.since
                self.change(settings: row, batch: batch)
            }
            for peer in peers(of: change.user) where isOnline(peer) && seesPresence(of: change.user, viewer: peer, peer: true) {
                let element = UserChange(uri: uri(change.user), online: .value(change.online), lastActive: .value(change.since))
                for session in sessions(of: peer) where session.watchesPresence {
                    batch.emit(.listChange(.user(ListChangeUser(elements: [element]))), to: session)
                }
            }
        }
    }

    /// The `user` element `viewer`'s `session` is sent of `user`: with presence when the
    /// session watches it and may see it, and `blocked` when the viewer blocks them.
    func userElement(_ user: UserRecord, for session: EngineSession, viewer: Int64) -> User {
        var element = User(uri: user.uri, regId: user.regId, userId: user.userId)
        if session.watchesPresence && seesPresence(of: user.number, viewer: viewer) {
            let (online, since) = shownPresence(of: user.number)
            element.online = online
            element.lastActive = since
        }
        if blocks(viewer, user.number) { element.blocked = true }
        return element
    }
}
