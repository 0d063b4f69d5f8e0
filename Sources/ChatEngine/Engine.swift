import Attachments
import ChatMetrics
import ChatProtocol
import Foundation
import Logging
import Storage
import Synchronization
import Threads

/// The one place that decides (docs/protocol.md §3–§9).
///
/// Sessions submit work from any thread; a single engine thread takes everything waiting
/// as one batch, decides each item in arrival order against the in-memory state, commits
/// the batch's writes to the store in one transaction (group commit), and only then
/// delivers the events of the batch, rendered per viewer, in commit order. The commit
/// runs on a thread of its own while the engine decides the next batch (see `end`). A
/// request that fails changes nothing: handlers check everything before they change
/// anything.
public final class Engine: @unchecked Sendable {
    enum Work {
        case request(Request, line: Int, session: EngineSession)
        case authenticate(userId: String, cookie: String?, line: Int, announce: Bool, session: EngineSession)
        case passthrough([Event], session: EngineSession)
        /// The session layer refused a token.
        case tokenRejected(SetupError, session: EngineSession)
        /// The token a session signed in with expired (or its key left the JWKS file).
        case tokenExpired(session: EngineSession)
        case close(EngineSession)
        case barrier(@Sendable () -> Void)
        /// Time passed: typing indications may have expired.
        case tick
        /// Users who came online have chats whose deliveries are still to be marked.
        case deliverDue
        /// The next page of a `chat` or `chatParticipant` list (`continueList`).
        case continueList(ListInProgress)
        /// The next page of a recall of everything a user sent in a chat (`recallAll`).
        case continueRecall(RecallInProgress)
        /// A message's attachments were stored (blobs) or could not be (error).
        case attachmentsStored(chat: Int64, id: Int64, thumb: String?, file: String?, error: String?)
        /// A search's hits, looked up off the engine thread (`Engine+Search.swift`).
        case searchFound(Search, line: Int, chatIds: [String], user: Int64, hits: Result<SearchFound, ProtocolError>, session: EngineSession)
        /// Finish what came before, then end the engine thread.
        case stop
        /// The committer finished the batch handed to it.
        case committed
        /// Another deciding process committed or said something (`othersActed`): what it
        /// did is followed before the batch that takes this (`followOthers`).
        case othersActed
        /// Members connected here may not have been marked delivered what another process
        /// committed in these chats (it decided before it knew they were connected).
        case deliverFollowed(chats: [Int64])

        /// The session whose input this is (kept in order behind its parked work).
        var session: EngineSession? {
            switch self {
            case .request(_, _, let session), .authenticate(_, _, _, _, let session), .passthrough(_, let session),
                .tokenRejected(_, let session), .tokenExpired(let session):
                session
            default: nil
            }
        }
    }

    /// At most this many work items go into one batch (and one transaction).
    static let batchLimit = 4096
    /// Events a batch may build for its sessions before the rest of its work is left to
    /// the next batch. A batch's events are held until its commit: without a bound, 4,096
    /// sends of 70 KB into a chat whose users have many endpoints would be held at once
    /// (70 KB × 4,096 × each endpoint).
    static let batchOutputLimit = 16 << 20
    /// A session's output (built in the batch, plus handed over and not yet taken by its
    /// client) above which its next requests wait in the engine, in order, until the
    /// client has taken half of it: a client that never reads costs at most this and one
    /// answer, however many requests it pipelines.
    public var outputMark = 4 << 20
    /// Work parked per session, and the order sessions were parked in.
    private var parked: [ObjectIdentifier: (session: EngineSession, work: [Work])] = [:]
    private var parkedOrder: [ObjectIdentifier] = []
    /// Parked work items (read by `drain` on other threads).
    private let parkedCount = Atomic<Int>(0)
    /// Sessions whose work is parked until an answer being made off the engine thread
    /// (a search) comes back, whatever their output.
    private var awaitingOutside: Set<ObjectIdentifier> = []
    /// Where searches look up the index and the store, several at once.
    let searchQueue = DispatchQueue(label: "chatcore-search", qos: .userInitiated, attributes: .concurrent)
    /// `listChunk` carries at most this many elements (§4).
    static let chunkSize = 500

    let store: ChatStore
    let logger: Logger
    /// Seconds since 1970: message timestamps.
    let clock: @Sendable () -> Int64
    /// Where attached files are kept (nil: attachments are refused).
    let attachments: AttachmentStore?
    /// The only directory socket sessions may attach files from (resolved), if any.
    let attachmentsDirectory: String?
    /// The text index behind `search` (nil: search scans memory).
    let searchIndex: MessageSearchIndex?
    private let inbox = Inbox<Work>()
    private let sessionCounter = Atomic<Int>(0)
    /// Left once the search index has every message it lacked at start-up.
    let searchRefill = DispatchGroup()
    /// Attachments being stored on worker threads, and work of sessions being prepared
    /// off their threads (tokens being checked): `drain` waits for both.
    let attachmentJobs = Atomic<Int>(0)
    private let outsideWork = Atomic<Int>(0)
    private var thread: Thread?
    /// Where batches are committed while the engine decides the next one (as many at
    /// once as the store takes: `ChatStore.commitsInFlight`).
    private let committer = DispatchQueue(label: "chatcore-commit", qos: .userInitiated, attributes: .concurrent)
    /// The batches being committed there, oldest first (engine thread). Their events are
    /// delivered in this order, and their output counts toward a session's pending output
    /// while later batches are decided.
    private var inFlight: [Commit] = []
    /// How many batches may be in flight at once.
    private let commitsInFlight: Int
    /// Whether commits carry the versions of the chats they change (`ChatStore`): several
    /// processes may decide on the store (and the feed has their slots too).
    let comparesChatVersions: Bool
    /// The last commit's `StoreBatch.sequence`.
    private var lastSequence: Int64 = 0
    /// Commits that failed while the batch after them was being decided (the first failed;
    /// those after it were decided on memory holding its changes, so they fail with it,
    /// and so does the batch being decided, at its end). No commits: the batch being
    /// decided conflicted committing what it had so far (`commitSoFar`).
    private var failedCommit: (commits: [Commit], error: Error)?
    /// Whether a commit failed and its batches wait to be decided again or answered (`end`).
    var hasFailedCommit: Bool { failedCommit != nil }
    /// The number of the batch being decided (its pins in the cache).
    private(set) var batchNumber = 0
    /// Since the last commit that was applied: the chats read again after conflicts (nil:
    /// everything was), and how many conflicts found nothing more to read with batches of
    /// one work item (`redo`).
    private var readAfterConflicts: Set<Int64>? = []
    private var repeatedConflicts = 0
    /// How many work items a batch takes now. A conflict that found nothing more to read
    /// divides it by four (a smaller batch touches fewer chats, and is decided and committed
    /// sooner: less time for another node to move one of them on); each applied commit
    /// doubles it again, up to `batchLimit`.
    private var batchLimitNow = Engine.batchLimit

