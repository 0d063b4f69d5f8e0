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
    /// `listChunk` carries at most this many elements (§4).
    static let chunkSize = 500

    let store: ChatStore
    let logger: Logger
    /// Seconds since 1970: message timestamps.
    let clock: @Sendable () -> Int64
    /// The messages in memory: the hot ones, up to a budget.
    let cache: MessageCache
    /// What each user may cost the others (rates, searches at once).
    var quotas: Quotas

    // The parts, each owning one concern's state (EngineParts.swift).
    let directory = Directory()
    let outputs: SessionOutputs
    let commits: Commits
    let following: Following
    let searches: Searches
    let attachmentWork: AttachmentWork
    let timed = TimedWork()
    let life: EngineLife

    /// Whether a commit failed and its batches wait to be decided again or answered (`end`).
    var hasFailedCommit: Bool { commits.failed != nil }
    /// Whether other processes decide on the store beside this one: what they do is
    /// followed before each batch.
    public var followsOthers: Bool { following.othersDecide }

    /// `clock` gives message timestamps (seconds since 1970); tests pass a fixed one.
    /// `cacheBytes` bounds the messages kept in memory. `feedSlot`: where this process
    /// numbers its changes in the feed, one slot per process deciding on the store (nil:
    /// the store's, `ChatStore.feedSlot`).
    /// `onFatalStoreError` is called (once, on the engine thread) when the store failed in
    /// a way the engine cannot recover from; the process should answer what it has and
    /// exit non-zero.
    public init(
        store: ChatStore, logger: Logger, searchIndex: MessageSearchIndex? = nil, attachments: AttachmentStore? = nil,
        attachmentsDirectory: String? = nil, cacheBytes: Int = Engine.defaultCacheBytes, feedSlot: Int? = nil,
        quotas: QuotaLimits = QuotaLimits(),
        clock: @escaping @Sendable () -> Int64 = Engine.wallClock,
        onFatalStoreError: (@Sendable (String) -> Void)? = nil
    ) throws {
        self.quotas = Quotas(limits: quotas)
        let feedSlot = feedSlot ?? store.feedSlot
        precondition((0..<FeedSlots.count).contains(feedSlot), "a feed slot is below \(FeedSlots.count)")
        self.cache = MessageCache(budget: cacheBytes)
        self.store = store
        self.logger = logger
        self.clock = clock
        self.outputs = SessionOutputs(mark: quotas.outputMark)
        self.commits = Commits(limit: max(1, store.commitsInFlight), comparesChatVersions: store.comparesChatVersions)
        self.following = Following(othersDecide: store.othersDecide, feedSlot: feedSlot)
        self.searches = Searches(index: searchIndex)
        self.attachmentWork = AttachmentWork(store: attachments, allowedDirectory: attachmentsDirectory)
        self.life = EngineLife(onFatalStoreError: onFatalStoreError)
        // From here on: what the others commit while memory is read is followed again
        // (reading a chat again is harmless), never missed.
        if followsOthers { following.cursor = try store.othersActivity(besides: feedSlot, after: nil, thoroughly: true)?.cursor }
        try reload()
    }

    /// Seconds since 1970 now: message timestamps, unless a test fixes them.
    public static let wallClock: @Sendable () -> Int64 = { Int64(Date().timeIntervalSince1970) }

    /// What the messages in memory may take by default (`--cache-mb`).
    public static let defaultCacheBytes = 64 << 20

    /// Reads what is per user and per chat from the store (never every message): at
    /// start-up, and after a failed commit, when memory must be what the store has.
    func reload() throws {
        let loaded = try store.loadDirectory()
        directory.users = UserDirectory(loaded.users)
        directory.endpoints = [:]
        directory.endpointsOfUser = [:]
        directory.lastEndpointOrdinal = 0
        for row in loaded.endpoints {
            directory.endpoints[row.id] = EndpointRecord(row)
            directory.endpointsOfUser[row.user, default: []].append(row.id)
            directory.lastEndpointOrdinal = max(directory.lastEndpointOrdinal, row.ordinal)
        }
        directory.chats = [:]
        directory.chatsOfUser = [:]
        directory.lastChatNumber = 0
        install(loaded)
        cache.removeAll()
        timed.typing = [:]
        following.followedFeed = loaded.feedPositions
        try refillSearchIndex()
    }

    /// The directory's chats with their memberships, and its counters, into memory
    /// (unless not `takingCounters`).
    private func install(_ loaded: StoreDirectory, takingCounters: Bool = true) {
        for row in loaded.chats {
            let chat = ChatRecord(row)
            chat.version = loaded.chatVersions[row.number] ?? 0
            directory.chats[row.number] = chat
            directory.lastChatNumber = max(directory.lastChatNumber, row.number)
        }
        for row in loaded.members {
            guard let chat = directory.chats[row.chat] else { continue }
            chat.members[row.user] = MemberRecord(row)
            if row.isActive { directory.chatsOfUser[row.user, default: []].insert(row.chat) }
        }
        guard takingCounters else { return }
        directory.changeSeq = loaded.feedPositions[following.feedSlot] ?? FeedSlots.base(of: following.feedSlot)
        searches.lastRow = loaded.counters.searchRow
        directory.storedCounters = StoreCounters(changeSeq: directory.changeSeq, slot: following.feedSlot, searchRow: searches.lastRow)
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
        _ numbers: Set<Int64>, with loaded: StoreDirectory, droppingOnly messages: [Int64: Set<Int64>]? = nil,
        takingCounters: Bool = true
    ) {
        if let messages {
            for (chat, ids) in messages { cache.remove(chat: chat, ids: ids) }
        } else {
            cache.remove(chats: numbers)
        }
        for number in numbers {
            guard let old = directory.chats.removeValue(forKey: number) else { continue }
            for (user, member) in old.members where member.isActive {
                directory.chatsOfUser[user]?.remove(number)
                if directory.chatsOfUser[user]?.isEmpty == true { directory.chatsOfUser[user] = nil }
            }
        }
        // A chat the batches made is not in the store: its number is free again.
        if loaded.chats.count < numbers.count && numbers.contains(directory.lastChatNumber) { directory.lastChatNumber = directory.chats.keys.max() ?? 0 }
        install(loaded, takingCounters: takingCounters)
    }

    /// The number of a new chat, user or search row: the store's (`ChatStore.takeNumbers`,
    /// kept a block at a time), which no other deciding process takes, or the one after
    /// `last`, the highest memory knows, when this process numbers them itself. When the
    /// store cannot give one, `last + 1` too, and the commit judges it: it fails as taking
    /// the number did (the store is unreachable), or conflicts when another process has
    /// that number (and the request is decided again), or stores it.
    func newNumber(for kind: NumberedKind, after last: Int64) -> Int64 {
        if directory.numbersTaken[kind]?.isEmpty ?? true { reserveNumbers(for: kind, count: 1) }
        guard var ranges = directory.numbersTaken[kind], let first = ranges.first else { return last + 1 }
        if first.count > 1 {
            ranges[0] = (first.lowerBound + 1)...first.upperBound
        } else {
            ranges.removeFirst()
        }
        directory.numbersTaken[kind] = ranges
        return first.lowerBound
    }

    /// Makes sure memory holds `count` numbers of `kind` from the store, taking what it
    /// lacks in one round trip: a request about to make many users asks for them all
    /// first (a chat started with 249 new invitees on PostgreSQL took 48 ms with a round
    /// trip per number, 12–15 ms so, and 11–13 ms when memory numbered them).
    func reserveNumbers(for kind: NumberedKind, count: Int) {
        let held = directory.numbersTaken[kind, default: []].reduce(0) { $0 + $1.count }
        guard count > held else { return }
        do {
            if let ranges = try store.takeNumbers(for: kind, count: count - held) { directory.numbersTaken[kind, default: []] += ranges }
        } catch {
            logger.warning(
                "the store gave no number for a new \(kind.rawValue): the commit judges the next one memory has",
                metadata: ["error": "\(error)"])
        }
    }

    /// How many chats and users the engine knows (logged at start-up).
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

    /// Hands the index every searchable message it does not have yet (it lags commits, may
    /// lose its tail in a crash, and is rebuilt whole when its file is lost or laid out by
    /// an older release): the store finds them by search row, on a thread of its own, so
    /// that start-up does not wait; a search waits for it (`searchRefill`).
    private func refillSearchIndex() throws {
        guard let searchIndex = searches.index else { return }
        let indexed = try searchIndex.indexedUpTo()
        let upTo = searches.lastRow
        guard indexed < upTo else { return }
        logger.info(
            "the search index lacks messages: filling it from the store in the background (searches wait for it)",
            metadata: ["indexedUpTo": "\(indexed)", "storeUpTo": "\(upTo)"])
        let store = self.store
        let logger = self.logger
        searches.refill.enter()
        let thread = Thread { [searchRefill = searches.refill] in
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
        outputs.awaitingOutside.remove(ObjectIdentifier(session))
    }

    /// The session's next work waits (in order) until `outsideAnswered`: its current
    /// request is being answered off the engine thread, or in later batches.
    func awaitOutside(_ session: EngineSession) {
        let key = ObjectIdentifier(session)
        outputs.awaitingOutside.insert(key)
        if outputs.parked[key] == nil {
            outputs.parked[key] = (session, [])
            outputs.parkedOrder.append(key)
        }
    }

    /// A session is preparing work off its thread (checking a token's signature) that it
    /// will submit: `drain` waits for it. Pair with `endOutsideWork` after submitting.
    public func beginOutsideWork() {
        outputs.outsideWork.add(1, ordering: .relaxed)
    }

    public func endOutsideWork() {
        outputs.outsideWork.subtract(1, ordering: .releasing)
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
            attachmentWork.jobs.load(ordering: .acquiring) == 0 && outputs.parkedCount.load(ordering: .acquiring) == 0
                && outputs.outsideWork.load(ordering: .acquiring) == 0
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
                try? searches.index?.waitUntilWritten()
                return
            }
            usleep(10_000)
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
        return life.ended.wait(timeout: .now() + seconds) == .success
    }

    // MARK: the loop

    private func run() {
        var stopping = false
        while !stopping {
            // While sessions wait for their clients to read, look again every 20 ms.
            let work = life.inbox.take(limit: commits.batchLimitNow, waitingAtMost: outputs.parked.isEmpty ? nil : 0.02)
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
            commits.batchNumber += 1
            let batch = Batch(cache: cache, number: commits.batchNumber)
            batch.inboxWork = work
            var barriers: [@Sendable () -> Void] = []
            takeUnparkedWork(batch: batch)
            var answeredOutside = false
            var taken = 0
            for (index, item) in work.enumerated() {
                if batch.builtBytes > Engine.batchOutputLimit {
                    life.inbox.putBack(work[index...])
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
        life.thread = nil
        life.ended.signal()
    }

    /// A batch handed to the committer: its rows, and what follows once they are durable.
    final class Commit: @unchecked Sendable {
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
            while commits.inFlight.count >= commits.limit && commits.failed == nil { settleOldest() }
        } else {
            settle()
        }
        if let failed = commits.failed {
            commits.failed = nil
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
        if batch.store.isEmpty && commits.inFlight.isEmpty {
            batch.committed()
            deliver(batch, then: barriers)
            return false
        }
        // The store applies it only after the last commit in flight, and only if that is.
        batch.store.follows = commits.inFlight.last { !$0.rows.isEmpty }?.rows.sequence
        let commit = Commit(batch: batch, counters: counters, barriers: barriers)
        commits.inFlight.append(commit)
        // A batch that wrote nothing behind commits in flight waits for them, in order.
        guard !commit.rows.isEmpty else {
            commit.finish()
            return false
        }
        let store = self.store
        commits.committer.async { [self] in
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
        guard !commits.inFlight.isEmpty else { return }
        let commit = commits.inFlight.removeFirst()
        commit.done.wait()
        if let error = commit.error {
            ServiceMetrics.commitFailures.increment()
            for later in commits.inFlight { later.done.wait() }
            commits.failed = ([commit] + commits.inFlight, error)
            commits.inFlight = []
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
        while !commits.inFlight.isEmpty { settleOldest() }
    }

    /// Delivers the batches in flight whose commits are done, oldest first, without
    /// waiting for any.
    private func settleFinished() {
        while let oldest = commits.inFlight.first, oldest.finished.load(ordering: .acquiring) { settleOldest() }
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
            if outputs.parked[key] != nil {
                outputs.parked[key]!.work.append(item)
                outputs.parkedCount.add(1, ordering: .relaxed)
                return
            }
            if case .request = item, !isShuttingDown,
                batch.pendingOutput(for: session) + commits.inFlight.reduce(0, { $0 + $1.batch.builtOutput(for: session) }) > outputs.mark
            {
                outputs.parked[key] = (session, [item])
                outputs.parkedOrder.append(key)
                outputs.parkedCount.add(1, ordering: .relaxed)
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
            timed.tickScheduled = false
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
            outputs.parkedCount.subtract(1, ordering: .releasing)
        }
    }

    /// The parked work that `takeUnparkedWork` takes, still counted as parked; with
    /// `whateverTheBacklog`, that of every session not waiting for an answer from outside
    /// (`redo`).
    private func unparkedWork(whateverTheBacklog: Bool = false) -> [Work] {
        guard !outputs.parked.isEmpty else { return [] }
        var released: [Work] = []
        let everyone = whateverTheBacklog || isShuttingDown
        outputs.parkedOrder.removeAll { key in
            guard let entry = outputs.parked[key] else { return true }
            guard !outputs.awaitingOutside.contains(key) else { return false }
            let backlog = entry.session.sink?.backlog ?? 0
            guard everyone || !entry.session.isOpen || backlog <= outputs.mark / 2 else { return false }
            released += entry.work
            outputs.parked[key] = nil
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
        let counters = StoreCounters(changeSeq: directory.changeSeq, slot: following.feedSlot, searchRow: searches.lastRow)
        // The counters as the store will hold them once the commits in flight are applied
        // (this one is applied only after them): unmoved, they are not written again, and
        // a batch that changed nothing is not committed at all.
        let stored = commits.inFlight.last { !$0.rows.isEmpty }?.counters ?? directory.storedCounters
        batch.collectRows(counters: counters == stored ? nil : counters)
        // Each chat changed is decided on the version memory has; the next commit expects
        // the one after (a commit in flight that fails makes memory be read again). A
        // batch that writes nothing is not committed, so it moves no version on.
        if commits.comparesChatVersions && !batch.store.isEmpty {
            batch.store.chatVersions = batch.changedChats.sorted().compactMap { number in
                guard let chat = directory.chats[number] else { return nil }
                defer { chat.version += 1 }
                return ChatVersion(chat: number, version: chat.version)
            }
        }
        if !batch.store.isEmpty {
            commits.lastSequence += 1
            batch.store.sequence = commits.lastSequence
            batch.store.feedSlot = following.feedSlot
        }
        return counters
    }

    /// The batch's rows are durable: the index gets their text, and what waited is done.
    private func wrote(_ batch: Batch, counters: StoreCounters) {
        directory.storedCounters = counters
        searches.index?.add(batch.takeSearchAdds(), removing: batch.takeSearchRemovals())
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
            if (error as? StoreFailure)?.kind == .conflict { commits.failed = ([], error) }
            throw ProtocolError(.internal, Engine.storeFailure(error))
        }
    }

    /// Waits until the store has the batches before this one (before reading what they
    /// changed); throws when a commit failed (this batch then fails whole at its end).
    func settleBeforeReading() throws {
        settle()
        if let failedCommit = commits.failed {
            throw ProtocolError(.internal, Engine.storeFailure(failedCommit.error))
        }
    }

    /// Whether a batch being committed changed `chat` (the store may not have it yet).
    func committing(_ chat: Int64) -> Bool {
        commits.inFlight.contains { $0.batch.hasUncommittedChanges(in: chat) }
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
        let repeated = commits.readAfterConflicts.map { read in uncommitted?.isSubset(of: read) ?? false } ?? true
        guard (error as? StoreFailure)?.kind == .conflict, !repeated || commits.repeatedConflicts < Engine.maxRedos else { return false }
        do {
            try readAgain(uncommitted)
        } catch {
            return false
        }
        if followsOthers { readAhead(uncommitted) }
        commits.readAfterConflicts = uncommitted.flatMap { chats in commits.readAfterConflicts?.union(chats) }
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
            if commits.batchLimitNow == 1 { commits.repeatedConflicts += 1 }
            commits.batchLimitNow = max(1, commits.batchLimitNow / 4)
        }
        life.inbox.putBack(again)
        // Counted as parked until they are in the inbox (`drain` looks at both).
        outputs.parkedCount.subtract(released.count, ordering: .releasing)
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
                directory.sessionsByUser[user, default: []].append(session)
                sessionsChanged(of: user)
            }
        }
    }

    /// A commit was applied: conflicts start over, and batches grow again.
    private func conflictsResolved() {
        commits.readAfterConflicts = []
        commits.repeatedConflicts = 0
        if commits.batchLimitNow < Engine.batchLimit { commits.batchLimitNow = min(Engine.batchLimit, commits.batchLimitNow * 2) }
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
            if let brokenStore = commits.brokenStore {
                throw ProtocolError(.internal, "the store failed and the service is stopping: \(commits.brokenStore)")
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
        directory.sessionsByUser[user]?.removeAll { $0 === session }
        if directory.sessionsByUser[user]?.isEmpty == true { directory.sessionsByUser[user] = nil }
        sessionsChanged(of: user)
    }
}
