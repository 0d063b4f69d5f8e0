import ChatMetrics
import ChatProtocol
import Storage

/// What one user may cost the others: per-user rates of requests, of chats started, of
/// users made by invitations, of chat events, and searches at once. Each rate is a token
/// bucket (a burst, refilled at a steady rate); a request past one is refused with
/// `RateLimited`, naming the limit and when it would pass. Owned by the engine thread.
///
/// Memory: a bucket is kept only while it is below full (`forgetFull`), so what this holds
/// is bounded by the users active in the last burst's refill time.
public struct QuotaLimits: Sendable {
    /// Requests of one user per second (a burst of ten seconds' worth). 0: no limit.
    public var requestsPerSecond: Double
    /// Chats one user starts per minute.
    public var chatsPerMinute: Double
    /// Users one user's invitations make (invitees chatcore did not know) per minute.
    public var newUsersPerMinute: Double
    /// Chat events and typing notices of one user per second (a burst of ten seconds').
    public var eventsPerSecond: Double
    /// Searches of one user running at once, and of everyone.
    public var searchesPerUser: Int
    public var searchesInAll: Int
    /// What one search may check before it answers what it found (`SearchBudget`).
    public var searchCandidates: Int
    public var searchBytes: Int
    /// How many endpoints one user may have at once: registered ones and sessions that
    /// have not registered (docs/protocol.md §3, `--max-endpoints`).
    public var endpointsPerUser: Int
    /// A session's output (built, plus handed over and not yet taken by its client) above
    /// which its next requests wait in the engine until the client has taken half of it.
    public var outputMark: Int

    public init(
        requestsPerSecond: Double = 50_000, chatsPerMinute: Double = 60, newUsersPerMinute: Double = 1_000,
        eventsPerSecond: Double = 50, searchesPerUser: Int = 2, searchesInAll: Int = 8,
        searchCandidates: Int = SearchBudget.defaultCandidates, searchBytes: Int = SearchBudget.defaultBytes,
        endpointsPerUser: Int = 100, outputMark: Int = 4 << 20
    ) {
        self.endpointsPerUser = endpointsPerUser
        self.outputMark = outputMark
        self.requestsPerSecond = requestsPerSecond
        self.chatsPerMinute = chatsPerMinute
        self.newUsersPerMinute = newUsersPerMinute
        self.eventsPerSecond = eventsPerSecond
        self.searchesPerUser = searchesPerUser
        self.searchesInAll = searchesInAll
        self.searchCandidates = searchCandidates
        self.searchBytes = searchBytes
    }
}

struct Quotas {
    enum Kind: String, CaseIterable {
        case requests, chats, newUsers, events

        /// The flag that sets it, for the refusal's reason.
        var flag: String {
            switch self {
            case .requests: "--max-requests-per-second"
            case .chats: "--max-chats-per-minute"
            case .newUsers: "--max-new-users-per-minute"
            case .events: "--max-events-per-second"
            }
        }
    }

    /// A token bucket: `tokens` at `at` (seconds on a monotonic clock).
    private struct Bucket {
        var tokens: Double
        var at: Double
    }

    let limits: QuotaLimits
    private var buckets: [Kind: [Int64: Bucket]] = [:]
    private var searching: [Int64: Int] = [:]
    private var searchingInAll = 0
    private var takenSinceForgetting = 0
    /// Seconds since an arbitrary start: rates follow real time even when message
    /// timestamps are fixed (transcripts).
    private let now: () -> Double

    init(limits: QuotaLimits, now: @escaping () -> Double = Quotas.monotonicSeconds) {
        self.limits = limits
        self.now = now
    }

    static func monotonicSeconds() -> Double {
        let elapsed = ContinuousClock.now - start
        return Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
    }

    private static let start = ContinuousClock.now

