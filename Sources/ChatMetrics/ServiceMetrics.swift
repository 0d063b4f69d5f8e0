import ChatProtocol
import CoreMetrics
import Foundation
import Metrics
import Synchronization
import Threads

/// What the service counts and measures, through swift-metrics: whoever bootstraps the
/// `MetricsSystem` (the command line, with `--metrics`) decides where it goes. Without a
/// bootstrap every metric is a no-op.
///
/// The metrics are made on first use, so the system must be bootstrapped before anything
/// is served.
public enum ServiceMetrics {
    /// Sessions open now (stdio and sockets).
    public static let sessions = Meter(label: "chatcore_sessions")
    /// Sessions opened since start.
    public static let sessionsOpened = Counter(label: "chatcore_sessions_opened_total")
    /// Requests (work items: requests, decode failures) the engine took in one batch.
    public static let batchSize = Recorder(label: "chatcore_batch_items", aggregate: true)
    /// One batch's transaction: from the start of the write to its synced commit.
    public static let commitDuration = Timer(label: "chatcore_commit_duration_seconds")
    /// Commits that failed (the batch's requests were answered Internal, or decided again
    /// when the commit conflicted).
    public static let commitFailures = Counter(label: "chatcore_commit_failures_total")
    /// Commits that conflicted with another node's (`StoreFailure.Kind.conflict`): their
    /// requests were decided again.
    public static let commitConflicts = Counter(label: "chatcore_commit_conflicts_total")
    /// Bytes handed to the transports, every session together.
    public static let outputBytes = Counter(label: "chatcore_output_bytes_total")
    /// Bytes of the store's files (the database, its write-ahead log, the search index).
    public static let storeBytes = Gauge(label: "chatcore_store_bytes")
    /// 1 while this node decides (it holds the store: SQLite, or PostgreSQL's writer lock),
    /// 0 while it relays its connections to the node that does.
    public static let deciding = Gauge(label: "chatcore_deciding")
    /// Connections a node that does not decide relays to the one that does: open now,
    /// and accepted since start.
    public static let relayedConnections = Meter(label: "chatcore_relayed_connections_open")
    public static let relayedConnectionsAccepted = Counter(label: "chatcore_relayed_connections_total")
    /// Notifications of offline recipients (`--notify-url`): answered 2xx by the
    /// application's server, tried again (each notification in a request that failed),
    /// dropped (the outbox was full: the oldest went; or the server refused them with a
    /// 4xx), and from being written to being answered 2xx.
    public static let notificationsSent = Counter(label: "chatcore_notifications_sent_total")
    public static let notificationsRetried = Counter(label: "chatcore_notifications_retried_total")
    public static let notificationsDroppedFull = Counter(label: "chatcore_notifications_dropped_total", dimensions: [("reason", "outbox_full")])
    public static let notificationsDroppedRefused = Counter(label: "chatcore_notifications_dropped_total", dimensions: [("reason", "refused")])
    public static let notificationLatency = Timer(label: "chatcore_notification_latency_seconds")

    /// What each family measures (`# HELP`), by label: every metric the service makes is
    /// here, and the exporter refuses one that is not (`help(of:)`).
    public static let help: [String: String] = [
        "chatcore_sessions": "Sessions open now (standard input/output and sockets).",
        "chatcore_sessions_opened_total": "Sessions opened since the process started.",
        "chatcore_batch_items": "Work items (requests, answers, closes) the engine decided in one batch.",
        "chatcore_commit_duration_seconds": "One batch's transaction, from the start of its write to its synced commit.",
        "chatcore_commit_failures_total": "Commits that failed: their requests were answered Internal, or decided again after a conflict.",
        "chatcore_commit_conflicts_total": "Commits another node's commit overtook (PostgreSQL): their requests were decided again.",
        "chatcore_output_bytes_total": "Bytes handed to the sessions' connections and standard output.",
        "chatcore_store_bytes": "Bytes of the store's files in the data directory, measured at each scrape.",
        "chatcore_deciding": "1 while this node decides (it holds the store), 0 while it relays to the node that does.",
        "chatcore_relayed_connections_open": "Connections this node relays to the deciding node, open now.",
        "chatcore_relayed_connections_total": "Connections this node relayed to the deciding node since it started.",
        "chatcore_notifications_sent_total": "Notifications of offline recipients the application's server answered 2xx.",
        "chatcore_notifications_retried_total": "Notifications to be sent again: their request failed (no answer, 5xx, 408 or 429).",
        "chatcore_notifications_dropped_total": "Notifications given up, by reason: outbox_full (the oldest went) or refused (a 4xx answer).",
        "chatcore_notification_latency_seconds": "From a notification written (with its message) to the application's server answering 2xx.",
        requestLabel: "Lines read, by request name (unknown: a name the protocol does not have, or not a request).",
        failureLabel: "Requests answered requestFailed, by request name and error.",
        durationLabel: "From a request's line decoded to its answers handed to the session's output, by request name.",
        "chatcore_quota_refusals_total": "Requests refused because their user was past a quota, by quota."
    ]

    /// The help of a metric the service makes (a label not in `help` is a mistake: its
    /// family would have no `# HELP`).
    public static func help(of label: String) -> String {
        guard let text = help[label] else { preconditionFailure("the metric \(label) has no help text (ServiceMetrics.help)") }
        return text
    }

