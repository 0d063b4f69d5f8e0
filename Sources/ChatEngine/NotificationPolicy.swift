/// Which recipients of a new message the application is notified of (`--notify-url`,
/// `NotificationOutbox`): every recipient for whom it counts as unread (not a message the
/// service posts, nor one sent with `neverCountUnread`) and who is connected nowhere; with
/// `unreadDelay`, also one who is connected but has not read it that long after.
public struct NotificationPolicy: Sendable {
    public var unreadDelay: Duration?
    /// Called (on the engine thread) once a commit wrote notifications: the notifier need
    /// not wait for its next look at the store.
    public var written: (@Sendable () -> Void)?

    public init(unreadDelay: Duration? = nil, written: (@Sendable () -> Void)? = nil) {
        self.unreadDelay = unreadDelay
        self.written = written
    }
}

extension Duration {
    /// Whole milliseconds (rounded down).
    public var wholeMilliseconds: Int64 {
        let (seconds, attoseconds) = components
        return seconds * 1000 + attoseconds / 1_000_000_000_000_000
    }
}