    /// How many endpoints one user may have at once: registered ones and sessions that
    /// have not registered (docs/protocol.md §3, `--max-endpoints`).
    public var maxEndpoints = 100

    // Engine-thread state.
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
    /// process's slot (`feedSlot`).
    var changeSeq: Int64 = 0
    /// Where this process numbers its changes in the feed (`FeedSlots`): 0 unless several
    /// processes decide on one store.
    let feedSlot: Int
    /// The newest message's row in the search index.
    var lastSearchRow: Int64 = 0
    /// What is left of the numbers taken from the store (`newNumber`), ascending.
    private var numbersTaken: [NumberedKind: [ClosedRange<Int64>]] = [:]
    /// The counters as the store has them.
    private var storedCounters = StoreCounters()
    /// The messages in memory: the hot ones, up to a budget.
    let cache: MessageCache
    /// Whether other processes decide on the store beside this one (`ChatStore.othersDecide`):
    /// what they do is followed before each batch (`followOthers`).
    public let followsOthers: Bool
    /// How far what the other deciding processes did has been followed.
    var followCursor: FollowCursor?
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
    /// Who is typing where, and when that expires (seconds on the monotonic clock).
    var typing: [TypingEntry: Double] = [:]
    var tickScheduled = false
    /// What each user may cost the others (rates, searches at once).
    var quotas: Quotas
    /// Users who came online, with their chats whose deliveries are still to be marked
    /// (`deliverDue`), oldest first.
    var deliveriesDue: [(user: Int64, chats: [Int64])] = []
    /// Messages whose attachments a worker is storing now (they stay `Sending` when
    /// memory is rebuilt after a failed commit), with their sources, held open until the
    /// message's link to its copy is durable.
    var attachmentsInFlight: [Batch.RowKey: SourcesInFlight] = [:]
    /// Set when memory could not be rebuilt after a failed commit: nothing more is done.
    var brokenStore: Error?
    private let shuttingDown = Atomic<Bool>(false)
    /// Signalled when the engine thread ends (`stop`).
    private let ended = DispatchSemaphore(value: 0)
    /// Under `fatalLock` (NSLock: ThreadSanitizer sees pthread locks, not `Mutex`'s futex).
    nonisolated(unsafe) private var fatalStoreError: String?
    private let fatalLock = NSLock()
    /// Called (once, on the engine thread) when the store failed in a way the engine
    /// cannot recover from; the process should answer what it has and exit non-zero.
    public var onFatalStoreError: (@Sendable (String) -> Void)?

    /// `clock` gives message timestamps (seconds since 1970); tests pass a fixed one.
    /// `cacheBytes` bounds the messages kept in memory. `feedSlot`: where this process
    /// numbers its changes in the feed, one slot per process deciding on the store (nil:
    /// the store's, `ChatStore.feedSlot`).
    public init(
        store: ChatStore, logger: Logger, searchIndex: MessageSearchIndex? = nil, attachments: AttachmentStore? = nil,
        attachmentsDirectory: String? = nil, cacheBytes: Int = Engine.defaultCacheBytes, feedSlot: Int? = nil,
        quotas: QuotaLimits = QuotaLimits(),
        clock: @escaping @Sendable () -> Int64 = Engine.wallClock
    ) throws {
        self.quotas = Quotas(limits: quotas)
        let feedSlot = feedSlot ?? store.feedSlot
        precondition((0..<FeedSlots.count).contains(feedSlot), "a feed slot is below \(FeedSlots.count)")
        self.feedSlot = feedSlot
        self.cache = MessageCache(budget: cacheBytes)
        self.searchIndex = searchIndex
        self.store = store
        self.commitsInFlight = max(1, store.commitsInFlight)
        self.comparesChatVersions = store.comparesChatVersions
        self.followsOthers = store.othersDecide
        self.logger = logger
        self.clock = clock
        self.attachments = attachments
        self.attachmentsDirectory = attachmentsDirectory
        // From here on: what the others commit while memory is read is followed again
        // (reading a chat again is harmless), never missed.
        if followsOthers { followCursor = try store.othersActivity(besides: feedSlot, after: nil, thoroughly: true)?.cursor }
        try reload()
    }

    /// Seconds since 1970 now: message timestamps, unless a test fixes them.
    public static let wallClock: @Sendable () -> Int64 = { Int64(Date().timeIntervalSince1970) }

    /// What the messages in memory may take by default (`--cache-mb`).
    public static let defaultCacheBytes = 64 << 20

    /// Reads what is per user and per chat from the store (never every message): at
    /// start-up, and after a failed commit, when memory must be what the store has.
    func reload() throws {
        let directory = try store.loadDirectory()
        users = UserDirectory(directory.users)
        endpoints = [:]
        endpointsOfUser = [:]
        lastEndpointOrdinal = 0
        for row in directory.endpoints {
            endpoints[row.id] = EndpointRecord(row)
            endpointsOfUser[row.user, default: []].append(row.id)
            lastEndpointOrdinal = max(lastEndpointOrdinal, row.ordinal)
        }
        chats = [:]
        chatsOfUser = [:]
        lastChatNumber = 0
        install(directory)
        cache.removeAll()
        typing = [:]
        followedFeed = directory.feedPositions
        try refillSearchIndex()
    }

