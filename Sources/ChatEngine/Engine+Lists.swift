import ChatProtocol
import Storage

/// The list requests (§4) and message matching (§8).
extension Engine {
    /// Results of a match without a window, and the most a window side may ask for.
    static let maxMatches = 1000

    // MARK: requestListAll

    func listAll(_ request: RequestListAll, user: Int64, session: EngineSession, line: Int, batch: Batch) throws {
        let cookie = request.cookie
        let header = Event.listAll(ListAll(type: request.type, cookie: cookie))
        switch request.type {
        case .global:
            answer(header, globalElements(of: session), to: session, batch: batch) { .global(ListChunkGlobal(cookie: cookie, elements: $0, last: $1)) }
        case .user:
            answer(header, visibleUsers(of: user).map { userElement($0, for: session, viewer: user) }, to: session, batch: batch) {
                .user(ListChunkUser(cookie: cookie, elements: $0, last: $1))
            }
        case .chat, .chatParticipant:
            // They grow with the user's chats: a page of chats per batch.
            batch.emit(header, to: session)
            let list = ListInProgress(
                kind: request.type, cookie: cookie, line: line, user: user, session: session,
                chats: (directory.chatsOfUser[user] ?? []).sorted())
            continueList(list, batch: batch)
        case .typing:
            answer(header, typingSeen(by: user), to: session, batch: batch) { .typing(ListChunkTyping(cookie: cookie, elements: $0, last: $1)) }
        case .chatMessage:
            throw ProtocolError.invalid("'type' chatMessage cannot be listed whole: use requestListMatching or requestListChanges")
        }
    }

    /// A `chat` or `chatParticipant` list being answered, a page of chats per batch.
    struct ListInProgress {
        let kind: ListType
        let cookie: String?
        let line: Int
        let user: Int64
        let session: EngineSession
        /// The chats still to list, in the order they were started.
        var chats: [Int64]
    }

    /// Elements one batch lists, at most about (a page ends with the chat that reaches
    /// it): a user in 2,000 chats of 50 made one answer of 100,000 participants, which held
    /// the engine from everyone else for 150 ms and more. A page also ends after
    /// `pageTime`. Pages of 2,000 and 8 ms held another user's sends p50 29 ms while that
    /// list was answered; pages of 500 and 2 ms, 13 ms (`Benchmarks/run.py hostile`).
    static let listPage = 500

    /// How long one page of work that grows with what a user has (a list, deliveries at
    /// sign-in) may hold the engine, about: then it goes on in a later batch.
    static let pageTime = Duration.milliseconds(2)

    /// Answers the next page of `list`: its chunks, the last one `last` when no chat is
    /// left; otherwise the rest follows in a later batch (once this one is committed),
    /// the session's later requests waiting for it, in order.
    func continueList(_ list: ListInProgress, batch: Batch) {
        var rest = list
        var elements = 0
        var chatElements: [Chat] = []
        var participants: [ChatParticipant] = []
        var taken = 0
        let deadline = ContinuousClock.now + Engine.pageTime
        while elements < Engine.listPage, taken < rest.chats.count, taken == 0 || ContinuousClock.now < deadline {
            let number = rest.chats[taken]
            taken += 1
            guard let chat = directory.chats[number], let member = chat.activeMember(list.user) else { continue }
            if list.kind == .chat {
                chatElements.append(renderChat(chat, for: member))
                elements += 1
            } else {
                let others = chat.activeMembers.filter { $0.user != list.user }.map { renderParticipant(chat, $0) }
                participants += others
                elements += max(1, others.count)
            }
        }
        rest.chats.removeFirst(taken)
        let done = rest.chats.isEmpty
        let cookie = list.cookie
        if list.kind == .chat {
            emitChunks(chatElements, last: done, to: list.session, batch: batch) { .chat(ListChunkChat(cookie: cookie, elements: $0, last: $1)) }
        } else {
            emitChunks(participants, last: done, to: list.session, batch: batch) {
                .chatParticipant(ListChunkChatParticipant(cookie: cookie, elements: $0, last: $1))
            }
        }
        if !done { continueLater(.continueList(rest), for: list.session, batch: batch) }
    }

