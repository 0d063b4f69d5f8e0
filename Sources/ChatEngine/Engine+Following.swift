import ChatProtocol
import Storage

/// Following the other processes that decide on the store (docs/several-deciding-nodes.md,
/// step 4). Before each batch, the engine reads what they did since it last looked
/// (`ChatStore.othersActivity`): for the chats their commits changed it renders what its
/// own connected users saw (from memory), takes those chats as the commits left them (read
/// with the commits, in one snapshot), renders them again and sends each viewer the
/// difference, in the order one process sends them (memberships, then new messages, then
/// changed messages, then the chat); it takes the
/// users and endpoints they made, who is connected to them (a message for a user connected
/// there is delivered as if the user were connected here), and their typing and chat events.
/// It tells them in turn who is connected here and what its sessions said that is never
/// stored.
extension Engine {
    /// Follows what the other deciding processes did (engine thread, before a batch):
    /// `thoroughly` before a batch that answers requests (`ChatStore.othersActivity`).
    func followOthers(thoroughly: Bool) {
        let activity: OthersActivity?
        do {
            activity = try coordination.othersActivity(besides: following.feedSlot, after: following.cursor, thoroughly: thoroughly)
        } catch {
            logger.warning(
                "what the other deciding nodes did could not be read: it is followed before the next batch",
                metadata: ["error": "\(error)"])
            return
        }
        guard let activity else {
            readEverythingAgain()
            return
        }
        if activity.online != following.onlineElsewhere {
            let changed = activity.online.symmetricDifference(following.onlineElsewhere)
            following.onlineElsewhere = activity.online
            for user in changed { presenceMayHaveChanged(of: user) }
        }
        guard !activity.isEmpty else {
            following.cursor = activity.cursor
            following.readAheadOfFollowing = []
            return
        }
        // What this process committed is applied first, so that reading the store again
        // does not go back on it; a commit of it that failed is decided again (`end`)
        // before anything is followed (the activity is read again then).
        settle()
        guard !hasFailedCommit else { return }
        following.cursor = activity.cursor
        // Everything memory read after a failed commit is followed now.
        let coarse = following.readAheadOfFollowing
        following.readAheadOfFollowing = []
        let batch = Batch(cache: cache, number: commits.batchNumber)
        // What is followed is durable already: its events are sent whatever happens next.
        batch.begin(.answered, session: nil)
        learn(activity.users, endpoints: activity.endpoints)
        for row in activity.userSettings where row != directory.settings[row.user] { adopt(settings: row, batch: batch) }
        do {
            try render(activity.commits, chatsNow: activity.chats, coarse: coarse, batch: batch)
        } catch {
            // Memory of those chats may be behind: a decision on one then conflicts and
            // reads it again. Their events are missing here.
            logger.error(
                "what another deciding node committed could not be read: this node's sessions miss its events",
                metadata: ["error": "\(error)"])
        }
        for event in activity.transient { render(event, batch: batch) }
        batch.deliver()
    }

    /// The store no longer has all the others did since the cursor: memory is read whole.
    private func readEverythingAgain() {
        settle()
        guard !hasFailedCommit else { return }
        logger.warning("this node fell behind what the other deciding nodes did: reading the store again whole")
        do {
            following.cursor = try coordination.othersActivity(besides: following.feedSlot, after: nil, thoroughly: true)?.cursor
            try reload()
            // What was committed between the cursor and the reading is in memory already.
            following.readAheadOfFollowing = nil
        } catch {
            logger.critical("cannot read the store again after falling behind the other nodes: stopping", metadata: ["error": "\(error)"])
            storeIsBroken(error)
        }
    }

    /// Users the others made or whose endpoints they changed, as the store has them now.
    private func learn(_ records: [UserRecord], endpoints rows: [EndpointRow]) {
        guard !records.isEmpty else { return }
        let numbers = Set(records.map(\.number))
        for record in records { directory.users.learn(record) }
        for user in numbers {
            for id in directory.endpointsOfUser[user] ?? [] { directory.endpoints[id] = nil }
            directory.endpointsOfUser[user] = nil
        }
        for row in rows.sorted(by: { $0.ordinal < $1.ordinal }) where numbers.contains(row.user) {
            directory.endpoints[row.id] = EndpointRecord(row)
            directory.endpointsOfUser[row.user, default: []].append(row.id)
            directory.lastEndpointOrdinal = max(directory.lastEndpointOrdinal, row.ordinal)
        }
    }

