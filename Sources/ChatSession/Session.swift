import ChatEngine
import ChatMetrics
import ChatProtocol
import ChatWire
import Foundation
import Logging
import Synchronization
import Threads

/// Where a session's output goes: a transport's writer. Implementations buffer, keep
/// order, and never block the caller.
public protocol SessionOutput: AnyObject, Sendable {
    /// Appends complete lines (copied before returning); `flush` ends a batch of events
    /// (§1).
    func write(_ bytes: UnsafeRawBufferPointer, flush: Bool)
    /// The engine has caught up with this session's input: reading may resume.
    func resumeInput()
    /// Bytes written and not yet taken by the client.
    var backlog: Int { get }
    /// The service ends the session: stop reading, and close once everything written
    /// so far has gone out.
    func closeAfterWritten()
}

/// One endpoint (§3): turns its lines into requests for the engine and the
/// engine's events into its output.
///
/// Lines arrive on one transport thread at a time. Answers the session makes itself
/// (decode failures, token failures) go straight out when nothing of this session is
/// waiting in the engine, and through the engine otherwise, so every answer keeps the
/// order of its request. Input is paused (`wantsInput`) while too many requests wait.
public final class Session: EventSink, @unchecked Sendable {  // its line state is its transport thread's; what it shares is `Locked` or atomic
    public struct Limits: Sendable {
        /// Requests of one session that may wait in the engine before its input pauses.
        public var maxRequestsInFlight: Int
        public var maxLineBytes: Int
        /// Before a token is accepted a line may be at most this long (an authToken line
        /// is < 9 KB): an anonymous connection cannot make the service hold much.
        public var maxLineBytesBeforeAuth: Int = 16 * 1024
        /// A session whose token expired is closed when no new token was accepted this
        /// long after (nil: never).
        public var authTimeout: Duration?

        public init(maxRequestsInFlight: Int = 1024, maxLineBytes: Int = 1 << 20, authTimeout: Duration? = .seconds(60)) {
            self.maxRequestsInFlight = maxRequestsInFlight
            self.maxLineBytes = maxLineBytes
            self.authTimeout = authTimeout
        }
    }

    public let transport: Transport
    private let engine: Engine
    private let authenticator: Authenticator
    private let output: SessionOutput
    private let limits: Limits
    private var handle: EngineSession!
    /// Work items submitted to the engine and not yet finished.
    private let logger: Logger
    private let inFlight = Atomic<Int>(0)
    /// Whether requests are timed (`chatcore_request_duration_seconds`: only when metrics
    /// are exported), and when each piece of work in `inFlight` was handed over, in order.
    private let timed = ServiceMetrics.isEnabled.load(ordering: .acquiring)
    private let timings = Locked<[(request: String?, since: ContinuousClock.Instant)]>([])
    /// Answers made on the transport thread, not yet handed to the output.
    private var pending = JSONWriter(capacity: 64)
    /// Reused for every line (transport thread only).
    private let decoder = LineDecoder()
    /// Lines of the transport that are not the client's: 1 once a relaying node's
    /// credential came first (transport thread only).
    private var lineOffset = 0

    public init(
        engine: Engine, authenticator: Authenticator, transport: Transport, output: SessionOutput, limits: Limits = Limits(), trustedUser: String? = nil,
        logger: Logger = Logger(label: "chatcore")
    ) {
        self.logger = logger
        self.engine = engine
        self.authenticator = authenticator
        self.transport = transport
        self.output = output
        self.limits = limits
        self.handle = engine.openSession(transport: transport, sink: self)
        if let trustedUser { start(trustedAs: trustedUser) }
    }

    /// The session is `userId`'s without a token: its parent started it so, or the node
    /// that relays it here did (no `global` answer).
    private func start(trustedAs userId: String) {
        // Its parent or the relaying node vouched for it: no token of its own ends it.
        token.withLock { $0.trusted = true }
        handingToEngine(nil)
        engine.authenticate(userId: userId, cookie: nil, line: 0, announce: false, session: handle)
    }

