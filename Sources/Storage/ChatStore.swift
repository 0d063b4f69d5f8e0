import Foundation
import Threads

/// What the engine needs from durable storage, in the engine's words.
///
/// The store is the source of truth. At start-up the engine reads only what is per user
/// and per chat (`loadDirectory`: users, endpoints, chats, memberships and the counters),
/// never every message; messages are read when a request needs them, through indexes
/// (by id, by tag, by reference, by change), and a bounded cache in the engine keeps the
/// hot ones. Every decision's writes go to `commit` as one batch: one transaction,
/// durable when `commit` returns (group commit), writing only what changed. SQLite
/// (`SQLiteStore`) is the default.
public protocol ChatStore: AnyObject, Sendable {
    // MARK: start-up

    /// Users, endpoints, chats with their memberships, and the counters, as last committed.
    func loadDirectory() throws -> StoreDirectory

    /// `loadDirectory` for the chats with these numbers only (no users, no endpoints): the
    /// chats the store has of them with their memberships and versions, and the counters.
    /// What memory reads again after a commit that failed, when it changed only chats.
    func loadChats(_ numbers: [Int64]) throws -> StoreDirectory

    // MARK: messages

    /// The messages of `chat` whose ids are in `ids`, ascending (ids that do not exist are
    /// left out), whole: references, reference counts and every user's private state.
    func messages(chat: Int64, in ids: ClosedRange<Int64>) throws -> [MessageRow]

    /// The messages of `chat` with these ids (ascending, each once), whole.
    func messages(chat: Int64, ids: [Int64]) throws -> [MessageRow]

    /// Up to `limit` ids of messages of `chat` that pass `filter`, starting at `start`
    /// (included) and going up (`ascending`) or down.
    func messageIds(chat: Int64, matching filter: MessageFilter, from start: Int64, ascending: Bool, limit: Int) throws -> [Int64]

    /// The first message of `chat` whose timestamp is at least `timestamp` (timestamps
    /// never decrease along a chat's ids), or nil when none is.
    func firstMessage(chat: Int64, notBefore timestamp: Int64) throws -> Int64?

    /// The first message of `chat` that `sender` sent with this `externalId`, if any.
    func message(chat: Int64, sender: Int64, externalId: String) throws -> Int64?

    /// The messages that mention `user` (`MessageRow.mentionedUsers`), across chats, newest
    /// first (by timestamp, then chat and id, descending), after `position` (the last one
    /// of the page before), at most `limit`.
    func mentions(of user: Int64, after position: MentionPosition?, limit: Int) throws -> [MentionPosition]

    /// The newest message referring to `target` with `tag`, leaving out `excluded`
    /// (messages being recalled), and how many there are without them.
    func references(chat: Int64, to target: Int64, tag: String, excluding excluded: Set<Int64>) throws -> (count: Int64, newest: Int64?)

    // MARK: the change feed

    /// Messages of `chats` whose own latest change is after `seq`, oldest change first, at
    /// most `limit`.
    func changedMessages(chats: [Int64], after seq: Int64, limit: Int) throws -> [MessageChangeRow]

    /// Changes of many messages at once (marks moving) in `chats` that end after `seq`,
    /// oldest first.
    func rangeChanges(chats: [Int64], after seq: Int64) throws -> [RangeChangeRow]

    /// Every feed slot's last committed position (`FeedSlots`), as committed now.
    func feedPositions() throws -> [Int: Int64]

    /// Which of these search hits `user` may still find, as the store has them now: the
    /// message holds the hit's search row (a recalled message holds none, so a hit from
    /// an index that missed the recall is left out) and `user` did not delete it for
    /// themselves. The index is derived data and may be stale; this is the truth.
    func searchable(by user: Int64, among hits: [SearchHit]) throws -> Set<SearchHit>

    // MARK: attachments and search

    /// How many messages hold on to a stored content (0 when none does).
    func blobUses(_ blob: String) throws -> Int64

    /// Text of messages whose search row is above `row`, by row (to refill an index that
    /// lags behind), at most `limit`. `maxBytes` bounds the page's texts together: it ends
    /// before the entry that would pass it (the first entry is always given), so that a
    /// page of long messages holds as much memory as one of short ones, not `limit` times
    /// the longest text.
    func searchEntries(after row: Int64, limit: Int, maxBytes: Int) throws -> [SearchEntry]

