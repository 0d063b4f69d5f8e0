import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Runs YAJL over one complete buffer (one line) with the given callbacks.
///
/// YAJL is fed the whole line in one call, so every token lies in that buffer and
/// `yajl_get_bytes_consumed` inside a callback is the offset just past the current token.
/// YAJL accepts form feed and vertical tab as whitespace, which RFC 8259 does not: such
/// a line is refused here before YAJL sees it (inside strings they are invalid anyway).
enum YAJL {
    struct SyntaxError: Error {
        let message: String
    }

    /// A line that ends inside its value.
    static let cutShort = "the line ends before the message does"

    /// A handle that parses line after line (`yajl_allow_multiple_values`), so YAJL
    /// allocates nothing per line. YAJL keeps `callbacks` by pointer: it must outlive the handle.
    static func makeReusableHandle(callbacks: UnsafePointer<yajl_callbacks>, context: UnsafeMutableRawPointer) -> yajl_handle? {
        guard let handle = yajl_alloc(callbacks, nil, context) else { return nil }
        _ = chatcore_yajl_allow_multiple_values(handle)
        return handle
    }

    /// Parses one line with a reusable handle. `incompleteness` says what is wrong when the
    /// line does not hold exactly one complete value and nothing after it but whitespace
    /// (nil: nothing). `reusable` is false when YAJL failed or the line was incomplete:
    /// the handle's state is then mid-value, and the caller must free it and use a fresh
    /// one for the next line.
    static func parse(_ text: UnsafeRawBufferPointer, with handle: yajl_handle, incompleteness: () -> String?) -> (error: SyntaxError?, reusable: Bool) {
        if let refused = refuseBeforeParsing(text) { return (refused, true) }
        let base = text.baseAddress!.assumingMemoryBound(to: UInt8.self)
        let status = yajl_parse(handle, base, text.count)
        let problem = incompleteness()
        if status == yajl_status_ok && problem == nil { return (nil, true) }
        let message = status == yajl_status_ok ? problem! : describeError(handle, base, text.count)
        return (SyntaxError(message: message), false)
    }

    /// Parses one complete text with a handle of its own.
    static func parse(
        _ text: UnsafeRawBufferPointer,
        callbacks: UnsafePointer<yajl_callbacks>,
        context: UnsafeMutableRawPointer
    ) -> SyntaxError? {
        if let refused = refuseBeforeParsing(text) { return refused }
        guard let handle = yajl_alloc(callbacks, nil, context) else {
            return SyntaxError(message: "out of memory")
        }
        defer { yajl_free(handle) }
        let base = text.baseAddress!.assumingMemoryBound(to: UInt8.self)
        var status = yajl_parse(handle, base, text.count)
        if status == yajl_status_ok {
            status = yajl_complete_parse(handle)
        }
        if status == yajl_status_ok { return nil }
        if status == yajl_status_client_canceled { return SyntaxError(message: "parsing was cancelled") }
        return SyntaxError(message: describeError(handle, base, text.count))
    }

    /// Checks syntax only, with no callbacks: YAJL keeps its nesting on the heap, so this
    /// is safe at any depth (used once a line was found too deep to decode).
    static func syntaxError(in text: UnsafeRawBufferPointer) -> SyntaxError? {
        var unused: UInt8 = 0
        let error = withUnsafePointer(to: yajl_callbacks()) { none in
            withUnsafeMutablePointer(to: &unused) { parse(text, callbacks: none, context: UnsafeMutableRawPointer($0)) }
        }
        // YAJL reports a value cut short when the input ends, with no useful offset.
        if let error, error.message.hasPrefix("premature EOF") { return SyntaxError(message: cutShort) }
        return error
    }

