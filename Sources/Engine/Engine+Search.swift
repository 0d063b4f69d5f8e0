import Foundation
import Protocol
import Store

/// `search` (PROTOCOL.md §9): message text from the store's index, chat subjects from
/// memory, and only what the user may see.
extension Engine {
    /// Queries shorter than this many characters cannot use the trigram index.
    static let indexedQueryLength = 3

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
        func visible(_ chat: ChatRecord, _ member: MemberRecord, _ id: Int64) -> MessageRecord? {
            guard id >= member.joinedAt, let message = chat.message(id), !message.isRecalled, message.searchRow > 0,
                  message.privateStates[user]?.isDeleted != true else { return nil }
            return message
        }
        if text.count >= Engine.indexedQueryLength, let searchIndex {
            // The index must see everything this batch posted or recalled before now.
            try commitSoFar(batch)
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
                for hit in hits {
                    guard let (chat, member) = members[hit.chat], visible(chat, member, hit.id) != nil else { continue }
                    found.append((hit.row, chat, hit.id))
                    if found.count == limit { break }
                }
                guard hits.count == page, let last = hits.last else { break }
                below = last.row
            }
        } else {
            // One or two characters (an emoji, a CJK word): no trigram to look up, so the
            // visible history is scanned, newest first, chat by chat (also without an index).
            for (chat, member) in scope {
                var taken = 0
                var id = chat.lastMessage
                while id >= max(member.joinedAt, 1) && taken < limit {
                    if let message = visible(chat, member, id), let content = message.content,
                       content.range(of: text, options: [.caseInsensitive]) != nil {
                        found.append((message.searchRow, chat, id))
                        taken += 1
                    }
                    id -= 1
                }
            }
            found.sort { $0.row > $1.row }
            if found.count > limit { found.removeLast(found.count - limit) }
        }
        let messages = found.map { MessageKey(chatId: $0.chat.chatId, messageId: $0.id) }
        return .searchResult(SearchResult(cookie: request.cookie, chatIds: chatIds, messages: messages, returnIdentifier: request.returnIdentifier))
    }
}
