/// Splits a byte stream into protocol lines (§1).
///
/// It knows only bytes and limits: a line is the bytes before `\n` (a trailing `\r` is
/// dropped before parsing but counts toward the limit). A line longer than
/// `maxLineBytes` is reported once as `.tooLarge` as soon as it is detected and then
/// discarded up to its newline without being kept in memory. Lines holding only
/// whitespace are skipped but still counted. Complete lines inside one chunk are handed
/// out without copying.
public struct LineFramer: Sendable {
    public enum Frame {
        /// A line to decode; the pointer is valid only during the callback.
        case line(UnsafeRawBufferPointer, number: Int)
        /// A line over the limit, already being discarded.
        case tooLarge(number: Int)
    }

    public private(set) var maxLineBytes: Int
    /// Bytes of a line that began in an earlier chunk.
    private var partial: [UInt8] = []
    /// True while the rest of an overlong line is being thrown away.
    private var discarding = false
    /// The number of the line currently being read (1-based).
    public private(set) var lineNumber = 1

    public init(maxLineBytes: Int) {
        precondition(maxLineBytes > 0)
        self.maxLineBytes = maxLineBytes
    }

    /// True when no partial line is buffered (nothing is lost if the input ends here).
    public var isAtLineBoundary: Bool { partial.isEmpty && !discarding }

    /// Bytes of a line not yet ended, held here.
    public var bufferedBytes: Int { partial.count }

    /// Lines may be longer from now on (a session that authenticated).
    public mutating func raiseLimit(to limit: Int) {
        maxLineBytes = max(maxLineBytes, limit)
    }

    /// The line being read is refused as too large now (all sessions together hold too
    /// much of their partial lines): what was held of it is let go, the rest skipped.
    public mutating func abandonPartialLine(_ body: (Frame) throws -> Void) rethrows {
        guard !partial.isEmpty else { return }
        partial = []
        discarding = true
        try body(.tooLarge(number: lineNumber))
    }

    /// A line's buffer is kept for the next only up to this size: one long line must not
    /// hold its memory for the life of the connection.
    static let keptCapacity = 64 * 1024

    public mutating func feed(_ chunk: UnsafeRawBufferPointer, _ body: (Frame) throws -> Void) rethrows {
        guard let base = chunk.baseAddress, chunk.count > 0 else { return }
        var start = 0
        let end = chunk.count
        while start < end {
            let rest = end - start
            let found = memchr(base + start, 0x0A, rest)
            if let newline = found {
                let lineEnd = base.distance(to: UnsafeRawPointer(newline))
                try finishLine(base + start, count: lineEnd - start, body)
                start = lineEnd + 1
            } else {
                try accumulate(base + start, count: rest, body)
                start = end
            }
        }
    }

    /// Call at end of input: a last line without a newline is still a line.
    public mutating func finish(_ body: (Frame) throws -> Void) rethrows {
        if discarding {
            discarding = false
            lineNumber += 1
            return
        }
        guard !partial.isEmpty else { return }
        let line = partial
        partial.removeAll(keepingCapacity: false)
        try line.withUnsafeBytes { try emit($0, body) }
        lineNumber += 1
    }

    private mutating func accumulate(_ bytes: UnsafeRawPointer, count: Int, _ body: (Frame) throws -> Void) rethrows {
        if discarding { return }
        if partial.count + count > maxLineBytes {
            partial.removeAll(keepingCapacity: false)
            discarding = true
            try body(.tooLarge(number: lineNumber))
            return
        }
        partial.append(contentsOf: UnsafeRawBufferPointer(start: bytes, count: count))
    }

    private mutating func finishLine(_ bytes: UnsafeRawPointer, count: Int, _ body: (Frame) throws -> Void) rethrows {
        defer { lineNumber += 1 }
        if discarding {
            discarding = false
            return
        }
        if partial.isEmpty {
            if count > maxLineBytes {
                try body(.tooLarge(number: lineNumber))
                return
            }
            try emit(UnsafeRawBufferPointer(start: bytes, count: count), body)
            return
        }
        if partial.count + count > maxLineBytes {
            partial.removeAll(keepingCapacity: false)
            try body(.tooLarge(number: lineNumber))
            return
        }
        partial.append(contentsOf: UnsafeRawBufferPointer(start: bytes, count: count))
        let line = partial
        partial.removeAll(keepingCapacity: partial.capacity <= LineFramer.keptCapacity)
        try line.withUnsafeBytes { try emit($0, body) }
    }

    private func emit(_ raw: UnsafeRawBufferPointer, _ body: (Frame) throws -> Void) rethrows {
        var line = raw
        if let last = line.last, last == 0x0D {
            line = UnsafeRawBufferPointer(rebasing: line.dropLast())
        }
        if LineFramer.isBlank(line) { return }
        try body(.line(line, number: lineNumber))
    }

    /// JSON whitespace only (space, tab, CR, LF); form feed and vertical tab are not.
    static func isBlank(_ line: UnsafeRawBufferPointer) -> Bool {
        for byte in line where byte != 0x20 && byte != 0x09 && byte != 0x0D && byte != 0x0A {
            return false
        }
        return true
    }
}

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#elseif canImport(Darwin)
    import Darwin
#endif
