import ChatProtocol
import Dispatch
import Foundation
import Storage

/// `search` (§9): message text from the store's index, chat subjects from
/// memory, and only what the user may see.
///
/// With an index, the engine decides what the user may search (their chats, from when
/// they joined), makes the store and the index see everything decided before, and hands
/// the look-up to a thread of its own (`searchQueue`): a search of a large history takes
/// milliseconds, during which the engine goes on deciding for everyone else. The
/// session's later requests wait in the engine, in order, until its answer is in
/// (`awaitingOutside`); the hits come back as work (`searchFound`) and are answered from
/// the engine thread like any other request.
/// What a search found: the hits, and whether it stopped at its budget first.
struct SearchFound: Sendable {
    var hits: [SearchHit]
    var incomplete: Bool
}

extension Engine {
    /// What a search needs off the engine thread: plain values only.
    struct SearchScope: Sendable {
        var text: String
        var limit: Int
        var user: Int64
        /// What it may check (`SearchBudget`).
        var maxCandidates: Int
        var maxBytes: Int
        /// The chats searched, each with the first message the user may see.
        var firstVisible: [Int64: Int64]
    }

    func search(_ request: Search, user: Int64, session: EngineSession, line: Int, batch: Batch) throws {
        let scope: [(ChatRecord, MemberRecord)]
        if let chatId = request.chatId {
            scope = [try chat(chatId, of: user)]
        } else {
            scope = chatsOf(user).map { ($0, $0.members[user]!) }
        }
        let text = request.text
        let limit = Int(request.suggestedMaxResults ?? 100)
        try quotas.beginSearch(by: user)
        var ended = false
        defer { if !ended { quotas.endSearch(by: user) } }
        let chatIds = request.chatId != nil ? [] : scope.filter { $0.0.subject.range(of: text, options: [.caseInsensitive]) != nil }.map(\.0.chatId)
        guard let searchIndex = searches.index else {
            let messages = try scan(scope, for: text, limit: limit, user: user)
            batch.emit(
                .searchResult(
                    SearchResult(
                        cookie: request.cookie, chatIds: chatIds, messages: messages,
                        returnIdentifier: request.returnIdentifier)), to: session)
            return
        }
        // The index must see everything decided before now (this batch's posts and
        // recalls included), and everything it lacked at start-up.
        try commitSoFar(batch)
        let searchScope = SearchScope(
            text: text, limit: limit, user: user,
            maxCandidates: quotas.limits.searchCandidates, maxBytes: quotas.limits.searchBytes,
            firstVisible: Dictionary(uniqueKeysWithValues: scope.map { ($0.0.number, max($0.1.joinedAt, 1)) }))
        batch.answeredLater()
        // Ended when its hits come back (`searchFound`).
        ended = true
        awaitOutside(session)
        beginOutsideWork()
        let store = self.store
        let refill = searches.refill
        searches.queue.async { [self] in
            let found: Result<SearchFound, ProtocolError>
            // An index being rebuilt (after an upgrade) can take minutes: a shutdown does
            // not wait for it.
            var rebuilt: Bool
            repeat { rebuilt = refill.wait(timeout: .now() + .milliseconds(100)) == .success } while !rebuilt && !isShuttingDown
            do {
                guard rebuilt else {
                    throw ProtocolError(.internal, "the service is shutting down: the search index was still being rebuilt")
                }
                found = .success(try Engine.look(up: searchScope, in: searchIndex, store: store))
            } catch let error as ProtocolError {
                found = .failure(error)
            } catch {
                found = .failure(ProtocolError(.internal, "the search index failed: \(error)"))
            }
            put(.searchFound(request, line: line, chatIds: chatIds, user: user, hits: found, session: session))
            endOutsideWork()
        }
    }

    /// The index's hits the user may see, newest first, up to the scope's limit, or as
    /// many as were found when the search's budget ran out (off the engine thread: only
    /// the index and the store are read).
    private static func look(up scope: SearchScope, in index: MessageSearchIndex, store: ChatStore) throws -> SearchFound {
        var found: [SearchHit] = []
        var below: Int64?
        let chats = scope.firstVisible.keys.sorted()
        let budget = SearchBudget(candidates: scope.maxCandidates, bytes: scope.maxBytes)
        while found.count < scope.limit && !budget.isExhausted {
            let page = max(scope.limit * 2, 64)
            let hits = try index.searchMessages(containing: scope.text, chats: chats, belowRow: below, limit: page, budget: budget)
            // The index is derived data and may be stale (it can lose its tail in a crash,
            // and a node that writes again after another node kept the index it had), so
            // every hit is checked against the store, all at once: recalled since, or
            // deleted by the user for themselves, it is left out.
            let candidates = hits.filter { hit in scope.firstVisible[hit.chat].map { hit.id >= $0 } ?? false }
            let searchable: Set<SearchHit>
            do {
                searchable = try store.searchable(by: scope.user, among: candidates)
            } catch {
                throw ProtocolError(.internal, "the store could not be read: \(error)")
            }
            for hit in candidates where searchable.contains(hit) {
                found.append(hit)
                if found.count == scope.limit { break }
            }
            guard hits.count == page, let last = hits.last else { break }
            below = last.row
        }
        return SearchFound(hits: found, incomplete: budget.isExhausted)
    }

    /// The answer to a search whose hits came back from `searchQueue`.
    func searchFound(
        _ request: Search, line: Int, chatIds: [String], user: Int64, hits: Result<SearchFound, ProtocolError>,
        session: EngineSession, batch: Batch
    ) {
        batch.begin(.request(name: Search.name, cookie: request.cookie, line: line), session: session)
        switch hits {
        case .failure(let error):
            batch.emit(error.requestFailed(request: Search.name, cookie: request.cookie, line: line), to: session)
        case .success(let found):
            // What changed while the index was read: a message recalled or deleted for
            // the user since is left out when its record says so.
            let messages = found.hits.compactMap { hit -> MessageKey? in
                guard let chat = directory.chats[hit.chat] else { return nil }
                if let cached = cache.get(chat: hit.chat, id: hit.id), !isVisible(cached, to: user) { return nil }
                return MessageKey(chatId: chat.chatId, messageId: hit.id)
            }
            batch.emit(
                .searchResult(
                    SearchResult(
                        cookie: request.cookie, chatIds: chatIds, messages: messages,
                        returnIdentifier: request.returnIdentifier, incomplete: found.incomplete ? true : nil)), to: session)
        }
    }

    private func isVisible(_ message: MessageRecord, to user: Int64) -> Bool {
        !message.isRecalled && message.searchRow > 0 && message.privateStates[user]?.isDeleted != true
    }

    /// Without an index (tests), the visible history is scanned, newest first.
    private func scan(_ scope: [(ChatRecord, MemberRecord)], for text: String, limit: Int, user: Int64) throws -> [MessageKey] {
        var found: [(row: Int64, chat: ChatRecord, id: Int64)] = []
        for (chat, member) in scope {
            var taken = 0
            var high = chat.lastMessage
            let low = max(member.joinedAt, 1)
            while high >= low && taken < limit {
                let page = try loadMessages(in: chat, max(low, high - 499)...high)
                for message in page.reversed() where taken < limit && isVisible(message, to: user) {
                    if let content = message.content, content.range(of: text, options: [.caseInsensitive]) != nil {
                        found.append((message.searchRow, chat, message.id))
                        taken += 1
                    }
                }
                high -= 500
            }
        }
        found.sort { $0.row > $1.row }
        if found.count > limit { found.removeLast(found.count - limit) }
        return found.map { MessageKey(chatId: $0.chat.chatId, messageId: $0.id) }
    }
}
