import Attachments
import ChatProtocol
import ChatWire
import Foundation
import GRDB
import Logging
import SQLiteStorage
import Storage
import Synchronization
import Testing

@testable import ChatEngine

/// The engine in-process: a real SQLite store (in memory unless a file is given), a
/// clock the test moves, and sessions whose events are recorded as JSON lines.
final class EngineHarness {
    let engine: Engine
    let store: ChatStore
    let clock: TestClock
    private var sessions: [String: (handle: EngineSession, sink: RecordingSink)] = [:]
    private let decoder = LineDecoder()
    private var line = 0

    init(
        store: ChatStore? = nil, searchIndex: MessageSearchIndex? = nil, attachments: AttachmentStore? = nil, attachmentsDirectory: String? = nil,
        cacheBytes: Int = Engine.defaultCacheBytes, feedSlot: Int? = nil, quotas: QuotaLimits = QuotaLimits(),
        clock: TestClock = TestClock(1_700_000_000)
    ) throws {
        let store = try store ?? SQLiteStore(writer: DatabaseQueue())
        self.store = store
        self.clock = clock
        var logger = Logger(label: "engine-tests")
        logger.logLevel = .critical
        engine = try Engine(
            store: store, coordination: (store as? NodeCoordination) ?? SoloNode(), logger: logger, searchIndex: searchIndex, attachments: attachments,
            attachmentsDirectory: attachmentsDirectory, cacheBytes: cacheBytes, feedSlot: feedSlot, quotas: quotas, clock: { clock.now })
        engine.start()
    }

    /// A directory removed when the harness goes.
    var scratch: URL?

    deinit {
        defer { if let scratch { try? FileManager.default.removeItem(at: scratch) } }
        engine.drain()
        engine.stop()
    }

    /// Opens session `name` authenticated as `user` and returns its first events.
    @discardableResult
    func connect(_ name: String, as user: String) -> [String] {
        let sink = RecordingSink()
        let handle = engine.openSession(transport: .tcp, sink: sink)
        sessions[name] = (handle, sink)
        line += 1
        engine.authenticate(userId: user, cookie: nil, line: line, announce: true, session: handle)
        engine.drain()
        return sink.take()
    }

    /// Submits one request line from session `name`; returns the events that session got.
    @discardableResult
    func send(_ name: String, _ json: String) -> [String] {
        submit(name, json)
        engine.drain()
        return events(name)
    }

    /// Submits without waiting (several requests then go into one batch).
    func submit(_ name: String, _ json: String) {
        engine.put(work(name, json))
    }

    /// Opens session `name` without authenticating it (`authentication`).
    func open(_ name: String) {
        let sink = RecordingSink()
        sessions[name] = (engine.openSession(transport: .tcp, sink: sink), sink)
    }

    /// The work that authenticates session `name` as `user` (for `engine.put(together:)`).
    func authentication(_ name: String, as user: String) -> Engine.Work {
        line += 1
        return .authenticate(userId: user, cookie: nil, line: line, announce: true, session: sessions[name]!.handle)
    }

    /// Submits requests (session name, line) that the engine takes into one batch.
    func submitTogether(_ requests: [(String, String)]) {
        engine.put(together: requests.map { work($0.0, $0.1) })
    }

    /// Submits `first` as one batch and holds its commit in flight (in `store`); runs
    /// `whileHeld`, submits `next` as the following batch, and lets the commit go on once
    /// the engine has decided `next` on top of `first` (it then waits for that commit,
    /// asking nothing else of the store first).
    func decideWhileCommitting(
        _ first: [(String, String)], in store: FailingStore, whileHeld: () -> Void = {},
        then next: [(String, String)]
    ) {
        store.holding.store(true, ordering: .relaxed)
        submitTogether(first)
        store.held.wait()
        store.holding.store(false, ordering: .relaxed)
        whileHeld()
        submitTogether(next)
        Thread.sleep(forTimeInterval: 0.3)
        store.release.signal()
    }

    /// The work of request line `json` from session `name`.
    func work(_ name: String, _ json: String) -> Engine.Work {
        let handle = sessions[name]!.handle
        line += 1
        let bytes = Array(json.utf8)
        return bytes.withUnsafeBytes { raw in
            let decoded = decoder.decode(raw, as: Request.self)
            switch decoded.result {
            case .success(let request):
                return .request(request, line: line, session: handle)
            case .failure(let failure):
                return .passthrough([ProtocolError(failure).requestFailed(request: decoded.request, cookie: decoded.cookie, line: line)], session: handle)
            }
        }
    }

    /// How often session `name` was handed events (about once per batch that had some).
    func deliveries(_ name: String) -> Int {
        sessions[name]!.sink.deliveries
    }

