import ArgumentParser
import ChatEngine
import ChatSession
import Logging
import Storage

/// Where the store is, and how nodes on one PostgreSQL database work together.
struct StoreOptions: ParsableArguments {
    @Option(
        name: .long,
        help: ArgumentHelp("Where the store lives (created if missing). Default: $XDG_DATA_HOME/chatcore, else ~/.local/share/chatcore.", valueName: "dir"))
    var dataDir: String?

    @Option(name: .long, help: ArgumentHelp("Memory for messages kept in memory (the hot ones; the store has them all), in MiB.", valueName: "MiB"))
    var cacheMb: Int = Engine.defaultCacheBytes >> 20

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Keep everything in this PostgreSQL database instead of SQLite in --data-dir: postgres://USER@HOST[:PORT]/DATABASE[?sslmode=MODE&sslrootcert=CA_FILE] (libpq's modes; default prefer), or postgres://USER@/DATABASE?host=SOCKET_DIR. No password here: --store-password-file or PGPASSWORD.",
            valueName: "url"))
    var store: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres: the address other nodes relay their connections to while this node is the writer (HOST:PORT or unix:PATH), where its relay listener is reached: the first tls:// --listen, else the first plain HOST:PORT or unix:PATH one. Default: that listener as bound (127.0.0.1 for 0.0.0.0). Without --listen the node listens on 127.0.0.1 on a free port for the sessions of other nodes on this machine, and advertises that.",
            valueName: "address"))
    var advertise: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres: the certificates (PEM) this node trusts to sign the writer's when the writer's relay listener is tls://. Default: the system's trusted roots. The certificate must also name the address the writer advertises.",
            valueName: "file"))
    var nodeTlsCa: String?

    @Flag(
        name: .long,
        help:
            "With --store postgres: every node decides for its own sessions, following the others' commits, instead of relaying its connections to the writer. Give it to every node of the database (experimental: docs/several-deciding-nodes.md)."
    )
    var allNodesDecide = false

    @Option(name: .long, help: ArgumentHelp("A file holding the PostgreSQL password of --store (trailing whitespace removed).", valueName: "file"))
    var storePasswordFile: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres, on a node waiting to be the writer: take over from a writer that has not said it is alive (it does every second) for this long, ending its database sessions. At least 3.",
            valueName: "seconds"))
    var writerTimeout: Double = 10

    @Option(
        name: .long,
        help: ArgumentHelp(
            "With --store postgres: a file whose bytes (at least 32) every node of the database is given, never stored in it. A node relaying its standard input/output session (--user) to the writer vouches for its user with it.",
            valueName: "file"))
    var nodeKeyFile: String?
}

/// Notifications of recipients who are not connected, to the application's server.
struct NotifyOptions: ParsableArguments {
    @Option(
        name: .long,
        help: ArgumentHelp(
            "POST a signed JSON notification here for every new message whose recipient is connected nowhere (http:// or https://), for the application to wake their devices. Needs --notify-secret-file.",
            valueName: "url"))
    var notifyUrl: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "A file whose bytes (at least 32) are the HMAC-SHA256 key of each notification's Chatcore-Signature header.", valueName: "file"))
    var notifySecretFile: String?

    @Option(name: .long, help: ArgumentHelp("Characters of a message's content each notification carries (0: none).", valueName: "n"))
    var notifyPreview: Int = 0

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Notify a recipient who is connected too, when they have not read the message this many seconds after it was sent (0: never).",
            valueName: "seconds"))
    var notifyUnreadDelay: Double = 0

    @Option(name: .long, help: ArgumentHelp("Notifications that may wait for the application's server; beyond it the oldest are dropped.", valueName: "n"))
    var notifyMaxQueued: Int = 100_000

    @Option(name: .long, help: ArgumentHelp("Notifications in one request at most.", valueName: "n"))
    var notifyBatch: Int = 100

    @Option(name: .long, help: ArgumentHelp("Seconds a request to the application's server may take before it is tried again later.", valueName: "seconds"))
    var notifyTimeout: Double = 10

    @Option(
        name: .long,
        help: ArgumentHelp(
            "The longest wait before a notification whose request failed is sent again, in seconds (the waits double from 1 up to this, with jitter).",
            valueName: "seconds"))
    var notifyLongestRetry: Double = 300
}

