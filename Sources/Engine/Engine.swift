import Attachments
import Foundation
import Logging
import Protocol
import Store
import Synchronization

/// The one place that decides (PROTOCOL.md §3–§9).
///
/// Sessions submit work from any thread; a single engine thread takes everything waiting
/// as one batch, decides each item in arrival order against the in-memory state, commits
/// the batch's writes to the store in one transaction (group commit), and only then
/// delivers the events of the batch, rendered per viewer, in commit order. A request
/// that fails changes nothing: handlers check everything before they change anything.
public final class Engine: @unchecked Sendable {
    enum Work {
        case request(Request, line: Int, session: EngineSession)
        case authenticate(userId: String, cookie: String?, line: Int, announce: Bool, session: EngineSession)
        case passthrough([Event], session: EngineSession)
        case close(EngineSession)
        case barrier(@Sendable () -> Void)
        /// Time passed: typing indications may have expired.
        case tick
        /// A message's attachments were stored (blobs) or could not be (error).
        case attachmentsStored(chat: Int64, id: Int64, thumb: String?, file: String?, error: String?)
        /// Finish what came before, then end the engine thread.
        case stop
    }

    /// At most this many work items go into one batch (and one transaction).
    static let batchLimit = 4096
    /// `listChunk` carries at most this many elements (PROTOCOL.md §4).
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
    /// Attachments being stored on worker threads.
    let attachmentJobs = Atomic<Int>(0)
    private var thread: Thread?

    // Engine-thread state.
    var users = UserDirectory()
    var sessionsByUser: [Int64: [EngineSession]] = [:]
    var chats: [Int64: ChatRecord] = [:]
    /// The chats each user takes part in now.
    var chatsOfUser: [Int64: Set<Int64>] = [:]
    var lastChatNumber: Int64 = 0
    /// The change feed's position: every message change takes the next number.
    var changeSeq: Int64 = 0
    /// The newest message's row in the search index.
    var lastSearchRow: Int64 = 0
    /// Who is typing where, and when that expires (seconds on the monotonic clock).
    var typing: [TypingEntry: Double] = [:]
    var tickScheduled = false
    /// How many messages hold on to each stored content; at 0 it is deleted.
    var blobUses: [String: Int] = [:]

    /// `clock` gives message timestamps (seconds since 1970); tests pass a fixed one.
    public init(store: ChatStore, logger: Logger, searchIndex: MessageSearchIndex? = nil, attachments: AttachmentStore? = nil,
                attachmentsDirectory: String? = nil, clock: @escaping @Sendable () -> Int64 = { Int64(Date().timeIntervalSince1970) }) throws {
        self.searchIndex = searchIndex
        self.store = store
        self.logger = logger
        self.clock = clock
        self.attachments = attachments
        self.attachmentsDirectory = attachmentsDirectory
        try reload()
    }

    private func reload() throws {
        let snapshot = try store.loadSnapshot()
        users = UserDirectory(snapshot.users)
        chats = [:]
        chatsOfUser = [:]
        lastChatNumber = 0
        changeSeq = 0
        lastSearchRow = 0
        for row in snapshot.chats {
            chats[row.number] = ChatRecord(row)
            lastChatNumber = max(lastChatNumber, row.number)
        }
        for row in snapshot.members {
            guard let chat = chats[row.chat] else { continue }
            chat.members[row.user] = MemberRecord(row)
            if row.isActive { chatsOfUser[row.user, default: []].insert(row.chat) }
        }
        for row in snapshot.messages {
            guard let chat = chats[row.chat] else { continue }
            guard row.id == chat.lastMessage + 1 else {
                throw StoreInconsistency(description: "chat \(row.chat) has message \(row.id) after \(chat.lastMessage): ids must be consecutive")
            }
            chat.append(MessageRecord(row))
            changeSeq = max(changeSeq, row.changeSeq)
            lastSearchRow = max(lastSearchRow, row.searchRow)
        }
        for row in snapshot.messageUsers {
            chats[row.chat]?.message(row.id)?.privateStates[row.user] = PrivateState(
                localData: row.localData.map { JSONValue(compactJSON: $0) }, isDeleted: row.isDeleted,
                thumbDetached: row.thumbDetached, fileState: row.fileDownloaded ? .done : nil)
        }
        blobUses = [:]
        for chat in chats.values {
            for message in chat.messages where !message.isRecalled {
                for blob in message.blobs { blobUses[blob, default: 0] += 1 }
            }
        }
        for chat in chats.values {
            chat.changeLog.sort { $0.seq < $1.seq }
            for member in chat.members.values { chat.recountUnread(member) }
        }
        typing = [:]
        try refillSearchIndex()
    }