    /// The events session `name` received since last asked.
    func events(_ name: String) -> [String] {
        engine.drain()
        return sessions[name]!.sink.take()
    }

    /// How often the engine ended session `name`.
    func ended(_ name: String) -> Int {
        engine.drain()
        return sessions[name]!.sink.ended
    }
}

extension EngineHarness {
    /// A harness on `store` where Alice ("a") started chat 1 with Bob ("b"): its Join is
    /// message 1, and Bob's events so far are taken.
    static func aliceAndBobInAChat(on store: ChatStore) throws -> EngineHarness {
        let h = try EngineHarness(store: store)
        h.connect("a", as: "alice")
        h.connect("b", as: "bob")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        _ = h.events("b")
        return h
    }

    /// A harness on `store` with a search index in a directory of its own, removed when
    /// the harness goes.
    static func withSearchIndex(_ store: ChatStore) throws -> EngineHarness {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("engine-tests-\(UUID())")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let harness = try EngineHarness(store: store, searchIndex: try SQLiteSearchIndex(directory: directory))
        harness.scratch = directory
        return harness
    }
}

/// Seconds since 1970 that a test sets.
final class TestClock: Sendable {
    private let value: Atomic<Int64>
    init(_ start: Int64) { value = Atomic(start) }
    var now: Int64 { value.load(ordering: .relaxed) }
    func set(_ seconds: Int64) { value.store(seconds, ordering: .relaxed) }
}

/// Records what the engine delivers, one JSON line per event.
final class RecordingSink: EventSink, @unchecked Sendable {
    private let lock = NSLock()
    private var lines: [String] = []

    var backlog: Int { 0 }

    /// How often the engine handed this session events (once per batch that had some).
    private(set) var deliveries = 0

    func deliver(_ lines: UnsafeRawBufferPointer) {
        let text = String(decoding: lines, as: UTF8.self)
        lock.lock()
        self.lines += text.split(separator: "\n").map(String.init)
        deliveries += 1
        lock.unlock()
    }

    func engineFinished(_ count: Int) {}

    /// How often the engine ended this session.
    private(set) var ended = 0

    func endSession() {
        lock.lock()
        ended += 1
        lock.unlock()
    }

    func take() -> [String] {
        lock.lock()
        defer { lock.unlock() }
        let taken = lines
        lines = []
        return taken
    }
}

/// A real store that fails its commits while `failing` is set, as a full disk would.
final class FailingStore: ChatStore, NodeCoordination, @unchecked Sendable {
    let inner: ChatStore
    let failing = Atomic<Bool>(false)
    /// While failing, this many more commits still succeed first.
    let successesFirst = Atomic<Int>(0)
    let failedCommits = Atomic<Int>(0)
    /// When set, the next commit fails (and this is cleared).
    let failOnce = Atomic<Bool>(false)
    /// While set, a commit first tells `held` and waits for `release` (a commit in flight).
    let holding = Atomic<Bool>(false)
    let held = DispatchSemaphore(value: 0)
    let release = DispatchSemaphore(value: 0)
    /// Commits begun (called by the engine), whatever became of them.
    let commitsBegun = Atomic<Int>(0)
    /// With more than one, a commit that follows another waits for it and fails when it
    /// failed, as PostgreSQL's does (the inner store then still commits one at a time).
    let commitsInFlight: Int
    /// Per feed slot: two engines on it (two nodes) number their commits alike.
    private let outcomes = (0..<FeedSlots.count).map { _ in CommitOutcomes() }

    /// While set, every commit conflicts (`StoreFailure.Kind.conflict`); when `conflictOnce`
    /// is set, the next commit does (and it is cleared).
    let conflicting = Atomic<Bool>(false)
    let conflictOnce = Atomic<Bool>(false)
    let conflicts = Atomic<Int>(0)
    /// With `versioned`, the store keeps each chat's version and refuses a commit decided
    /// on an older one, as PostgreSQL's does for several deciding nodes: two engines on it
    /// are two nodes.
    private let versioned: Bool
    var comparesChatVersions: Bool { versioned }
    var feedSlot: Int { 0 }
    func wakeWhenOthersAct(_ wake: @escaping @Sendable () -> Void) -> Bool { false }
    private let versionsLock = NSLock()
    private var versions: [Int64: Int64] = [:]

    /// With `numbering`, new chats, users and search rows take their numbers from the
    /// store, as from PostgreSQL's sequences (`takeNumbers`): the next after the highest
    /// the store held when it was made or handed out since; search rows four at a time.
    private let numbering: Bool
    private let numbersLock = NSLock()
    private var lastNumbers: [NumberedKind: Int64]?
    let numbersTaken = Atomic<Int>(0)

