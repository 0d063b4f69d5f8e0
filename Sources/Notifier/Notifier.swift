import AsyncHTTPClient
import ChatEngine
import ChatMetrics
import ChatProtocol
import ChatWire
import Crypto
import Foundation
import Logging
import NIOCore
import Storage
import Synchronization

/// Where notifications go and how (`--notify-url` and the options beside it).
public struct NotifierSettings: Sendable {
    /// The application's server: every request is a POST of a `NotificationBatch`.
    public var url: String
    /// The key each request is signed with (HMAC-SHA256, `Chatcore-Signature`).
    public var secret: [UInt8]
    /// At most this many characters of a message's content in its notification (0: none).
    public var previewLength = 0
    /// At most this many notifications in one request.
    public var batchSize = 100
    /// At most this many notifications wait; beyond it the oldest are dropped.
    public var maxQueued = 100_000
    /// How long a request may take before it counts as failed.
    public var timeout: Duration = .seconds(10)
    /// How long a notification taken to be sent is nobody else's: if this notifier stops
    /// before it finished with it, another (or this one, restarted) sends it after that.
    /// Twice the request's timeout and five seconds more (to ask the engine and write back).
    public var lease: Duration { timeout * 2 + .seconds(5) }
    /// The wait before the first retry; each retry waits twice as long, up to `longestRetry`,
    /// with jitter (a random half of it taken off).
    public var firstRetry: Duration = .seconds(1)
    public var longestRetry: Duration = .seconds(300)
    /// How often the store is looked at when nothing woke the notifier (retries coming due,
    /// notifications other nodes wrote).
    public var look: Duration = .seconds(1)

    public init(url: String, secret: [UInt8]) {
        self.url = url
        self.secret = secret
    }
}

/// Sends the notifications the engine writes to the outbox (`NotificationOutbox`) to the
/// application's server, off the engine's thread: takes what is due, has the engine say
/// what each becomes now (`Engine.compose`), posts them in batches, and removes what the
/// server answered, or makes it due again later. A server that is down or slow costs the
/// senders of messages nothing: notifications wait in the store, bounded by `maxQueued`.
public final class Notifier: Sendable {
    let settings: NotifierSettings
    let outbox: NotificationOutbox
    let logger: Logger
    let client: HTTPClient
    private let bell = Bell()
    private let queue = DispatchQueue(label: "chatcore-notifier-store")
    private let key: SymmetricKey

    public init(settings: NotifierSettings, outbox: NotificationOutbox, logger: Logger) {
        self.settings = settings
        self.outbox = outbox
        self.logger = logger
        self.key = SymmetricKey(data: settings.secret)
        var configuration = HTTPClient.Configuration()
        configuration.redirectConfiguration = .disallow
        configuration.timeout = .init(connect: .seconds(5))
        self.client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
    }

    /// Something was written that may be due now.
    public func wake() {
        bell.ring()
    }

    /// Sends notifications until the task is cancelled, then closes the HTTP client.
    /// `engine` says what each becomes (`Engine.compose`).
    public func run(engine: Engine) async {
        var lastTrim = ContinuousClock.now - .seconds(3600)
        // Requests in a row that failed: while the server fails, nothing is taken until a
        // wait that doubles with each (the notifications wait in the store meanwhile,
        // costing the senders nothing but their rows).
        var failures: Int64 = 0
        while !Task.isCancelled {
            if ContinuousClock.now - lastTrim > .seconds(1) {
                lastTrim = .now
                await trim()
            }
            switch await sendDue(engine: engine) {
            case .nothingDue:
                await bell.wait(upTo: settings.look)
            case .sent:
                failures = 0
            case .serverFailed(let asked):
                failures += 1
                try? await Task.sleep(for: .milliseconds(delay(after: failures, atLeast: asked)))
            }
        }
        try? await client.shutdown()
    }

    enum Round {
        case nothingDue
        case sent
        /// A request failed (no answer, 5xx, 408, 429): the server asked for this wait, if any.
        case serverFailed(Duration?)
    }

    /// Drops the oldest notifications beyond `maxQueued`.
    private func trim() async {
        do {
            let keep = settings.maxQueued
            let dropped = try await blocking { try self.outbox.trimNotifications(keep: keep) }
            if dropped > 0 {
                ServiceMetrics.notificationsDroppedFull.increment(by: Int64(dropped))
                logger.warning("notifications dropped: more were waiting than --notify-max-queued", metadata: ["dropped": "\(dropped)", "kept": "\(keep)"])
            }
        } catch {
            logger.warning("the notification outbox could not be trimmed", metadata: ["error": "\(error)"])
        }
    }

