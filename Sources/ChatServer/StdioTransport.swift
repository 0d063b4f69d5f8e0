import ChatEngine
import ChatSession
import ChatWire
import Foundation
import Logging
import Threads

#if canImport(Glibc)
    import Glibc
#endif

/// The standard input/output session (§1).
///
/// Blocking threads rather than an event loop, because standard input may be a regular
/// file (`chatcore serve --user u < requests.ndjson`), which epoll cannot watch. The
/// reading thread stops reading while the output is backed up or the engine has too
/// much of this session's work; at the end of input everything submitted is finished
/// and written before `run` returns.
public final class StdioTransport: @unchecked Sendable {
    private let input: Int32
    private let output: FileOutput
    private let session: Session
    private let engine: Engine
    private let maxLineBytes: Int
    private let logger: Logger

    public init(
        engine: Engine, authenticator: Authenticator, limits: Session.Limits, trustedUser: String?, logger: Logger,
        input: Int32 = 0, outputDescriptor: Int32 = 1
    ) {
        self.input = input
        self.engine = engine
        self.logger = logger
        self.maxLineBytes = limits.maxLineBytes
        let output = FileOutput(descriptor: outputDescriptor, logger: logger)
        self.output = output
        self.session = Session(engine: engine, authenticator: authenticator, transport: .stdio, output: output, limits: limits, trustedUser: trustedUser)
    }

    /// Reads until end of input, then waits until every answer is written.
    public func run() {
        var framer = LineFramer(maxLineBytes: maxLineBytes)
        let chunkSize = 64 * 1024
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: chunkSize, alignment: 16)
        defer { buffer.deallocate() }
        while !output.isBroken && !output.isEnded && !engine.isShuttingDown {
            output.waitUntilWritable()
            output.waitWhile { !self.session.wantsInput && !self.engine.isShuttingDown }
            if output.isEnded { break }
            // Wait for input in short steps, so that an ended session stops reading even
            // while its parent sends nothing.
            var waiting = pollfd(fd: input, events: Int16(POLLIN), revents: 0)
            let ready = poll(&waiting, 1, 100)
            if ready == 0 || (ready < 0 && errno == EINTR) { continue }
            let count = read(input, buffer.baseAddress, chunkSize)
            if count < 0 {
                if errno == EINTR { continue }
                logger.error("reading standard input failed", metadata: ["errno": "\(errno)"])
                break
            }
            if count == 0 { break }
            framer.feed(UnsafeRawBufferPointer(rebasing: buffer[0..<count])) { session.receive($0) }
            session.endOfInputChunk()
        }
        framer.finish { session.receive($0) }
        session.endOfInputChunk()
        engine.drain()
        session.close()
        engine.drain()
        output.finish()
    }
}

extension StdioTransport {
    /// Shutting down (the engine has drained): writes out every answer decided so far,
    /// giving up at `deadline` if standard output is not being read.
    public func flushForShutdown(deadline: Date) {
        output.finish(deadline: deadline)
    }
}

/// Buffered, ordered output to a file descriptor, written by its own thread so that the
/// engine never blocks on a slow reader.
final class FileOutput: SessionOutput, @unchecked Sendable {
    /// Above this many buffered bytes the reading side waits.
    static let highWater = 4 << 20

    private let descriptor: Int32
    private let logger: Logger
    private let condition = NSCondition()
    private var buffer: [UInt8] = []
    private var flushRequested = false
    private var finished = false
    private var writing = false
    /// Bytes of the chunk being written now.
    private var writingCount = 0
    private var broken = false
    private var ended = false
    /// Standard output cannot be written to any more (read under the lock).
    var isBroken: Bool {
        condition.lock()
        defer { condition.unlock() }
        return broken
    }

    /// The service ended the session (its endpoint was deregistered): nothing more is
    /// read, and nothing more is written after what was written before.
    var isEnded: Bool {
        condition.lock()
        defer { condition.unlock() }
        return ended
    }

    func closeAfterWritten() {
        condition.lock()
        ended = true
        flushRequested = true
        condition.broadcast()
        condition.unlock()
    }

    init(descriptor: Int32, logger: Logger) {
        self.descriptor = descriptor
        self.logger = logger
        let thread = Thread { [self] in
            nameCurrentThread("stdout")
            writeLoop()
        }
        thread.start()
    }

    func write(_ bytes: UnsafeRawBufferPointer, flush: Bool) {
        condition.lock()
        if !broken && !ended { buffer.append(contentsOf: bytes) }
        if flush { flushRequested = true }
        condition.broadcast()
        condition.unlock()
    }

    var backlog: Int {
        condition.lock()
        defer { condition.unlock() }
        return buffer.count + (writing ? writingCount : 0)
    }

    func resumeInput() {
        condition.lock()
        condition.broadcast()
        condition.unlock()
    }

    /// Blocks while `predicate` holds (re-checked whenever output or the engine moves on).
    func waitWhile(_ predicate: () -> Bool) {
        condition.lock()
        while predicate() && !broken && !ended { _ = condition.wait(until: Date(timeIntervalSinceNow: 0.05)) }
        condition.unlock()
    }

    func waitUntilWritable() {
        condition.lock()
        while buffer.count > FileOutput.highWater && !broken { condition.wait() }
        condition.unlock()
    }

    /// Writes out everything (giving up at `deadline`, if any) and stops the writer.
    func finish(deadline: Date? = nil) {
        condition.lock()
        finished = true
        flushRequested = true
        condition.broadcast()
        while (!buffer.isEmpty || writing) && !broken {
            if let deadline {
                guard condition.wait(until: deadline) else { break }
            } else {
                condition.wait()
            }
        }
        condition.unlock()
    }

    private func writeLoop() {
        var chunk: [UInt8] = []
        while true {
            condition.lock()
            while !(flushRequested && !buffer.isEmpty) && !(finished && buffer.isEmpty) && buffer.count < 64 * 1024 {
                condition.wait()
            }
            if buffer.isEmpty && finished {
                condition.unlock()
                return
            }
            swap(&chunk, &buffer)
            flushRequested = false
            writing = true
            writingCount = chunk.count
            condition.broadcast()
            condition.unlock()

            let ok = chunk.withUnsafeBytes { writeAll($0) }
            chunk.removeAll(keepingCapacity: true)

            condition.lock()
            writing = false
            if !ok {
                broken = true
                buffer.removeAll()
            }
            condition.broadcast()
            condition.unlock()
            if !ok { return }
        }
    }

    private func writeAll(_ bytes: UnsafeRawBufferPointer) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let written = Glibc.write(descriptor, bytes.baseAddress! + offset, bytes.count - offset)
            if written < 0 {
                if errno == EINTR { continue }
                if errno == EAGAIN {
                    var pollDescriptor = pollfd(fd: descriptor, events: Int16(POLLOUT), revents: 0)
                    _ = poll(&pollDescriptor, 1, 1000)
                    continue
                }
                logger.warning("standard output is closed; answers are dropped", metadata: ["errno": "\(errno)"])
                return false
            }
            offset += written
        }
        return true
    }
}