    /// The next page of a list (`continueList`): the session's later requests went on
    /// waiting for it.
    func listContinues(_ list: ListInProgress, batch: Batch) {
        resume(RequestListAll.name, cookie: list.cookie, line: list.line, session: list.session, batch: batch) {
            continueList(list, batch: batch)
        }
    }

    /// `elements` as `listChunk`s of at most `chunkSize`; the last of them says `last`. A
    /// page that ends the list with no element is one empty chunk; one that does not end it
    /// and has none, nothing.
    private func emitChunks<Element>(
        _ elements: [Element], last: Bool, to session: EngineSession, batch: Batch,
        _ chunk: ([Element], Bool?) -> ListChunk
    ) {
        let pieces = elements.isEmpty ? (last ? [[]] : []) : elements.chunked(Engine.chunkSize)
        for (index, piece) in pieces.enumerated() {
            batch.emit(.listChunk(chunk(piece, last && index == pieces.count - 1 ? true : nil)), to: session)
        }
    }

    /// The `chat` list as `user` sees it.
    func chatElements(of user: Int64) -> [Chat] {
        chatsOf(user).map { renderChat($0, for: $0.members[user]!) }
    }

    /// The `chatParticipant` list as `user` sees it (never `user`).
    func participantElements(of user: Int64) -> [ChatParticipant] {
        chatsOf(user).flatMap { chat in chat.activeMembers.filter { $0.user != user }.map { renderParticipant(chat, $0) } }
    }

    /// The chats `user` takes part in, in the order they were started.
    func chatsOf(_ user: Int64) -> [ChatRecord] {
        (directory.chatsOfUser[user] ?? []).sorted().compactMap { directory.chats[$0] }
    }

    func typingSeen(by user: Int64) -> [Typing] {
        timed.typing.keys
            .filter { $0.user != user && directory.chats[$0.chat]?.activeMember(user) != nil }
            .sorted { ($0.chat, $0.user) < ($1.chat, $1.user) }
            .map { Typing(userUri: uri($0.user), chatId: String($0.chat)) }
    }

    // MARK: requestListElements

