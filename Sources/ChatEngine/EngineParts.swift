import Attachments
import Foundation
import Logging
import Storage
import Synchronization
import Threads

// The parts the engine coordinates. Each owns one concern's state; all of it is confined
// to the engine thread unless a property says otherwise (its atomics and queues are read
// or used from other threads, as said beside them).

/// Who and what the engine knows: users, their endpoints and sessions, chats and their
/// memberships, and the numbers it hands out (chats, endpoints, the change feed's).
final class Directory {
    var users = UserDirectory()
    /// Registered endpoints by id, and each user's in registration order.
    var endpoints: [Int64: EndpointRecord] = [:]
    var endpointsOfUser: [Int64: [Int64]] = [:]
    var lastEndpointOrdinal: Int64 = 0
    var sessionsByUser: [Int64: [EngineSession]] = [:]
    var chats: [Int64: ChatRecord] = [:]
    /// The chats each user takes part in now.
    var chatsOfUser: [Int64: Set<Int64>] = [:]
    var lastChatNumber: Int64 = 0
    /// The change feed's position: every message change takes the next number of this
    /// process's slot (`Following.feedSlot`).
    var changeSeq: Int64 = 0
    /// What is left of the numbers taken from the store (`newNumber`), ascending.
    var numbersTaken: [NumberedKind: [ClosedRange<Int64>]] = [:]
    /// The counters as the store has them.
    var storedCounters = StoreCounters()
    /// Users' uris as elements show them, made once (most renderings name a sender); at
    /// most `urisKept`, forgotten all at once when full.
    var uris: [Int64: String] = [:]
    static let urisKept = 16384
    /// What users chose for themselves (those who chose anything: `settings(of:)`).
    var settings: [Int64: UserSettingsRow] = [:]
    /// Who blocks each user (the other side of `UserSettingsRow.blocked`).
    var blockers: [Int64: Set<Int64>] = [:]
}

extension Directory {
    /// The number of a new chat, user or search row: `coordination`'s (taken from the
    /// store a block at a time), which no other deciding process takes, or the one after
    /// `last`, the highest memory knows, when this process numbers them itself. When the
    /// store cannot give one, `last + 1` too, and the commit judges it: it fails as taking
    /// the number did (the store is unreachable), or conflicts when another process has
    /// that number (and the request is decided again), or stores it.
    func newNumber(for kind: NumberedKind, after last: Int64, from coordination: NodeCoordination, logger: Logger) -> Int64 {
        if numbersTaken[kind]?.isEmpty ?? true { reserveNumbers(for: kind, count: 1, from: coordination, logger: logger) }
        guard var ranges = numbersTaken[kind], let first = ranges.first else { return last + 1 }
        if first.count > 1 {
            ranges[0] = (first.lowerBound + 1)...first.upperBound
        } else {
            ranges.removeFirst()
        }
        numbersTaken[kind] = ranges
        return first.lowerBound
    }

    /// Makes sure memory holds `count` numbers of `kind`, taking what it lacks in one
    /// round trip: a request about to make many users asks for them all first (a chat
    /// started with 249 new invitees on PostgreSQL took 48 ms with a round trip per
    /// number, 12–15 ms so, and 11–13 ms when memory numbered them).
    func reserveNumbers(for kind: NumberedKind, count: Int, from coordination: NodeCoordination, logger: Logger) {
        let held = numbersTaken[kind, default: []].reduce(0) { $0 + $1.count }
        guard count > held else { return }
        do {
            if let ranges = try coordination.takeNumbers(for: kind, count: count - held) { numbersTaken[kind, default: []] += ranges }
        } catch {
            logger.warning(
                "the store gave no number for a new \(kind.rawValue): the commit judges the next one memory has",
                metadata: ["error": "\(error)"])
        }
    }
}

