import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Names the calling thread for `top -H`, `ps -L` and /proc (the kernel keeps 15 bytes).
///
/// Every thread chatcore starts calls this first thing. `Thread.current.name` is not enough
/// on Linux: Foundation applies it only once `start()` has recorded the new thread, and a
/// thread that runs before that (seen under ThreadSanitizer) stays unnamed. Writing
/// /proc/thread-self/comm names the calling thread itself, whenever it runs.
public func nameCurrentThread(_ name: String) {
    Thread.current.name = name
    #if os(Linux)
        let descriptor = open("/proc/thread-self/comm", O_WRONLY | O_CLOEXEC)
        guard descriptor >= 0 else { return }
        defer { close(descriptor) }
        let bytes = Array(name.utf8.prefix(15))
        _ = bytes.withUnsafeBytes { write(descriptor, $0.baseAddress, $0.count) }
    #endif
}