/// Who may sign in.
struct AuthOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp("A file whose bytes, as they are (at least 32), are the HMAC key for authToken JWTs (HS256).", valueName: "file"))
    var authSecretFile: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "A JWKS file (JSON Web Key Set): authToken JWTs signed RS256 or ES256 by one of its keys are accepted. Read again on SIGHUP. Give --auth-audience with it.",
            valueName: "file"))
    var authJwks: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "A token's 'aud' must name this (the identity provider's name for this service): other applications of the same provider cannot sign in here. Without it, --auth-jwks starts with a warning.",
            valueName: "audience"))
    var authAudience: String?

    @Option(name: .long, help: ArgumentHelp("A token's 'iss' must be this (the identity provider).", valueName: "issuer"))
    var authIssuer: String?

    @Option(name: .long, help: ArgumentHelp("Seconds by which a token's exp, nbf and iat may be off this machine's clock.", valueName: "seconds"))
    var authLeeway: Double = TokenPolicy.defaultLeeway

    @Option(name: .long, help: ArgumentHelp("A token valid for longer than this (exp from iat) is refused.", valueName: "seconds"))
    var authMaxLifetime: Double = TokenPolicy.defaultMaxLifetime

    @Flag(name: .long, help: "Accept any authToken. Refuses to listen on anything but loopback addresses and Unix sockets.")
    var insecureNoAuth = false

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Close a socket connection whose authToken has not been accepted this many seconds after it connected, or after its token expired (0: never).",
            valueName: "seconds"))
    var authTimeout: Int = 60
}

/// What one session, and all of them together, may hold.
struct LimitOptions: ParsableArguments {
    @Option(
        name: .customLong("max-line-bytes"),
        help: ArgumentHelp("A longer line is skipped without being buffered and answered with TooLarge.", valueName: "bytes"))
    var maxLineBytesOption = ByteCount(1 << 20)
    var maxLineBytes: Int { maxLineBytesOption.bytes }

    @Option(name: .long, help: ArgumentHelp("Requests of one session that may wait in the engine before its input is paused.", valueName: "n"))
    var maxRequestsInFlight: Int = 1024

    @Option(
        name: .customLong("output-high-water"), help: ArgumentHelp("Unread output of a socket session above which its input is paused.", valueName: "bytes"))
    var outputHighWaterOption = ByteCount(1 << 20)
    var outputHighWater: Int { outputHighWaterOption.bytes }

    @Option(name: .customLong("max-output-bytes"), help: ArgumentHelp("Unread output of a socket session above which it is disconnected.", valueName: "bytes"))
    var maxOutputBytesOption = ByteCount(64 << 20)
    var maxOutputBytes: Int { maxOutputBytesOption.bytes }

    @Option(
        name: .customLong("max-output-total"),
        help: ArgumentHelp(
            "Unread output of all socket sessions together above which a session behind by more than its share (this over the sessions open, at least --output-high-water) is disconnected when more is written to it. Default: 4 × --max-output-bytes.",
            valueName: "bytes")
    )
    var maxOutputTotalOption: ByteCount?
    var maxOutputTotal: Int? { maxOutputTotalOption?.bytes }

    @Option(
        name: .customLong("max-input-total"),
        help: ArgumentHelp(
            "Bytes of unfinished lines all socket sessions together may hold; the line that would go over is refused (TooLarge).", valueName: "bytes"))
    var maxInputTotalOption = ByteCount(256 << 20)
    var maxInputTotal: Int { maxInputTotalOption.bytes }

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Socket connections open at once; further ones are closed when accepted. Lowered to what the file descriptor limit leaves room for.",
            valueName: "n"))
    var maxSessions: Int = 10_000

    @Option(name: .long, help: ArgumentHelp("Close a socket connection that sends nothing for this many seconds (0: never).", valueName: "seconds"))
    var idleTimeout: Int = 0

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Endpoints one user may have at once: registered ones (endpointUpdate) and connected sessions. A session past it waits in setupState Full.",
            valueName: "n"))
    var maxEndpoints: Int = 100

    /// `--max-output-total`, or four times `--max-output-bytes` (at most `Int.max`).
    var outputTotalLimit: Int {
        if let maxOutputTotal { return maxOutputTotal }
        let (four, overflow) = maxOutputBytes.multipliedReportingOverflow(by: 4)
        return overflow ? .max : four
    }
}

/// What one user may cost the others.
struct QuotaOptions: ParsableArguments {
    @Option(
        name: .long,
        help: ArgumentHelp(
            "Requests of one user per second, with a burst of ten seconds' worth; past it they are refused (RateLimited). 0: no limit.", valueName: "n"))
    var maxRequestsPerSecond: Double = QuotaLimits().requestsPerSecond