/// Per-session output: work parked behind a session whose client does not read, or that
/// waits for an answer made off the engine thread, and work being prepared elsewhere.
final class SessionOutputs {
    /// A session's output (built in the batch, plus handed over and not yet taken by its
    /// client) above which its next requests wait in the engine, in order, until the
    /// client has taken half of it: a client that never reads costs at most this and one
    /// answer, however many requests it pipelines.
    let mark: Int
    /// Work parked per session, and the order sessions were parked in.
    private var parked: [ObjectIdentifier: (session: EngineSession, work: [Engine.Work])] = [:]
    private var parkedOrder: [ObjectIdentifier] = []
    /// Parked work items, counted until they are taken (read by `drain` on other threads).
    let parkedCount = Atomic<Int>(0)
    /// Sessions whose work is parked until an answer being made off the engine thread
    /// (a search) comes back, whatever their output.
    private var awaitingOutside: Set<ObjectIdentifier> = []
    /// Work of sessions being prepared off their threads (tokens being checked), counted
    /// from any thread: `drain` waits for it.
    let outsideWork = Atomic<Int>(0)

    init(mark: Int) { self.mark = mark }

    var isAnyParked: Bool { !parked.isEmpty }

    /// Whether the session's work waits behind earlier work of it.
    func isParked(_ session: EngineSession) -> Bool {
        parked[ObjectIdentifier(session)] != nil
    }

    /// Parks `item` behind the session's parked work (or as its first).
    func park(_ item: Engine.Work, of session: EngineSession) {
        let key = ObjectIdentifier(session)
        if parked[key] == nil {
            parked[key] = (session, [])
            parkedOrder.append(key)
        }
        parked[key]!.work.append(item)
        parkedCount.add(1, ordering: .relaxed)
    }

    /// The session's next work waits (in order) until `outsideAnswered`, whatever its
    /// output.
    func awaitOutside(_ session: EngineSession) {
        let key = ObjectIdentifier(session)
        awaitingOutside.insert(key)
        if parked[key] == nil {
            parked[key] = (session, [])
            parkedOrder.append(key)
        }
    }

    func outsideAnswered(_ session: EngineSession) {
        awaitingOutside.remove(ObjectIdentifier(session))
    }

    /// The parked work of every session whose client has taken enough of its output
    /// (down to half the mark), or that closed, in the order it was parked; with
    /// `everyone`, that of every session not waiting for an answer from outside. It is no
    /// longer parked but still counted (`parkedCount`) until `taken`.
    func release(everyone: Bool) -> [Engine.Work] {
        guard !parked.isEmpty else { return [] }
        var released: [Engine.Work] = []
        parkedOrder.removeAll { key in
            guard let entry = parked[key] else { return true }
            guard !awaitingOutside.contains(key) else { return false }
            let backlog = entry.session.sink?.backlog ?? 0
            guard everyone || !entry.session.isOpen || backlog <= mark / 2 else { return false }
            released += entry.work
            parked[key] = nil
            return true
        }
        return released
    }

    /// `count` released items were taken (parked again, begun, or put in the inbox).
    func taken(_ count: Int) {
        parkedCount.subtract(count, ordering: .releasing)
    }
}