    /// With `following` (and `versioned`), the engines on it follow one another
    /// (`othersDecide`): it logs what each commit changed, who is connected to each feed
    /// slot and the transient events, as a store several deciding nodes share does.
    private let following: Bool
    var othersDecide: Bool { following }
    private let logLock = NSLock()
    private var log: [FollowedCommit] = []
    private var feedAt: [Int: Int64] = [:]
    private var online: [Int: Set<Int64>] = [:]
    private var transients: [(slot: Int, event: TransientEvent)] = []

    init(_ inner: ChatStore, commitsInFlight: Int = 1, versioned: Bool = false, numbering: Bool = false, following: Bool = false) {
        precondition(!following || versioned, "the engines follow the chats each commit claims")
        self.inner = inner
        self.commitsInFlight = commitsInFlight
        self.versioned = versioned
        self.numbering = numbering
        self.following = following
    }

    func othersActivity(besides slot: Int, after cursor: FollowCursor?, thoroughly: Bool) throws -> OthersActivity? {
        // No commit lands while the log and its chats are read (one snapshot).
        versionsLock.lock()
        defer { versionsLock.unlock() }
        let (activity, users) = logLock.withLock { () -> (OthersActivity, Set<Int64>) in
            var now = FollowCursor()
            now.commits[0] = Int64(log.count)
            now.transient[0] = Int64(transients.count)
            var activity = OthersActivity(cursor: now)
            activity.online = online.filter { $0.key != slot }.values.reduce(into: []) { $0.formUnion($1) }
            guard let cursor else { return (activity, []) }
            activity.commits = log[Int(cursor.commits[0] ?? 0)...].filter { $0.slot != slot }
            activity.transient = transients[Int(cursor.transient[0] ?? 0)...].filter { $0.slot != slot }.map(\.event)
            return (activity, Set(activity.commits.flatMap(\.users)))
        }
        var withChats = activity
        let numbers = Set(activity.commits.flatMap(\.chats)).sorted()
        if !numbers.isEmpty {
            withChats.chats = try inner.loadChats(numbers)
            withChats.chats.chatVersions = versions.filter { numbers.contains($0.key) }
        }
        guard !users.isEmpty else { return withChats }
        let directory = try inner.loadDirectory()
        withChats.users = directory.users.filter { users.contains($0.number) }
        withChats.endpoints = directory.endpoints.filter { users.contains($0.user) }
        return withChats
    }

    /// While set, who is connected to each node is not passed on (as when a node decides
    /// before it hears that a user connected to another).
    let presenceHidden = Atomic<Bool>(false)

    func announceOnline(slot: Int, joined: [Int64], left: [Int64]) throws {
        guard !presenceHidden.load(ordering: .relaxed) else { return }
        logLock.withLock {
            online[slot, default: []].formUnion(joined)
            online[slot, default: []].subtract(left)
        }
    }

    func announce(_ event: TransientEvent, slot: Int) throws {
        logLock.withLock { transients.append((slot, event)) }
    }

    func takeNumbers(for kind: NumberedKind, count: Int) throws -> [ClosedRange<Int64>]? {
        guard numbering else { return nil }
        numbersTaken.add(1, ordering: .relaxed)
        return try numbersLock.withLock {
            if lastNumbers == nil {
                let directory = try inner.loadDirectory()
                lastNumbers = [
                    .chat: directory.chats.map(\.number).max() ?? 0, .user: directory.users.map(\.number).max() ?? 0,
                    .searchRow: directory.counters.searchRow
                ]
            }
            let first = lastNumbers![kind]! + 1
            lastNumbers![kind]! += kind == .searchRow ? 4 * ((Int64(count) + 3) / 4) : Int64(count)
            return [first...lastNumbers![kind]!]
        }
    }

    struct InjectedFailure: Error, CustomStringConvertible {
        var description: String { "database or disk is full (injected)" }
    }

    /// How often memory was read whole, and how often only some chats of it.
    let directoryLoads = Atomic<Int>(0)
    let chatLoads = Atomic<Int>(0)

    /// This many more reads of memory back (`loadDirectory`, `loadChats`) fail, as they do
    /// on a connection PostgreSQL closed as it restarted.
    let readsFailing = Atomic<Int>(0)

    private func failARead() throws {
        if readsFailing.load(ordering: .relaxed) > 0 {
            readsFailing.subtract(1, ordering: .relaxed)
            throw StoreFailure(.other, "the connection was closed (the server restarted)")
        }
    }

    func loadDirectory() throws -> StoreDirectory {
        try failARead()
        directoryLoads.add(1, ordering: .relaxed)
        let read = versioned ? versionsLock.withLock { versions } : [:]
        var directory = try inner.loadDirectory()
        directory.chatVersions = read
        return directory
    }