    /// The directory's chats with their memberships, and its counters, into memory
    /// (unless not `takingCounters`).
    private func install(_ directory: StoreDirectory, takingCounters: Bool = true) {
        for row in directory.chats {
            let chat = ChatRecord(row)
            chat.version = directory.chatVersions[row.number] ?? 0
            chats[row.number] = chat
            lastChatNumber = max(lastChatNumber, row.number)
        }
        for row in directory.members {
            guard let chat = chats[row.chat] else { continue }
            chat.members[row.user] = MemberRecord(row)
            if row.isActive { chatsOfUser[row.user, default: []].insert(row.chat) }
        }
        guard takingCounters else { return }
        changeSeq = directory.feedPositions[feedSlot] ?? FeedSlots.base(of: feedSlot)
        lastSearchRow = directory.counters.searchRow
        storedCounters = StoreCounters(changeSeq: changeSeq, slot: feedSlot, searchRow: lastSearchRow)
    }

    /// What memory must read again after `batches` failed to commit: the chats they changed
    /// since they were last committed, or everything (nil) when they made users or changed
    /// endpoints. Asked before the batches drop what they changed (`Batch.failAll`).
    private static func uncommitted(_ batches: [Batch]) -> Set<Int64>? {
        guard !batches.contains(where: \.changedUsersOrEndpoints) else { return nil }
        return batches.reduce(into: []) { $0.formUnion($1.changedChats) }
    }

    /// Makes memory what the store has after a failed commit, reading only the chats that
    /// commit changed (`uncommitted`): their records, memberships and versions, and the
    /// counters; their messages leave the cache. The rest of memory never held anything
    /// the commit had, so it stays (a directory of a million chats is not read again for
    /// one chat's conflict). `nil`: everything (`reload`).
    func readAgain(_ numbers: Set<Int64>?) throws {
        guard let numbers else { return try reload() }
        replace(numbers, with: try store.loadChats(numbers.sorted()))
    }

    /// Memory of the chats `numbers` becomes `directory` (what the store has of them): their
    /// messages leave the cache, or only `messages` of them. Not `takingCounters`, this
    /// process's counters stay as memory has them (what the others did is followed: the
    /// directory was read while a commit of this process may have been in flight, and
    /// its counters would take this process's feed positions and search rows back).
    func replace(
        _ numbers: Set<Int64>, with directory: StoreDirectory, droppingOnly messages: [Int64: Set<Int64>]? = nil,
        takingCounters: Bool = true
    ) {
        if let messages {
            for (chat, ids) in messages { cache.remove(chat: chat, ids: ids) }
        } else {
            cache.remove(chats: numbers)
        }
        for number in numbers {
            guard let old = chats.removeValue(forKey: number) else { continue }
            for (user, member) in old.members where member.isActive {
                chatsOfUser[user]?.remove(number)
                if chatsOfUser[user]?.isEmpty == true { chatsOfUser[user] = nil }
            }
        }
        // A chat the batches made is not in the store: its number is free again.
        if directory.chats.count < numbers.count && numbers.contains(lastChatNumber) { lastChatNumber = chats.keys.max() ?? 0 }
        install(directory, takingCounters: takingCounters)
    }

    /// The number of a new chat, user or search row: the store's (`ChatStore.takeNumbers`,
    /// kept a block at a time), which no other deciding process takes, or the one after
    /// `last`, the highest memory knows, when this process numbers them itself. When the
    /// store cannot give one, `last + 1` too, and the commit judges it: it fails as taking
    /// the number did (the store is unreachable), or conflicts when another process has
    /// that number (and the request is decided again), or stores it.
    func newNumber(for kind: NumberedKind, after last: Int64) -> Int64 {
        if numbersTaken[kind]?.isEmpty ?? true { reserveNumbers(for: kind, count: 1) }
        guard var ranges = numbersTaken[kind], let first = ranges.first else { return last + 1 }
        if first.count > 1 {
            ranges[0] = (first.lowerBound + 1)...first.upperBound
        } else {
            ranges.removeFirst()
        }
        numbersTaken[kind] = ranges
        return first.lowerBound
    }

    /// Makes sure memory holds `count` numbers of `kind` from the store, taking what it
    /// lacks in one round trip: a request about to make many users asks for them all
    /// first (a chat started with 249 new invitees on PostgreSQL took 48 ms with a round
    /// trip per number, 12–15 ms so, and 11–13 ms when memory numbered them).
    func reserveNumbers(for kind: NumberedKind, count: Int) {
        let held = numbersTaken[kind, default: []].reduce(0) { $0 + $1.count }
        guard count > held else { return }
        do {
            if let ranges = try store.takeNumbers(for: kind, count: count - held) { numbersTaken[kind, default: []] += ranges }
        } catch {
            logger.warning(
                "the store gave no number for a new \(kind.rawValue): the commit judges the next one memory has",
                metadata: ["error": "\(error)"])
        }
    }

    /// How many chats and users the engine knows (logged at start-up).
    public var chatCount: Int { chats.count }
    public var userCount: Int { users.byNumber.count }

    /// Requests taken from now on are refused ("shutting down") instead of started.
    public func beginShutdown() {
        shuttingDown.store(true, ordering: .releasing)
    }

    public var isShuttingDown: Bool { shuttingDown.load(ordering: .acquiring) }

    func storeIsBroken(_ error: Error) {
        guard brokenStore == nil else { return }
        brokenStore = error
        let reason =
            switch (error as? StoreFailure)?.kind {
            case .io?: "the store hit \(error); restart chatcore: SQLite recovers the store when it opens it"
            case .superseded?: "\(error)"
            default: "the store failed and could not be read back: \(error)"
            }
        fatalLock.withLock { fatalStoreError = reason }
        onFatalStoreError?(reason)
    }

    /// Why the store can no longer be used (the process should exit non-zero), if so.
    public var storeFailure: String? { fatalLock.withLock { fatalStoreError } }

