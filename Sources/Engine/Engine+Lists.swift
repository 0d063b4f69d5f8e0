import Protocol
import Store

/// The list requests (PROTOCOL.md §4) and message matching (§8).
extension Engine {
    /// Results of a match without a window, and the most a window side may ask for.
    static let maxMatches = 1000

    // MARK: requestListAll

    func listAll(_ request: RequestListAll, user: Int64, session: EngineSession, batch: Batch) throws {
        let cookie = request.cookie
        let header = Event.listAll(ListAll(type: request.type, cookie: cookie))
        switch request.type {
        case .global:
            answer(header, globalElements(of: session), to: session, batch: batch) { .global(ListChunkGlobal(cookie: cookie, elements: $0, last: $1)) }
        case .user:
            answer(header, visibleUsers(of: user).map(userElement), to: session, batch: batch) { .user(ListChunkUser(cookie: cookie, elements: $0, last: $1)) }
        case .chat:
            answer(header, chatElements(of: user), to: session, batch: batch) { .chat(ListChunkChat(cookie: cookie, elements: $0, last: $1)) }
        case .chatParticipant:
            answer(header, participantElements(of: user), to: session, batch: batch) {
                .chatParticipant(ListChunkChatParticipant(cookie: cookie, elements: $0, last: $1))
            }
        case .typing:
            answer(header, typingSeen(by: user), to: session, batch: batch) { .typing(ListChunkTyping(cookie: cookie, elements: $0, last: $1)) }
        case .chatMessage:
            throw ProtocolError.invalid("'type' chatMessage cannot be listed whole: use requestListMatching or requestListChanges")
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
        (chatsOfUser[user] ?? []).sorted().compactMap { chats[$0] }
    }

    func typingSeen(by user: Int64) -> [Typing] {
        typing.keys
            .filter { $0.user != user && chats[$0.chat]?.activeMember(user) != nil }
            .sorted { ($0.chat, $0.user) < ($1.chat, $1.user) }
            .map { Typing(userUri: uri($0.user), chatId: String($0.chat)) }
    }

    // MARK: requestListElements

    func listElements(_ request: RequestListElements, user: Int64, session: EngineSession, batch: Batch) {
        switch request {
        case .global(let request):
            let all = globalElements(of: session)
            let (found, missing) = lookUp(request.elements) { key in all.first { $0.name == key.name } }
            answer(.listElements(.global(ListElementsGlobal(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) { .global(ListChunkGlobal(cookie: request.cookie, elements: $0, last: $1)) }
        case .user(let request):
            // Any user, by uri (a client resolving a sender it has not seen yet) or regId.
            let (found, missing) = lookUp(request.elements) { key -> User? in
                guard user != Engine.nobody else { return nil }
                if let uri = key.uri { return self.user(fromURI: uri, viewer: user).flatMap { users[$0] }.map(userElement) }
                return key.regId.flatMap { users.find(regId: $0) }.map(userElement)
            }
            answer(.listElements(.user(ListElementsUser(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) { .user(ListChunkUser(cookie: request.cookie, elements: $0, last: $1)) }
        case .chat(let request):
            let (found, missing) = lookUp(request.elements) { key in
                (try? chat(key.chatId, of: user)).map { renderChat($0.0, for: $0.1) }
            }
            answer(.listElements(.chat(ListElementsChat(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) { .chat(ListChunkChat(cookie: request.cookie, elements: $0, last: $1)) }
        case .chatParticipant(let request):
            let (found, missing) = lookUp(request.elements) { key -> ChatParticipant? in
                guard let (chat, _) = try? chat(key.chatId, of: user), let number = self.user(fromURI: key.userUri, viewer: user),
                      number != user, let member = chat.activeMember(number) else { return nil }
                return renderParticipant(chat, member)
            }
            answer(.listElements(.chatParticipant(ListElementsChatParticipant(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) { .chatParticipant(ListChunkChatParticipant(cookie: request.cookie, elements: $0, last: $1)) }
        case .chatMessage(let request):
            let (found, missing) = lookUp(request.elements) { key -> ChatMessage? in
                guard let (chat, member) = try? chat(key.chatId, of: user),
                      let message = try? message(key.messageId, in: chat, seenBy: member) else { return nil }
                return renderMessage(message, in: chat, for: user)
            }
            answer(.listElements(.chatMessage(ListElementsChatMessage(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) { .chatMessage(ListChunkChatMessage(cookie: request.cookie, elements: $0, last: $1)) }
        case .typing(let request):
            let current = typingSeen(by: user)
            let (found, missing) = lookUp(request.elements) { key in
                current.first { $0.userUri == key.userUri && $0.chatId == key.chatId }
            }
            answer(.listElements(.typing(ListElementsTyping(cookie: request.cookie, missing: missing))), found, to: session, batch: batch) { .typing(ListChunkTyping(cookie: request.cookie, elements: $0, last: $1)) }
        }
    }

    /// A list answer (PROTOCOL.md §4): its header, then `listChunk`s of at most
    /// `chunkSize` elements (at least one, possibly empty), the final one `last: true`.
    /// Clients apply a chunk to the list its header opened, so the header comes first.
    func answer<Element>(_ header: Event, _ elements: [Element], to session: EngineSession, batch: Batch,
                         _ chunk: ([Element], Bool?) -> ListChunk) {
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
            let (header, found) = try matchMessages(request, user: user)
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

    /// The header of the answer and the matching messages, in order.
    func matchMessages(_ request: RequestListMatchingChatMessage, user: Int64) throws -> (ListMatchingChatMessage, [ChatMessage]) {
        let criteria = request.criteria
        let (chat, member) = try chat(criteria.chatId, of: user)
        let narrows = criteria.tag != nil || criteria.ref != nil || criteria.notRefTag != nil || criteria.senderUri != nil
        guard narrows || request.window != nil else {
            throw ProtocolError.invalid("'criteria' needs at least one of 'tag', 'ref', 'notRefTag' and 'senderUri', or the request a 'window'")
        }
        let sender: Int64? = criteria.senderUri.map { self.user(fromURI: $0, viewer: user) ?? -1 }
        let candidates = Candidates(chat: chat, criteria: criteria, first: max(member.joinedAt, 1))
        func matches(_ id: Int64) -> Bool {
            let message = chat.messages[Int(id - 1)]
            if let tag = criteria.tag, message.tag != tag { return false }
            if let notRefTag = criteria.notRefTag, message.refs.contains(where: { $0.tag == notRefTag }) { return false }
            if let sender, message.sender != sender { return false }
            return true
        }

        var ids: [Int64] = []
        var hasMoreBefore: Bool?
        var hasMoreAfter: Bool?
        if let window = request.window {
            // The anchor is the ids [first, end): the message `messageId`, or the first
            // message of second `timestamp`; when no message has that second, the anchor is
            // empty, the gap between the older and the newer messages. `before` is older
            // than the anchor, `after` newer; the anchor is included when `inclusive` and
            // it matches.
            let first: Int64
            let end: Int64
            switch (window.messageId, window.timestamp) {
            case (let id?, nil):
                first = id
                end = id + 1
            case (nil, let timestamp?):
                // Timestamps never decrease along the ids.
                let index = chat.messages.partitioningIndex { $0.timestamp >= timestamp }
                first = Int64(index) + 1
                end = index < chat.messages.count && chat.messages[index].timestamp == timestamp ? first + 1 : first
            default:
                throw ProtocolError.invalid("'window' needs exactly one of 'messageId' and 'timestamp'")
            }
            let position = candidates.firstPosition(atLeast: first)
            let afterPosition = candidates.firstPosition(atLeast: end)
            var anchored: [Int64] = []
            for index in position..<max(position, afterPosition) where matches(candidates[index]) {
                anchored.append(candidates[index])
            }
            var before: [Int64] = []
            var index = position - 1
            let wantBefore = Int(window.before ?? 0)
            while index >= 0 {
                let id = candidates[index]
                if matches(id) {
                    if before.count == wantBefore {
                        hasMoreBefore = true
                        break
                    }
                    before.append(id)
                }
                index -= 1
            }
            var after: [Int64] = []
            index = afterPosition
            let wantAfter = Int(window.after ?? 0)
            while index < candidates.count {
                let id = candidates[index]
                if matches(id) {
                    if after.count == wantAfter {
                        hasMoreAfter = true
                        break
                    }
                    after.append(id)
                }
                index += 1
            }
            ids = before.reversed()
            if window.inclusive ?? true { ids += anchored }
            ids += after
            if window.reverse ?? false { ids.reverse() }
            hasMoreBefore = hasMoreBefore ?? false
            hasMoreAfter = hasMoreAfter ?? false
        } else {
            var index = 0
            while index < candidates.count {
                let id = candidates[index]
                if matches(id) {
                    if ids.count == Engine.maxMatches {
                        hasMoreAfter = true
                        break
                    }
                    ids.append(id)
                }
                index += 1
            }
        }
        let result = ids.map { renderMessage(chat.messages[Int($0 - 1)], in: chat, for: user) }
        var refTargets: [ChatMessage]?
        if request.withRefTargets ?? false {
            var seen = Set<Int64>()
            var targets: [ChatMessage] = []
            for id in ids {
                for ref in chat.messages[Int(id - 1)].refs where ref.messageId >= member.joinedAt && seen.insert(ref.messageId).inserted {
                    if let target = chat.message(ref.messageId) { targets.append(renderMessage(target, in: chat, for: user)) }
                }
            }
            refTargets = targets
        }
        return (ListMatchingChatMessage(cookie: request.cookie, hasMoreBefore: hasMoreBefore, hasMoreAfter: hasMoreAfter, refTargets: refTargets),
                result)
    }

    // MARK: requestListChanges

    func listChanges(_ request: RequestListChanges, user: Int64) throws -> Event {
        let scope: [ChatRecord]
        if let chatId = request.chatId {
            scope = [try chat(chatId, of: user).0]
        } else {
            scope = chatsOf(user)
        }
        guard let token = request.since else {
            return .listChanges(ListChanges(cookie: request.cookie, changed: [], token: String(changeSeq), hasMore: false))
        }
        guard let since = Int64(token), since >= 0, since <= changeSeq else {
            throw ProtocolError.invalid("'since' \(token) is not a token this service gave out")
        }
        let limit = Int(request.limit ?? 100)
        var found: [(seq: Int64, chat: ChatRecord, message: MessageRecord)] = []
        for chat in scope {
            guard let member = chat.activeMember(user) else { continue }
            var index = chat.changeLog.partitioningIndex { $0.seq > since }
            var taken = 0
            while index < chat.changeLog.count && taken <= limit {
                let entry = chat.changeLog[index]
                index += 1
                guard let message = chat.message(entry.id), message.changeSeq == entry.seq, entry.id >= member.joinedAt else { continue }
                found.append((entry.seq, chat, message))
                taken += 1
            }
        }
        found.sort { $0.seq < $1.seq }
        let hasMore = found.count > limit
        if hasMore { found.removeLast(found.count - limit) }
        let changed = found.map { renderMessage($0.message, in: $0.chat, for: user) }
        let next = hasMore ? found.last!.seq : changeSeq
        return .listChanges(ListChanges(cookie: request.cookie, changed: changed, token: String(next), hasMore: hasMore))
    }
}

/// The message ids a match starts from, ascending: a `ref` criterion's sources, a `tag`'s
/// messages, or the member's whole history: each an index, never a scan of the chat.
struct Candidates {
    private let list: ArraySlice<Int64>?
    private let first: Int64
    let count: Int

    init(chat: ChatRecord, criteria: ChatMessageCriteria, first: Int64) {
        self.first = first
        let last = chat.lastMessage
        var ids: [Int64]?
        if let ref = criteria.ref {
            ids = chat.message(ref.messageId)?.referencedBy[ref.tag] ?? []
        } else if let tag = criteria.tag {
            ids = chat.idsByTag[tag] ?? []
        }
        if let ids {
            let start = ids.partitioningIndex { $0 >= first }
            list = ids[start...]
            count = ids.count - start
        } else {
            list = nil
            count = first <= last ? Int(last - first + 1) : 0
        }
    }

    subscript(position: Int) -> Int64 {
        if let list { return list[list.startIndex + position] }
        return first + Int64(position)
    }

    /// The first position whose id is at least `id`.
    func firstPosition(atLeast id: Int64) -> Int {
        if let list { return list.partitioningIndex { $0 >= id } - list.startIndex }
        return Int(min(max(id - first, 0), Int64(count)))
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
