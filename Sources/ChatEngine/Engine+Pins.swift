import ChatProtocol
import Logging
import Storage

/// A pinned message of a chat: who pinned it, and when the pin ends by itself (nil: it
/// stays until unpinned).
struct PinRecord: Equatable {
    var message: Int64
    var by: Int64
    var until: Int64?

    /// A chat's pins as the store keeps them: one line per pin, newest first, the message
    /// id, who pinned it and when it ends (0: never).
    static func stored(_ pins: [PinRecord]) -> String? {
        pins.isEmpty ? nil : pins.map { "\($0.message) \($0.by) \($0.until ?? 0)" }.joined(separator: "\n")
    }

    static func read(_ text: String?) -> [PinRecord] {
        guard let text else { return [] }
        return text.split(separator: "\n").compactMap { line in
            let fields = line.split(separator: " ").compactMap { Int64($0) }
            guard fields.count == 3 else { return nil }
            return PinRecord(message: fields[0], by: fields[1], until: fields[2] == 0 ? nil : fields[2])
        }
    }
}

/// One pin, by chat and message.
struct PinKey: Hashable {
    let chat: Int64
    let message: Int64
}

extension Engine {
    /// How many messages a chat may have pinned: every member's chat element lists them.
    static let maxPinsPerChat = 50

    func pin(_ request: ChatMessagePin, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        let message = try message(request.messageId, in: chat, seenBy: member)
        if chat.pinPolicy == .adminsOnly && !member.isAdmin {
            throw ProtocolError.notPermitted("only admins may pin in chat '\(chat.chatId)' (pinPolicy AdminsOnly)")
        }
        let pinned = chat.pins.firstIndex { $0.message == message.id }
        let changes = PendingChanges()
        if request.unpin == true {
            guard pinned != nil else { return }
            unpin(message, in: chat, changes)
            publish(changes, batch: batch)
            return
        }
        try requireStanding(message)
        if message.isSystem { throw ProtocolError.notPermitted("message \(message.id) is a system message (\(message.tag))") }
        if let until = request.until, until <= now() {
            throw ProtocolError.invalid("'until' \(until) is not in the future")
        }
        if pinned == nil && chat.pins.count >= Engine.maxPinsPerChat {
            throw ProtocolError(.tooLarge, "chat '\(chat.chatId)' has \(chat.pins.count) pinned messages, the limit (\(Engine.maxPinsPerChat))")
        }
        willChange(message, in: chat, changes)
        willChange(chat, changes)
        if let pinned { chat.pins.remove(at: pinned) }
        chat.pins.insert(PinRecord(message: message.id, by: user, until: request.until), at: 0)
        schedulePinEnds(of: chat)
        publish(changes, batch: batch)
    }

    /// Takes `message`'s pin away, if it has one (unpinned, recalled, or its time is up).
    func unpin(_ message: MessageRecord, in chat: ChatRecord, _ changes: PendingChanges) {
        guard let index = chat.pins.firstIndex(where: { $0.message == message.id }) else { return }
        willChange(message, in: chat, changes)
        willChange(chat, changes)
        chat.pins.remove(at: index)
    }

    /// Pins of `chat` that end by themselves are ended on time (`endPins`).
    func schedulePinEnds(of chat: ChatRecord) {
        var earliest: Double?
        for pin in chat.pins {
            guard let until = pin.until else { continue }
            let due = monotonicSeconds() + Double(until - now())
            timed.pinEnds[PinKey(chat: chat.number, message: pin.message)] = (due, until)
            earliest = min(earliest ?? due, due)
        }
        if let earliest { scheduleTick(due: earliest) }
    }

    /// Ends the pins whose time is up, for everyone.
    func endPins(batch: Batch) {
        let now = monotonicSeconds()
        for (key, end) in timed.pinEnds where end.due <= now {
            timed.pinEnds[key] = nil
            guard let chat = directory.chats[key.chat], let pin = chat.pins.first(where: { $0.message == key.message }), pin.until == end.until
            else { continue }
            do {
                guard let message = try loadMessage(key.message, in: chat) else { continue }
                let changes = PendingChanges()
                unpin(message, in: chat, changes)
                publish(changes, batch: batch)
            } catch {
                logger.warning("a pin did not end: the store could not be read", metadata: ["chat": "\(chat.chatId)", "error": "\(error)"])
                timed.pinEnds[key] = (now + 1, end.until)
            }
        }
        if !timed.pinEnds.isEmpty { scheduleTick() }
    }
}