/// Batches being committed while the engine decides the next one, and recovery from a
/// commit that failed.
final class Commits {
    /// Where batches are committed (as many at once as the store takes:
    /// `ChatStore.commitsInFlight`).
    let committer = DispatchQueue(label: "chatcore-commit", qos: .userInitiated, attributes: .concurrent)
    /// The batches being committed there, oldest first. Their events are delivered in
    /// this order, and their output counts toward a session's pending output while later
    /// batches are decided.
    var inFlight: [Engine.Commit] = []
    /// How many batches may be in flight at once.
    let limit: Int
    /// Whether commits carry the versions of the chats they change (`ChatStore`): several
    /// processes may decide on the store (and the feed has their slots too).
    let comparesChatVersions: Bool
    /// The last commit's `StoreBatch.sequence`.
    var lastSequence: Int64 = 0
    /// Commits that failed while the batch after them was being decided (the first failed;
    /// those after it were decided on memory holding its changes, so they fail with it,
    /// and so does the batch being decided, at its end). No commits: the batch being
    /// decided conflicted committing what it had so far (`commitSoFar`).
    var failed: (commits: [Engine.Commit], error: Error)?
    /// The number of the batch being decided (its pins in the cache).
    var batchNumber = 0
    /// Since the last commit that was applied: the chats read again after conflicts (nil:
    /// everything was), and how many conflicts found nothing more to read with batches of
    /// one work item (`redo`).
    var readAfterConflicts: Set<Int64>? = []
    var repeatedConflicts = 0
    /// How many work items a batch takes now. A conflict that found nothing more to read
    /// divides it by four (a smaller batch touches fewer chats, and is decided and committed
    /// sooner: less time for another node to move one of them on); each applied commit
    /// doubles it again, up to `Engine.batchLimit`.
    var batchLimitNow = Engine.batchLimit
    /// Set when memory could not be rebuilt after a failed commit: nothing more is done.
    var brokenStore: Error?
    /// Reads decided while a batch waited for the commit before it
    /// (`answerReadsWhileWaiting`) that changed something after all: they are ended
    /// after that batch, in order.
    var decidedWhileWaiting: [Batch] = []

    init(limit: Int, comparesChatVersions: Bool) {
        self.limit = limit
        self.comparesChatVersions = comparesChatVersions
    }
}

/// What the other processes deciding on the store did, as far as it was followed, and who
/// is online there.
final class Following {
    /// Whether other processes decide on the store beside this one (`ChatStore.othersDecide`):
    /// what they do is followed before each batch (`followOthers`).
    let othersDecide: Bool
    /// Where this process numbers its changes in the feed (`FeedSlots`): 0 unless several
    /// processes decide on one store.
    let feedSlot: Int
    /// How far what the other deciding processes did has been followed.
    var cursor: FollowCursor?
    /// Users with a session on another deciding process (they are delivered to as if
    /// connected here).
    var onlineElsewhere: Set<Int64> = []
    /// Users whose sessions here came or went since the others were last told, and who
    /// the others were told has a session here (`announcePresence`).
    var presenceChanged: Set<Int64> = []
    var announcedOnline: Set<Int64> = []
    /// Per feed slot of another process, the position up to which its changes were
    /// followed (read whole: where the store was then).
    var followedFeed: [Int: Int64] = [:]
    /// Chats memory read again after a commit of this process failed (nil: everything),
    /// since the others were last followed: memory of them may already hold what the
    /// others committed, so the next follow cannot tell what changed, and sends their
    /// elements whole (`renderCoarsely`).
    var readAheadOfFollowing: Set<Int64>? = []

    init(othersDecide: Bool, feedSlot: Int) {
        self.othersDecide = othersDecide
        self.feedSlot = feedSlot
    }
}

/// Searches: the index, the queue they run on off the engine thread, and its refill.
final class Searches {
    /// Where searches look up the index and the store, several at once.
    let queue = DispatchQueue(label: "chatcore-search", qos: .userInitiated, attributes: .concurrent)
    /// The text index behind `search` (nil: search scans memory).
    let index: MessageSearchIndex?
    /// Left once the search index has every message it lacked at start-up.
    let refill = DispatchGroup()
    /// The newest message's row in the search index.
    var lastRow: Int64 = 0

    init(index: MessageSearchIndex?) { self.index = index }
}

/// Attached files: where they are kept, and those being stored on worker threads.
final class AttachmentWork {
    /// Where attached files are kept (nil: attachments are refused).
    let store: AttachmentStore?
    /// The only directory socket sessions may attach files from (resolved), if any.
    let allowedDirectory: String?
    /// Attachments being stored on worker threads (counted from them): `drain` waits.
    let jobs = Atomic<Int>(0)
    /// Messages whose attachments a worker is storing now (they stay `Sending` when
    /// memory is rebuilt after a failed commit), with their sources, held open until the
    /// message's link to its copy is durable.
    var inFlight: [Batch.RowKey: SourcesInFlight] = [:]

