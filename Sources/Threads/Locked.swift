import Foundation

/// A value reached only under its lock: the one way chatcore shares mutable state between
/// threads outside the engine thread. Threads may also wait, without holding the lock,
/// until the value is as they need it (`wait(until:)`), woken by `change`.
///
/// A pthread mutex and condition (NSCondition), which ThreadSanitizer sees, unlike the
/// futex of `Synchronization.Mutex`. Inlinable: callers on hot paths (every line of
/// standard output, every work item into the engine) get it specialized to their value.
public final class Locked<Value>: @unchecked Sendable {  // `value` is only reached with `condition` locked
    @usableFromInline let condition = NSCondition()
    @usableFromInline var value: Value

    public init(_ value: Value) { self.value = value }

    @inlinable
    public func withLock<T>(_ body: (inout Value) throws -> T) rethrows -> T {
        condition.lock()
        defer { condition.unlock() }
        return try body(&value)
    }

    /// Runs `body` with the lock held, without reaching the value: a `Locked<Void>` used as
    /// a plain mutex (one at a time through `body`). ThreadSanitizer took the exclusive
    /// access to a zero-sized value through `withLock` for a race.
    @inlinable
    public func exclusively<T>(_ body: () throws -> T) rethrows -> T {
        condition.lock()
        defer { condition.unlock() }
        return try body()
    }

    /// `withLock`, then wakes every thread waiting for the value to change (`wait`).
    @inlinable
    public func change<T>(_ body: (inout Value) throws -> T) rethrows -> T {
        condition.lock()
        defer {
            condition.broadcast()
            condition.unlock()
        }
        return try body(&value)
    }

    /// Waits, with the lock released, until `ready` says the value is as needed (each
    /// `change` wakes it to look again), or until `deadline` if one is given; then runs
    /// `body` under the lock, whichever came first. `notifying`: `body` changes the value
    /// as `change` does, waking the threads that wait for it.
    @inlinable
    public func wait<T>(
        until ready: (Value) -> Bool, deadline: Date? = nil, notifying: Bool = false, then body: (inout Value) throws -> T
    ) rethrows -> T {
        condition.lock()
        defer {
            if notifying { condition.broadcast() }
            condition.unlock()
        }
        if let deadline {
            while !ready(value) && condition.wait(until: deadline) {}
        } else {
            while !ready(value) { condition.wait() }
        }
        return try body(&value)
    }
}
