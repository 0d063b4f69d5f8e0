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
    }

    /// At most this many work items go into one batch (and one transaction).
    static let batchLimit = 4096
    /// `listChunk` carries at most this many elements (PROTOCOL.md §4).
    static let chunkSize = 500

    let store: ChatStore
    let logger: Logger
    private let inbox = Inbox<Work>()
    private let sessionCounter = Atomic<Int>(0)
    private var thread: Thread?

    // Engine-thread state.
    var users = UserDirectory()
    var sessionsByUser: [Int64: [EngineSession]] = [:]

    public init(store: ChatStore, logger: Logger) throws {
        self.store = store
        self.logger = logger
        try reload()
    }

    private func reload() throws {
        let snapshot = try store.loadSnapshot()
        users = UserDirectory(snapshot.users)
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

    /// Waits until everything submitted before this call is done.
    public func drain() {
        let done = DispatchSemaphore(value: 0)
        barrier { done.signal() }
        done.wait()
    }

    // MARK: the loop

    private func run() {
        while true {
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
                }
            }
            commit(batch)
            batch.deliver()
            for body in barriers { body() }
        }
    }

    private func commit(_ batch: Batch) {
        guard !batch.store.isEmpty else { return }
        do {
            try store.commit(batch.store)
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
            if !events.isEmpty && session.isOpen { session.sink.deliver(events) }
            if let count = finished[key] { session.sink.engineFinished(count) }
        }
    }
}