    /// Whether a token of this session has been accepted (any thread).
    public var isAuthenticated: Bool { handle.isAuthenticated }

    /// False while the engine has too much of this session's work: stop reading.
    public var wantsInput: Bool {
        inFlight.load(ordering: .acquiring) < limits.maxRequestsInFlight
    }

    // MARK: input (transport thread)

    public func receive(_ frame: LineFramer.Frame) {
        switch frame {
        case .line(let bytes, let number):
            receive(line: bytes, number: number)
        case .tooLarge(let number):
            let reason =
                !isAuthenticated && limits.maxLineBytesBeforeAuth < limits.maxLineBytes
                ? "the line is longer than the \(limits.maxLineBytesBeforeAuth) bytes a line may have before a token is accepted"
                : "the line is longer than the limit of \(limits.maxLineBytes) bytes (--max-line-bytes)"
            refuseLine(number: number, reason: reason)
        }
    }

    /// The line `number` is refused, as too large, for `reason` (it is skipped).
    public func refuseLine(number: Int, reason: String) {
        ServiceMetrics.received(nil)
        respond(ProtocolError(.tooLarge, reason).requestFailed(request: nil, cookie: nil, line: number - lineOffset))
    }

    public func receive(line: UnsafeRawBufferPointer, number framed: Int) {
        // Shutting down: lines read from now on are not accepted (and not answered).
        guard !engine.isShuttingDown else { return }
        let number = framed - lineOffset
        let decoded = decoder.decode(line, as: Request.self)
        ServiceMetrics.received(decoded.request)
        switch decoded.result {
        case .failure(let failure):
            respond(
                RealProtocol.failure(failure, request: decoded.request, line: line).requestFailed(
                    request: decoded.request, cookie: decoded.cookie, line: number))
        case .success(.authToken(let request))
        where number == 1 && transport != .stdio
            && authenticator.acceptsNodeToken(request.authToken, userId: request.userId):
            // Another node of a shared store relays its standard input/output session
            // here, started as `userId`, and vouched for it with the node key: from now on
            // this is that session, as if it were this node's own (no `global` answer to
            // this line, and the client's lines are numbered from the next one).
            lineOffset = 1
            start(trustedAs: request.userId)
        case .success(.authToken(let request)):
            handOver()
            handingToEngine("authToken")
            submitOrHold(.token(request, line: number))
        case .success(let request):
            if tokenHasExpired.load(ordering: .acquiring), let expired = token.withLock({ $0.expired }) {
                respond(
                    ProtocolError(.notAuthenticated, "the session's token expired at \(expired): send a new authToken for its user")
                        .requestFailed(request: request.name, cookie: request.cookie, line: number))
                return
            }
            handOver()
            handingToEngine(request.name)
            submitOrHold(.request(request, line: number))
        }
    }

    /// Ends a chunk of input: whatever was answered here goes out now.
    public func endOfInputChunk() {
        handOver(flush: true)
    }

    /// The client will send nothing more (it shut down its write side): `done` runs once
    /// every answer to what it sent has been handed to the output.
    public func finishInput(then done: @escaping @Sendable () -> Void) {
        handOver(flush: true)
        submitOrHold(.barrier(done))
    }

    public func close() {
        authenticator.unwatch(ObjectIdentifier(self))
        handOver(flush: true)
        submitOrHold(.close)
    }

    /// An answer made here, kept in order behind the session's work in the engine.
    private func respond(_ event: Event) {
        if inFlight.load(ordering: .acquiring) == 0 {
            ServiceMetrics.count(event)  // through the engine, the batch counts it
            event.encode(to: &pending)
            if pending.count >= 64 * 1024 { handOver(flush: false) }
        } else {
            handOver()
            handingToEngine(nil)
            submitOrHold(.answer(event))
        }
    }

