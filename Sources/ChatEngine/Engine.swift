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
public final class Engine: @unchecked Sendable {  // its parts are the engine thread's alone (checked in debug builds); other threads only put work in its inbox
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
        /// Notifications the notifier took, to be turned into what it sends (`compose`).
        case composeNotifications([NotificationRow], previewLength: Int, reply: @Sendable ([NotificationOutcome]) -> Void)
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
    /// How often the engine looks for reads it can answer while it waits for a commit
    /// (`answerReadsWhileWaiting`), in seconds.
    static let readLookInterval = 0.001
    /// Events a batch may build for its sessions before the rest of its work is left to
    /// the next batch. A batch's events are held until its commit: without a bound, 4,096
    /// sends of 70 KB into a chat whose users have many endpoints would be held at once
    /// (70 KB × 4,096 × each endpoint).
    static let batchOutputLimit = 16 << 20
    /// `listChunk` carries at most this many elements (§4).
    static let chunkSize = 500

    let store: ChatStore
    /// How this process shares the store with others that decide on it (`SoloNode` when
    /// it is alone on it).
    let coordination: NodeCoordination
    let logger: Logger
    /// Seconds since 1970: message timestamps.
    let clock: @Sendable () -> Int64
    /// The messages in memory: the hot ones, up to a budget.
    let cache: MessageCache
    /// What each user may cost the others (rates, searches at once).
    var quotas: Quotas
    /// Whether and when recipients who are not connected are notified (nil: never).
    let notificationPolicy: NotificationPolicy?

    // The parts, each owning one concern's state (EngineParts.swift). They are the
    // engine thread's: each is reached through an accessor that checks so in debug
    // builds. What other threads may touch (atomics, queues, the inbox) is reached
    // through the stored property itself, beside a comment that says so.
    private let _directory = Directory()
    let _outputs: SessionOutputs
    private let _commits: Commits
    let _following: Following
    let _searches: Searches
    let _attachmentWork: AttachmentWork
    private let _timed = TimedWork()
    private let _presence = Presence()
    /// Any thread's: the inbox, atomics and locked values only.
    let life: EngineLife

    var directory: Directory {
        confined()
        return _directory
    }
    var outputs: SessionOutputs {
        confined()
        return _outputs
    }
    var commits: Commits {
        confined()
        return _commits
    }
    var following: Following {
        confined()
        return _following
    }
    var searches: Searches {
        confined()
        return _searches
    }
    var attachmentWork: AttachmentWork {
        confined()
        return _attachmentWork
    }
    var timed: TimedWork {
        confined()
        return _timed
    }
    var presence: Presence {
        confined()
        return _presence
    }

    /// Checks (debug builds) that this is the engine thread, or that it has not started
    /// yet (the engine is being made). Nothing in release builds: the accessors above
    /// are then the stored parts themselves.
    @inline(__always)
    private func confined() {
        #if DEBUG
            let owner = life.owner.load(ordering: .relaxed)
            precondition(owner == 0 || owner == EngineLife.currentThread, "the engine's state was reached off the engine thread")
        #endif
    }

    /// Whether a commit failed and its batches wait to be decided again or answered (`end`).
    var hasFailedCommit: Bool { commits.failed != nil }
    /// Whether other processes decide on the store beside this one: what they do is
    /// followed before each batch.
    public var followsOthers: Bool { _following.othersDecide }  // immutable: any thread