    /// Where each slot's changes in `commits` lie: after the first one's start, up to the
    /// last one's end.
    private static func spans(of commits: [FollowedCommit]) -> [Int: (after: Int64, upTo: Int64)] {
        var spans: [Int: (after: Int64, upTo: Int64)] = [:]
        for commit in commits {
            let span = spans[commit.slot] ?? (commit.feedAfter, commit.feedUpTo)
            spans[commit.slot] = (min(span.after, commit.feedAfter), max(span.upTo, commit.feedUpTo))
        }
        return spans
    }

    /// Memory of these chats (nil: of everything) was read again after a commit failed:
    /// it may hold what the others committed since they were last followed.
    func readAhead(_ numbers: Set<Int64>?) {
        guard let numbers, let already = following.readAheadOfFollowing else {
            following.readAheadOfFollowing = nil
            return
        }
        following.readAheadOfFollowing = already.union(numbers)
    }

    /// Makes memory of the chats `commits` changed what the store has, and sends this
    /// process's sessions what changed for them; those of `coarse` (nil: all) whole.
    /// `chatsNow`: those chats as the commits left them (`OthersActivity.chats`).
    private func render(_ commits: [FollowedCommit], chatsNow: StoreDirectory, coarse: Set<Int64>?, batch: Batch) throws {
        let numbers = Set(commits.flatMap(\.chats)).sorted()
        let isCoarse = { (number: Int64) in coarse?.contains(number) ?? true }
        let spans = Engine.spans(of: commits)
        defer {
            for (slot, span) in spans { following.followedFeed[slot] = max(following.followedFeed[slot] ?? FeedSlots.base(of: slot), span.upTo) }
        }
        guard !numbers.isEmpty else { return }
        var rewritten: [Int64: Set<Int64>] = [:]
        for commit in commits {
            for (chat, ids) in commit.rewritten { rewritten[chat, default: []].formUnion(ids) }
        }
        // Only the chats someone connected here is or was a member of are rendered; of the
        // others memory takes the new rows and drops the cached messages, and no message
        // of theirs is read (on a node whose sessions chat among themselves, most).
        var membersNow: Set<Int64> = []
        for member in chatsNow.members where isOnline(member.user) { membersNow.insert(member.chat) }
        let watched = numbers.filter { number in membersNow.contains(number) || directory.chats[number]?.members.keys.contains(where: isOnline) == true }
        cache.remove(chats: Set(numbers).subtracting(watched))
        // The messages they changed: each slot's own changes between the positions they
        // took, and the marks that moved over many at once; with the position each change
        // took (the order `publish` changed them in).
        var changed = rewritten
        var positions: [Batch.RowKey: Int64] = [:]
        for (slot, span) in spans where span.upTo > span.after && !watched.isEmpty {
            var after = span.after
            reading: while true {
                let rows = try store.changedMessages(chats: watched, after: after, limit: 500)
                for row in rows {
                    guard row.changeSeq <= span.upTo else { break reading }
                    changed[row.chat, default: []].insert(row.id)
                    positions[Batch.RowKey(chat: row.chat, item: row.id)] = row.changeSeq
                }
                guard rows.count == 500, let last = rows.last else { break }
                after = last.changeSeq
            }
            for range in try store.rangeChanges(chats: watched, after: span.after)
            where FeedSlots.slot(of: range.firstSeq) == slot && range.firstSeq <= span.upTo {
                changed[range.chat, default: []].formUnion(range.firstId...range.lastId)
                for id in range.firstId...range.lastId where positions[Batch.RowKey(chat: range.chat, item: id)] == nil {
                    positions[Batch.RowKey(chat: range.chat, item: id)] = range.firstSeq + id - range.firstId
                }
            }
        }
        // Before: each changed message as each connected viewer saw it, when memory can
        // tell (`knowsBefore`); otherwise the viewer is sent it whole.
        var previous: [Int64: ChatRecord] = [:]
        var before: [Int64: [Int64: [Int64: ChatMessage]]] = [:]
        var whole: [Int64: Set<Int64>] = [:]
        for number in numbers where !isCoarse(number) {
            guard let chat = directory.chats[number] else { continue }
            previous[number] = chat
            guard chat.members.values.contains(where: { $0.isActive && isOnline($0.user) }) else { continue }
            let ids = (changed[number] ?? []).filter { $0 <= chat.lastMessage }.sorted()
            for message in try loadMessages(in: chat, ids: ids) {
                guard knowsBefore(message, spans: spans, rewritten: rewritten[number]?.contains(message.id) ?? false) else {
                    whole[number, default: []].insert(message.id)
                    continue
                }
                var seen: [Int64: ChatMessage] = [:]
                for member in viewers(of: message, in: chat) where isOnline(member.user) {
                    seen[member.user] = renderMessage(message, in: chat, for: member.user)
                }
                before[number, default: [:]][message.id] = seen
            }
        }
        replace(Set(numbers), with: chatsNow, droppingOnly: changed, takingCounters: false)
        var undelivered: [Int64] = []
        for number in numbers {
            guard let chat = directory.chats[number] else { continue }
            let order = { (id: Int64) in positions[Batch.RowKey(chat: number, item: id)] ?? Int64.max }
            if isCoarse(number) {
                var inserted: Set<Int64> = []
                var members: Set<Int64> = []
                for commit in commits {
                    inserted.formUnion(commit.inserted[number] ?? [])
                    members.formUnion(commit.members[number] ?? [])
                }
                try renderCoarsely(chat, inserted: inserted, changed: changed[number] ?? [], members: members, order: order, batch: batch)
            } else {
                try renderFollowed(chat, was: previous[number], before: before[number] ?? [:], whole: whole[number] ?? [], order: order, batch: batch)
            }
            if chat.activeMembers.contains(where: { isOnline($0.user) && $0.deliveredUpTo < chat.lastMessage }) { undelivered.append(number) }
        }
        // A member connected here whom the deciding node did not know connected is marked
        // delivered here, in a batch of this node's (deciding, and committing).
        if !undelivered.isEmpty { put(.deliverFollowed(chats: undelivered)) }
    }