    // MARK: writing

    /// Applies the batch atomically and durably. On error nothing of it was applied.
    func commit(_ batch: StoreBatch) throws

    /// How many commits the engine may have in flight at once. With more than one,
    /// `commit` is called for a batch while the one before it (`StoreBatch.follows`) may
    /// still be running on another thread: the store may do the batch's independent work
    /// meanwhile (inserting its new messages), but applies it only once the one it
    /// follows is durable, and not at all if that one failed.
    var commitsInFlight: Int { get }
}

/// What the store may number (`NodeCoordination.takeNumbers`).
public enum NumberedKind: String, Sendable {
    case chat
    case user
    case searchRow
}

extension ChatStore {
    /// One: each commit starts once the one before it returned.
    public var commitsInFlight: Int { 1 }
}

/// Which messages a match looks for (docs/protocol.md §8 criteria, in store words).
public struct MessageFilter: Sendable, Equatable {
    /// The lowest id (the member's first visible message).
    public var firstId: Int64
    /// The highest id that may match (nil: any).
    public var lastId: Int64?
    public var tag: String?
    /// Messages referring to this message with this tag.
    public var referring: RefRow?
    /// Leave out messages with an outgoing reference with this tag.
    public var notRefTag: String?
    public var sender: Int64?
    /// Leave out recalled messages and messages with a reserved tag.
    public var onlyRecallable = false

    public init(firstId: Int64, lastId: Int64? = nil, tag: String? = nil, referring: RefRow? = nil, notRefTag: String? = nil, sender: Int64? = nil) {
        self.firstId = firstId
        self.lastId = lastId
        self.tag = tag
        self.referring = referring
        self.notRefTag = notRefTag
        self.sender = sender
    }

    /// The tags only the service posts (§6).
    public static let reservedTags: Set<String> = ["Join", "Leave", "Subject", "Gap", "Shred", "Clear", "Admin", "Remove", "Mute", "Ban"]
}

/// Why a commit failed, in the words the engine decides by.
public struct StoreFailure: Error, CustomStringConvertible, Sendable {
    public enum Kind: Sendable {
        /// The disk is full: nothing was written, and commits work again once space is freed.
        case full
        /// An I/O error (a failed write or sync): what reached the disk is unknown until
        /// the store is opened again (SQLite recovers its WAL then), and the open store
        /// may refuse every later commit. The service must stop.
        case io
        /// Another process became the store's writer (a node that took over): nothing of
        /// the commit was applied, and what this process holds in memory may be behind
        /// the store. The service must stop.
        case superseded
        /// Another process committed first to a chat this batch changes (its version moved
        /// on: `StoreBatch.chatVersions`): nothing of the commit was applied, and what this
        /// process holds of that chat is behind the store. Read the store again and decide
        /// the batch's requests again.
        case conflict
        /// Anything else: nothing of the commit was applied.
        case other
    }

    public let kind: Kind
    public let description: String

    public init(_ kind: Kind, _ description: String) {
        self.kind = kind
        self.description = description
    }

    /// Whether the service must stop rather than go on with this store.
    public var stopsTheService: Bool { kind == .io || kind == .superseded }
}

/// The text index behind `search` (§9). It is derived from the messages: it
/// may lag behind commits (additions are handed over and written in the background) and
/// lose its tail in a crash; the engine re-adds what it lacks at start-up.
public protocol MessageSearchIndex: AnyObject, Sendable {
    /// The highest search row in the index.
    func indexedUpTo() throws -> Int64

    /// Hands over committed messages' text, and rows whose text is gone (recalled).
    func add(_ entries: [SearchEntry], removing rows: [Int64])

    /// Waits until everything handed over before the call is written.
    func waitUntilWritten() throws

    /// A bulk load (rebuilding the index from the store) was handed over: the index may
    /// reorganise itself while it has nothing else to write.
    func bulkLoadEnded()

    /// Messages of `chats` whose text contains `text` case-insensitively, newest first
    /// (descending search row), below `belowRow` when given; everything handed over
    /// before the call is taken into account. Each candidate checked on its text is paid
    /// for from `budget`; when it runs out the search ends with what it found.
    func searchMessages(containing text: String, chats: [Int64], belowRow: Int64?, limit: Int, budget: SearchBudget) throws -> [SearchHit]
}