    @Option(name: .long, help: ArgumentHelp("Chats one user may start per minute (the minute's worth at once). 0: no limit.", valueName: "n"))
    var maxChatsPerMinute: Double = QuotaLimits().chatsPerMinute

    @Option(name: .long, help: ArgumentHelp("Users one user's invitations may make per minute (invitees chatcore did not know). 0: no limit.", valueName: "n"))
    var maxNewUsersPerMinute: Double = QuotaLimits().newUsersPerMinute

    @Option(
        name: .long,
        help: ArgumentHelp("Chat events and typing notices of one user per second, with a burst of ten seconds' worth. 0: no limit.", valueName: "n"))
    var maxEventsPerSecond: Double = QuotaLimits().eventsPerSecond

    @Option(name: .long, help: ArgumentHelp("Candidates one search checks at most; past it, it answers what it found, marked incomplete.", valueName: "n"))
    var maxSearchCandidates: Int = SearchBudget.defaultCandidates

    @Option(
        name: .customLong("max-search-bytes"),
        help: ArgumentHelp("Bytes of text one search checks at most; past it, it answers what it found, marked incomplete.", valueName: "bytes"))
    var maxSearchBytesOption = ByteCount(SearchBudget.defaultBytes)
    var maxSearchBytes: Int { maxSearchBytesOption.bytes }
}

/// Who connects, and how.
struct ListenOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp("Serve standard input/output as this user, already authenticated.", valueName: "id"))
    var user: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "Accept connections at HOST:PORT (TCP; [::1]:PORT for IPv6), unix:PATH, ws://HOST:PORT[/PATH] (WebSocket, one message per text frame, for browsers), or tls://HOST:PORT and wss://HOST:PORT[/PATH] (the same over TLS: give --tls-cert and --tls-key). Repeatable.",
            valueName: "address"))
    var listen: [String] = []

    @Option(
        name: .long,
        help: ArgumentHelp(
            "The origins (scheme://host[:port], separated by commas) whose pages may open a WebSocket; others are refused (403) before the upgrade. Default: any. A client that sends no Origin (not a browser) always may.",
            valueName: "origins"))
    var wsAllowedOrigins: String?

    /// `--ws-allowed-origins`, each origin trimmed, in the order given (nil: any origin).
    var allowedOrigins: [String]? {
        wsAllowedOrigins.map { $0.split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) } }
    }

    @Option(
        name: .long,
        help: ArgumentHelp(
            "The certificate chain (PEM) the tls:// and wss:// listeners present, the server's first. Read again on SIGHUP.",
            valueName: "file"))
    var tlsCert: String?

    @Option(name: .long, help: ArgumentHelp("The private key (PEM) of --tls-cert. Read again on SIGHUP.", valueName: "file"))
    var tlsKey: String?

    @Option(
        name: .long,
        help: ArgumentHelp(
            "The only directory socket sessions may attach files from (after resolving links). Without it they attach nothing; standard input/output may name any readable file.",
            valueName: "dir"))
    var attachmentsDir: String?
}

/// What the service says of itself.
struct ObservabilityOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp("Serve Prometheus metrics at http://HOST:PORT/metrics.", valueName: "address"))
    var metrics: String?

    @Option(name: .long, help: ArgumentHelp("trace, debug, info, notice, warning, error or critical. Logs go to standard error.", valueName: "level"))
    var logLevel: Logger.Level = .info

    @Option(name: .long, help: ArgumentHelp("text (for people) or json (one object per line, for log collectors).", valueName: "format"))
    var logFormat: LogFormat = .text
}

/// Where the other options come from besides the command line (read by `Settings` before
/// parsing; declared here so that the parser accepts them and `--help` shows them).
struct ConfigurationOptions: ParsableArguments {
    @Option(
        name: .long,
        help: ArgumentHelp(
            "A YAML file of options by their long names (max-line-bytes: 2 MiB, listen: [127.0.0.1:7400], insecure-no-auth: true). Each option is also read from the environment as CHATCORE_<NAME> (CHATCORE_MAX_LINE_BYTES; a list separated by commas). The command line wins over the environment, which wins over the file. Default: $CHATCORE_CONFIG.",
            valueName: "file"))
    var config: String?

    @Flag(name: .long, help: "Print the settings in effect as a config file, each with where it came from, and exit.")
    var showConfig = false
}