    // MARK: work for the engine, in order

    /// What this session hands the engine. While a token's signature is being checked
    /// (off this thread), everything after it waits here, in order.
    private enum Work {
        case request(Request, line: Int)
        case token(AuthToken, line: Int)
        case answer(Event)
        case barrier(@Sendable () -> Void)
        case tokenExpired
        case close
    }

    /// Work held while a token is checked off the session's thread. Work is handed to the
    /// engine under its lock, so that what was held goes before anything that arrives
    /// while it is handed over.
    private struct Hold {
        var holding = false
        var held: [Work] = []
    }

    private let hold = Locked(Hold())

    private func submitOrHold(_ work: Work) {
        hold.withLock { hold in
            if hold.holding {
                hold.held.append(work)
            } else {
                submit(work, hold: &hold)
            }
        }
    }

    /// Hands one piece of work to the engine (under `hold`'s lock).
    private func submit(_ work: Work, hold: inout Hold) {
        switch work {
        case .request(let request, let line):
            engine.submit(request, line: line, from: handle)
        case .answer(let event):
            engine.passthrough([event], to: handle)
        case .barrier(let done):
            engine.barrier(done)
        case .close:
            engine.close(handle)
        case .tokenExpired:
            engine.tokenExpired(session: handle)
        case .token(let request, let line):
            switch authenticator.check() {
            case .accepted:
                engine.authenticate(userId: request.userId, cookie: request.cookie, line: line, announce: true, session: handle)
            case .refused(let error):
                refused(request, error)
            case .verify:
                hold.holding = true
                engine.beginOutsideWork()
                let authenticator = self.authenticator
                Task { [self] in
                    let verdict = await authenticator.verify(token: request.authToken, userId: request.userId)
                    verified(request, line: line, verdict: verdict)
                }
            }
        }
    }

    /// A sign-in is refused: said to the client, and logged with why (never the token).
    private func refused(_ request: AuthToken, _ error: SetupErrorCode) {
        logger.notice("sign-in refused", metadata: ["userId": "\(request.userId)", "reason": "\(error.rawValue)", "transport": "\(transport)"])
        engine.rejectToken(SetupError(error: error, cookie: request.cookie), session: handle)
    }

    /// A token's check is done: its answer, then everything held behind it, go to the
    /// engine (up to the next token that needs checking).
    private func verified(_ request: AuthToken, line: Int, verdict: Authenticator.Verdict) {
        hold.withLock { hold in verified(request, line: line, verdict: verdict, hold: &hold) }
    }

    private func verified(_ request: AuthToken, line: Int, verdict: Authenticator.Verdict, hold: inout Hold) {
        switch verdict {
        case .refused(let error):
            refused(request, error)
        case .accepted(let expires, let keyId):
            if let generation = accepted(userId: request.userId) {
                watch(generation, until: expires, keyId: keyId)
            }
            engine.authenticate(userId: request.userId, cookie: request.cookie, line: line, announce: true, session: handle)
        }
        hold.holding = false
        while !hold.holding && !hold.held.isEmpty {
            submit(hold.held.removeFirst(), hold: &hold)
        }
        engine.endOutsideWork()
    }

    // MARK: the token's life (any thread)

    /// What the session knows of the token it signed in with.
    private struct TokenLife {
        /// Started trusted (`--user`, or relayed by a node): tokens do not end it.
        var trusted = false
        /// The user the first accepted token was for: later tokens of another user
        /// change nothing here (the engine refuses them).
        var user: String?
        /// Counts accepted tokens: a timer or key watch of an older token does nothing.
        var generation = 0
        /// When the current token expired (nil: it has not).
        var expired: Date?
    }

    private let token = Locked(TokenLife())
    /// Whether `token.expired` is set: read for every line, without the lock.
    private let tokenHasExpired = Atomic<Bool>(false)

