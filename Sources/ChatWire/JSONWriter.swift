#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Writes compact JSON (no whitespace) into a byte buffer.
///
/// Generated encoders drive it field by field; free-form values (`JSONValue`) are
/// embedded verbatim, which is why this is not `yajl_gen`: YAJL's generator cannot
/// insert an already-encoded value, and re-generating one would change its escapes and
/// number spellings (docs/protocol.md requires them to come back as sent).
///
/// The buffer is raw memory owned by the writer (it is not copyable): every answer is
/// written through here, and an `Array` pays a uniqueness and capacity check per byte
/// appended.
public struct JSONWriter: ~Copyable {
    private var base: UnsafeMutablePointer<UInt8>
    private var capacity: Int
    /// Bytes written so far.
    public private(set) var count = 0
    /// True when the next value or key must be preceded by a comma.
    private var needsComma = false

    public init(capacity: Int = 256) {
        self.capacity = max(capacity, 64)
        base = .allocate(capacity: self.capacity)
    }

    deinit { base.deallocate() }

    public var isEmpty: Bool { count == 0 }

    /// A copy of what was written.
    public var bytes: [UInt8] { Array(UnsafeBufferPointer(start: base, count: count)) }

    /// What was written, valid inside `body` only.
    public func withBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        try body(UnsafeRawBufferPointer(start: base, count: count))
    }

    /// Appends bytes that are already complete JSON lines.
    public mutating func appendLines(_ bytes: UnsafeRawBufferPointer) {
        guard let start = bytes.baseAddress?.assumingMemoryBound(to: UInt8.self), !bytes.isEmpty else { return }
        put(UnsafeBufferPointer(start: start, count: bytes.count))
        needsComma = false
    }

    /// Replaces every occurrence of `needle` at or after `start` by `replacement`, which
    /// must not be longer (the bytes move left in place).
    public mutating func replaceAll(_ needle: [UInt8], with replacement: [UInt8], from start: Int) {
        precondition(replacement.count <= needle.count && !needle.isEmpty)
        guard count - start >= needle.count else { return }
        var read = start
        var write = start
        needle.withUnsafeBytes { needleBytes in
            while read < count {
                let remaining = count - read
                guard let offset = JSONWriter.find(needleBytes, in: UnsafeRawPointer(base + read), count: remaining).map({ $0 + read }) else { break }
                let kept = offset - read
                if write != read && kept > 0 { memmove(base + write, base + read, kept) }
                write += kept
                for byte in replacement {
                    base[write] = byte
                    write += 1
                }
                read = offset + needle.count
            }
        }
        if write != read {
            let tail = count - read
            if tail > 0 { memmove(base + write, base + read, tail) }
            count = write + tail
        }
    }

    /// The numbers written as `"<prefix><decimal digits>"` at or after `start`, for a caller
    /// that would otherwise search the bytes for many such quoted strings one by one (each
    /// member of a group, for its own uri, in a message they all see alike). nil: `prefix`
    /// also stands where it is not followed by digits and a quote, so finding only these
    /// numbers could miss a spelling.
    public func quotedNumbers(after prefix: [UInt8], from start: Int = 0) -> [Int64]? {
        var numbers: [Int64] = []
        var read = start
        let found: Bool = prefix.withUnsafeBytes { prefixBytes in
            while read < count, let offset = JSONWriter.find(prefixBytes, in: UnsafeRawPointer(base + read), count: count - read) {
                var at = read + offset + prefix.count
                var number: Int64 = 0
                let digits = at
                while at < count, base[at] >= UInt8(ascii: "0"), base[at] <= UInt8(ascii: "9"), at - digits < 18 {
                    number = number * 10 + Int64(base[at] - UInt8(ascii: "0"))
                    at += 1
                }
                guard at > digits, at < count, base[at] == UInt8(ascii: "\""), base[digits] != UInt8(ascii: "0") || at == digits + 1 else { return false }
                numbers.append(number)
                read = at + 1
            }
            return true
        }
        return found ? numbers : nil
    }

    /// The offset of the first `needle` in `count` bytes at `haystack`: `memchr` for one of
    /// its bytes, then a compare. That byte is its first slash, if it has one: the needle
    /// is a quoted uri, and a quote starts every key and string of an event, while a slash
    /// stands almost only in uris (looking for the quote, a compare at every key was 5% of
    /// the engine thread's work for a send).
    private static func find(_ needle: UnsafeRawBufferPointer, in haystack: UnsafeRawPointer, count: Int) -> Int? {
        let anchor = needle.firstIndex(of: UInt8(ascii: "/")) ?? 0
        let byte = Int32(needle[anchor])
        // The anchor of a match is in [anchor, count - needle.count + anchor].
        var from = anchor
        while count - from >= needle.count - anchor {
            guard let hit = memchr(haystack + from, byte, count - from - (needle.count - anchor) + 1) else { return nil }
            let at = haystack.distance(to: UnsafeRawPointer(hit)) - anchor
            if memcmp(haystack + at, needle.baseAddress!, needle.count) == 0 { return at }
            from = at + anchor + 1
        }
        return nil
    }

    /// Forgets what was written, keeping the memory.
    public mutating func removeAll() {
        count = 0
        needsComma = false
    }

    public mutating func beginObject() {
        separate()
        put(UInt8(ascii: "{"))
        needsComma = false
    }

    public mutating func endObject() {
        put(UInt8(ascii: "}"))
        needsComma = true
    }

    public mutating func beginArray() {
        separate()
        put(UInt8(ascii: "["))
        needsComma = false
    }

    public mutating func endArray() {
        put(UInt8(ascii: "]"))
        needsComma = true
    }

    /// A member name known at compile time (ASCII, nothing to escape).
    public mutating func key(_ name: StaticString) {
        separate()
        reserve(name.utf8CodeUnitCount + 3)
        putReserved(UInt8(ascii: "\""))
        name.withUTF8Buffer { putReserved($0) }
        putReserved(UInt8(ascii: "\""))
        putReserved(UInt8(ascii: ":"))
        needsComma = false
    }

    /// A member name with its quotes and colon, known at compile time: `"chatId":`
    /// (generated encoders use this: one copy per key).
    public mutating func rawKey(_ token: StaticString) {
        reserve(token.utf8CodeUnitCount + 1)
        if needsComma { putReserved(UInt8(ascii: ",")) }
        token.withUTF8Buffer { putReserved($0) }
        needsComma = false
    }

    /// A member name from data (escaped as needed).
    public mutating func key(dynamic name: String) {
        string(name)
        put(UInt8(ascii: ":"))
        needsComma = false
    }

    public mutating func string(_ value: String) {
        var value = value
        value.withUTF8 { quoted($0) }
    }

    public mutating func string(_ value: StaticString) {
        value.withUTF8Buffer { quoted($0) }
    }

    public mutating func integer(_ value: Int64) {
        separate()
        appendDecimal(value)
        needsComma = true
    }

    public mutating func integer(_ value: Int) { integer(Int64(value)) }

    /// A 64-bit id: written as a decimal string (§1).
    public mutating func id64(_ value: Int64) {
        separate()
        put(UInt8(ascii: "\""))
        appendDecimal(value)
        put(UInt8(ascii: "\""))
        needsComma = true
    }

    public mutating func bool(_ value: Bool) {
        separate()
        let text: StaticString = value ? "true" : "false"
        text.withUTF8Buffer { put($0) }
        needsComma = true
    }

    public mutating func null() {
        separate()
        let text: StaticString = "null"
        text.withUTF8Buffer { put($0) }
        needsComma = true
    }

    /// An already-encoded compact JSON value, written as it is.
    public mutating func json(_ value: JSONValue) {
        separate()
        var text = value.json
        text.withUTF8 { put($0) }
        needsComma = true
    }

    /// Ends a top-level message: a newline, ready for the next one.
    public mutating func endLine() {
        put(0x0A)
        needsComma = false
    }

    // MARK: bytes

    @inline(__always)
    private mutating func separate() {
        if needsComma { put(UInt8(ascii: ",")) }
    }

    @inline(__always)
    private mutating func reserve(_ extra: Int) {
        if capacity - count < extra { grow(toHold: extra) }
    }

    @inline(never)
    private mutating func grow(toHold extra: Int) {
        var newCapacity = capacity * 2
        while newCapacity - count < extra { newCapacity *= 2 }
        let newBase = UnsafeMutablePointer<UInt8>.allocate(capacity: newCapacity)
        newBase.update(from: base, count: count)
        base.deallocate()
        base = newBase
        capacity = newCapacity
    }

    @inline(__always)
    private mutating func put(_ byte: UInt8) {
        reserve(1)
        putReserved(byte)
    }

    @inline(__always)
    private mutating func put(_ buffer: UnsafeBufferPointer<UInt8>) {
        reserve(buffer.count)
        putReserved(buffer)
    }

    @inline(__always)
    private mutating func putReserved(_ byte: UInt8) {
        base[count] = byte
        count += 1
    }

    @inline(__always)
    private mutating func putReserved(_ buffer: UnsafeBufferPointer<UInt8>) {
        guard let source = buffer.baseAddress, buffer.count > 0 else { return }
        (base + count).update(from: source, count: buffer.count)
        count += buffer.count
    }

    private mutating func appendDecimal(_ value: Int64) {
        reserve(20)
        if value == 0 {
            putReserved(UInt8(ascii: "0"))
            return
        }
        if value < 0 { putReserved(UInt8(ascii: "-")) }
        var magnitude = value.magnitude
        var digits = 0
        var probe = magnitude
        while probe > 0 {
            digits += 1
            probe /= 10
        }
        var index = count + digits
        count = index
        while magnitude > 0 {
            index -= 1
            base[index] = UInt8(ascii: "0") + UInt8(truncatingIfNeeded: magnitude % 10)
            magnitude /= 10
        }
    }

    /// A string value: quoted, with what RFC 8259 requires escaped.
    private mutating func quoted(_ utf8: UnsafeBufferPointer<UInt8>) {
        // Room for the common case (nothing to escape): comma, quotes, the bytes.
        reserve(utf8.count + 3)
        if needsComma { putReserved(UInt8(ascii: ",")) }
        putReserved(UInt8(ascii: "\""))
        var runStart = 0
        var index = 0
        let total = utf8.count
        while index < total {
            let byte = utf8[index]
            if byte >= 0x20 && byte != UInt8(ascii: "\"") && byte != UInt8(ascii: "\\") {
                index += 1
                continue
            }
            putReserved(UnsafeBufferPointer(rebasing: utf8[runStart..<index]))
            // An escape is at most six bytes where the input had one; keep the rest's room.
            reserve(6 + (total - index) + 1)
            putReserved(0x5C)
            switch byte {
            case UInt8(ascii: "\""): putReserved(0x22)
            case UInt8(ascii: "\\"): putReserved(0x5C)
            case 0x0A: putReserved(UInt8(ascii: "n"))
            case 0x0D: putReserved(UInt8(ascii: "r"))
            case 0x09: putReserved(UInt8(ascii: "t"))
            case 0x08: putReserved(UInt8(ascii: "b"))
            case 0x0C: putReserved(UInt8(ascii: "f"))
            default:
                putReserved(UInt8(ascii: "u"))
                putReserved(0x30)
                putReserved(0x30)
                putReserved(hexDigit(byte >> 4))
                putReserved(hexDigit(byte & 0xF))
            }
            index += 1
            runStart = index
        }
        putReserved(UnsafeBufferPointer(rebasing: utf8[runStart..<total]))
        putReserved(UInt8(ascii: "\""))
        needsComma = true
    }

    @inline(__always)
    private func hexDigit(_ nibble: UInt8) -> UInt8 {
        nibble < 10 ? UInt8(ascii: "0") + nibble : UInt8(ascii: "a") + nibble - 10
    }
}