    /// Hands the index every searchable message it does not have yet (it lags commits, may
    /// lose its tail in a crash, and is rebuilt whole when its file is lost or laid out by
    /// an older release): the store finds them by search row, on a thread of its own, so
    /// that start-up does not wait; a search waits for it (`searchRefill`).
    private func refillSearchIndex() throws {
        guard let searchIndex else { return }
        let indexed = try searchIndex.indexedUpTo()
        let upTo = lastSearchRow
        guard indexed < upTo else { return }
        logger.info(
            "the search index lacks messages: filling it from the store in the background (searches wait for it)",
            metadata: ["indexedUpTo": "\(indexed)", "storeUpTo": "\(upTo)"])
        let store = self.store
        let logger = self.logger
        searchRefill.enter()
        let thread = Thread { [searchRefill] in
            nameCurrentThread("search-refill")
            do {
                _ = try searchIndex.fill(after: indexed, upTo: upTo, from: store.searchEntries)
                searchIndex.bulkLoadEnded()
            } catch {
                logger.error("the search index could not be refilled: searches may miss messages", metadata: ["error": "\(error)"])
            }
            searchRefill.leave()
        }
        thread.start()
    }

    struct StoreInconsistency: Error, CustomStringConvertible {
        let description: String
    }

    public func start() {
        let thread = Thread { [self] in
            // Every thread names itself first thing (`nameCurrentThread` says why).
            nameCurrentThread("engine")
            run()
        }
        thread.stackSize = 8 << 20
        self.thread = thread
        thread.start()
    }

    // MARK: submitting work (any thread)

    public func openSession(transport: Transport, sink: EventSink) -> EngineSession {
        let id = sessionCounter.add(1, ordering: .relaxed).newValue
        ServiceMetrics.sessions.increment()
        ServiceMetrics.sessionsOpened.increment()
        return EngineSession(id: id, transport: transport, sink: sink)
    }

    public func submit(_ request: Request, line: Int, from session: EngineSession) {
        inbox.put(.request(request, line: line, session: session))
    }

    /// The session proved (token or trusted start) that it is `userId`. With `announce`
    /// it receives the `global` changes (authTokenState, setupState, localUri, localRegId).
    public func authenticate(userId: String, cookie: String?, line: Int, announce: Bool, session: EngineSession) {
        inbox.put(.authenticate(userId: userId, cookie: cookie, line: line, announce: announce, session: session))
    }

    /// Events the session made itself (e.g. a decode failure) that must come out after
    /// everything it submitted before.
    public func passthrough(_ events: [Event], to session: EngineSession) {
        inbox.put(.passthrough(events, session: session))
    }

    /// The session layer refused a token: the answer keeps its place behind the session's
    /// work, and changes `authTokenState` for an unauthenticated session.
    public func rejectToken(_ error: SetupError, session: EngineSession) {
        inbox.put(.tokenRejected(error, session: session))
    }

    /// The session's token expired: its `authTokenState` goes to `Needed` until a new
    /// token for its user is accepted (the session layer refuses its requests meanwhile).
    public func tokenExpired(session: EngineSession) {
        inbox.put(.tokenExpired(session: session))
    }

    public func close(_ session: EngineSession) {
        inbox.put(.close(session))
    }

    /// Runs `body` on the engine thread once everything submitted before it is done.
    public func barrier(_ body: @escaping @Sendable () -> Void) {
        inbox.put(.barrier(body))
    }

    /// Hands the outcome of storing a message's attachments to the engine thread.
    func attachmentsFinished(chat: Int64, id: Int64, thumb: String?, file: String?, error: String?) {
        inbox.put(.attachmentsStored(chat: chat, id: id, thumb: thumb, file: file, error: error))
    }

    /// Asks the engine thread to look at the clock (typing expiry).
    func tick() {
        inbox.put(.tick)
    }

    /// Another deciding process committed or said something: the engine follows it before
    /// its next batch (a store that hears of it calls this so that an idle engine does).
    public func othersActed() {
        inbox.put(.othersActed)
    }

    /// Hands work made off the engine thread to it.
    func put(_ work: Work) {
        inbox.put(work)
    }

    /// Hands several items over at once: they are taken into one batch (tests).
    func put(together work: [Work]) {
        inbox.put(contentsOf: work)
    }

    /// The session's work goes on (its parked work is taken again): what `awaitOutside`
    /// waited for is answered.
    func outsideAnswered(_ session: EngineSession) {
        awaitingOutside.remove(ObjectIdentifier(session))
    }

    /// The session's next work waits (in order) until `outsideAnswered`: its current
    /// request is being answered off the engine thread, or in later batches.
    func awaitOutside(_ session: EngineSession) {
        let key = ObjectIdentifier(session)
        awaitingOutside.insert(key)
        if parked[key] == nil {
            parked[key] = (session, [])
            parkedOrder.append(key)
        }
    }

    /// A session is preparing work off its thread (checking a token's signature) that it
    /// will submit: `drain` waits for it. Pair with `endOutsideWork` after submitting.
    public func beginOutsideWork() {
        outsideWork.add(1, ordering: .relaxed)
    }

    public func endOutsideWork() {
        outsideWork.subtract(1, ordering: .releasing)
    }

    /// Waits until everything submitted before this call is done, attachments being
    /// stored and the search index included.
    public func drain() {
        func waitForBarrier() {
            let done = DispatchSemaphore(value: 0)
            barrier { done.signal() }
            done.wait()
        }
        func idle() -> Bool {
            attachmentJobs.load(ordering: .acquiring) == 0 && parkedCount.load(ordering: .acquiring) == 0
                && outsideWork.load(ordering: .acquiring) == 0
        }
        while true {
            // Everything submitted so far is decided, so every attachment job it started
            // is counted. A job hands its outcome to the inbox before it stops counting:
            // when none counts, one more barrier has taken every outcome. Taking an outcome
            // can start more work (a search answered lets the session's next search
            // begin), so that barrier must find nothing counting either.
            waitForBarrier()
            if idle() {
                waitForBarrier()
                guard idle() else { continue }
                // The index is derived data, but a clean stop should not leave it to be
                // rebuilt at the next start.
                try? searchIndex?.waitUntilWritten()
                return
            }
            usleep(10_000)
        }
    }

    /// Ends the engine thread once everything submitted before is done (tests, fuzzing).
    /// Nothing may be submitted afterwards (`drain` would wait for ever).
    public func stop() {
        inbox.put(.stop)
    }

    /// `stop`, then waits up to `seconds` for the engine thread to end; returns whether it
    /// did. A clean stop calls it before closing the store: a node following others would
    /// otherwise go on reading (and taking connections of) a store being closed.
    public func stop(waitingAtMost seconds: Double) -> Bool {
        stop()
        return ended.wait(timeout: .now() + seconds) == .success
    }

