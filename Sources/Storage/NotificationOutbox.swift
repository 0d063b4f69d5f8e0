/// Notifications for recipients who are not connected (`--notify-url`): written by the
/// engine in the same commit as the message they are about (`StoreBatch.notifications`),
/// so that a crash loses none, and taken from the store by the notifier, which sends them
/// to the application's server and removes them once it answered.
///
/// One notification per message and recipient (`NotificationKey`, written once by the
/// engine): the key is also what the application's server tells a repeated request by (a
/// notifier that stopped between sending and removing sends it again). The store numbers
/// them in the order they were written (`NotificationRow.seq`): appending one is cheap,
/// and the oldest are the lowest.
public protocol NotificationOutbox: AnyObject, Sendable {
    /// Takes up to `limit` notifications due at `now`, the earliest due first, and makes
    /// each due again at `leaseUntil` with one more attempt counted: nobody else (another
    /// node, or this one after a restart) takes them before then unless `finish` says so.
    /// Times are milliseconds since 1970.
    func takeDueNotifications(now: Int64, leaseUntil: Int64, limit: Int) throws -> [NotificationRow]

    /// `done`: sent, or given up (removed). `retry`: to be taken again from `due` on. Both
    /// by `NotificationRow.seq`.
    func finishNotifications(done: [Int64], retry: [(seq: Int64, due: Int64)]) throws

    /// Removes the oldest notifications (the first written) beyond `keep`; returns how
    /// many went.
    func trimNotifications(keep: Int) throws -> Int

    /// When the earliest waiting notification is due (nil: none waits).
    func nextNotificationDue() throws -> Int64?
}

/// Which notification: a message, and whom it is for.
public struct NotificationKey: Sendable, Hashable {
    public var chat: Int64
    public var id: Int64
    public var user: Int64

    public init(chat: Int64, id: Int64, user: Int64) {
        self.chat = chat
        self.id = id
        self.user = user
    }
}

/// A notification waiting to be sent.
public struct NotificationRow: Sendable, Equatable {
    /// Its number in the outbox, in the order they were written (0 until it is written).
    public var seq: Int64 = 0
    public var key: NotificationKey
    /// When it was written (milliseconds since 1970).
    public var created: Int64
    /// When it is to be sent next (milliseconds since 1970): at once for a recipient who is
    /// not connected, after the configured delay for one who is (sent only if they have
    /// not read the message by then).
    public var due: Int64
    /// How many times it was taken to be sent.
    public var attempts: Int64

    public init(seq: Int64 = 0, key: NotificationKey, created: Int64, due: Int64, attempts: Int64 = 0) {
        self.seq = seq
        self.key = key
        self.created = created
        self.due = due
        self.attempts = attempts
    }
}
