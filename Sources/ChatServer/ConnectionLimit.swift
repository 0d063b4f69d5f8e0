import NIOCore
import Synchronization

/// The connections a listener has open, up to a limit (`--max-sessions`, the metrics
/// port's): `admit` counts one more, or refuses it past the limit, for the caller to
/// close; a connection admitted is counted until it closes.
final class ConnectionLimit: Sendable {
    let limit: Int
    private let open = Atomic<Int>(0)

    init(_ limit: Int) {
        self.limit = limit
    }

    /// Connections admitted and not closed yet.
    var count: Int { open.load(ordering: .relaxed) }

    func admit(_ channel: Channel) -> Bool {
        guard open.add(1, ordering: .relaxed).newValue <= limit else {
            open.subtract(1, ordering: .relaxed)
            return false
        }
        channel.closeFuture.whenComplete { _ in self.open.subtract(1, ordering: .relaxed) }
        return true
    }
}
