/// What a process deciding on a store learns of the other processes deciding on it
/// (docs/several-deciding-nodes.md, step 4): what their commits changed, who is connected
/// to them, and what they said that is never stored (typing, chat events). The engine
/// reads it before each batch (`ChatStore.othersActivity`), makes its memory what the
/// store has, and renders the changes for its own sessions.

/// One commit of another deciding process: what it changed, as a process that follows it
/// needs to know to read it and render it.
public struct FollowedCommit: Sendable, Equatable {
    /// The committing process's feed slot (`FeedSlots`).
    public var slot: Int
    /// The slot's feed positions the commit's changes took: those after `feedAfter`, up to
    /// `feedUpTo` (equal when it changed no message).
    public var feedAfter: Int64
    public var feedUpTo: Int64
    /// The chats it changed (their rows, members, messages or the messages' states),
    /// ascending.
    public var chats: [Int64]
    /// The users it made or whose endpoints or settings it changed, ascending.
    public var users: [Int64]
    /// Messages it wrote other than by moving a mark over them (their columns, a user's
    /// private state, their references' counts), by chat: a follower that does not hold
    /// one cannot tell what changed in it.
    public var rewritten: [Int64: [Int64]]
    /// The messages it added, by chat.
    public var inserted: [Int64: [Int64]]
    /// The users whose membership it changed (joined, left, removed, made admin or not),
    /// by chat.
    public var members: [Int64: [Int64]]

    public init(
        slot: Int, feedAfter: Int64, feedUpTo: Int64, chats: [Int64], users: [Int64] = [], rewritten: [Int64: [Int64]] = [:],
        inserted: [Int64: [Int64]] = [:], members: [Int64: [Int64]] = [:]
    ) {
        self.slot = slot
        self.feedAfter = feedAfter
        self.feedUpTo = feedUpTo
        self.chats = chats
        self.users = users
        self.rewritten = rewritten
        self.inserted = inserted
        self.members = members
    }

    /// What a store that several processes decide on logs for `batch`, committed by the
    /// process in its feed slot (`StoreBatch.feedSlot`) whose feed position was
    /// `feedAfter` before it (its counters hold where it is after).
    public init(of batch: StoreBatch, feedAfter: Int64) {
        var users = Set(batch.directory.newUsers.map(\.number))
        users.formUnion(batch.directory.endpoints.map(\.user))
        users.formUnion(batch.directory.endpointUsers)
        users.formUnion(batch.directory.userSettings.map(\.user))
        var rewritten: [Int64: Set<Int64>] = [:]
        for update in batch.messageUpdates { rewritten[update.row.chat, default: []].insert(update.row.id) }
        for state in batch.privateStates { rewritten[state.chat, default: []].insert(state.id) }
        for count in batch.refCounts { rewritten[count.chat, default: []].insert(count.target) }
        var inserted: [Int64: [Int64]] = [:]
        for message in batch.newMessages { inserted[message.chat, default: []].append(message.id) }
        var members: [Int64: Set<Int64>] = [:]
        for member in batch.directory.members { members[member.chat, default: []].insert(member.user) }
        for update in batch.directory.memberUpdates where !update.columns.isDisjoint(with: [.isActive, .isAdmin, .joinedAt, .mutedUntil, .isBanned]) {
            members[update.row.chat, default: []].insert(update.row.user)
        }
        self.init(
            slot: batch.feedSlot, feedAfter: feedAfter, feedUpTo: batch.counters?.changeSeq ?? feedAfter,
            chats: batch.chatVersions.map(\.chat).sorted(), users: users.sorted(),
            rewritten: rewritten.mapValues { $0.sorted() }, inserted: inserted.mapValues { $0.sorted() },
            members: members.mapValues { $0.sorted() })
    }
}

/// Something another deciding process's session said that is never stored.
public enum TransientEvent: Sendable, Equatable {
    /// `user` is typing in `chat` (said again while they go on).
    case typing(user: Int64, chat: Int64)
    /// `chatEventSend` by `user`: its tag, and its data as compact JSON.
    case chatEvent(user: Int64, chat: Int64, tag: String, data: String?)
}

/// How far a follower has read the other processes' activity: opaque to the engine, kept
/// between reads (`ChatStore.othersActivity`).
public struct FollowCursor: Sendable, Equatable {
    /// Per slot, how far its commits were read (in the store's own measure).
    public var commits: [Int: Int64] = [:]
    /// Per slot, how far its transient events were read (in the store's own measure).
    public var transient: [Int: Int64] = [:]
    /// Per slot, the feed position its last commit read had got to.
    public var feed: [Int: Int64] = [:]

    public init() {}
}

/// What the other deciding processes did since a cursor.
public struct OthersActivity: Sendable {
    /// Their commits, each slot's in the order they were applied.
    public var commits: [FollowedCommit] = []
    /// The users those commits made or whose endpoints or settings they changed, as stored now, with
    /// every endpoint each of them has now.
    public var users: [UserRecord] = []
    public var endpoints: [EndpointRow] = []
    /// The settings those users have now (of those who have any).
    public var userSettings: [UserSettingsRow] = []
    /// The chats those commits changed, with their memberships and versions, as the store
    /// has them with exactly those commits (read with them, in one snapshot).
    public var chats = StoreDirectory()
    /// Who has a session on another deciding process now.
    public var online: Set<Int64> = []
    /// What their sessions said that is never stored, in order.
    public var transient: [TransientEvent] = []
    /// Where the next read goes on from.
    public var cursor: FollowCursor

    public init(cursor: FollowCursor) {
        self.cursor = cursor
    }

    public var isEmpty: Bool { commits.isEmpty && transient.isEmpty }
}