    /// YAJL's own words for its error, without its decorations, and where it happened.
    private static func describeError(_ handle: yajl_handle?, _ base: UnsafePointer<UInt8>, _ count: Int) -> String {
        let offset = yajl_get_bytes_consumed(handle)
        var message = "not valid JSON"
        if let raw = yajl_get_error(handle, 0, base, count) {
            message = String(cString: raw)
                .trimmingSpaces()
                .replacingPrefix("lexical error: ", with: "")
                .replacingPrefix("parse error: ", with: "")
            yajl_free_error(handle, raw)
        }
        if message.hasSuffix(".") { message.removeLast() }
        return "\(message) (near byte \(offset + 1))"
    }

    /// What is refused before YAJL sees it: an empty line, form feed or vertical tab, and
    /// bytes that are not UTF-8.
    private static func refuseBeforeParsing(_ text: UnsafeRawBufferPointer) -> SyntaxError? {
        if text.isEmpty { return SyntaxError(message: "the line is empty") }
        if let bad = firstNonJSONWhitespace(text) {
            return SyntaxError(message: "invalid character at byte \(bad + 1)")
        }
        if let bad = firstInvalidUTF8(text) {
            return SyntaxError(message: "not UTF-8 at byte \(bad + 1)")
        }
        return nil
    }

    /// Where the first byte sequence that is not UTF-8 (RFC 3629) starts, if any.
    ///
    /// YAJL checks only the shape of a sequence (a lead byte and its continuation bytes):
    /// it lets through overlong forms (`C0 80` for U+0000), encoded surrogates (`ED A0 80`)
    /// and code points past U+10FFFF, which Swift then turns into U+FFFD. Two different
    /// user ids would become one, and text would change silently; so they are refused here.
    static func firstInvalidUTF8(_ text: UnsafeRawBufferPointer) -> Int? {
        let count = text.count
        var index = 0
        while index < count {
            // ASCII, eight bytes at a time.
            if index + 8 <= count, text.loadUnaligned(fromByteOffset: index, as: UInt64.self) & 0x8080_8080_8080_8080 == 0 {
                index += 8
                continue
            }
            let lead = text[index]
            if lead < 0x80 {
                index += 1
                continue
            }
            // The continuation bytes after the lead, and the range the first of them must
            // be in (which rules out overlong forms, surrogates and what is past U+10FFFF).
            let following: Int
            var low: UInt8 = 0x80
            var high: UInt8 = 0xBF
            switch lead {
            case 0xC2...0xDF: following = 1
            case 0xE0:
                following = 2
                low = 0xA0
            case 0xED:
                following = 2
                high = 0x9F
            case 0xE1...0xEF: following = 2
            case 0xF0:
                following = 3
                low = 0x90
            case 0xF4:
                following = 3
                high = 0x8F
            case 0xF1...0xF3: following = 3
            default: return index
            }
            guard index + following < count, (low...high).contains(text[index + 1]) else { return index }
            var next = index + 2
            while next <= index + following {
                guard text[next] & 0xC0 == 0x80 else { return index }
                next += 1
            }
            index = next
        }
        return nil
    }

    /// Form feed (0x0C) and vertical tab (0x0B) are never valid in a JSON text: outside
    /// strings they are not whitespace, inside strings control characters must be escaped.
    private static func firstNonJSONWhitespace(_ text: UnsafeRawBufferPointer) -> Int? {
        let base = text.baseAddress!
        if let found = memchr(base, 0x0C, text.count) { return base.distance(to: UnsafeRawPointer(found)) }
        if let found = memchr(base, 0x0B, text.count) { return base.distance(to: UnsafeRawPointer(found)) }
        return nil
    }
}

extension String {
    fileprivate func trimmingSpaces() -> String {
        var scalars = Substring(self)
        while let last = scalars.last, last == " " || last == "\n" { scalars.removeLast() }
        while let first = scalars.first, first == " " || first == "\n" { scalars.removeFirst() }
        return String(scalars)
    }

    fileprivate func replacingPrefix(_ prefix: String, with replacement: String) -> String {
        hasPrefix(prefix) ? replacement + dropFirst(prefix.count) : self
    }
}
