/// How this process shares its store with other processes that decide on it (PostgreSQL
/// nodes, docs/several-deciding-nodes.md): who numbers what, where its changes sit in the
/// change feed, and what the others did. Apart from `ChatStore`, which is storage only: a
/// store only this process writes (SQLite) has no coordination, and the engine runs with
/// `SoloNode`.
public protocol NodeCoordination: AnyObject, Sendable {
    /// Whether commits are compared with the chats' versions (`StoreBatch.chatVersions`):
    /// a store that several deciding processes share. One that only this process writes
    /// (SQLite) has nothing to compare them with, and the engine leaves them out.
    var comparesChatVersions: Bool { get }

    /// At least `count` numbers for new chats, users or search rows that no other process
    /// deciding on this store takes (PostgreSQL: a sequence), ascending, in one round trip;
    /// or nil when this process numbers them itself, after the highest it has read (SQLite,
    /// which one process writes). A number taken for a commit that then fails, or left
    /// over when the process stops, is not given again: numbers may have gaps, never
    /// repeats.
    func takeNumbers(for kind: NumberedKind, count: Int) throws -> [ClosedRange<Int64>]?

    /// The feed slot this process numbers its changes in (`FeedSlots`), which no other
    /// process deciding on the store has while this one does: 0 for a store only this
    /// process writes.
    var feedSlot: Int { get }

    /// Whether other processes decide on this store beside this one now: the engine then
    /// follows what they do (`othersActivity`) before each batch it decides, and tells
    /// them who is connected to it (`announceOnline`) and what its sessions say that is
    /// never stored (`announce`).
    var othersDecide: Bool { get }

    /// What the other deciding processes did after `cursor` (a new cursor: from now on):
    /// their commits (each slot's in the order they were applied), the chats those
    /// changed as they left them (`loadChats`, read with the commits in one snapshot: no
    /// later commit shows in them), the users they made or changed the endpoints of, who
    /// is connected to them now, and their transient events. Nil when the store no longer
    /// has all of it (memory must be read again whole).
    /// `slot` is the asking process's feed slot: its own doings are left out.
    /// `thoroughly`: the store itself is looked at, not only what the store was told of
    /// (`wakeWhenOthersAct`): before a batch that answers requests, so that what another
    /// process did before a request came is followed before the request is decided.
    func othersActivity(besides slot: Int, after cursor: FollowCursor?, thoroughly: Bool) throws -> OthersActivity?

    /// `joined` now have a session on the process in feed slot `slot`, and `left` no
    /// longer have one.
    func announceOnline(slot: Int, joined: [Int64], left: [Int64]) throws

    /// Hands a transient event of the sessions of the process in feed slot `slot` to the
    /// other deciding processes.
    func announce(_ event: TransientEvent, slot: Int) throws

    /// Calls `wake` (on another thread) whenever another deciding process may have done
    /// something (`othersActivity` then has it). Returns whether it will: when not, the
    /// caller looks often on its own. While the store is told of every doing,
    /// `othersActivity` reads only what it was told of (and everything once a second).
    func wakeWhenOthersAct(_ wake: @escaping @Sendable () -> Void) -> Bool
}

/// The coordination of a process alone on its store: it numbers what it makes itself,
/// its changes are feed slot 0's, and nobody else acts.
public final class SoloNode: NodeCoordination {
    public init() {}

    public var comparesChatVersions: Bool { false }

    public func takeNumbers(for kind: NumberedKind, count: Int) throws -> [ClosedRange<Int64>]? { nil }

    public var feedSlot: Int { 0 }

    public var othersDecide: Bool { false }

    public func othersActivity(besides slot: Int, after cursor: FollowCursor?, thoroughly: Bool) throws -> OthersActivity? {
        OthersActivity(cursor: cursor ?? FollowCursor())
    }

    public func announceOnline(slot: Int, joined: [Int64], left: [Int64]) throws {}

    public func announce(_ event: TransientEvent, slot: Int) throws {}

    public func wakeWhenOthersAct(_ wake: @escaping @Sendable () -> Void) -> Bool { false }
}
