import Foundation

/// The result of work finished elsewhere (a SwiftNIO future, a callback), for a thread that
/// may block to wait for it with a deadline: the one way chatcore's blocking code waits for
/// an event loop. Hand `complete` to the work (`future.whenComplete(outcome.complete)`),
/// then `wait`, as often as needed.
public final class Outcome<Value: Sendable>: Sendable {
    private let result = Locked<Result<Value, any Error>?>(nil)

    public init() {}

    public func complete(_ outcome: Result<Value, any Error>) {
        result.change { $0 = outcome }
    }

    /// The result, or nil if `deadline` came first.
    public func wait(until deadline: ContinuousClock.Instant) -> Result<Value, any Error>? {
        let left = (deadline - .now).components
        let seconds = Double(left.seconds) + Double(left.attoseconds) / 1e18
        return result.wait(until: { $0 != nil }, deadline: Date(timeIntervalSinceNow: max(0, seconds))) { $0 }
    }
}