    /// Whether `message`, as memory has it, is what it was before the commits followed now:
    /// its latest change is this process's own, or one already followed, or one of these
    /// commits that only moved a mark over it (`rewritten`: they wrote it).
    private func knowsBefore(_ message: MessageRecord, spans: [Int: (after: Int64, upTo: Int64)], rewritten: Bool) -> Bool {
        let slot = FeedSlots.slot(of: message.changeSeq)
        if slot == following.feedSlot || message.changeSeq <= following.followedFeed[slot] ?? FeedSlots.base(of: slot) { return true }
        if let span = spans[slot], message.changeSeq <= span.upTo { return !rewritten }
        return false
    }

    /// Sends the users connected here what changed for them in `chat` (read again) since
    /// it was `old` (nil: memory did not have it).
    /// `order`: the position a changed message's change took (they are sent in that order).
    private func renderFollowed(
        _ chat: ChatRecord, was old: ChatRecord?, before: [Int64: [Int64: ChatMessage]], whole: Set<Int64>,
        order: (Int64) -> Int64, batch: Batch
    ) throws {
        func active(_ chat: ChatRecord?, _ user: Int64) -> MemberRecord? {
            guard let member = chat?.members[user], member.isActive else { return nil }
            return member
        }
        var connected = Set(chat.members.keys.filter(isOnline))
        if let old { connected.formUnion(old.members.keys.filter(isOnline)) }
        var staying: [MemberRecord] = []
        for user in connected.sorted() {
            switch (active(old, user), active(chat, user)) {
            case (nil, let member?):
                try introduce(chat, to: member, batch: batch)
            case (_?, nil):
                emit(.listRemove(.chat(ListRemoveChat(elements: [ChatKey(chatId: chat.chatId)]))), toUser: user, batch: batch)
            case (_?, let member?):
                staying.append(member)
            case (nil, nil):
                break
            }
        }
        guard let old, !staying.isEmpty else { return }
        // Who takes part, as `depart`, `invite` and `setAdmin` announce it.
        let departed = old.activeMembers.filter { active(chat, $0.user) == nil }
        let joined = chat.activeMembers.filter { active(old, $0.user) == nil }
        let changedParticipants = chat.activeMembers.compactMap { member -> ChatParticipantChange? in
            guard let was = active(old, member.user) else { return nil }
            return difference(renderParticipant(old, was), renderParticipant(chat, member))
        }
        for member in staying {
            for gone in departed {
                let key = ChatParticipantKey(chatId: chat.chatId, userUri: uri(gone.user))
                emit(.listRemove(.chatParticipant(ListRemoveChatParticipant(elements: [key]))), toUser: member.user, batch: batch)
            }
            for change in changedParticipants where change.userUri != uri(member.user) {
                emit(.listChange(.chatParticipant(ListChangeChatParticipant(elements: [change]))), toUser: member.user, batch: batch)
            }
            if !joined.isEmpty {
                let participants = joined.map { renderParticipant(chat, $0) }
                emit(.listAdd(.chatParticipant(ListAddChatParticipant(elements: participants))), toUser: member.user, batch: batch)
            }
        }
        if chat.lastMessage > old.lastMessage {
            announceFollowed(try loadMessages(in: chat, (old.lastMessage + 1)...chat.lastMessage), in: chat, to: staying, batch: batch)
        }
        // Changed messages, then the chat, as `publish` sends them.
        let stayingUsers = Set(staying.map(\.user))
        var messageChanges: [Int64: [ChatMessageChange]] = [:]
        let changedIds = Set(before.keys).union(whole).sorted { (order($0), $0) < (order($1), $1) }
        for message in try loadMessages(in: chat, ids: changedIds) {
            for member in viewers(of: message, in: chat) where stayingUsers.contains(member.user) {
                let now = renderMessage(message, in: chat, for: member.user)
                if whole.contains(message.id) {
                    messageChanges[member.user, default: []].append(everything(now))
                } else if let was = before[message.id]?[member.user], let change = difference(was, now) {
                    messageChanges[member.user, default: []].append(change)
                }
            }
        }
        emit(messageChanges, to: staying, batch: batch)
        for member in staying {
            guard let was = old.members[member.user], let change = difference(renderChat(old, for: was), renderChat(chat, for: member)) else { continue }
            emit(.listChange(.chat(ListChangeChat(elements: [change]))), toUser: member.user, batch: batch)
        }
    }