    func listElements(_ request: RequestListElements, user: Int64, session: EngineSession, batch: Batch) {
        switch request {
        case .global(let request):
            let all = globalElements(of: session)
            let (found, missing) = lookUp(request.elements) { key in all.first { $0.name == key.name } }
            answer(.listElements(.global(ListElementsGlobal(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) {
                .global(ListChunkGlobal(cookie: request.cookie, elements: $0, last: $1))
            }
        case .user(let request):
            // A user the asker knows (`knows`), by uri (a client resolving a sender it has
            // not seen yet) or regId.
            let (found, missing) = lookUp(request.elements) { key -> User? in
                guard user != Engine.nobody else { return nil }
                let found =
                    key.uri.map { uri in self.user(fromURI: uri, viewer: user).flatMap { directory.users[$0] } }
                    ?? key.regId.flatMap { directory.users.find(regId: $0) }
                return found.flatMap { knows($0.number, viewer: user, session: session) ? userElement($0, for: session, viewer: user) : nil }
            }
            answer(.listElements(.user(ListElementsUser(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) {
                .user(ListChunkUser(cookie: request.cookie, elements: $0, last: $1))
            }
        case .chat(let request):
            let (found, missing) = lookUp(request.elements) { key in
                (try? chat(key.chatId, of: user)).map { renderChat($0.0, for: $0.1) }
            }
            answer(.listElements(.chat(ListElementsChat(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) {
                .chat(ListChunkChat(cookie: request.cookie, elements: $0, last: $1))
            }
        case .chatParticipant(let request):
            let (found, missing) = lookUp(request.elements) { key -> ChatParticipant? in
                guard let (chat, _) = try? chat(key.chatId, of: user), let number = self.user(fromURI: key.userUri, viewer: user),
                    number != user, let member = chat.activeMember(number)
                else { return nil }
                return renderParticipant(chat, member)
            }
            answer(.listElements(.chatParticipant(ListElementsChatParticipant(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) {
                .chatParticipant(ListChunkChatParticipant(cookie: request.cookie, elements: $0, last: $1))
            }
        case .chatMessage(let request):
            let (found, missing) = lookUp(request.elements) { key -> ChatMessage? in
                guard let (chat, member) = try? chat(key.chatId, of: user),
                    let message = try? message(key.messageId, in: chat, seenBy: member)
                else { return nil }
                return renderMessage(message, in: chat, for: user)
            }
            answer(.listElements(.chatMessage(ListElementsChatMessage(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) {
                .chatMessage(ListChunkChatMessage(cookie: request.cookie, elements: $0, last: $1))
            }
        case .typing(let request):
            let current = typingSeen(by: user)
            let (found, missing) = lookUp(request.elements) { key in
                current.first { $0.userUri == key.userUri && $0.chatId == key.chatId }
            }
            answer(.listElements(.typing(ListElementsTyping(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) {
                .typing(ListChunkTyping(cookie: request.cookie, elements: $0, last: $1))
            }
        }
    }

    /// A list answer (§4): its header, then `listChunk`s of at most
    /// `chunkSize` elements (at least one, possibly empty), the final one `last: true`.
    /// Clients apply a chunk to the list its header opened, so the header comes first.
    func answer<Element>(
        _ header: Event, _ elements: [Element], to session: EngineSession, batch: Batch,
        _ chunk: ([Element], Bool?) -> ListChunk
    ) {
        batch.emit(header, to: session)
        let pieces = elements.isEmpty ? [[]] : elements.chunked(Engine.chunkSize)
        for (index, piece) in pieces.enumerated() {
            batch.emit(.listChunk(chunk(piece, index == pieces.count - 1 ? true : nil)), to: session)
        }
    }

    /// The elements found for `keys`, and the keys not found (nil when none are missing).
    private func lookUp<Key, Element>(_ keys: [Key], _ find: (Key) -> Element?) -> ([Element], [Key]?) {
        var found: [Element] = []
        var missing: [Key] = []
        for key in keys {
            if let element = find(key) { found.append(element) } else { missing.append(key) }
        }
        return (found, missing.isEmpty ? nil : missing)
    }

    // MARK: requestListMatching

    func listMatching(_ request: RequestListMatching, user: Int64, session: EngineSession, batch: Batch) throws {
        switch request {
        case .chatParticipant(let request):
            let found = try matchParticipants(request, user: user)
            answer(.listMatching(.chatParticipant(ListMatchingChatParticipant(cookie: request.cookie))), found, to: session, batch: batch) {
                .chatParticipant(ListChunkChatParticipant(cookie: request.cookie, elements: $0, last: $1))
            }
        case .chatMessage(let request):
            let (header, found) = try matchMessages(request, user: user, batch: batch)
            answer(.listMatching(.chatMessage(header)), found, to: session, batch: batch) {
                .chatMessage(ListChunkChatMessage(cookie: request.cookie, elements: $0, last: $1))
            }
        case .chat(let request):
            // No mailboxes and no end-to-end keys: nothing matches (as bbmcore answers a
            // criterion nothing meets: an empty list).
            answer(.listMatching(.chat(ListMatchingChat(cookie: request.cookie))), [Chat](), to: session, batch: batch) {
                .chat(ListChunkChat(cookie: request.cookie, elements: $0, last: $1))
            }
        case .user(let request):
            answer(.listMatching(.user(ListMatchingUser(cookie: request.cookie))), [User](), to: session, batch: batch) {
                .user(ListChunkUser(cookie: request.cookie, elements: $0, last: $1))
            }
        }
    }

    func matchParticipants(_ request: RequestListMatchingChatParticipant, user: Int64) throws -> [ChatParticipant] {
        let criteria = request.criteria
        let wanted = criteria.userUri.map { self.user(fromURI: $0, viewer: user) ?? -1 }
        var result: [ChatParticipant] = []
        if let chatId = criteria.chatId {
            let (chat, _) = try chat(chatId, of: user)
            for member in chat.activeMembers where member.user != user && (wanted == nil || wanted == member.user) {
                result.append(renderParticipant(chat, member))
            }
        } else if let wanted {
            for chat in chatsOf(user) where wanted != user {
                if let member = chat.activeMember(wanted) { result.append(renderParticipant(chat, member)) }
            }
        } else {
            throw ProtocolError.invalid("'criteria' needs 'chatId', or 'userUri' and 'state'")
        }
        return result
    }

    /// The header of the answer and the matching messages, in order. Without criteria
    /// that narrow, the ids are counted out; with them, the store's indexes find them.
    func matchMessages(_ request: RequestListMatchingChatMessage, user: Int64, batch: Batch) throws -> (ListMatchingChatMessage, [ChatMessage]) {
        let criteria = request.criteria
        let (chat, member) = try chat(criteria.chatId, of: user)
        let narrows = criteria.tag != nil || criteria.ref != nil || criteria.notRefTag != nil || criteria.senderUri != nil
        guard narrows || request.window != nil else {
            throw ProtocolError.invalid("'criteria' needs at least one of 'tag', 'ref', 'notRefTag' and 'senderUri', or the request a 'window'")
        }
        var filter = MessageFilter(firstId: max(member.joinedAt, 1), lastId: chat.lastMessage)
        filter.tag = criteria.tag
        filter.referring = criteria.ref.map { RefRow(tag: $0.tag, target: $0.messageId) }
        filter.notRefTag = criteria.notRefTag
        filter.sender = criteria.senderUri.map { self.user(fromURI: $0, viewer: user) ?? -1 }
        let first = filter.firstId
        let last = chat.lastMessage
        /// Up to `limit` matching ids from `start`, up or down.
        func ids(from start: Int64, ascending: Bool, limit: Int) throws -> [Int64] {
            guard limit > 0 else { return [] }
            if narrows { return try matchingIds(in: chat, filter, from: start, ascending: ascending, limit: limit, batch: batch) }
            if ascending {
                let low = max(start, first)
                return low <= last ? Array(low...min(last, low + Int64(limit) - 1)) : []
            }
            let high = min(start, last)
            return high >= first ? Array((max(first, high - Int64(limit) + 1)...high).reversed()) : []
        }

        var found: [Int64] = []
        var hasMoreBefore: Bool?
        var hasMoreAfter: Bool?
        if let window = request.window {
            // The anchor is the ids [anchor, end): the message `messageId`, or the first
            // message of second `timestamp`; when no message has that second, the anchor is
            // empty, the gap between the older and the newer messages. `before` is older
            // than the anchor, `after` newer; the anchor is included when `inclusive` and
            // it matches.
            let anchor: Int64
            let end: Int64
            switch (window.messageId, window.timestamp) {
            case (let id?, nil):
                // Past the last message, where the next would be (the same matches, and
                // no overflow at the largest id).
                anchor = min(id, last + 1)
                end = anchor + 1
            case (nil, let timestamp?):
                try commitIfChanged(chat, batch: batch)
                let at: Int64?
                do {
                    at = try store.firstMessage(chat: chat.number, notBefore: timestamp)
                } catch {
                    throw unreadable(error)
                }
                anchor = at ?? last + 1
                end = try at.flatMap { try loadMessage($0, in: chat) }?.timestamp == timestamp ? anchor + 1 : anchor
            default:
                throw ProtocolError.invalid("'window' needs exactly one of 'messageId' and 'timestamp'")
            }
            let anchored = anchor < end ? try ids(from: anchor, ascending: true, limit: 1).filter { $0 < end } : []
            let wantBefore = Int(window.before ?? 0)
            var before = try ids(from: anchor - 1, ascending: false, limit: wantBefore + 1)
            hasMoreBefore = before.count > wantBefore
            if before.count > wantBefore { before.removeLast() }
            let wantAfter = Int(window.after ?? 0)
            var after = try ids(from: end, ascending: true, limit: wantAfter + 1)
            hasMoreAfter = after.count > wantAfter
            if after.count > wantAfter { after.removeLast() }
            found = before.reversed()
            if window.inclusive ?? true { found += anchored }
            found += after
            if window.reverse ?? false { found.reverse() }
        } else {
            found = try ids(from: first, ascending: true, limit: Engine.maxMatches + 1)
            if found.count > Engine.maxMatches {
                found.removeLast()
                hasMoreAfter = true
            }
        }
        let messages = try loadMessages(in: chat, ids: found).filter { $0.isSeen(by: user) }
        let result = messages.map { renderMessage($0, in: chat, for: user) }
        var refTargets: [ChatMessage]?
        if request.withRefTargets ?? false {
            var seen = Set<Int64>()
            var targetIds: [Int64] = []
            for message in messages {
                for ref in message.refs where ref.messageId >= member.joinedAt && seen.insert(ref.messageId).inserted { targetIds.append(ref.messageId) }
            }
            refTargets = try loadMessages(in: chat, ids: targetIds).filter { $0.isSeen(by: user) }.map { renderMessage($0, in: chat, for: user) }
        }
        return (
            ListMatchingChatMessage(cookie: request.cookie, hasMoreBefore: hasMoreBefore, hasMoreAfter: hasMoreAfter, refTargets: refTargets),
            result
        )
    }

    // MARK: requestListChanges

    /// The change feed (§4): messages of the user's chats whose latest change
    /// is after `since`, oldest change first. A message's latest change is the later of its
    /// own (`changeSeq`) and of the marks that moved over it (range changes). Positions are
    /// per slot (`FeedSlots`, one per process deciding on the store) and so is the token;
    /// the answer takes each slot's changes in order, slot after slot.
    func listChanges(_ request: RequestListChanges, user: Int64, batch: Batch) throws -> Event {
        let scope: [ChatRecord]
        if let chatId = request.chatId {
            scope = [try chat(chatId, of: user).0]
        } else {
            scope = chatsOf(user)
        }
        guard let token = request.since else {
            return .listChanges(ListChanges(cookie: request.cookie, changed: [], token: FeedToken(try feedNow()).description, hasMore: false))
        }
        guard let since = FeedToken(token) else {
            throw ProtocolError.invalid("'since' \(token) is not a token this service gave out")
        }
        let limit = Int(request.limit ?? 100)
        var scoped: [Int64: (chat: ChatRecord, firstId: Int64)] = [:]
        for chat in scope {
            guard let member = chat.activeMember(user) else { continue }
            try commitIfChanged(chat, batch: batch)
            scoped[chat.number] = (chat, member.joinedAt)
        }
        let now = FeedToken(try feedNow())
        guard since.positions.indices.allSatisfy({ since[$0] <= now[$0] }) else {
            throw ProtocolError.invalid("'since' \(token) is not a token this service gave out")
        }
        var found: [(seq: Int64, chat: ChatRecord, message: MessageRecord)] = []
        var next = now
        var hasMore = false
        for slot in 0..<FeedSlots.count where since[slot] < now[slot] {
            guard !hasMore else {
                next[slot] = since[slot]
                continue
            }
            let base = FeedSlots.base(of: slot)
            var page = try changes(in: scoped, after: base + since[slot], upTo: base + now[slot], limit: limit - found.count + 1)
            if found.count + page.count > limit {
                hasMore = true
                page.removeLast(found.count + page.count - limit)
                next[slot] = (page.last?.seq).map { $0 - base } ?? since[slot]
            }
            found += page
        }
        // A message changed by two slots since may be found in each: it is given once.
        var given: Set<Batch.RowKey> = []
        let changed = found.filter { given.insert(Batch.RowKey(chat: $0.chat.number, item: $0.message.id)).inserted && $0.message.isSeen(by: user) }
            .map { renderMessage($0.message, in: $0.chat, for: user) }
        return .listChanges(ListChanges(cookie: request.cookie, changed: changed, token: next.description, hasMore: hasMore))
    }

    /// Every slot's last position: this process's as memory has it (its decisions, whose
    /// commits a read waits for), the others' as the store has them committed. A store
    /// only this process writes has no other slots.
    private func feedNow() throws -> [Int64] {
        var positions = [Int64](repeating: 0, count: FeedSlots.count)
        if commits.comparesChatVersions {
            let stored: [Int: Int64]
            do {
                stored = try store.feedPositions()
            } catch {
                throw unreadable(error)
            }
            for (slot, position) in stored where slot != following.feedSlot { positions[slot] = position - FeedSlots.base(of: slot) }
        }
        positions[following.feedSlot] = directory.changeSeq - FeedSlots.base(of: following.feedSlot)
        return positions
    }

    /// Up to `limit` messages of `chats` (each from its `firstId`) whose latest change is
    /// after `since` and at most `upTo`, both in one slot, with that position, ascending.
    private func changes(
        in chats: [Int64: (chat: ChatRecord, firstId: Int64)], after since: Int64, upTo: Int64,
        limit: Int
    ) throws -> [(seq: Int64, chat: ChatRecord, message: MessageRecord)] {
        let slot = FeedSlots.slot(of: since)
        let numbers = chats.keys.sorted()
        let ranges: [RangeChangeRow]
        do {
            ranges = try store.rangeChanges(chats: numbers, after: since).filter { FeedSlots.slot(of: $0.firstSeq) == slot }
        } catch {
            throw unreadable(error)
        }
        var rangesOfChat: [Int64: [RangeChangeRow]] = [:]
        for range in ranges { rangesOfChat[range.chat, default: []].append(range) }
        /// The latest position any range gives message `id` of `chat`.
        func rangeSeq(of id: Int64, in chat: Int64) -> Int64 {
            (rangesOfChat[chat] ?? []).reduce(0) { latest, range in max(latest, range.seq(of: id) ?? 0) }
        }
        var result: [(seq: Int64, chat: ChatRecord, message: MessageRecord)] = []
        // Candidates come from two sorted streams: messages by their own change, and the
        // ranges' messages by position; a candidate counts at its latest position only.
        var own: [MessageChangeRow] = []
        var ownIndex = 0
        var ownAfter = since
        var ownDone = false
        var rangeCursor = ranges.map { range in max(range.firstId, chats[range.chat]?.firstId ?? 1, range.firstId + since - range.firstSeq + 1) }
        func nextOwn() throws -> MessageChangeRow? {
            if ownIndex == own.count && !ownDone {
                do {
                    own = try store.changedMessages(chats: numbers, after: ownAfter, limit: max(limit * 2, 64))
                } catch {
                    throw unreadable(error)
                }
                ownIndex = 0
                if let last = own.last { ownAfter = last.changeSeq }
                // Past `upTo`: another slot's, or not yet committed everywhere this read looks.
                let inReach = own.prefix { $0.changeSeq <= upTo }
                ownDone = own.isEmpty || inReach.count < own.count
                own = Array(inReach)
                // One read per chat for the page, not one per message.
                for (number, page) in Dictionary(grouping: own, by: \.chat) {
                    if let (chat, firstId) = chats[number] {
                        _ = try loadMessages(in: chat, ids: page.map(\.id).filter { $0 >= firstId })
                    }
                }
            }
            return ownIndex < own.count ? own[ownIndex] : nil
        }
        while result.count < limit {
            let candidateOwn = try nextOwn()
            var best: (range: Int, seq: Int64)?
            for (index, range) in ranges.enumerated() where rangeCursor[index] <= range.lastId {
                let seq = range.seq(of: rangeCursor[index])!
                if seq <= upTo && (best == nil || seq < best!.seq) { best = (index, seq) }
            }
            if let candidate = candidateOwn, best == nil || candidate.changeSeq < best!.seq {
                ownIndex += 1
                guard let (chat, firstId) = chats[candidate.chat], candidate.id >= firstId,
                    rangeSeq(of: candidate.id, in: candidate.chat) < candidate.changeSeq,
                    let message = try loadMessage(candidate.id, in: chat)
                else { continue }
                result.append((candidate.changeSeq, chat, message))
            } else if let (index, seq) = best {
                let range = ranges[index]
                let id = rangeCursor[index]
                rangeCursor[index] += 1
                // A change of the message's own in another slot is neither before nor after
                // this one: the message counts here too.
                guard let (chat, _) = chats[range.chat], rangeSeq(of: id, in: range.chat) == seq,
                    let message = try loadMessage(id, in: chat),
                    message.changeSeq < seq || FeedSlots.slot(of: message.changeSeq) != slot
                else { continue }
                result.append((seq, chat, message))
            } else {
                break
            }
        }
        return result
    }
}

extension Collection {
    /// The first index where `predicate` holds, for a predicate that is false and then
    /// true along the collection (binary search).
    func partitioningIndex(where predicate: (Element) -> Bool) -> Index {
        var low = startIndex
        var length = count
        while length > 0 {
            let half = length / 2
            let middle = index(low, offsetBy: half)
            if predicate(self[middle]) {
                length = half
            } else {
                low = index(after: middle)
                length -= half + 1
            }
        }
        return low
    }
}

extension Engine {
    /// No user has this number: lists rendered for it are empty.
    static let nobody: Int64 = 0
}

/// Where a page of a list answered in pages ended (a `next`, given back as `after`): a
/// fixed number of non-negative numbers, written "a.b…". Opaque to clients.
struct PageCursor: CustomStringConvertible {
    let fields: [Int64]

    init(_ fields: Int64...) {
        self.fields = fields
    }

    /// The cursor `text` spells, when it has `count` fields of decimal digits.
    init?(_ text: String, count: Int) {
        let parts = text.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == count else { return nil }
        var fields: [Int64] = []
        for part in parts {
            guard !part.isEmpty, part.allSatisfy({ $0.isASCII && $0.isNumber }), let field = Int64(part) else { return nil }
            fields.append(field)
        }
        self.fields = fields
    }

    var description: String { fields.map(String.init).joined(separator: ".") }
}

/// A change feed token (`since`): the position read up to in each slot (`FeedSlots`),
/// counted from the slot's base, written "p0.p1…" without the slots after the last that
/// has one: with one slot, the plain number the feed always gave.
struct FeedToken: CustomStringConvertible {
    private(set) var positions: [Int64]

    init(_ positions: [Int64]) {
        self.positions = positions
    }

    init?(_ text: String) {
        let parts = text.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count <= FeedSlots.count else { return nil }
        var positions: [Int64] = []
        for part in parts {
            guard !part.isEmpty, part.allSatisfy({ $0.isASCII && $0.isNumber }), let position = Int64(part),
                position < FeedSlots.base(of: 1)
            else { return nil }
            positions.append(position)
        }
        self.positions = positions
    }

    /// The slot's position (0 for a slot the token does not name).
    subscript(slot: Int) -> Int64 {
        get { slot < positions.count ? positions[slot] : 0 }
        set {
            if slot >= positions.count { positions += [Int64](repeating: 0, count: slot - positions.count + 1) }
            positions[slot] = newValue
        }
    }

    var description: String {
        var shown = positions
        while shown.count > 1 && shown.last == 0 { shown.removeLast() }
        return shown.isEmpty ? "0" : shown.map(String.init).joined(separator: ".")
    }
}