    // MARK: the loop

    private func run() {
        var stopping = false
        while !stopping {
            // While sessions wait for their clients to read, look again every 20 ms.
            let work = inbox.take(limit: batchLimitNow, waitingAtMost: parked.isEmpty ? nil : 0.02)
            if followsOthers {
                // A wake-up to follow, or a commit done, asks nobody anything.
                followOthers(
                    thoroughly: work.contains { item in
                        switch item {
                        case .othersActed, .committed: false
                        default: true
                        }
                    })
            }
            batchNumber += 1
            let batch = Batch(cache: cache, number: batchNumber)
            batch.inboxWork = work
            var barriers: [@Sendable () -> Void] = []
            takeUnparkedWork(batch: batch)
            var answeredOutside = false
            var taken = 0
            for (index, item) in work.enumerated() {
                if batch.builtBytes > Engine.batchOutputLimit {
                    inbox.putBack(work[index...])
                    break
                }
                switch item {
                case .barrier(let body):
                    barriers.append(body)
                case .stop:
                    stopping = true
                case .committed, .othersActed:
                    continue
                case .searchFound:
                    answeredOutside = true
                    take(item, batch: batch, inboxIndex: index)
                default:
                    take(item, batch: batch, inboxIndex: index)
                }
                taken += 1
            }
            if taken > 0 { ServiceMetrics.batchSize.record(taken) }
            // The sessions whose answers came back go on at once, not at the next look.
            if answeredOutside { takeUnparkedWork(batch: batch) }
            // Before its events reach anyone, the others know who is connected here now.
            if followsOthers { announcePresence() }
            // A batch decided again (its commit conflicted) is taken again, `stop` with it.
            if end(batch, barriers: barriers, stopping: stopping) { stopping = false }
            cache.trim()
        }
        // The thread object holds this engine through its closure: let go of it.
        thread = nil
        ended.signal()
    }

    /// A batch handed to the committer: its rows, and what follows once they are durable.
    private final class Commit: @unchecked Sendable {
        let batch: Batch
        let rows: StoreBatch
        let counters: StoreCounters
        let barriers: [@Sendable () -> Void]
        /// Signalled by the committer once `error` and `took` are set (`finish`).
        let done = DispatchSemaphore(value: 0)
        /// Set with `done` (looked at between work items, without waiting).
        let finished = Atomic<Bool>(false)
        var error: Error?
        var took: Duration = .zero

        init(batch: Batch, counters: StoreCounters, barriers: [@Sendable () -> Void]) {
            self.batch = batch
            self.rows = batch.store
            self.counters = counters
            self.barriers = barriers
        }

        func finish() {
            finished.store(true, ordering: .releasing)
            done.signal()
        }
    }

    /// Ends a decided batch: its rows go to the committer and the engine goes on deciding
    /// the next batch while they are written; its events are delivered when the commit
    /// is done, after those of the batches committed before it and before anything decided
    /// later. With the store's `commitsInFlight` at 1, a batch is handed over once the one
    /// before it is durable and delivered (`settle`); with 2 (PostgreSQL), while it may
    /// still be committing (the store applies a batch only after, and only if, the one it
    /// `follows`). The next batch is decided on memory that already holds this one's
    /// changes (its changed messages stay pinned in the cache, and a query of the store
    /// waits for the commit: `commitIfChanged`), so when this commit fails every batch
    /// after it fails with it. A batch that something waits for (removing files, starting
    /// attachment copies), and the last one, are committed while the engine waits.
    ///
    /// When a commit conflicts (another node committed first to a chat it changes), the
    /// batches that failed with it are decided again instead (`redo`). Returns whether they
    /// were: their work, and `stop` when `stopping`, is then in the inbox again.
    private func end(_ batch: Batch, barriers: [@Sendable () -> Void], stopping: Bool) -> Bool {
        let later = !stopping && !batch.hasActionsAfterCommit
        settleFinished()
        if later {
            while inFlight.count >= commitsInFlight && failedCommit == nil { settleOldest() }
        } else {
            settle()
        }
        if let failed = failedCommit {
            failedCommit = nil
            if redo(failed.commits.map { ($0.batch, $0.barriers) } + [(batch, barriers)], stopping: stopping, after: failed.error) {
                return true
            }
            fail([batch] + failed.commits.reversed().map(\.batch), with: failed.error)
            for commit in failed.commits { deliver(commit.batch, then: commit.barriers) }
            deliver(batch, then: barriers)
            return false
        }
        guard later else {
            do {
                try writeChanges(batch)
            } catch {
                if redo([(batch, barriers)], stopping: stopping, after: error) { return true }
                fail([batch], with: error)
            }
            deliver(batch, then: barriers)
            return false
        }
        let counters = collect(batch)
        batch.takeAsWritten()
        if batch.store.isEmpty && inFlight.isEmpty {
            batch.committed()
            deliver(batch, then: barriers)
            return false
        }
        // The store applies it only after the last commit in flight, and only if that is.
        batch.store.follows = inFlight.last { !$0.rows.isEmpty }?.rows.sequence
        let commit = Commit(batch: batch, counters: counters, barriers: barriers)
        inFlight.append(commit)
        // A batch that wrote nothing behind commits in flight waits for them, in order.
        guard !commit.rows.isEmpty else {
            commit.finish()
            return false
        }
        let store = self.store
        committer.async { [self] in
            let started = ContinuousClock.now
            do {
                try store.commit(commit.rows)
            } catch {
                commit.error = error
            }
            commit.took = ContinuousClock.now - started
            commit.finish()
            // Wakes the engine when it waits for work: the events are due.
            put(.committed)
        }
        return false
    }

    /// Waits for the oldest batch in flight, then delivers its events. When its commit
    /// failed, the batches in flight after it are waited for too, and the failure of all
    /// of them is kept for the end of the batch being decided (`end`).
    private func settleOldest() {
        guard !inFlight.isEmpty else { return }
        let commit = inFlight.removeFirst()
        commit.done.wait()
        if let error = commit.error {
            ServiceMetrics.commitFailures.increment()
            for later in inFlight { later.done.wait() }
            failedCommit = ([commit] + inFlight, error)
            inFlight = []
            return
        }
        if !commit.rows.isEmpty {
            ServiceMetrics.committed(in: commit.took)
            conflictsResolved()
        }
        wrote(commit.batch, counters: commit.counters)
        deliver(commit.batch, then: commit.barriers)
    }