    /// Sends the users connected here `chat` (read again) as the followed commits left it,
    /// when memory cannot tell what it was before them (`readAheadOfFollowing`): a member
    /// whose membership they changed gets the chat whole (or its removal), the others
    /// the participants they changed, the messages they added, the ones they changed
    /// whole, and the chat whole. Nothing is missed; more is sent than changed.
    private func renderCoarsely(
        _ chat: ChatRecord, inserted: Set<Int64>, changed: Set<Int64>, members changedMembers: Set<Int64>,
        order: (Int64) -> Int64, batch: Batch
    ) throws {
        var staying: [MemberRecord] = []
        for (user, member) in chat.members.sorted(by: { $0.key < $1.key }) where isOnline(user) {
            if changedMembers.contains(user) {
                if member.isActive {
                    try introduce(chat, to: member, batch: batch)
                } else {
                    emit(.listRemove(.chat(ListRemoveChat(elements: [ChatKey(chatId: chat.chatId)]))), toUser: user, batch: batch)
                }
            } else if member.isActive {
                staying.append(member)
            }
        }
        guard !staying.isEmpty else { return }
        let others = changedMembers.sorted().compactMap { chat.members[$0] }
        for member in staying {
            for other in others where other.user != member.user {
                if other.isActive {
                    emit(.listAdd(.chatParticipant(ListAddChatParticipant(elements: [renderParticipant(chat, other)]))), toUser: member.user, batch: batch)
                } else {
                    let key = ChatParticipantKey(chatId: chat.chatId, userUri: uri(other.user))
                    emit(.listRemove(.chatParticipant(ListRemoveChatParticipant(elements: [key]))), toUser: member.user, batch: batch)
                }
            }
        }
        announceFollowed(try loadMessages(in: chat, ids: inserted.sorted()), in: chat, to: staying, batch: batch)
        let stayingUsers = Set(staying.map(\.user))
        var messageChanges: [Int64: [ChatMessageChange]] = [:]
        for message in try loadMessages(in: chat, ids: changed.subtracting(inserted).sorted { (order($0), $0) < (order($1), $1) }) {
            for member in viewers(of: message, in: chat) where stayingUsers.contains(member.user) {
                messageChanges[member.user, default: []].append(everything(renderMessage(message, in: chat, for: member.user)))
            }
        }
        emit(messageChanges, to: staying, batch: batch)
        for member in staying {
            emit(.listChange(.chat(ListChangeChat(elements: [everything(renderChat(chat, for: member))]))), toUser: member.user, batch: batch)
        }
    }