    /// Hands the index every searchable message it does not have yet (it lags commits and
    /// may lose its tail in a crash).
    private func refillSearchIndex() throws {
        guard let searchIndex else { return }
        let indexed = try searchIndex.indexedUpTo()
        guard indexed < lastSearchRow else { return }
        var entries: [SearchEntry] = []
        for chat in chats.values {
            for message in chat.messages where message.searchRow > indexed {
                if let content = message.content { entries.append(SearchEntry(row: message.searchRow, chat: chat.number, id: message.id, text: content)) }
            }
        }
        entries.sort { $0.row < $1.row }
        searchIndex.add(entries, removing: [])
    }

    struct StoreInconsistency: Error, CustomStringConvertible {
        let description: String
    }

    public func start() {
        let thread = Thread { [self] in run() }
        thread.name = "chatcore-engine"
        thread.stackSize = 8 << 20
        self.thread = thread
        thread.start()
    }

    // MARK: submitting work (any thread)

    public func openSession(transport: Transport, sink: EventSink) -> EngineSession {
        let id = sessionCounter.add(1, ordering: .relaxed).newValue
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

    /// Waits until everything submitted before this call is done, attachments being
    /// stored and the search index included.
    public func drain() {
        func waitForBarrier() {
            let done = DispatchSemaphore(value: 0)
            barrier { done.signal() }
            done.wait()
        }
        while true {
            // Everything submitted so far is decided, so every attachment job it started
            // is counted. A job hands its outcome to the inbox before it stops counting:
            // when none counts, one more barrier has taken every outcome.
            waitForBarrier()
            if attachmentJobs.load(ordering: .acquiring) == 0 {
                waitForBarrier()
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

    // MARK: the loop

    private func run() {
        var stopping = false
        while !stopping {
            let work = inbox.take(limit: Engine.batchLimit)
            let batch = Batch()
            var barriers: [@Sendable () -> Void] = []
            for item in work {
                switch item {
                case .request(let request, let line, let session):
                    batch.finish(session)
                    guard session.isOpen else { continue }
                    process(request, line: line, session: session, batch: batch)
                case .authenticate(let userId, let cookie, _, let announce, let session):
                    batch.finish(session)
                    guard session.isOpen else { continue }
                    authenticate(userId: userId, cookie: cookie, announce: announce, session: session, batch: batch)
                case .passthrough(let events, let session):
                    batch.finish(session)
                    for event in events { batch.emit(event, to: session) }
                case .close(let session):
                    detach(session)
                case .barrier(let body):
                    barriers.append(body)
                case .tick:
                    tickScheduled = false
                    expireTyping(batch: batch)
                case .attachmentsStored(let chat, let id, let thumb, let file, let error):
                    attachmentsStored(chat: chat, id: id, thumb: thumb, file: file, error: error, batch: batch)
                case .stop:
                    stopping = true
                }
            }
            commit(batch)
            batch.deliver()
            for body in barriers { body() }
        }
        // The thread object holds this engine through its closure: let go of it.
        thread = nil
    }

    /// Writes what the batch changed so far in one transaction, then hands the text of
    /// what was committed to the search index. On a throw nothing was written and the
    /// batch keeps its rows.
    private func writeChanges(_ batch: Batch) throws {
        batch.collectRows()
        guard !batch.store.isEmpty else { return }
        try store.commit(batch.store)
        batch.committed()
        searchIndex?.add(batch.takeSearchAdds(), removing: batch.takeSearchRemovals())
    }

    /// Commits what the batch changed so far (before reading from the store). If that
    /// fails, the batch keeps its rows: its final commit fails again and answers all.
    func commitSoFar(_ batch: Batch) throws {
        do {
            try writeChanges(batch)
        } catch {
            throw ProtocolError(.internal, "the store could not commit the change: \(error)")
        }
    }

    private func commit(_ batch: Batch) {
        do {
            try writeChanges(batch)
        } catch {
            // Nothing of the batch is durable: none of its events may be seen. The
            // in-memory state is rebuilt from the store and every request is refused.
            logger.error("commit failed, answering the batch with Internal", metadata: ["error": "\(error)"])
            batch.failAll(with: ProtocolError(.internal, "the store could not commit the change: \(error)"))
            do {
                try reload()
            } catch {
                logger.critical("cannot reload the store after a failed commit", metadata: ["error": "\(error)"])
            }
        }
    }

    private func process(_ request: Request, line: Int, session: EngineSession, batch: Batch) {
        batch.beginRequest(name: request.name, cookie: request.cookie, line: line, session: session)
        do {
            guard let user = session.user else {
                throw ProtocolError(.notAuthenticated, "the session is not authenticated: send authToken first")
            }
            try handle(request, user: user, session: session, batch: batch)
        } catch let error as ProtocolError {
            batch.emit(error.requestFailed(request: request.name, cookie: request.cookie, line: line), to: session)
        } catch {
            batch.emit(ProtocolError(.internal, "\(error)").requestFailed(request: request.name, cookie: request.cookie, line: line), to: session)
        }
    }

    private func detach(_ session: EngineSession) {
        session.isOpen = false
        if let user = session.user {
            sessionsByUser[user]?.removeAll { $0 === session }
            if sessionsByUser[user]?.isEmpty == true { sessionsByUser[user] = nil }
        }
    }
}

/// The outcome of one batch: the store writes, and the events per session in order.
final class Batch {
    var store = StoreBatch()
    /// Records changed by the batch, written whole at commit (each once).
    private var dirtyChats: [Int64: ChatRecord] = [:]
    private var dirtyMembers: [RowKey: (chat: Int64, member: MemberRecord)] = [:]
    private var dirtyMessages: [RowKey: (chat: Int64, message: MessageRecord)] = [:]
    private var dirtyPrivate: [PrivateKey: (chat: Int64, message: MessageRecord, user: Int64)] = [:]
    /// Text for the search index, handed over once committed.
    var searchAdds: [SearchEntry] = []
    var searchRemovals: [Int64] = []

    func takeSearchAdds() -> [SearchEntry] {
        defer { searchAdds = [] }
        return searchAdds
    }

    func takeSearchRemovals() -> [Int64] {
        defer { searchRemovals = [] }
        return searchRemovals
    }

    struct RowKey: Hashable {
        let chat: Int64
        let item: Int64
    }

    struct PrivateKey: Hashable {
        let chat: Int64
        let message: Int64
        let user: Int64
    }

    func changed(_ chat: ChatRecord) { dirtyChats[chat.number] = chat }

    func changed(_ member: MemberRecord, of chat: ChatRecord) {
        dirtyMembers[RowKey(chat: chat.number, item: member.user)] = (chat.number, member)
    }

    func changed(_ message: MessageRecord, of chat: ChatRecord) {
        dirtyMessages[RowKey(chat: chat.number, item: message.id)] = (chat.number, message)
    }

    func changedPrivately(_ message: MessageRecord, of chat: ChatRecord, for user: Int64) {
        dirtyPrivate[PrivateKey(chat: chat.number, message: message.id, user: user)] = (chat.number, message, user)
    }

    /// The rows so far are durable: later commits of this batch need not write them again.
    func committed() {
        store = StoreBatch()
        dirtyChats = [:]
        dirtyMembers = [:]
        dirtyMessages = [:]
        dirtyPrivate = [:]
    }

    /// Turns the changed records into the rows of the store batch.
    func collectRows() {
        store.chats = dirtyChats.values.map(\.row)
        store.members = dirtyMembers.values.map { $0.member.row(chat: $0.chat) }
        store.messages = dirtyMessages.values.map { $0.message.row(chat: $0.chat) }
        store.messageUsers = dirtyPrivate.values.map { entry in
            let state = entry.message.privateStates[entry.user] ?? PrivateState()
            var row = MessageUserRow(chat: entry.chat, id: entry.message.id, user: entry.user, localData: state.localData?.json, isDeleted: state.isDeleted)
            row.thumbDetached = state.thumbDetached
            row.fileDownloaded = state.fileState == .done
            return row
        }
    }
    private var outputs: [ObjectIdentifier: (session: EngineSession, events: [Event])] = [:]
    private var order: [ObjectIdentifier] = []
    private var finished: [ObjectIdentifier: Int] = [:]
    /// Requests of this batch, so that a failed commit can answer each of them.
    private var requests: [(name: String, cookie: String?, line: Int, session: EngineSession)] = []

    func emit(_ event: Event, to session: EngineSession) {
        let key = ObjectIdentifier(session)
        if outputs[key] == nil {
            outputs[key] = (session, [event])
            order.append(key)
        } else {
            outputs[key]!.events.append(event)
        }
    }

    func finish(_ session: EngineSession) {
        let key = ObjectIdentifier(session)
        if outputs[key] == nil {
            outputs[key] = (session, [])
            order.append(key)
        }
        finished[key, default: 0] += 1
    }

    func beginRequest(name: String, cookie: String?, line: Int, session: EngineSession) {
        requests.append((name, cookie, line, session))
    }

    func failAll(with error: ProtocolError) {
        for key in order { outputs[key]!.events.removeAll() }
        for request in requests {
            emit(error.requestFailed(request: request.name, cookie: request.cookie, line: request.line), to: request.session)
        }
    }

    func deliver() {
        for key in order {
            let (session, events) = outputs[key]!
            guard let sink = session.sink else { continue }
            if !events.isEmpty && session.isOpen { sink.deliver(events) }
            if let count = finished[key] { sink.engineFinished(count) }
        }
    }
}