    func loadChats(_ numbers: [Int64]) throws -> StoreDirectory {
        try failARead()
        chatLoads.add(1, ordering: .relaxed)
        // The versions first, as PostgreSQL's: a chat read after its version is at least
        // that version (a commit on it since makes the next claim fail, never pass).
        let read = versioned ? versionsLock.withLock { versions.filter { numbers.contains($0.key) } } : [:]
        var directory = try inner.loadChats(numbers)
        directory.chatVersions = read
        return directory
    }
    func messages(chat: Int64, in ids: ClosedRange<Int64>) throws -> [MessageRow] { try inner.messages(chat: chat, in: ids) }
    func messages(chat: Int64, ids: [Int64]) throws -> [MessageRow] { try inner.messages(chat: chat, ids: ids) }
    func messageIds(chat: Int64, matching filter: MessageFilter, from start: Int64, ascending: Bool, limit: Int) throws -> [Int64] {
        try inner.messageIds(chat: chat, matching: filter, from: start, ascending: ascending, limit: limit)
    }
    func firstMessage(chat: Int64, notBefore timestamp: Int64) throws -> Int64? { try inner.firstMessage(chat: chat, notBefore: timestamp) }
    func message(chat: Int64, sender: Int64, externalId: String) throws -> Int64? {
        try inner.message(chat: chat, sender: sender, externalId: externalId)
    }
    func mentions(of user: Int64, after position: MentionPosition?, limit: Int) throws -> [MentionPosition] {
        try inner.mentions(of: user, after: position, limit: limit)
    }
    func references(chat: Int64, to target: Int64, tag: String, excluding excluded: Set<Int64>) throws -> (count: Int64, newest: Int64?) {
        try inner.references(chat: chat, to: target, tag: tag, excluding: excluded)
    }
    func changedMessages(chats: [Int64], after seq: Int64, limit: Int) throws -> [MessageChangeRow] {
        try inner.changedMessages(chats: chats, after: seq, limit: limit)
    }
    func rangeChanges(chats: [Int64], after seq: Int64) throws -> [RangeChangeRow] { try inner.rangeChanges(chats: chats, after: seq) }
    func feedPositions() throws -> [Int: Int64] { try inner.feedPositions() }
    func blobUses(_ blob: String) throws -> Int64 { try inner.blobUses(blob) }
    func searchable(by user: Int64, among hits: [SearchHit]) throws -> Set<SearchHit> {
        try inner.searchable(by: user, among: hits)
    }
    func searchEntries(after row: Int64, limit: Int, maxBytes: Int) throws -> [SearchEntry] {
        try inner.searchEntries(after: row, limit: limit, maxBytes: maxBytes)
    }

    func commit(_ batch: StoreBatch) throws {
        commitsBegun.add(1, ordering: .relaxed)
        var applied = false
        defer { outcomes[batch.feedSlot].record(batch.sequence, applied: applied) }
        if holding.load(ordering: .relaxed) {
            held.signal()
            release.wait()
        }
        if let follows = batch.follows, !outcomes[batch.feedSlot].wait(for: follows) {
            throw InjectedFailure()
        }
        try commitOrFail(batch)
        applied = true
    }

    private func commitOrFail(_ batch: StoreBatch) throws {
        if conflictOnce.exchange(false, ordering: .relaxed) || conflicting.load(ordering: .relaxed) {
            conflicts.add(1, ordering: .relaxed)
            throw StoreFailure(.conflict, "another node committed first (injected)")
        }
        if failOnce.exchange(false, ordering: .relaxed) {
            failedCommits.add(1, ordering: .relaxed)
            throw InjectedFailure()
        }
        if failing.load(ordering: .relaxed) && successesFirst.subtract(1, ordering: .relaxed).newValue < 0 {
            failedCommits.add(1, ordering: .relaxed)
            throw InjectedFailure()
        }
        guard versioned else { return try inner.commit(batch) }
        // Compared, applied and moved on at once, as a row lock would.
        versionsLock.lock()
        defer { versionsLock.unlock() }
        for claim in batch.chatVersions where versions[claim.chat, default: 0] != claim.version {
            conflicts.add(1, ordering: .relaxed)
            throw StoreFailure(.conflict, "chat \(claim.chat) is at version \(versions[claim.chat, default: 0]), not \(claim.version)")
        }
        let feedAfter = following ? try logLock.withLock { try feedAt[batch.feedSlot] ?? inner.feedPositions()[batch.feedSlot] } : nil
        try inner.commit(batch)
        if following {
            let after = feedAfter ?? FeedSlots.base(of: batch.feedSlot)
            let entry = FollowedCommit(of: batch, feedAfter: after)
            logLock.withLock {
                log.append(entry)
                feedAt[batch.feedSlot] = entry.feedUpTo
            }
        }
        for claim in batch.chatVersions { versions[claim.chat] = claim.version + 1 }
    }
}