    /// (rate per second, burst) of a kind; nil: unlimited.
    private func shape(_ kind: Kind) -> (rate: Double, burst: Double)? {
        switch kind {
        case .requests: limits.requestsPerSecond > 0 ? (limits.requestsPerSecond, limits.requestsPerSecond * 10) : nil
        case .chats: limits.chatsPerMinute > 0 ? (limits.chatsPerMinute / 60, limits.chatsPerMinute) : nil
        case .newUsers: limits.newUsersPerMinute > 0 ? (limits.newUsersPerMinute / 60, limits.newUsersPerMinute) : nil
        case .events: limits.eventsPerSecond > 0 ? (limits.eventsPerSecond, limits.eventsPerSecond * 10) : nil
        }
    }

    /// Takes `count` of `kind` for `user`, or throws `RateLimited` (and takes nothing)
    /// when the user has not that many left.
    mutating func take(_ count: Int, of kind: Kind, by user: Int64) throws {
        guard count > 0, let (rate, burst) = shape(kind) else { return }
        let time = now()
        var bucket = buckets[kind]?[user] ?? Bucket(tokens: burst, at: time)
        bucket.tokens = min(burst, bucket.tokens + (time - bucket.at) * rate)
        bucket.at = time
        guard bucket.tokens >= Double(count) else {
            buckets[kind, default: [:]][user] = bucket
            let wait = (Double(count) - bucket.tokens) / rate
            ServiceMetrics.quotaRefused(kind.rawValue)
            throw ProtocolError(
                .rateLimited, "over the limit of \(Quotas.describe(kind, limits: limits)) (\(kind.flag)): retry in \(Quotas.seconds(wait))",
                retryAfterMs: count > Int(burst) ? nil : Int64((wait * 1000).rounded(.up)))
        }
        bucket.tokens -= Double(count)
        buckets[kind, default: [:]][user] = bucket
        takenSinceForgetting += 1
        if takenSinceForgetting >= 4096 { forgetFull(at: time) }
    }

    /// Drops the buckets that have refilled: an absent bucket is a full one.
    private mutating func forgetFull(at time: Double) {
        takenSinceForgetting = 0
        for kind in Kind.allCases {
            guard let (rate, burst) = shape(kind) else { continue }
            buckets[kind] = buckets[kind]?.filter { $0.value.tokens + (time - $0.value.at) * rate < burst }
        }
    }

    /// A search of `user` begins, or is refused: at most `searchesPerUser` of theirs and
    /// `searchesInAll` in all run at once.
    mutating func beginSearch(by user: Int64) throws {
        if searching[user, default: 0] >= limits.searchesPerUser {
            ServiceMetrics.quotaRefused("searches")
            throw ProtocolError(
                .rateLimited, "at most \(limits.searchesPerUser) searches of one user run at once: retry when one is answered",
                retryAfterMs: 100)
        }
        if searchingInAll >= limits.searchesInAll {
            ServiceMetrics.quotaRefused("searches")
            throw ProtocolError(
                .rateLimited, "the service runs its most searches at once (\(limits.searchesInAll)): retry in a moment",
                retryAfterMs: 100)
        }
        searching[user, default: 0] += 1
        searchingInAll += 1
    }

    mutating func endSearch(by user: Int64) {
        searchingInAll -= 1
        let left = searching[user, default: 1] - 1
        searching[user] = left > 0 ? left : nil
    }

    private static func describe(_ kind: Kind, limits: QuotaLimits) -> String {
        switch kind {
        case .requests: "\(number(limits.requestsPerSecond)) requests per second per user"
        case .chats: "\(number(limits.chatsPerMinute)) chats started per minute per user"
        case .newUsers: "\(number(limits.newUsersPerMinute)) new users invited per minute per user"
        case .events: "\(number(limits.eventsPerSecond)) chat events and typing notices per second per user"
        }
    }

    private static func number(_ value: Double) -> String {
        value == value.rounded() ? String(Int64(value)) : String(value)
    }

    private static func seconds(_ value: Double) -> String {
        value < 1 ? "\(Int((value * 1000).rounded(.up))) ms" : "\(Int(value.rounded(.up))) s"
    }
}
