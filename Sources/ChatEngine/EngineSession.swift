import ChatProtocol
import Storage
import Synchronization

/// Where the engine sends a session's events. Implemented by the session layer.
public protocol EventSink: AnyObject, Sendable {
    /// Encoded events (complete lines) for this session, in commit order. Called on the
    /// engine thread: must copy what it keeps and must not block.
    func deliver(_ lines: UnsafeRawBufferPointer)
    /// Bytes handed over and not yet taken by the client. While it is above the engine's
    /// mark, the session's further requests wait in the engine.
    var backlog: Int { get }
    /// The engine has finished `count` more of this session's submitted work items
    /// (their events, if any, were delivered first).
    func engineFinished(_ count: Int)
    /// The service ends this session (its endpoint was deregistered): close it once the
    /// events delivered so far are written. Called on the engine thread.
    func endSession()
}

/// How a session reached the service; decides which files it may name (§7).
public enum Transport: String, Sendable {
    case stdio
    case tcp
    case unix
    case webSocket = "websocket"
}

/// The engine's handle on one session (an endpoint). Its mutable state is touched only
/// on the engine thread.
public final class EngineSession: @unchecked Sendable, Hashable {  // its mutable state is the engine thread's alone (checked in debug builds)
    public let id: Int
    public let transport: Transport
    /// Weak: the session layer owns the sink (and through it this handle); an engine that
    /// outlives a closed connection must not keep it alive.
    weak var sink: EventSink?
    /// The user whose token this session presented: set up (`user` is then the same), or
    /// waiting for an endpoint of that user to be free (setupState `Full`).
    var identity: Int64? {
        didSet { authenticated.store(identity != nil, ordering: .releasing) }
    }
    private let authenticated = Atomic<Bool>(false)

    /// Whether a token of this session has been accepted (and its acceptance not undone by
    /// a failed commit). Read on any thread: the transport closes connections that take
    /// too long to authenticate.
    public var isAuthenticated: Bool { authenticated.load(ordering: .acquiring) }
    /// The user this endpoint is set up as: it receives that user's events (engine
    /// thread only).
    var user: Int64? {
        didSet { quotedOwnURI = user.map(UserRecord.quotedURI) }
    }
    /// This session's endpoint once it is set up: one the user registered, or one that
    /// lasts as long as the session (§3).
    var endpoint: Int64?
    /// What `endpointUpdate` said before the session was set up; applied when it is.
    var pendingEndpoint: EndpointUpdate?
    /// `"bbmpim://user/id/<user>"` as JSON bytes, made once (every event this session gets
    /// is searched for it: docs/protocol.md §3, the local user is id/0 in its own view).
    private(set) var quotedOwnURI: [UInt8]?
    var isOpen = true
    /// It asked for presence (`presenceSet.watch`).
    var watchesPresence = false
    /// A token of this session was refused while it was not authenticated (its
    /// `authTokenState` shows `Rejected`).
    var tokenRejected = false
    /// The token it signed in with expired, and no new one was accepted yet (its
    /// `authTokenState` shows `Needed`).
    var tokenExpired = false
    /// Lists it asked for before authenticating (answered empty): brought up to date with
    /// a `listAdd` when it authenticates (§4).
    var listedEarly: Set<ListType> = []
    /// Users this session looked up by id (`identitiesGet`): it may list them. At most
    /// `maxLookedUp` are kept (the oldest go first).
    private var lookedUpUsers: Set<Int64> = []
    private var lookedUpOrder: [Int64] = []
    static let maxLookedUp = 10_000

    func lookedUp(_ user: Int64) {
        guard lookedUpUsers.insert(user).inserted else { return }
        lookedUpOrder.append(user)
        if lookedUpOrder.count > EngineSession.maxLookedUp {
            let dropped = lookedUpOrder.prefix(lookedUpOrder.count / 2)
            lookedUpUsers.subtract(dropped)
            lookedUpOrder.removeFirst(dropped.count)
        }
    }

    func hasLookedUp(_ user: Int64) -> Bool { lookedUpUsers.contains(user) }

    init(id: Int, transport: Transport, sink: EventSink) {
        self.id = id
        self.transport = transport
        self.sink = sink
    }

    /// Who the session is, as a failed commit must restore it.
    struct Setup {
        var identity: Int64?
        var user: Int64?
        var endpoint: Int64?
        var pendingEndpoint: EndpointUpdate?
    }

    var setup: Setup {
        get { Setup(identity: identity, user: user, endpoint: endpoint, pendingEndpoint: pendingEndpoint) }
        set {
            identity = newValue.identity
            user = newValue.user
            endpoint = newValue.endpoint
            pendingEndpoint = newValue.pendingEndpoint
        }
    }

    public static func == (lhs: EngineSession, rhs: EngineSession) -> Bool { lhs === rhs }
    public func hash(into hasher: inout Hasher) { hasher.combine(ObjectIdentifier(self)) }
}
