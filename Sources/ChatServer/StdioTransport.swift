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
public final class StdioTransport: Sendable {
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
final class FileOutput: SessionOutput, Sendable {
    /// Above this many buffered bytes the reading side waits.
    static let highWater = 4 << 20

    private let descriptor: Int32
    private let logger: Logger

    /// What the sessions hand over and the writer thread takes.
    private struct State {
        var buffer: [UInt8] = []
        var flushRequested = false
        var finished = false
        var writing = false
        /// Bytes of the chunk being written now.
        var writingCount = 0
        var broken = false
        var ended = false
    }

    private let state = Locked(State())

    /// Standard output cannot be written to any more.
    var isBroken: Bool { state.withLock { $0.broken } }

    /// The service ended the session (its endpoint was deregistered): nothing more is
    /// read, and nothing more is written after what was written before.
    var isEnded: Bool { state.withLock { $0.ended } }

    func closeAfterWritten() {
        state.change {
            $0.ended = true
            $0.flushRequested = true
        }
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
        state.change {
            if !$0.broken && !$0.ended { $0.buffer.append(contentsOf: bytes) }
            if flush { $0.flushRequested = true }
        }
    }

    var backlog: Int {
        state.withLock { $0.buffer.count + ($0.writing ? $0.writingCount : 0) }
    }

    func resumeInput() {
        state.change { _ in }
    }

    /// Blocks while `predicate` holds (re-checked whenever output or the engine moves on,
    /// and every 50 ms).
    func waitWhile(_ predicate: () -> Bool) {
        func done(_ state: State) -> Bool { !predicate() || state.broken || state.ended }
        while !state.wait(until: done, deadline: Date(timeIntervalSinceNow: 0.05), then: { done($0) }) {}
    }

    func waitUntilWritable() {
        state.wait(until: { $0.buffer.count <= FileOutput.highWater || $0.broken }) { _ in }
    }

    /// Writes out everything (giving up at `deadline`, if any) and stops the writer.
    func finish(deadline: Date? = nil) {
        state.change {
            $0.finished = true
            $0.flushRequested = true
        }
        state.wait(until: { ($0.buffer.isEmpty && !$0.writing) || $0.broken }, deadline: deadline) { _ in }
    }

    private func writeLoop() {
        var chunk: [UInt8] = []
        while true {
            let more = state.wait(
                until: { ($0.flushRequested && !$0.buffer.isEmpty) || ($0.finished && $0.buffer.isEmpty) || $0.buffer.count >= 64 * 1024 },
                notifying: true
            ) { state in
                if state.buffer.isEmpty && state.finished { return false }
                swap(&chunk, &state.buffer)
                state.flushRequested = false
                state.writing = true
                state.writingCount = chunk.count
                return true
            }
            if !more { return }

            let ok = chunk.withUnsafeBytes { writeAll($0) }
            chunk.removeAll(keepingCapacity: true)

            state.change {
                $0.writing = false
                if !ok {
                    $0.broken = true
                    $0.buffer.removeAll()
                }
            }
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