    /// A token for `userId` was accepted: when it is the session's (first) user's, it takes
    /// the place of the token before, and its generation is returned.
    private func accepted(userId: String) -> Int? {
        token.withLock { life in
            if life.trusted { return nil }
            if let user = life.user, !user.utf8.elementsEqual(userId.utf8) { return nil }
            life.user = userId
            life.generation += 1
            life.expired = nil
            tokenHasExpired.store(false, ordering: .releasing)
            return life.generation
        }
    }

    /// Ends the token of `generation` at `expires`, or when the JWKS key `keyId` is gone.
    private func watch(_ generation: Int, until expires: Date, keyId: String?) {
        if let keyId {
            authenticator.watchKey(keyId, owner: ObjectIdentifier(self)) { [weak self] in self?.expire(generation: generation) }
        } else {
            authenticator.unwatch(ObjectIdentifier(self))
        }
        guard expires != .distantFuture else { return }
        let delay = max(0, expires.timeIntervalSinceNow)
        DispatchQueue.global().asyncAfter(deadline: .now() + min(delay, 100 * 365 * 86_400)) { [weak self] in
            self?.expire(generation: generation)
        }
    }

    /// The token of `generation` is over: the session's requests are refused, its
    /// `authTokenState` goes to `Needed`, and without a new token within the auth timeout
    /// the session is closed.
    private func expire(generation: Int) {
        let now = Date()
        let current = token.withLock { life -> Bool in
            guard life.generation == generation, life.expired == nil else { return false }
            life.expired = now
            tokenHasExpired.store(true, ordering: .releasing)
            return true
        }
        guard current else { return }
        handingToEngine(nil)
        submitOrHold(.tokenExpired)
        guard let timeout = limits.authTimeout else { return }
        let seconds = Double(timeout.components.seconds) + Double(timeout.components.attoseconds) / 1e18
        DispatchQueue.global().asyncAfter(deadline: .now() + seconds) { [weak self] in
            guard let self, self.token.withLock({ $0.generation == generation && $0.expired != nil }) else { return }
            self.output.closeAfterWritten()
        }
    }

    private func handOver(flush: Bool = false) {
        guard !pending.isEmpty else {
            if flush { output.write(UnsafeRawBufferPointer(start: nil, count: 0), flush: true) }
            return
        }
        // Taken out first: writing on the event loop may flush at once, and a peer that
        // reset makes NIO close the channel right there, which closes this session and
        // comes back here (found by ThreadSanitizer's run: the nested access trapped).
        let outgoing = pending.bytes
        pending.removeAll()
        ServiceMetrics.outputBytes.increment(by: outgoing.count)
        outgoing.withUnsafeBytes { output.write($0, flush: flush) }
    }

    // MARK: EventSink (engine thread)

    public func deliver(_ lines: UnsafeRawBufferPointer) {
        ServiceMetrics.outputBytes.increment(by: lines.count)
        output.write(lines, flush: true)
    }

    public var backlog: Int { output.backlog }

    public func endSession() {
        output.closeAfterWritten()
    }

    /// One more piece of work goes to the engine, for `request` (nil: not a request of the
    /// client's, not timed).
    private func handingToEngine(_ request: String?) {
        if timed { timings.withLock { $0.append((request, .now)) } }
        inFlight.add(1, ordering: .relaxed)
    }

    public func engineFinished(_ count: Int) {
        if timed {
            let now = ContinuousClock.now
            let done = timings.withLock { timings -> ArraySlice<(request: String?, since: ContinuousClock.Instant)> in
                let done = timings.prefix(count)
                timings.removeFirst(min(count, timings.count))
                return done
            }
            for (request, since) in done where request != nil { ServiceMetrics.answered(request, after: now - since) }
        }
        let before = inFlight.subtract(count, ordering: .acquiringAndReleasing).oldValue
        if before >= limits.maxRequestsInFlight && before - count < limits.maxRequestsInFlight {
            output.resumeInput()
        }
    }
}