/// What one search may check: candidates and bytes of their text. A search that runs out
/// answers what it found and says so (`incomplete`), so that no query costs more than
/// this, whatever the history holds.
public final class SearchBudget {  // one search's, on one thread at a time
    public private(set) var candidates: Int
    public private(set) var bytes: Int
    /// Set when a candidate could not be paid for.
    public private(set) var isExhausted = false

    public static let defaultCandidates = 20_000
    /// About 60 ms of checking in a release build on the machine of docs/benchmarks.md.
    public static let defaultBytes = 8 << 20

    public init(candidates: Int = SearchBudget.defaultCandidates, bytes: Int = SearchBudget.defaultBytes) {
        self.candidates = candidates
        self.bytes = bytes
    }

    /// Pays for checking one candidate of `count` bytes; false (and exhausted) when the
    /// budget cannot.
    public func spend(bytes count: Int) -> Bool {
        guard !isExhausted, candidates > 0, bytes >= count else {
            isExhausted = true
            return false
        }
        candidates -= 1
        bytes -= count
        return true
    }
}

/// The texts of one page of `MessageSearchIndex.fill` together, at most (bytes).
public let searchFillPageBytes = 8 << 20

extension MessageSearchIndex {
    /// Hands over the entries the store has above `row` (`entries(after:limit:maxBytes:)`),
    /// a page at a time, each written before the next is read (handing a long history over
    /// at once would hold all of its text in memory: 500 MB after 11 s at 10M; so would a
    /// page of 10,000 entries counted only by number, when they are long: 254 MB for 3,000
    /// texts of 71 KB), up to `upTo` (nil: until the store has no more), while `goOn` says
    /// so. Returns the last row handed over (`row` when none was).
    public func fill(
        after row: Int64, upTo: Int64? = nil,
        from entries: (_ after: Int64, _ limit: Int, _ maxBytes: Int) throws -> [SearchEntry],
        while goOn: () -> Bool = { true }
    ) throws -> Int64 {
        var after = row
        while goOn() && after < upTo ?? Int64.max {
            let page = try entries(after, 10_000, searchFillPageBytes).filter { upTo == nil || $0.row <= upTo! }
            guard let last = page.last else { break }
            add(page, removing: [])
            try waitUntilWritten()
            after = last.row
        }
        return after
    }
}

/// A message found by `searchMessages`.
public struct SearchHit: Sendable, Hashable {
    public var chat: Int64
    public var id: Int64
    /// The message's position in the search index (newer is larger).
    public var row: Int64

    public init(chat: Int64, id: Int64, row: Int64) {
        self.chat = chat
        self.id = id
        self.row = row
    }
}

/// A message's text entering the search index.
public struct SearchEntry: Sendable, Equatable {
    public var row: Int64
    public var chat: Int64
    public var id: Int64
    public var text: String

    public init(row: Int64, chat: Int64, id: Int64, text: String) {
        self.row = row
        self.chat = chat
        self.id = id
        self.text = text
    }
}

/// Whether each recent commit (by `StoreBatch.sequence`) was applied, for a store with
/// more than one commit in flight (`ChatStore.commitsInFlight`): the commit that follows
/// one (`StoreBatch.follows`) waits for its outcome before it applies what depends on it.
public final class CommitOutcomes: Sendable {
    private let applied = Locked<[Int64: Bool]>([:])

    public init() {}

    public func record(_ sequence: Int64, applied outcome: Bool) {
        applied.change { applied in
            applied[sequence] = outcome
            // Only a few commits are ever in flight: older outcomes have been read.
            applied = applied.filter { $0.key > sequence - 16 }
        }
    }

    /// Whether commit `sequence` was applied, if it returned (nil while it runs).
    public func outcome(of sequence: Int64) -> Bool? {
        applied.withLock { $0[sequence] }
    }

    /// Waits until commit `sequence` returned; whether it was applied.
    public func wait(for sequence: Int64) -> Bool {
        applied.wait(until: { $0[sequence] != nil }) { $0[sequence]! }
    }
}