    /// Waits for every batch in flight (see `settleOldest`).
    func settle() {
        while !inFlight.isEmpty { settleOldest() }
    }

    /// Delivers the batches in flight whose commits are done, oldest first, without
    /// waiting for any.
    private func settleFinished() {
        while let oldest = inFlight.first, oldest.finished.load(ordering: .acquiring) { settleOldest() }
    }

    /// Hands the batch's events to its sessions, then runs what waited for them (`drain`'s
    /// barriers).
    private func deliver(_ batch: Batch, then barriers: [@Sendable () -> Void]) {
        batch.deliver()
        for body in barriers { body() }
    }

    /// Decides one work item into the batch, or parks it behind the session's earlier
    /// work while the session's client has too much output to take. `inboxIndex`: where it
    /// is in `batch.inboxWork` (nil: it comes from elsewhere).
    private func take(_ item: Work, batch: Batch, inboxIndex: Int? = nil) {
        if let session = item.session, session.isOpen {
            let key = ObjectIdentifier(session)
            if parked[key] != nil {
                parked[key]!.work.append(item)
                parkedCount.add(1, ordering: .relaxed)
                return
            }
            if case .request = item, !isShuttingDown,
                batch.pendingOutput(for: session) + inFlight.reduce(0, { $0 + $1.batch.builtOutput(for: session) }) > outputMark
            {
                parked[key] = (session, [item])
                parkedOrder.append(key)
                parkedCount.add(1, ordering: .relaxed)
                return
            }
        }
        // A commit that finished is delivered at once, not after everything this batch
        // takes (under a flood that would hold each batch's events for the next's decisions).
        settleFinished()
        // Between work items the cache gives back what it holds beyond its budget (never
        // what this batch changed): a request sees one record per message while it runs.
        cache.trim()
        if let inboxIndex {
            batch.took(inboxIndex: inboxIndex)
        } else {
            batch.took(item)
        }
        switch item {
        case .request(let request, let line, let session):
            batch.finish(session)
            guard session.isOpen else { return }
            if isShuttingDown {
                batch.begin(.answered, session: session)
                batch.emit(
                    ProtocolError(.internal, "the service is shutting down: the request was not started")
                        .requestFailed(request: request.name, cookie: request.cookie, line: line), to: session)
                return
            }
            batch.begin(.request(name: request.name, cookie: request.cookie, line: line), session: session)
            process(request, line: line, session: session, batch: batch)
        case .authenticate(let userId, let cookie, let line, let announce, let session):
            batch.finish(session)
            guard session.isOpen else { return }
            batch.begin(.request(name: "authToken", cookie: cookie, line: line), session: session)
            authenticate(userId: userId, cookie: cookie, line: line, announce: announce, session: session, batch: batch)
        case .passthrough(let events, let session):
            batch.finish(session)
            batch.begin(.answered, session: session)
            for event in events { batch.emit(event, to: session) }
        case .tokenRejected(let error, let session):
            batch.finish(session)
            batch.begin(.answered, session: session)
            tokenRejected(error, session: session, batch: batch)
        case .tokenExpired(let session):
            batch.finish(session)
            guard session.isOpen else { return }
            batch.begin(.answered, session: session)
            tokenExpired(session: session, batch: batch)
        case .close(let session):
            batch.begin(.internal, session: nil)
            detach(session)
        case .tick:
            batch.begin(.internal, session: nil)
            tickScheduled = false
            expireTyping(batch: batch)
        case .continueList(let list):
            listContinues(list, batch: batch)
        case .continueRecall(let recall):
            recallContinues(recall, batch: batch)
        case .deliverDue:
            batch.begin(.internal, session: nil)
            do {
                try deliverDue(batch: batch)
            } catch {
                logger.warning("deliveries were not marked: the store could not be read", metadata: ["error": "\(error)"])
            }
        case .attachmentsStored(let chat, let id, let thumb, let file, let error):
            batch.begin(.internal, session: nil)
            attachmentsStored(chat: chat, id: id, thumb: thumb, file: file, error: error, batch: batch)
        case .searchFound(let request, let line, let chatIds, let user, let hits, let session):
            outsideAnswered(session)
            quotas.endSearch(by: user)
            guard session.isOpen else { return }
            searchFound(request, line: line, chatIds: chatIds, user: user, hits: hits, session: session, batch: batch)
        case .deliverFollowed(let numbers):
            batch.begin(.internal, session: nil)
            deliverFollowed(numbers, batch: batch)
        case .barrier, .stop, .committed, .othersActed:
            break
        }
    }

    /// Takes the parked work of every session whose client has taken enough of its output
    /// (or that closed, or of everyone when shutting down), in the order it was parked.
    /// Each item stops counting as parked only once it is taken (parked again, or begun):
    /// `drain` may read the count in the middle (a commit that settles runs its barriers),
    /// and work let go of and not yet taken must not look done. It did: a search at the
    /// end of the input, parked behind a large output, was let go of, `drain` saw nothing
    /// left, the session closed, and the search's answer was dropped.
    private func takeUnparkedWork(batch: Batch) {
        for item in unparkedWork() {
            take(item, batch: batch)
            parkedCount.subtract(1, ordering: .releasing)
        }
    }

    /// The parked work that `takeUnparkedWork` takes, still counted as parked; with
    /// `whateverTheBacklog`, that of every session not waiting for an answer from outside
    /// (`redo`).
    private func unparkedWork(whateverTheBacklog: Bool = false) -> [Work] {
        guard !parked.isEmpty else { return [] }
        var released: [Work] = []
        let everyone = whateverTheBacklog || isShuttingDown
        parkedOrder.removeAll { key in
            guard let entry = parked[key] else { return true }
            guard !awaitingOutside.contains(key) else { return false }
            let backlog = entry.session.sink?.backlog ?? 0
            guard everyone || !entry.session.isOpen || backlog <= outputMark / 2 else { return false }
            released += entry.work
            parked[key] = nil
            return true
        }
        return released
    }