    /// `clock` gives message timestamps (seconds since 1970); tests pass a fixed one.
    /// `cacheBytes` bounds the messages kept in memory. `feedSlot`: where this process
    /// numbers its changes in the feed, one slot per process deciding on the store (nil:
    /// the store's, `ChatStore.feedSlot`).
    /// `onFatalStoreError` is called (once, on the engine thread) when the store failed in
    /// a way the engine cannot recover from; the process should answer what it has and
    /// exit non-zero.
    public init(
        store: ChatStore, coordination: NodeCoordination = SoloNode(), logger: Logger, searchIndex: MessageSearchIndex? = nil,
        attachments: AttachmentStore? = nil,
        attachmentsDirectory: String? = nil, cacheBytes: Int = Engine.defaultCacheBytes, feedSlot: Int? = nil,
        quotas: QuotaLimits = QuotaLimits(), notifications: NotificationPolicy? = nil,
        clock: @escaping @Sendable () -> Int64 = Engine.wallClock,
        onFatalStoreError: (@Sendable (String) -> Void)? = nil
    ) throws {
        self.quotas = Quotas(limits: quotas)
        self.notificationPolicy = notifications
        let feedSlot = feedSlot ?? coordination.feedSlot
        precondition((0..<FeedSlots.count).contains(feedSlot), "a feed slot is below \(FeedSlots.count)")
        self.cache = MessageCache(budget: cacheBytes)
        self.store = store
        self.coordination = coordination
        self.logger = logger
        self.clock = clock
        self._outputs = SessionOutputs(mark: quotas.outputMark)
        self._commits = Commits(limit: max(1, store.commitsInFlight), comparesChatVersions: coordination.comparesChatVersions)
        self._following = Following(othersDecide: coordination.othersDecide, feedSlot: feedSlot)
        self._searches = Searches(index: searchIndex)
        self._attachmentWork = AttachmentWork(store: attachments, allowedDirectory: attachmentsDirectory)
        self.life = EngineLife(onFatalStoreError: onFatalStoreError)
        // From here on: what the others commit while memory is read is followed again
        // (reading a chat again is harmless), never missed.
        if followsOthers { following.cursor = try coordination.othersActivity(besides: feedSlot, after: nil, thoroughly: true)?.cursor }
        try reload()
    }

    /// Seconds since 1970 now: message timestamps, unless a test fixes them.
    public static let wallClock: @Sendable () -> Int64 = { Int64(Date().timeIntervalSince1970) }

    /// The wall clock in milliseconds since 1970 (notifications' times).
    public static func milliseconds() -> Int64 { Int64((Date().timeIntervalSince1970 * 1000).rounded(.down)) }

    /// What the messages in memory may take by default (`--cache-mb`).
    public static let defaultCacheBytes = 64 << 20

    /// How many chats and users the engine knows (logged at start-up, before `start`).
    public var chatCount: Int { directory.chats.count }
    public var userCount: Int { directory.users.byNumber.count }

    /// Requests taken from now on are refused ("shutting down") instead of started.
    public func beginShutdown() {
        life.shuttingDown.store(true, ordering: .releasing)
    }

    public var isShuttingDown: Bool { life.shuttingDown.load(ordering: .acquiring) }

    func storeIsBroken(_ error: Error) {
        guard commits.brokenStore == nil else { return }
        commits.brokenStore = error
        let reason =
            switch (error as? StoreFailure)?.kind {
            case .io?: "the store hit \(error); restart chatcore: SQLite recovers the store when it opens it"
            case .superseded?: "\(error)"
            default: "the store failed and could not be read back: \(error)"
            }
        life.fatalStoreError.withLock { $0 = reason }
        life.onFatalStoreError?(reason)
    }