    /// Messages another node added, to the members who stay in the chat: their senders
    /// stopped typing when they sent them.
    private func announceFollowed(_ posted: [MessageRecord], in chat: ChatRecord, to staying: [MemberRecord], batch: Batch) {
        for sender in Set(posted.map(\.sender)).sorted() { stopTyping(user: sender, chat: chat, batch: batch) }
        for member in staying {
            let visible = posted.filter { $0.id >= member.joinedAt }
            for chunk in visible.map({ renderMessage($0, in: chat, for: member.user) }).chunked(Engine.chunkSize) {
                emit(.listAdd(.chatMessage(ListAddChatMessage(elements: chunk))), toUser: member.user, batch: batch)
            }
        }
    }

    /// Each member's message changes, in order, as `publish` sends them.
    private func emit(_ changes: [Int64: [ChatMessageChange]], to staying: [MemberRecord], batch: Batch) {
        for member in staying {
            for chunk in (changes[member.user] ?? []).chunked(Engine.chunkSize) {
                emit(.listChange(.chatMessage(ListChangeChatMessage(elements: chunk))), toUser: member.user, batch: batch)
            }
        }
    }

    /// A transient event of another node's session, for the sessions here.
    private func render(_ event: TransientEvent, batch: Batch) {
        switch event {
        case .typing(let user, let number):
            guard let chat = directory.chats[number], chat.activeMember(user) != nil else { return }
            typingStarted(user, in: chat, batch: batch)
        case .chatEvent(let user, let number, let tag, let data):
            guard let chat = directory.chats[number] else { return }
            let event = Event.chatEvent(ChatEvent(chatId: chat.chatId, senderUri: uri(user), tag: tag, data: data.map { JSONValue(compactJSON: $0) }))
            for member in chat.activeMembers {
                for session in sessions(of: member.user) { batch.emit(event, to: session) }
            }
        }
    }

    /// Marks delivered, to the members connected here, what the other nodes committed in
    /// these chats (`render`).
    func deliverFollowed(_ numbers: [Int64], batch: Batch) {
        let changes = PendingChanges()
        for number in numbers {
            guard let chat = directory.chats[number] else { continue }
            do {
                try markDelivered(chat, batch: batch, changes: changes)
            } catch {
                logger.warning("could not mark delivered what another node committed", metadata: ["chat": "\(number)", "error": "\(error)"])
            }
        }
        publish(changes, batch: batch)
    }

    /// Tells the other deciding nodes what a session here said that is never stored.
    func tellOthers(_ event: TransientEvent) {
        guard followsOthers else { return }
        do {
            try coordination.announce(event, slot: following.feedSlot)
        } catch {
            logger.warning("could not tell the other deciding nodes of a typing or chat event", metadata: ["error": "\(error)"])
        }
    }

    /// A session of `user` came or went here: the other deciding nodes are told whether
    /// the user is still connected here (`announcePresence`). Nothing is kept when no
    /// other node decides.
    func sessionsChanged(of user: Int64) {
        if followsOthers { following.presenceChanged.insert(user) }
        presenceMayHaveChanged(of: user)
    }

    /// Tells the other deciding nodes who came and went here since they were last told.
    func announcePresence() {
        guard !following.presenceChanged.isEmpty else { return }
        var joined: [Int64] = []
        var left: [Int64] = []
        for user in following.presenceChanged.sorted() {
            if isOnline(user) && !following.announcedOnline.contains(user) { joined.append(user) }
            if !isOnline(user) && following.announcedOnline.contains(user) { left.append(user) }
        }
        following.presenceChanged = []
        guard !joined.isEmpty || !left.isEmpty else { return }
        do {
            try coordination.announceOnline(slot: following.feedSlot, joined: joined, left: left)
            following.announcedOnline.formUnion(joined)
            following.announcedOnline.subtract(left)
        } catch {
            // Told again after the next batch.
            following.presenceChanged.formUnion(joined + left)
            logger.warning("could not tell the other deciding nodes who is connected here", metadata: ["error": "\(error)"])
        }
    }

    /// Whether a user has a session here or on another deciding node.
    func isConnectedAnywhere(_ user: Int64) -> Bool {
        isOnline(user) || following.onlineElsewhere.contains(user)
    }
}
