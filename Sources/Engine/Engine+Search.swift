import Foundation
import Protocol
import Store

/// `search` (PROTOCOL.md §9): message text from the store's index, chat subjects from
/// memory, and only what the user may see.
extension Engine {
    func search(_ request: Search, user: Int64, batch: Batch) throws -> Event {
        let scope: [(ChatRecord, MemberRecord)]
        if let chatId = request.chatId {
            scope = [try chat(chatId, of: user)]
        } else {
            scope = chatsOf(user).map { ($0, $0.members[user]!) }
        }
        let text = request.text
        let limit = Int(request.suggestedMaxResults ?? 100)
        var chatIds: [String] = []
        if request.chatId == nil {
            chatIds = scope.filter { $0.0.subject.range(of: text, options: [.caseInsensitive]) != nil }.map(\.0.chatId)
        }

        var found: [(row: Int64, chat: ChatRecord, id: Int64)] = []
        func visible(_ message: MessageRecord, to member: MemberRecord) -> Bool {
            message.id >= member.joinedAt && !message.isRecalled && message.searchRow > 0 && message.privateStates[user]?.isDeleted != true
        }
        if let searchIndex {
            // The index must see everything this batch posted or recalled before now, and
            // everything it lacked at start-up.
            try commitSoFar(batch)
            searchRefill.wait()
            let members = Dictionary(uniqueKeysWithValues: scope.map { ($0.0.number, $0) })
            var below: Int64?
            while found.count < limit {
                let page = max(limit * 2, 64)
                let hits: [SearchHit]
                do {
                    hits = try searchIndex.searchMessages(containing: text, chats: Array(members.keys).sorted(), belowRow: below, limit: page)
                } catch {
                    throw ProtocolError(.internal, "the search index failed: \(error)")
                }
                // The index has only what is searchable and not recalled; what the user
                // deleted for themselves is asked of the store, all at once.
                let candidates = hits.filter { hit in members[hit.chat].map { hit.id >= $0.1.joinedAt } ?? false }
                let deleted: Set<MessageAddress>
                do {
                    deleted = try store.privatelyDeleted(by: user, among: candidates.map { MessageAddress(chat: $0.chat, id: $0.id) })
                } catch {
                    throw unreadable(error)
                }
                for hit in candidates where !deleted.contains(MessageAddress(chat: hit.chat, id: hit.id)) {
                    let (chat, member) = members[hit.chat]!
                    if let cached = cache.get(chat: hit.chat, id: hit.id), !visible(cached, to: member) { continue }
                    found.append((hit.row, chat, hit.id))
                    if found.count == limit { break }
                }
                guard hits.count == page, let last = hits.last else { break }
                below = last.row
            }
        } else {
            // Without an index (tests), the visible history is scanned, newest first.
            for (chat, member) in scope {
                var taken = 0
                var high = chat.lastMessage
                let low = max(member.joinedAt, 1)
                while high >= low && taken < limit {
                    let page = try loadMessages(in: chat, max(low, high - 499)...high)
                    for message in page.reversed() where taken < limit && visible(message, to: member) {
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
        }
        let messages = found.map { MessageKey(chatId: $0.chat.chatId, messageId: $0.id) }
        return .searchResult(SearchResult(cookie: request.cookie, chatIds: chatIds, messages: messages, returnIdentifier: request.returnIdentifier))
    }
}
