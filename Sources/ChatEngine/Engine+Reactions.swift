import ChatProtocol
import Glibc
import Storage

/// A reaction one user gave to a message, and when (which orders a message's reactions
/// by first appearance, and its reactors in pages).
struct GivenReaction {
    var text: String
    /// Microseconds since 1970, after every other reaction to the message: the real time,
    /// so that the order is the same whichever deciding node took each reaction.
    var stamp: Int64

    /// A user's reactions as the store keeps them: one line per reaction, its stamp, a
    /// space and the reaction (which holds no control character).
    static func stored(_ reactions: [GivenReaction]) -> String? {
        reactions.isEmpty ? nil : reactions.map { "\($0.stamp) \($0.text)" }.joined(separator: "\n")
    }

    static func read(_ text: String?) -> [GivenReaction] {
        guard let text else { return [] }
        return text.split(separator: "\n").compactMap { line in
            guard let space = line.firstIndex(of: " "), let stamp = Int64(line[..<space]) else { return nil }
            return GivenReaction(text: String(line[line.index(after: space)...]), stamp: stamp)
        }
    }
}

/// One reaction to a message: how many users gave it, and when it first appeared.
struct ReactionTally {
    var text: String
    var count: Int64
    var first: Int64
}

extension MessageRecord {
    /// Its reactions, per reaction, in order of first appearance: counted once from every
    /// user's private state and kept until a reaction changes (`reactionsChanged`), so that
    /// rendering it for each of a big chat's viewers does not count them again.
    var reactionTallies: [ReactionTally] {
        if let tallies = countedReactions { return tallies }
        let tallies = tallyReactions()
        countedReactions = tallies
        return tallies
    }

    func reactionsChanged() {
        countedReactions = nil
    }

    private func tallyReactions() -> [ReactionTally] {
        var tallies: [ExactText: ReactionTally] = [:]
        for state in privateStates.values {
            for given in state.reactions {
                let key = ExactText(given.text)
                if var tally = tallies[key] {
                    tally.count += 1
                    tally.first = min(tally.first, given.stamp)
                    tallies[key] = tally
                } else {
                    tallies[key] = ReactionTally(text: given.text, count: 1, first: given.stamp)
                }
            }
        }
        return tallies.values.sorted { $0.first < $1.first || ($0.first == $1.first && $0.text.utf8.lexicographicallyPrecedes($1.text.utf8)) }
    }
}

extension Engine {
    /// How many different reactions a message may have: each viewer's element carries
    /// them all.
    static let maxReactionsPerMessage = 32

    func react(_ request: ChatMessageReact, user: Int64, batch: Batch) throws {
        if request.reaction.unicodeScalars.contains(where: { $0.value < 0x20 || $0.value == 0x7F }) {
            throw ProtocolError.invalid("'reaction' holds a control character")
        }
        let (chat, member) = try chat(request.chatId, of: user)
        try requireNotMuted(member, in: chat, doing: "react")
        let message = try message(request.messageId, in: chat, seenBy: member)
        try requireStanding(message)
        if message.privateStates[user]?.isDeleted == true {
            throw ProtocolError.notPermitted("message \(message.id) was deleted by you")
        }
        let mine = message.privateStates[user]?.reactions ?? []
        let given = mine.firstIndex { sameBytes($0.text, request.reaction) }
        if request.remove == true {
            guard given != nil else { return }
        } else {
            guard given == nil else { return }
            let tallies = message.reactionTallies
            if tallies.count >= Engine.maxReactionsPerMessage && !tallies.contains(where: { sameBytes($0.text, request.reaction) }) {
                throw ProtocolError(
                    .tooLarge, "message \(message.id) has \(tallies.count) different reactions, the limit (\(Engine.maxReactionsPerMessage))")
            }
        }
        let changes = PendingChanges()
        willChange(message, in: chat, changes)
        var state = message.privateStates[user] ?? PrivateState()
        if let given {
            state.reactions.remove(at: given)
        } else {
            var now = timespec()
            clock_gettime(CLOCK_REALTIME, &now)
            let latest = message.privateStates.values.lazy.flatMap(\.reactions).map(\.stamp).max() ?? 0
            state.reactions.append(GivenReaction(text: request.reaction, stamp: max(Int64(now.tv_sec) * 1_000_000 + Int64(now.tv_nsec) / 1000, latest + 1)))
        }
        message.privateStates[user] = state
        message.reactionsChanged()
        batch.changedPrivately(message, for: user)
        publish(changes, batch: batch)
    }

    /// Who reacted to a message with what, oldest first, a page at a time. A page ends
    /// after a reaction: `next` names it by its stamp and its user.
    func reactions(_ request: ChatMessageReactionsGet, user: Int64) throws -> Event {
        let (chat, member) = try chat(request.chatId, of: user)
        let message = try message(request.messageId, in: chat, seenBy: member)
        var all: [(stamp: Int64, user: Int64, text: String)] = []
        if !message.isRecalled && !(message.isGapForOthers && message.sender != user) {
            for (reactor, state) in message.privateStates {
                for given in state.reactions where request.reaction.map({ sameBytes($0, given.text) }) ?? true {
                    all.append((given.stamp, reactor, given.text))
                }
            }
        }
        all.sort { ($0.stamp, $0.user) < ($1.stamp, $1.user) }
        var start = all.startIndex
        if let after = request.after {
            guard let cursor = PageCursor(after, count: 2) else {
                throw ProtocolError.invalid("'after' is not the 'next' of a page of this message's reactions")
            }
            start = all.firstIndex { ($0.stamp, $0.user) > (cursor.fields[0], cursor.fields[1]) } ?? all.endIndex
        }
        let page = all[start...].prefix(Int(request.limit ?? 100))
        let next = page.count < all.count - start ? page.last.map { PageCursor($0.stamp, $0.user).description } : nil
        return .chatMessageReactions(
            ChatMessageReactionsEvent(
                cookie: request.cookie, chatId: chat.chatId, messageId: message.id,
                reactions: page.map { Reactor(userUri: uri($0.user), reaction: $0.text) }, next: next))
    }
}
