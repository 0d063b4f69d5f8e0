import ChatProtocol
import Storage

/// What the notifier sends for a notification it took from the store (`Engine.compose`).
public enum NotificationOutcome: Sendable {
    /// To be sent, as this.
    case send(MessageNotification)
    /// Not to be sent: why (the recipient read the message, it was recalled, they left the
    /// chat).
    case drop(String)
    /// Not known here yet: another node committed it and this one has not followed that
    /// commit (its chat, or the recipient's membership). To be tried again a little later.
    case later(String)
}

extension Engine {
    /// Turns notifications taken from the store into what the application's server is
    /// sent, from what the engine knows now: a recipient who read the message since, left
    /// the chat, or a message recalled since, is not notified. `previewLength`: at most
    /// this many characters of the content (0: none).
    public func compose(_ rows: [NotificationRow], previewLength: Int) async -> [NotificationOutcome] {
        await withCheckedContinuation { continuation in
            life.inbox.put(.composeNotifications(rows, previewLength: previewLength, reply: { continuation.resume(returning: $0) }))
        }
    }

    func composeNow(_ rows: [NotificationRow], previewLength: Int) -> [NotificationOutcome] {
        rows.map { row in
            do {
                return try outcome(of: row.key, previewLength: previewLength)
            } catch {
                logger.warning("a notification's message could not be read", metadata: ["error": "\(error)"])
                return .drop("its message could not be read: \(error)")
            }
        }
    }

    private func outcome(of key: NotificationKey, previewLength: Int) throws -> NotificationOutcome {
        guard let chat = directory.chats[key.chat], let member = chat.members[key.user] else {
            return .later("the chat or the recipient's membership is not known here yet")
        }
        guard member.isActive else { return .drop("the recipient left the chat") }
        guard member.readUpTo < key.id else { return .drop("the recipient read the message") }
        guard key.id >= member.joinedAt else { return .drop("the recipient joined after the message") }
        guard key.id <= chat.lastMessage, let message = try loadMessage(key.id, in: chat), message.isSeen(by: key.user) else {
            return .later("the message is not known here yet")
        }
        guard !message.isRecalled else { return .drop("the message was recalled") }
        guard let recipient = directory.users[key.user], let sender = directory.users[message.sender] else {
            return .drop("the user is not known")
        }
        // The devices that can be woken: those that gave a push token.
        let endpoints = (directory.endpointsOfUser[key.user] ?? []).compactMap { directory.endpoints[$0] }.compactMap { endpoint in
            endpoint.pushToken.map {
                NotifiedEndpoint(endpointId: endpoint.id, description: endpoint.description, nickname: endpoint.nickname, pushToken: $0)
            }
        }
        let preview = previewLength > 0 ? message.content.map { String($0.prefix(previewLength)) } : nil
        return .send(
            MessageNotification(
                id: "\(chat.chatId):\(message.id):\(recipient.regId)", chatId: chat.chatId, messageId: message.id, senderUri: uri(message.sender),
                senderUserId: sender.userId, tag: message.tag, preview: preview, timestamp: message.timestamp, recipientUri: uri(key.user),
                recipientUserId: recipient.userId, recipientRegId: recipient.regId, numUnread: member.numUnread, endpoints: endpoints))
    }
}