    /// Why the store can no longer be used (the process should exit non-zero), if so.
    public var storeFailure: String? { life.fatalStoreError.withLock { $0 } }

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
        self.life.thread = thread
        thread.start()
    }

    // MARK: submitting work (any thread)

    public func openSession(transport: Transport, sink: EventSink) -> EngineSession {
        let id = life.sessionCounter.add(1, ordering: .relaxed).newValue
        ServiceMetrics.sessions.increment()
        ServiceMetrics.sessionsOpened.increment()
        return EngineSession(id: id, transport: transport, sink: sink)
    }

    public func submit(_ request: Request, line: Int, from session: EngineSession) {
        life.inbox.put(.request(request, line: line, session: session))
    }

    /// The session proved (token or trusted start) that it is `userId`. With `announce`
    /// it receives the `global` changes (authTokenState, setupState, localUri, localRegId).
    public func authenticate(userId: String, cookie: String?, line: Int, announce: Bool, session: EngineSession) {
        life.inbox.put(.authenticate(userId: userId, cookie: cookie, line: line, announce: announce, session: session))
    }

    /// Events the session made itself (e.g. a decode failure) that must come out after
    /// everything it submitted before.
    public func passthrough(_ events: [Event], to session: EngineSession) {
        life.inbox.put(.passthrough(events, session: session))
    }

    /// The session layer refused a token: the answer keeps its place behind the session's
    /// work, and changes `authTokenState` for an unauthenticated session.
    public func rejectToken(_ error: SetupError, session: EngineSession) {
        life.inbox.put(.tokenRejected(error, session: session))
    }

    /// The session's token expired: its `authTokenState` goes to `Needed` until a new
    /// token for its user is accepted (the session layer refuses its requests meanwhile).
    public func tokenExpired(session: EngineSession) {
        life.inbox.put(.tokenExpired(session: session))
    }

    public func close(_ session: EngineSession) {
        life.inbox.put(.close(session))
    }

    /// Runs `body` on the engine thread once everything submitted before it is done.
    public func barrier(_ body: @escaping @Sendable () -> Void) {
        life.inbox.put(.barrier(body))
    }

    /// Hands the outcome of storing a message's attachments to the engine thread.
    func attachmentsFinished(chat: Int64, id: Int64, thumb: String?, file: String?, error: String?) {
        life.inbox.put(.attachmentsStored(chat: chat, id: id, thumb: thumb, file: file, error: error))
    }

    /// Asks the engine thread to look at the clock (typing expiry).
    func tick() {
        life.inbox.put(.tick)
    }

    /// Another deciding process committed or said something: the engine follows it before
    /// its next batch (a store that hears of it calls this so that an idle engine does).
    public func othersActed() {
        life.inbox.put(.othersActed)
    }

    /// Hands work made off the engine thread to it.
    func put(_ work: Work) {
        life.inbox.put(work)
    }

    /// Hands several items over at once: they are taken into one batch (tests).
    func put(together work: [Work]) {
        life.inbox.put(contentsOf: work)
    }

    /// The session's work goes on (its parked work is taken again): what `awaitOutside`
    /// waited for is answered.
    func outsideAnswered(_ session: EngineSession) {
        outputs.outsideAnswered(session)
    }

    /// The session's next work waits (in order) until `outsideAnswered`: its current
    /// request is being answered off the engine thread, or in later batches.
    func awaitOutside(_ session: EngineSession) {
        outputs.awaitOutside(session)
    }

    /// A session is preparing work off its thread (checking a token's signature) that it
    /// will submit: `drain` waits for it. Pair with `endOutsideWork` after submitting.
    public func beginOutsideWork() {
        _outputs.outsideWork.add(1, ordering: .relaxed)
    }

    public func endOutsideWork() {
        _outputs.outsideWork.subtract(1, ordering: .releasing)
        life.settle()
    }

    /// Waits until everything submitted before this call is done, attachments being
    /// stored and the search index included.
    public func drain() {
        func waitForBarrier() {
            let done = Locked(false)
            barrier { done.change { $0 = true } }
            done.wait(until: { $0 }) { _ in }
        }
        func idle() -> Bool {
            _attachmentWork.jobs.load(ordering: .acquiring) == 0 && _outputs.parkedCount.load(ordering: .acquiring) == 0
                && _outputs.outsideWork.load(ordering: .acquiring) == 0
        }
        while true {
            let seen = life.settled.withLock { $0 }
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
                try? _searches.index?.waitUntilWritten()  // immutable: any thread
                return
            }
            // Until something outside the inbox ends (nothing is missed: a change since
            // `seen` ends the wait at once).
            life.settled.wait(until: { $0 != seen }) { _ in }
        }
    }

    /// Ends the engine thread once everything submitted before is done (tests, fuzzing).
    /// Nothing may be submitted afterwards (`drain` would wait for ever).
    public func stop() {
        life.inbox.put(.stop)
    }

    /// `stop`, then waits up to `seconds` for the engine thread to end; returns whether it
    /// did. A clean stop calls it before closing the store: a node following others would
    /// otherwise go on reading (and taking connections of) a store being closed.
    public func stop(waitingAtMost seconds: Double) -> Bool {
        stop()
        return life.ended.wait(until: { $0 }, deadline: Date(timeIntervalSinceNow: seconds)) { $0 }
    }

    // MARK: the loop

}
