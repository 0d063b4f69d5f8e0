import Foundation

/// A value reached only under a lock: the one way chatcore shares mutable state between
/// threads outside the engine (NSLock, which ThreadSanitizer sees, unlike the futex of
/// `Synchronization.Mutex`).
public final class Locked<Value>: @unchecked Sendable {  // `value` is only reached under `lock`
    private let lock = NSLock()
    private var value: Value

    public init(_ value: Value) { self.value = value }

    public func withLock<T>(_ body: (inout Value) throws -> T) rethrows -> T {
        lock.lock()
        defer { lock.unlock() }
        return try body(&value)
    }
}