    /// Writes what the batch changed so far in one transaction, then hands the text of
    /// what was committed to the search index and carries out what had to wait for the
    /// commit (removing files, starting attachment copies). On a throw nothing was
    /// written and the batch keeps its rows.
    private func writeChanges(_ batch: Batch) throws {
        let counters = collect(batch)
        if !batch.store.isEmpty {
            // Nothing is in flight (callers settle first): it follows no commit.
            let started = ContinuousClock.now
            do {
                try store.commit(batch.store)
            } catch {
                ServiceMetrics.commitFailures.increment()
                throw error
            }
            ServiceMetrics.committed(in: ContinuousClock.now - started)
            conflictsResolved()
            wrote(batch, counters: counters)
        } else {
            batch.committed()
        }
    }

    /// Turns what the batch changed into its store rows, numbered as the next commit when
    /// there are any (`StoreBatch.sequence`); returns the counters they hold.
    private func collect(_ batch: Batch) -> StoreCounters {
        let counters = StoreCounters(changeSeq: changeSeq, slot: feedSlot, searchRow: lastSearchRow)
        // The counters as the store will hold them once the commits in flight are applied
        // (this one is applied only after them): unmoved, they are not written again, and
        // a batch that changed nothing is not committed at all.
        let stored = inFlight.last { !$0.rows.isEmpty }?.counters ?? storedCounters
        batch.collectRows(counters: counters == stored ? nil : counters)
        // Each chat changed is decided on the version memory has; the next commit expects
        // the one after (a commit in flight that fails makes memory be read again). A
        // batch that writes nothing is not committed, so it moves no version on.
        if comparesChatVersions && !batch.store.isEmpty {
            batch.store.chatVersions = batch.changedChats.sorted().compactMap { number in
                guard let chat = chats[number] else { return nil }
                defer { chat.version += 1 }
                return ChatVersion(chat: number, version: chat.version)
            }
        }
        if !batch.store.isEmpty {
            lastSequence += 1
            batch.store.sequence = lastSequence
            batch.store.feedSlot = feedSlot
        }
        return counters
    }

    /// The batch's rows are durable: the index gets their text, and what waited is done.
    private func wrote(_ batch: Batch, counters: StoreCounters) {
        storedCounters = counters
        searchIndex?.add(batch.takeSearchAdds(), removing: batch.takeSearchRemovals())
        batch.committed()
    }

    /// Commits what the batch changed so far (before reading from the store), after the
    /// batch before it. If that fails, the batch keeps its rows: its final commit fails
    /// again and answers all. If it conflicted, the batch is decided again at its end
    /// (`redo`), whatever its final commit would do, and nothing more of it reads the store.
    func commitSoFar(_ batch: Batch) throws {
        try settleBeforeReading()
        do {
            try writeChanges(batch)
        } catch {
            if (error as? StoreFailure)?.kind == .conflict { failedCommit = ([], error) }
            throw ProtocolError(.internal, Engine.storeFailure(error))
        }
    }

    /// Waits until the store has the batches before this one (before reading what they
    /// changed); throws when a commit failed (this batch then fails whole at its end).
    func settleBeforeReading() throws {
        settle()
        if let failedCommit {
            throw ProtocolError(.internal, Engine.storeFailure(failedCommit.error))
        }
    }

    /// Whether a batch being committed changed `chat` (the store may not have it yet).
    func committing(_ chat: Int64) -> Bool {
        inFlight.contains { $0.batch.hasUncommittedChanges(in: chat) }
    }

    static func storeFailure(_ error: Error) -> String {
        "the store failed to commit the change, so nothing of this request was done (\(error))"
    }

    /// Decides the work of `batches` (oldest first, each with the barriers waiting for
    /// it) again, when their commit conflicted (`StoreFailure.Kind.conflict`: another node
    /// committed first to a chat they change): memory is read again from the store, each
    /// batch keeps only its durable events (`Batch.takeBack`) and delivers them, and its
    /// other work goes back to the front of the inbox, in order, ahead of everything that
    /// came later, so the next batch decides it on what the store has now. Work parked
    /// behind it (a session whose client was slow) follows it there, except that of
    /// sessions waiting for a search's answer (their work was never in these batches);
    /// barriers and `stop` come last. A conflict on chats not read yet is progress: a node
    /// whose memory of many chats is behind meets them one batch at a time. One on chats
    /// just read again (another node moved them on again) makes batches smaller
    /// (`batchLimitNow`). Returns false, having done nothing, when the failure is no
    /// conflict, when the store cannot be read, or when `maxRedos` such conflicts came
    /// with batches of one work item, since a commit was last applied (the caller answers
    /// `Internal`).
    private func redo(_ batches: [(batch: Batch, barriers: [@Sendable () -> Void])], stopping: Bool, after error: Error) -> Bool {
        let uncommitted = Engine.uncommitted(batches.map(\.batch))
        let repeated = readAfterConflicts.map { read in uncommitted?.isSubset(of: read) ?? false } ?? true
        guard (error as? StoreFailure)?.kind == .conflict, !repeated || repeatedConflicts < Engine.maxRedos else { return false }
        do {
            try readAgain(uncommitted)
        } catch {
            return false
        }
        if followsOthers { readAhead(uncommitted) }
        readAfterConflicts = uncommitted.flatMap { chats in readAfterConflicts?.union(chats) }
        ServiceMetrics.commitConflicts.increment()
        logger.info("a commit conflicted with another node's: deciding its requests again", metadata: ["error": "\(error)"])
        var work: [[Work]] = []
        for (batch, _) in batches.reversed() {
            let (taken, setups) = batch.takeBack()
            putBack(setups)
            work.insert(taken, at: 0)
        }
        for (batch, _) in batches { batch.deliver() }
        var again = work.flatMap { $0 }
        let released = unparkedWork(whateverTheBacklog: true)
        again += released
        again += batches.flatMap(\.barriers).map { Work.barrier($0) }
        if stopping { again.append(.stop) }
        if repeated {
            // Smaller batches are progress too: only conflicts of one work item at a time
            // count toward answering `Internal`.
            if batchLimitNow == 1 { repeatedConflicts += 1 }
            batchLimitNow = max(1, batchLimitNow / 4)
        }
        inbox.putBack(again)
        // Counted as parked until they are in the inbox (`drain` looks at both).
        parkedCount.subtract(released.count, ordering: .releasing)
        return true
    }

