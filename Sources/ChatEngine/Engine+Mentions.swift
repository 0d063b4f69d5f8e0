import ChatProtocol
import Storage

extension Engine {
    /// The messages that mention the user, across the chats they are in now, newest first,
    /// a page at a time: a page holds those of the next `limit` mentions still to be shown
    /// (not recalled, not deleted by them), so it may hold fewer; `next` is where it ended.
    func mentions(_ request: ChatMessageMentionsGet, user: Int64) throws -> Event {
        var after: MentionPosition?
        if let text = request.after {
            guard let cursor = PageCursor(text, count: 3) else {
                throw ProtocolError.invalid("'after' is not the 'next' of a page of your mentions")
            }
            after = MentionPosition(timestamp: cursor.fields[0], chat: cursor.fields[1], id: cursor.fields[2])
        }
        let limit = Int(request.limit ?? 50)
        let positions: [MentionPosition]
        do {
            positions = try store.mentions(of: user, after: after, limit: limit)
        } catch {
            throw unreadable(error)
        }
        var messages: [ChatMessage] = []
        for position in positions {
            guard let chat = directory.chats[position.chat], let member = chat.activeMember(user), member.received(position.id),
                let message = try loadMessage(position.id, in: chat), message.isSeen(by: user), !message.isGapForOthers,
                message.mentions(user), message.privateStates[user]?.isDeleted != true
            else { continue }
            messages.append(renderMessage(message, in: chat, for: user))
        }
        let next = positions.count == limit ? positions.last.map { PageCursor($0.timestamp, $0.chat, $0.id).description } : nil
        return .chatMessageMentions(ChatMessageMentionsEvent(cookie: request.cookie, messages: messages, next: next))
    }
}