    public static let requestLabel = "chatcore_requests_total"
    public static let failureLabel = "chatcore_request_failures_total"
    public static let durationLabel = "chatcore_request_duration_seconds"
    /// Buckets of the histograms, by label (where the exporter's defaults do not fit).
    public static let valueBuckets: [String: [Double]] = [
        "chatcore_batch_items": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    ]
    public static let durationBuckets: [String: [Duration]] = [
        "chatcore_commit_duration_seconds": [
            .microseconds(100), .microseconds(250), .microseconds(500), .milliseconds(1), .milliseconds(2), .milliseconds(5),
            .milliseconds(10), .milliseconds(25), .milliseconds(50), .milliseconds(100), .milliseconds(250), .seconds(1)
        ],
        durationLabel: [
            .microseconds(100), .microseconds(250), .microseconds(500), .milliseconds(1), .milliseconds(2), .milliseconds(5),
            .milliseconds(10), .milliseconds(25), .milliseconds(50), .milliseconds(100), .milliseconds(250), .seconds(1),
            .seconds(5)
        ],
        "chatcore_notification_latency_seconds": [
            .milliseconds(10), .milliseconds(50), .milliseconds(100), .milliseconds(250), .milliseconds(500), .seconds(1), .seconds(5),
            .seconds(30), .seconds(60), .seconds(300), .seconds(3600)
        ]
    ]

    /// Request names are labels only when the protocol has them: anything else a client
    /// sends is "unknown" (a label per made-up name would let anyone grow the metrics).
    private static let known: Set<String> = Set(Request.wireMessages.fields.map(\.name))
    /// The counters of every request name the protocol has: made once, on first use (after
    /// the bootstrap), then only read. A line is counted with one lookup and no string
    /// built: this happens for every line read, bad ones included.
    private static let byRequest: [String: RequestCounters] = Dictionary(
        uniqueKeysWithValues: known.map { ($0, RequestCounters(name: $0)) })
    private static let unknownRequest = RequestCounters(name: "unknown")

    /// One request name's counters: lines read, and failures by error (made on first use,
    /// so that a scrape lists only failures that happened).
    private final class RequestCounters: Sendable {
        let name: String
        let received: Counter
        /// Made on first use: only requests that were answered have a histogram.
        let duration = Locked<Timer?>(nil)
        private let failures = Locked<[(error: String, counter: Counter)]>([])

        init(name: String) {
            self.name = name
            received = Counter(label: ServiceMetrics.requestLabel, dimensions: [("request", name)])
        }

        func failure(_ error: String) -> Counter {
            failures.withLock { failures in
                if let known = failures.first(where: { $0.error == error }) { return known.counter }
                let counter = Counter(label: ServiceMetrics.failureLabel, dimensions: [("request", name), ("error", error)])
                failures.append((error, counter))
                return counter
            }
        }
    }

    private static func counters(_ request: String?) -> RequestCounters {
        request.flatMap { byRequest[$0] } ?? unknownRequest
    }

    /// Requests refused because their user was past a quota, by quota.
    private static let quotaRefusals: [String: Counter] = Dictionary(
        uniqueKeysWithValues: ["requests", "chats", "newUsers", "events", "searches"].map {
            ($0, Counter(label: "chatcore_quota_refusals_total", dimensions: [("quota", $0)]))
        })

    /// A request was refused by the quota `quota` (`Quotas`).
    public static func quotaRefused(_ quota: String) {
        quotaRefusals[quota]?.increment()
    }

    /// Whether metrics are exported (`register` was called): what costs time to measure
    /// is measured only then.
    public static let isEnabled = Atomic<Bool>(false)

    /// A request named `request` was answered `elapsed` after its line was decoded.
    public static func answered(_ request: String?, after elapsed: Duration) {
        let counters = counters(request)
        let timer = counters.duration.withLock { timer in
            if let timer { return timer }
            let made = Timer(label: durationLabel, dimensions: [("request", counters.name)])
            timer = made
            return made
        }
        timer.record(duration: elapsed)
    }

    /// Makes every metric at once (after the bootstrap), so that a scrape shows each one,
    /// at zero until it moves.
    public static func register() {
        isEnabled.store(true, ordering: .releasing)
        _ = (sessions, sessionsOpened, batchSize, commitDuration, commitFailures, commitConflicts, outputBytes, storeBytes)
        _ = (deciding, relayedConnections, relayedConnectionsAccepted)
        _ = (byRequest, unknownRequest, quotaRefusals)
    }

    /// A line was read as a request (decoded or not). Counted only while metrics are
    /// exported: unexported, a counter goes nowhere, and finding it by name took about a
    /// tenth of a line's time where each line is refused at once (`run.py codec`).
    public static func received(_ request: String?) {
        guard isEnabled.load(ordering: .relaxed) else { return }
        counters(request).received.increment()
    }

    /// A request was answered `requestFailed` with `error` (counted as `received` is).
    public static func failed(_ request: String?, error: String) {
        guard isEnabled.load(ordering: .relaxed) else { return }
        counters(request).failure(error).increment()
    }

    /// A batch's commit took `duration`.
    public static func committed(in duration: Duration) {
        commitDuration.record(duration: duration)
    }

    /// Counts the event when it is a `requestFailed`.
    public static func count(_ event: Event) {
        if case .requestFailed(let failure) = event {
            failed(failure.request, error: failure.error.rawValue)
        }
    }
}