    init(store: AttachmentStore?, allowedDirectory: String?) {
        self.store = store
        self.allowedDirectory = allowedDirectory
    }
}

/// What is due later: typing indications expiring, deliveries of users who came online.
final class TimedWork {
    /// Who is typing where, and when that expires (seconds on the monotonic clock).
    var typing: [TypingEntry: Double] = [:]
    /// Pins that end by themselves: when (seconds on the monotonic clock), and the `until`
    /// they were given. An entry whose pin was removed or given another `until` since is
    /// passed over when it is due.
    var pinEnds: [PinKey: (due: Double, until: Int64)] = [:]
    /// Mutes that end by themselves, likewise (`MemberRecord.mutedUntil`).
    var muteEnds: [MemberKey: (due: Double, until: Int64)] = [:]
    /// When the next tick is due (seconds on the monotonic clock; nil: none is scheduled).
    /// Work due sooner schedules one of its own: a tick due later must not hold it up.
    var tickAt: Double?
    /// Users who came online, with their chats whose deliveries are still to be marked
    /// (`deliverDue`), oldest first.
    var deliveriesDue: [(user: Int64, chats: [Int64])] = []
}

/// Who is seen online (docs/protocol.md, presence): what was last shown of each user, and
/// the users whose connections changed since, shown at most once a `Presence.interval`.
final class Presence {
    /// What the users who watch presence were last shown of each user who is online: since
    /// when (seconds since 1970). A user left out was shown offline (since their stored
    /// `lastActive`).
    var shown: [Int64: (online: Bool, since: Int64)] = [:]
    /// Users whose connections changed since they were last shown, with when they were
    /// first seen with none (seconds on the monotonic clock, and since 1970).
    var changed: [Int64: (monotonic: Double, wall: Int64)?] = [:]
    /// When the changed users are looked at next (seconds on the monotonic clock).
    var dueAt: Double?
    /// Changes are shown at most this often (seconds), all at once.
    static let interval = 1.0
    /// A user whose last connection closed is shown offline only if none came back within
    /// this (seconds): a phone that moves between networks is not seen to come and go.
    static let grace = 3.0
}

/// One member of one chat.
struct MemberKey: Hashable {
    let chat: Int64
    let user: Int64
}

/// The engine thread's life: its inbox (filled from any thread), the thread, and how it
/// ends.
final class EngineLife {
    let inbox = Inbox<Engine.Work>()
    /// The engine thread (`currentThread` there), once it runs: 0 before.
    let owner = Atomic<UInt>(0)
    let sessionCounter = Atomic<Int>(0)
    var thread: Thread?
    let shuttingDown = Atomic<Bool>(false)
    /// Signalled when the engine thread ends (`stop`).
    let ended = Locked(false)
    /// Why the store can no longer be used, read from any thread.
    let fatalStoreError = Locked<String?>(nil)
    /// Called (once, on the engine thread) when the store failed in a way the engine
    /// cannot recover from; the process should answer what it has and exit non-zero.
    let onFatalStoreError: (@Sendable (String) -> Void)?
    /// Moves on each time work outside the inbox ends (an attachment job, a session's
    /// parked work or its work off the engine thread): `drain` waits for it, any thread.
    let settled = Locked<UInt64>(0)

    init(onFatalStoreError: (@Sendable (String) -> Void)?) { self.onFatalStoreError = onFatalStoreError }

    /// Says that work outside the inbox ended (`settled`).
    func settle() {
        settled.change { $0 &+= 1 }
    }

    /// The calling thread, as `owner` holds it.
    static var currentThread: UInt {
        #if canImport(Glibc)
            UInt(pthread_self())
        #else
            UInt(bitPattern: pthread_self())
        #endif
    }
}