    /// Takes one batch of due notifications and sends it.
    private func sendDue(engine: Engine) async -> Round {
        let now = Engine.milliseconds()
        let rows: [NotificationRow]
        do {
            let lease = now + settings.lease.wholeMilliseconds
            let limit = settings.batchSize
            rows = try await blocking { try self.outbox.takeDueNotifications(now: now, leaseUntil: lease, limit: limit) }
        } catch {
            logger.warning("due notifications could not be read", metadata: ["error": "\(error)"])
            return .nothingDue
        }
        guard !rows.isEmpty else { return .nothingDue }
        let outcomes = await engine.compose(rows, previewLength: settings.previewLength)
        var done: [Int64] = []
        var sending: [(row: NotificationRow, notification: MessageNotification)] = []
        var retry: [(seq: Int64, due: Int64)] = []
        for (row, outcome) in zip(rows, outcomes) {
            switch outcome {
            case .send(let notification):
                sending.append((row, notification))
            case .drop:
                done.append(row.seq)
            case .later(let why):
                // Another node's commit this one has not followed yet: it will have soon.
                if row.attempts < Notifier.attemptsWhileUnknown {
                    retry.append((row.seq, now + delay(after: row.attempts, atLeast: nil)))
                } else {
                    done.append(row.seq)
                    logger.warning("a notification is dropped: \(why)", metadata: ["chat": "\(row.key.chat)", "message": "\(row.key.id)"])
                }
            }
        }
        // Requests of at most `maxBody` bytes (one notification alone may be more).
        var requests: [[(row: NotificationRow, notification: MessageNotification)]] = []
        var size = 0
        for item in sending {
            let bytes = Notifier.encodedSize(of: item.notification)
            if requests.isEmpty || size + bytes > Notifier.maxBody {
                requests.append([])
                size = 0
            }
            requests[requests.count - 1].append(item)
            size += bytes
        }
        var round = Round.sent
        for request in requests {
            if case .serverFailed = round {
                // The server just failed: the rest wait for their next try.
                for (row, _) in request { retry.append((row.seq, now + delay(after: row.attempts, atLeast: nil))) }
                ServiceMetrics.notificationsRetried.increment(by: Int64(request.count))
                continue
            }
            switch await post(request.map(\.notification)) {
            case .delivered:
                done += request.map(\.row.seq)
                ServiceMetrics.notificationsSent.increment(by: Int64(request.count))
                let answered = Engine.milliseconds()
                for (row, _) in request { ServiceMetrics.notificationLatency.recordMilliseconds(max(0, answered - row.created)) }
            case .refused(let status):
                done += request.map(\.row.seq)
                ServiceMetrics.notificationsDroppedRefused.increment(by: Int64(request.count))
                logger.error(
                    "the application's server refused notifications: they are dropped", metadata: ["status": "\(status)", "count": "\(request.count)"])
            case .failed(let why, let retryAfter):
                ServiceMetrics.notificationsRetried.increment(by: Int64(request.count))
                let now = Engine.milliseconds()
                for (row, _) in request { retry.append((row.seq, now + delay(after: row.attempts, atLeast: retryAfter))) }
                logger.notice("notifications will be sent again", metadata: ["why": "\(why)", "count": "\(request.count)"])
                round = .serverFailed(retryAfter)
            }
        }
        do {
            try await blocking { [done, retry] in try self.outbox.finishNotifications(done: done, retry: retry) }
        } catch {
            // They are sent again once their lease ends: the server tells them apart by id.
            logger.warning("sent notifications could not be marked", metadata: ["error": "\(error)"])
        }
        return round
    }

    /// How long to wait before the next try of a notification tried `attempts` times
    /// (milliseconds): doubling from `firstRetry` up to `longestRetry`, minus a random
    /// part of up to half, and never less than the server asked for.
    func delay(after attempts: Int64, atLeast asked: Duration?) -> Int64 {
        let first = settings.firstRetry.wholeMilliseconds
        let longest = settings.longestRetry.wholeMilliseconds
        let exponent = min(max(attempts - 1, 0), 30)
        let full = min(longest, first << exponent)
        let jittered = full - Int64.random(in: 0...(full / 2))
        return max(jittered, asked?.wholeMilliseconds ?? 0)
    }

