import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// Scalars converted to the type the schema wants, within its limits.
extension DecodeState {
    mutating func convert(_ value: Scalar, to type: WireType) -> WireValue? {
        switch (type, value) {
        case (.string(let minBytes, let maxBytes), .string(let text)):
            if text.count < minBytes {
                fail(minBytes == 1 ? "'\(path())' must not be empty" : "'\(path())' must be at least \(minBytes) bytes")
                return nil
            }
            if text.count > maxBytes {
                let reason = "'\(path())' must be at most \(maxBytes) bytes"
                fail(reason)
                return nil
            }
            // Unescaped strings point into the line: keep the pointer. Escaped ones are in
            // YAJL's scratch buffer, reused by the next string: copy them now.
            if let start = text.baseAddress, let base, start >= base, start + text.count <= base + count {
                return .text(text)
            }
            // Only an escape makes a NUL (a raw one is not JSON). No store keeps it in
            // text: SQLite reads text up to it, PostgreSQL refuses it (failing the batch).
            if let start = text.baseAddress, memchr(start, 0, text.count) != nil {
                fail("'\(path())' must not contain U+0000 (\\u0000)")
                return nil
            }
            // YAJL turns a lone high surrogate into "?" and a lone low one into bytes that
            // are not UTF-8 (read as U+FFFD): the value would not be what was sent.
            if let base, let escape = Self.unpairedSurrogate(in: UnsafeRawBufferPointer(start: base + previousEnd, count: consumed - previousEnd)) {
                fail("'\(path())' has an unpaired surrogate (\\u\(escape)), which is not a character")
                return nil
            }
            return .string(String(decoding: text, as: UTF8.self))
        case (.enumeration(let allowed), .string(let text)):
            for candidate in allowed where candidate.utf8.elementsEqual(text) {
                return .string(candidate)
            }
            failMismatch(type)
            return nil
        case (.constant(let expected), .string(let text)):
            if expected.utf8.elementsEqual(text) { return .string(expected) }
            failMismatch(type)
            return nil
        case (.integer(let minimum, let maximum), .number(let text)):
            guard let number = parseInteger(text) else {
                let reason = "'\(path())' must be an integer between \(minimum) and \(maximum)"
                fail(reason)
                return nil
            }
            guard number >= minimum && number <= maximum else {
                let reason = "'\(path())' must be between \(minimum) and \(maximum)"
                fail(reason)
                return nil
            }
            return .integer(number)
        case (.id64, .number(let text)):
            guard let number = parseInteger(text), number >= 0 else {
                failMismatch(type)
                return nil
            }
            return .integer(number)
        case (.id64, .string(let text)):
            // Only the service's own spelling: answers name an id as the service writes
            // it, so "02" or "-0" would come back as an id the client never sent.
            guard let number = parseInteger(text), number >= 0, text[0] != UInt8(ascii: "-"),
                text.count == 1 || text[0] != UInt8(ascii: "0")
            else {
                failMismatch(type)
                return nil
            }
            return .integer(number)
        case (.boolean, .bool(let flag)):
            return .bool(flag)
        case (.json(let objectOnly), _):
            if objectOnly {
                failMismatch(type)
                return nil
            }
            let raw = UnsafeRawBufferPointer(start: base! + previousEnd, count: consumed - previousEnd)
            return .json(JSONValue(compactJSON: WireDecoder.minify(raw)))
        case (.rejected, _):
            let reason = "'\(path())' is read-only"
            fail(reason)
            return nil
        default:
            failMismatch(type)
            return nil
        }
    }

    static func unpairedSurrogate(in raw: UnsafeRawBufferPointer) -> String? {
        func unit(at index: Int) -> UInt16? {
            guard index + 6 <= raw.count, raw[index] == UInt8(ascii: "\\"), raw[index + 1] == UInt8(ascii: "u") else { return nil }
            var value: UInt16 = 0
            for byte in raw[(index + 2)..<(index + 6)] {
                guard let digit = hexDigit(byte) else { return nil }
                value = value << 4 | UInt16(digit)
            }
            return value
        }
        var index = 0
        while index < raw.count {
            guard raw[index] == UInt8(ascii: "\\") else {
                index += 1
                continue
            }
            guard let value = unit(at: index) else {
                index += 2
                continue
            }
            switch value {
            case 0xD800...0xDBFF:
                guard let next = unit(at: index + 6), (0xDC00...0xDFFF).contains(next) else {
                    return String(decoding: raw[(index + 2)..<(index + 6)], as: UTF8.self)
                }
                index += 12
            case 0xDC00...0xDFFF:
                return String(decoding: raw[(index + 2)..<(index + 6)], as: UTF8.self)
            default:
                index += 6
            }
        }
        return nil
    }

    static func hexDigit(_ byte: UInt8) -> UInt8? {
        switch byte {
        case UInt8(ascii: "0")...UInt8(ascii: "9"): byte - UInt8(ascii: "0")
        case UInt8(ascii: "a")...UInt8(ascii: "f"): byte - UInt8(ascii: "a") + 10
        case UInt8(ascii: "A")...UInt8(ascii: "F"): byte - UInt8(ascii: "A") + 10
        default: nil
        }
    }

    /// `-?[0-9]+` within Int64; nil for fractions, exponents and overflow.
    func parseInteger(_ text: UnsafeRawBufferPointer) -> Int64? {
        guard !text.isEmpty, text.count <= 20 else { return nil }
        var index = 0
        var negative = false
        if text[0] == UInt8(ascii: "-") {
            negative = true
            index = 1
            guard text.count > 1 else { return nil }
        }
        var value: Int64 = 0
        while index < text.count {
            let byte = text[index]
            guard byte >= 0x30 && byte <= 0x39 else { return nil }
            let digit = Int64(byte - 0x30)
            let (times10, overflow1) = value.multipliedReportingOverflow(by: 10)
            let (next, overflow2) = negative ? times10.subtractingReportingOverflow(digit) : times10.addingReportingOverflow(digit)
            if overflow1 || overflow2 { return nil }
            value = next
            index += 1
        }
        return value
    }
}