    /// How many conflicts that found nothing more to read, with batches of one work item,
    /// may be decided again before the batch is answered `Internal` (`redo`).
    static let maxRedos = 8

    /// Sessions whose setup uncommitted work changed are as they were before it (`setups`:
    /// the latest change first).
    private func putBack(_ setups: [(session: EngineSession, before: EngineSession.Setup)]) {
        for (session, before) in setups {
            unregister(session)
            session.setup = before
            if let user = session.user, session.isOpen {
                sessionsByUser[user, default: []].append(session)
                sessionsChanged(of: user)
            }
        }
    }

    /// A commit was applied: conflicts start over, and batches grow again.
    private func conflictsResolved() {
        readAfterConflicts = []
        repeatedConflicts = 0
        if batchLimitNow < Engine.batchLimit { batchLimitNow = min(Engine.batchLimit, batchLimitNow * 2) }
    }

    /// The commit of `batches` (the latest first) failed. Nothing since their last
    /// commit is durable: none of their events may be seen, every request they held gets
    /// one Internal answer, sessions they authenticated are unauthenticated again (the
    /// latest change undone first), and memory of what they changed is read again from the
    /// store (`readAgain`), so no number handed out by them is remembered.
    private func fail(_ batches: [Batch], with error: Error) {
        logger.error("commit failed: the requests of the batch are answered with Internal", metadata: ["error": "\(error)"])
        let uncommitted = Engine.uncommitted(batches)
        for batch in batches {
            putBack(batch.failAll(reason: Engine.storeFailure(error)))
        }
        if let failure = error as? StoreFailure, failure.stopsTheService {
            // SQLite keeps the connection in an error state after an I/O error, and
            // the kernel may have dropped what it did not sync: only opening the store
            // again (a restart, which recovers the WAL) is sound. Another writer
            // (superseded) may have changed what memory holds. Refuse everything from
            // now on and let the process answer what it has and stop.
            logger.critical(
                failure.kind == .io ? "the store hit an I/O error: stopping" : "another process writes the store: stopping",
                metadata: ["error": "\(failure)"])
            storeIsBroken(failure)
            return
        }
        if followsOthers { readAhead(uncommitted) }
        do {
            try readAgainWaiting(uncommitted)
        } catch {
            // Memory and store may now disagree: serving on could announce what is
            // not durable. Every answer decided so far is delivered by the caller's
            // shutdown path; the process must not go on.
            logger.critical("cannot reload the store after a failed commit: stopping", metadata: ["error": "\(error)"])
            storeIsBroken(error)
        }
    }

    /// How long memory is tried to be read back after a failed commit before the service
    /// stops (`readAgainWaiting`).
    static let readBackPatience = 10.0

    /// `readAgain`, tried again every 0.2 s for up to `readBackPatience` while it fails: a
    /// commit fails most often because the store went away for a moment (PostgreSQL
    /// restarting), and a read right after it can still meet a connection the server
    /// closed before the process saw it close. Each try reads everything it needs again
    /// before memory takes it, so one that failed half-way leaves nothing to undo.
    private func readAgainWaiting(_ numbers: Set<Int64>?) throws {
        let deadline = ContinuousClock.now + .seconds(Engine.readBackPatience)
        while true {
            do {
                return try readAgain(numbers)
            } catch {
                guard ContinuousClock.now < deadline else { throw error }
                logger.warning("cannot read the store back after a failed commit: trying again", metadata: ["error": "\(error)"])
                Thread.sleep(forTimeInterval: 0.2)
            }
        }
    }

    private func process(_ request: Request, line: Int, session: EngineSession, batch: Batch) {
        do {
            if let brokenStore {
                throw ProtocolError(.internal, "the store failed and the service is stopping: \(brokenStore)")
            }
            guard let user = session.user else {
                if try serveBeforeSetUp(request, session: session, line: line, batch: batch) { return }
                throw notSetUp(session)
            }
            try handle(request, user: user, session: session, line: line, batch: batch)
        } catch {
            refuse(request.name, cookie: request.cookie, line: line, with: error, session: session, batch: batch)
        }
    }

    /// The `requestFailed` answer to a request that threw `error` (Internal when it is not
    /// a protocol error).
    func refuse(_ name: String, cookie: String?, line: Int, with error: Error, session: EngineSession, batch: Batch) {
        let failure = error as? ProtocolError ?? ProtocolError(.internal, "\(error)")
        batch.emit(failure.requestFailed(request: name, cookie: cookie, line: line), to: session)
    }

    /// A request answered a page per batch goes on with `next` in a later batch, once this
    /// one is committed; the session's later requests wait for it (`resume`). A page whose
    /// commit fails ends it, and they go on.
    func continueLater(_ next: Work, for session: EngineSession, batch: Batch) {
        awaitOutside(session)
        batch.whenCommitted { [self] in put(next) }
        batch.ifNotCommitted { [self] in outsideAnswered(session) }
    }

    /// The next page of a request `continueLater` put off, as part of that request
    /// (`name`, `cookie`, `line`); nothing when its session has closed since.
    func resume(_ name: String, cookie: String?, line: Int, session: EngineSession, batch: Batch, page: () throws -> Void) {
        outsideAnswered(session)
        guard session.isOpen else { return }
        batch.begin(.request(name: name, cookie: cookie, line: line), session: session)
        do {
            try page()
        } catch {
            refuse(name, cookie: cookie, line: line, with: error, session: session, batch: batch)
        }
    }

    private func detach(_ session: EngineSession) {
        if session.isOpen { ServiceMetrics.sessions.decrement() }
        session.isOpen = false
        unregister(session)
    }

    /// The session no longer receives its user's events.
    func unregister(_ session: EngineSession) {
        guard let user = session.user else { return }
        sessionsByUser[user]?.removeAll { $0 === session }
        if sessionsByUser[user]?.isEmpty == true { sessionsByUser[user] = nil }
        sessionsChanged(of: user)
    }
}