    /// Tries of a notification whose message or membership this node does not know yet
    /// (`NotificationOutcome.later`) before it is given up.
    static let attemptsWhileUnknown: Int64 = 10

    /// A request's body is at most this many bytes, unless one notification alone is more.
    static let maxBody = 1 << 20

    static func encodedSize(of notification: MessageNotification) -> Int {
        var writer = JSONWriter(capacity: 1024)
        notification.encode(to: &writer)
        return writer.count + 1
    }

    enum Answer {
        case delivered
        case refused(status: UInt)
        case failed(String, retryAfter: Duration?)
    }

    /// Posts one request of notifications, signed.
    func post(_ notifications: [MessageNotification]) async -> Answer {
        var writer = JSONWriter(capacity: 1024 * notifications.count)
        NotificationBatch(notifications: notifications).encode(to: &writer)
        let body = writer.bytes
        var request = HTTPClientRequest(url: settings.url)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.headers.add(name: "User-Agent", value: "chatcore")
        request.headers.add(name: "Chatcore-Signature", value: signature(of: body, at: Int64(Date().timeIntervalSince1970)))
        request.body = .bytes(ByteBuffer(bytes: body))
        do {
            let response = try await client.execute(request, timeout: .milliseconds(settings.timeout.wholeMilliseconds))
            _ = try? await response.body.collect(upTo: 64 * 1024)
            let code = response.status.code
            switch code {
            case 200..<300:
                return .delivered
            case 408, 429:
                return .failed("the server answered \(code)", retryAfter: retryAfter(response.headers.first(name: "Retry-After")))
            case 400..<500:
                return .refused(status: code)
            default:
                return .failed("the server answered \(code)", retryAfter: retryAfter(response.headers.first(name: "Retry-After")))
            }
        } catch {
            return .failed("\(error)", retryAfter: nil)
        }
    }

    /// `t=SECONDS,v1=HEX`: HEX is the HMAC-SHA256 of SECONDS, a dot and the body.
    func signature(of body: [UInt8], at seconds: Int64) -> String {
        var signed = Array("\(seconds).".utf8)
        signed += body
        let code = HMAC<SHA256>.authenticationCode(for: signed, using: key)
        return "t=\(seconds),v1=" + code.map { String(format: "%02x", $0) }.joined()
    }

    /// A Retry-After of whole seconds (a date is not honoured: the backoff applies).
    private func retryAfter(_ value: String?) -> Duration? {
        guard let value, let seconds = Int64(value.trimmingCharacters(in: .whitespaces)), seconds >= 0 else { return nil }
        return .seconds(min(seconds, 3600))
    }

    /// Runs store work on the notifier's own thread (the stores block).
    private func blocking<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            queue.async { continuation.resume(with: Result { try body() }) }
        }
    }
}

/// Wakes the notifier when something was written (rung before anyone waits: the next wait
/// returns at once). One waiter at a time: the notifier's loop.
final class Bell: Sendable {
    private struct State {
        var rung = false
        var waiter: CheckedContinuation<Void, Never>?
        /// The wait now under way was cancelled (whichever of its cancellation and its
        /// continuation comes first, the other sees it).
        var cancelled = false
    }

    private let state = Mutex(State())

    func ring() {
        let waiter = state.withLock { state -> CheckedContinuation<Void, Never>? in
            guard let waiter = state.waiter else {
                state.rung = true
                return nil
            }
            state.waiter = nil
            return waiter
        }
        waiter?.resume()
    }

    /// Returns when rung, after `duration`, or when the task is cancelled.
    func wait(upTo duration: Duration) async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { try? await Task.sleep(for: duration) }
            group.addTask { await self.waitForRing() }
            await group.next()
            group.cancelAll()
        }
    }

    private func waitForRing() async {
        state.withLock { $0.cancelled = false }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { state -> Bool in
                    if state.cancelled { return true }
                    if state.rung {
                        state.rung = false
                        return true
                    }
                    state.waiter = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            let waiter = state.withLock { state -> CheckedContinuation<Void, Never>? in
                state.cancelled = true
                defer { state.waiter = nil }
                return state.waiter
            }
            waiter?.resume()
        }
    }
}
