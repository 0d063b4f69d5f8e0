import CYAJL

/// The set of messages a line may carry (the generated `Request`): maps a top-level
/// member name to the type of its value, and builds the message from the decoded value.
public protocol WireMessageSet: Sendable {
    static func wireType(named name: String) -> WireType?
    init(name: String, value: WireValue) throws
}

/// The outcome of decoding one line: the message, or why not, with what the error
/// answer needs (PROTOCOL.md §2): the member name when the line is an object with
/// exactly one member, and the cookie when its value is an object with a string cookie.
public struct DecodedLine<Message: Sendable>: Sendable {
    public let request: String?
    public let cookie: String?
    public let result: Result<Message, WireFailure>
}

/// Decodes lines with YAJL's callbacks straight into generated types.
///
/// No tree is built for known members: each callback either fills a typed slot of the
/// object being decoded (after checking type and limits) or is skipped. Free-form values
/// are captured as their original bytes, minus whitespace. The whole line is always
/// parsed, so that a syntax error anywhere wins over a semantic one and a cookie after
/// an offending member is still found; after the first semantic failure, values are
/// only skipped.
public enum WireDecoder {
    public static func decodeLine<M: WireMessageSet>(_ line: UnsafeRawBufferPointer, as: M.Type) -> DecodedLine<M> {
        let context = DecodeContext(base: line.baseAddress, mode: .line(M.wireType(named:)), pathPrefix: "")
        if let syntax = context.run(line) {
            return DecodedLine(request: nil, cookie: nil, result: .failure(WireFailure(.parseError, "invalid JSON: \(syntax.message)")))
        }
        if let structural = context.structural {
            return DecodedLine(request: context.requestName, cookie: context.requestName == nil ? nil : context.cookie, result: .failure(structural))
        }
        if let failure = context.failure {
            return DecodedLine(request: context.requestName, cookie: context.cookie, result: .failure(failure))
        }
        guard let name = context.requestName, let value = context.result else {
            return DecodedLine(request: context.requestName, cookie: context.cookie, result: .failure(WireFailure(.parseError, "a message must be one object with one member")))
        }
        do {
            return DecodedLine(request: name, cookie: context.cookie, result: .success(try M(name: name, value: value)))
        } catch let failure as WireFailure {
            return DecodedLine(request: name, cookie: context.cookie, result: .failure(failure))
        } catch {
            return DecodedLine(request: name, cookie: context.cookie, result: .failure(WireFailure(.internal, "\(error)")))
        }
    }

    public static func decodeLine<M: WireMessageSet>(_ line: String, as type: M.Type) -> DecodedLine<M> {
        var line = line
        return line.withUTF8 { decodeLine(UnsafeRawBufferPointer($0), as: type) }
    }

    /// Decodes a whole JSON text as one value of `type` (used for unions and tests).
    public static func decode<T: WireDecodable>(_ type: T.Type, from json: String) throws -> T {
        let value = try decodeValue(.object(type), from: Array(json.utf8), pathPrefix: "")
        return try value.object(type)
    }

    static func decodeValue(_ type: WireType, from bytes: [UInt8], pathPrefix: String) throws -> WireValue {
        try bytes.withUnsafeBytes { raw in
            let context = DecodeContext(base: raw.baseAddress, mode: .document(type), pathPrefix: pathPrefix)
            if let syntax = context.run(raw) {
                throw WireFailure(.parseError, "invalid JSON: \(syntax.message)")
            }
            if let failure = context.structural ?? context.failure { throw failure }
            guard let value = context.result else { throw WireFailure(.parseError, "no value") }
            return value
        }
    }

    /// Removes the whitespace outside strings from a valid JSON text (and a leading
    /// `:` or `,` left over from the member or element before it).
    static func minify(_ raw: UnsafeRawBufferPointer) -> String {
        var out: [UInt8] = []
        out.reserveCapacity(raw.count)
        var inString = false
        var escaped = false
        for byte in raw {
            if inString {
                out.append(byte)
                if escaped {
                    escaped = false
                } else if byte == UInt8(ascii: "\\") {
                    escaped = true
                } else if byte == UInt8(ascii: "\"") {
                    inString = false
                }
                continue
            }
            switch byte {
            case 0x20, 0x09, 0x0A, 0x0D:
                continue
            case UInt8(ascii: ":"), UInt8(ascii: ","):
                if out.isEmpty { continue }
                out.append(byte)
            case UInt8(ascii: "\""):
                inString = true
                out.append(byte)
            default:
                out.append(byte)
            }
        }
        return String(decoding: out, as: UTF8.self)
    }
}

/// The request-level schema used for a name that is not a known request: every member is
/// skipped but a string `cookie`, which is still echoed.
struct UnknownRequest: WireDecodable {
    static let wireSchema = WireSchema([WireField("cookie", .string(minBytes: 0, maxBytes: Int.max))], ignoresUnknownFields: true)
    init(wire fields: WireFields) throws {}
}

// MARK: - Frames

private final class EnvelopeFrame {
    var members = 0
    var pending: WireType?
}

private final class ObjectFrame {
    let type: any WireDecodable.Type
    let schema: WireSchema
    var fields: WireFields
    /// The member whose value comes next; -1 when that value is skipped.
    var pending = -1
    /// The object is the request itself (its `cookie` is echoed in failures).
    let isRequest: Bool

    init(_ type: any WireDecodable.Type, isRequest: Bool) {
        self.type = type
        self.schema = type.wireSchema
        self.fields = WireFields(count: schema.fields.count)
        self.isRequest = isRequest
    }
}

private final class ArrayFrame {
    let element: WireType
    let minItems: Int
    let maxItems: Int
    var values: [WireValue] = []
    var index = 0

    init(element: WireType, minItems: Int, maxItems: Int) {
        self.element = element
        self.minItems = minItems
        self.maxItems = maxItems
    }
}

/// Collects the bytes of a free-form value (or a union, decoded once complete).
private final class CaptureFrame {
    let start: Int
    let type: WireType
    var depth = 1

    init(start: Int, type: WireType) {
        self.start = start
        self.type = type
    }
}

private final class SkipFrame {
    var depth = 1
}

private enum Frame {
    case envelope(EnvelopeFrame)
    case object(ObjectFrame)
    case array(ArrayFrame)
    case capture(CaptureFrame)
    case skip(SkipFrame)
}

private enum Scalar {
    case null
    case bool(Bool)
    case number(UnsafeRawBufferPointer)
    case string(UnsafeRawBufferPointer)
}

// MARK: - Context

private final class DecodeContext {
    enum Mode {
        case line((String) -> WireType?)
        case document(WireType)
    }

    let base: UnsafeRawPointer?
    let mode: Mode
    let pathPrefix: String
    var handle: yajl_handle?
    var stack: [Frame] = []
    /// The offset just past the token of the previous callback.
    var previousEnd = 0

    var failure: WireFailure?
    var structural: WireFailure?
    var requestName: String?
    var cookie: String?
    var result: WireValue?

    init(base: UnsafeRawPointer?, mode: Mode, pathPrefix: String) {
        self.base = base
        self.mode = mode
        self.pathPrefix = pathPrefix
        stack.reserveCapacity(8)
    }

    static func from(_ pointer: UnsafeMutableRawPointer?) -> DecodeContext {
        Unmanaged<DecodeContext>.fromOpaque(pointer!).takeUnretainedValue()
    }

    func run(_ text: UnsafeRawBufferPointer) -> YAJL.SyntaxError? {
        let context = Unmanaged.passUnretained(self).toOpaque()
        return withUnsafePointer(to: decodeCallbacks) { callbacks in
            YAJL.parse(text, callbacks: callbacks, context: context, handleOut: { self.handle = $0 })
        }
    }

    @inline(__always)
    var consumed: Int { Int(yajl_get_bytes_consumed(handle)) }

    // MARK: failures

    func fail(_ reason: @autoclosure () -> String, kind: WireFailure.Kind = .invalidParameter) {
        if failure == nil { failure = WireFailure(kind, reason()) }
    }

    func failStructure(_ reason: String) {
        if structural == nil { structural = WireFailure(.parseError, reason) }
    }

    /// The dotted path of the member being decoded: `criteria.window.before`, `invitees[2].regId`.
    func path(last: String? = nil, through endIndex: Int? = nil) -> String {
        var parts = pathPrefix
        let end = endIndex ?? stack.count
        for index in 0..<end {
            switch stack[index] {
            case .object(let object):
                guard object.pending >= 0 else { continue }
                if !parts.isEmpty { parts += "." }
                parts += object.schema.fields[object.pending].name
            case .array(let array):
                parts += "[\(array.index)]"
            default:
                continue
            }
        }
        if let last {
            if !parts.isEmpty { parts += "." }
            parts += last
        }
        return parts
    }

    func failMismatch(_ type: WireType) {
        fail("'\(path())' must be \(type.expectation)")
    }

    // MARK: targets and delivery

    /// The type of the value that comes next, or nil when it is to be skipped.
    func target() -> WireType? {
        switch stack.last {
        case nil:
            if case .document(let type) = mode { return type }
            return nil
        case .envelope(let envelope)?:
            return envelope.pending
        case .object(let object)?:
            return object.pending >= 0 ? object.schema.fields[object.pending].type : nil
        case .array(let array)?:
            return array.element
        case .capture?, .skip?:
            return nil
        }
    }

    func deliver(_ value: WireValue?) {
        switch stack.last {
        case nil, .envelope?:
            result = value
        case .object(let object)?:
            if object.pending >= 0, let value { object.fields.values[object.pending] = value }
            object.pending = -1
        case .array(let array)?:
            if let value {
                if array.values.count >= array.maxItems {
                    fail("'\(path(through: stack.count - 1))' must have at most \(array.maxItems) items")
                } else {
                    array.values.append(value)
                }
            }
            array.index += 1
        case .capture?, .skip?:
            break
        }
    }

    /// Where an open brace or bracket lies inside a skipped or captured value, only depth counts.
    func nest() -> Bool {
        switch stack.last {
        case .skip(let skip)?:
            skip.depth += 1
            return true
        case .capture(let capture)?:
            capture.depth += 1
            return true
        default:
            return false
        }
    }

    // MARK: callbacks

    func startMap() {
        defer { previousEnd = consumed }
        if nest() { return }
        if stack.isEmpty, case .line = mode {
            stack.append(.envelope(EnvelopeFrame()))
            return
        }
        if case .envelope? = stack.last, target() == nil {
            stack.append(.skip(SkipFrame()))
            return
        }
        guard var type = target() else {
            stack.append(.skip(SkipFrame()))
            return
        }
        if case .nullable(let inner) = type { type = inner }
        switch type {
        case .object(let objectType):
            let isRequest: Bool
            if case .envelope? = stack.last { isRequest = true } else { isRequest = false }
            stack.append(.object(ObjectFrame(objectType, isRequest: isRequest)))
        case .union, .json:
            stack.append(.capture(CaptureFrame(start: previousEnd, type: type)))
        case .rejected:
            fail("'\(path())' is read-only")
            stack.append(.skip(SkipFrame()))
        default:
            failMismatch(type)
            stack.append(.skip(SkipFrame()))
        }
    }

    func mapKey(_ key: UnsafeRawBufferPointer) {
        defer { previousEnd = consumed }
        switch stack.last {
        case .envelope(let envelope)?:
            envelope.members += 1
            if envelope.members > 1 {
                failStructure("a message must have exactly one member, the request name: {\"<request>\":{...}}")
                requestName = nil
                envelope.pending = nil
                return
            }
            let name = String(decoding: key, as: UTF8.self)
            requestName = name
            if case .line(let lookup) = mode, let type = lookup(name) {
                envelope.pending = type
            } else {
                fail("unknown request '\(name)'", kind: .unknownRequest)
                envelope.pending = .object(UnknownRequest.self)
            }
        case .object(let object)?:
            guard let index = object.schema.index(of: key) else {
                object.pending = -1
                if !object.schema.ignoresUnknownFields {
                    fail("unknown field '\(path(last: String(decoding: key, as: UTF8.self)))'")
                }
                return
            }
            if failure != nil && !(object.isRequest && object.schema.fields[index].name == "cookie") {
                object.pending = -1
                return
            }
            if object.fields.has(index) {
                object.pending = index
                fail("'\(path())' is given twice")
                return
            }
            object.pending = index
        default:
            return
        }
    }

    func endMap() {
        defer { previousEnd = consumed }
        switch stack.last {
        case .skip(let skip)?:
            skip.depth -= 1
            if skip.depth == 0 {
                stack.removeLast()
                deliver(nil)
            }
        case .capture(let capture)?:
            capture.depth -= 1
            if capture.depth == 0 { finishCapture(capture) }
        case .envelope(let envelope)?:
            stack.removeLast()
            if envelope.members == 0 {
                failStructure("a message must have exactly one member, the request name: {\"<request>\":{...}}")
            }
        case .object(let object)?:
            if failure == nil {
                for index in object.schema.fields.indices where object.schema.fields[index].required && !object.fields.has(index) {
                    fail("'\(path(last: object.schema.fields[index].name, through: stack.count - 1))' is required")
                    break
                }
                let present = object.fields.values.reduce(0) { $1 == nil ? $0 : $0 + 1 }
                if !object.schema.members.contains(present) {
                    fail(object.schema.memberCountReason(path: path(through: stack.count - 1)))
                }
            }
            stack.removeLast()
            guard failure == nil else {
                deliver(nil)
                return
            }
            do {
                deliver(.object(try object.type.init(wire: object.fields)))
            } catch let error as WireFailure {
                fail(error.reason, kind: error.kind)
                deliver(nil)
            } catch {
                fail("\(error)", kind: .internal)
                deliver(nil)
            }
        case .array?, nil:
            break
        }
    }

    func startArray() {
        defer { previousEnd = consumed }
        if nest() { return }
        if stack.isEmpty, case .line = mode {
            failStructure("a message must be a JSON object")
            stack.append(.skip(SkipFrame()))
            return
        }
        if case .envelope(let envelope)? = stack.last {
            if envelope.pending != nil { failStructure("the value of '\(requestName ?? "")' must be an object") }
            stack.append(.skip(SkipFrame()))
            return
        }
        guard var type = target() else {
            stack.append(.skip(SkipFrame()))
            return
        }
        if case .nullable(let inner) = type { type = inner }
        switch type {
        case .array(let element, let minItems, let maxItems):
            stack.append(.array(ArrayFrame(element: element, minItems: minItems, maxItems: maxItems)))
        case .json(objectOnly: false):
            stack.append(.capture(CaptureFrame(start: previousEnd, type: type)))
        case .rejected:
            fail("'\(path())' is read-only")
            stack.append(.skip(SkipFrame()))
        default:
            failMismatch(type)
            stack.append(.skip(SkipFrame()))
        }
    }

    func endArray() {
        defer { previousEnd = consumed }
        switch stack.last {
        case .skip(let skip)?:
            skip.depth -= 1
            if skip.depth == 0 {
                stack.removeLast()
                deliver(nil)
            }
        case .capture(let capture)?:
            capture.depth -= 1
            if capture.depth == 0 { finishCapture(capture) }
        case .array(let array)?:
            if array.values.count < array.minItems {
                fail("'\(path(through: stack.count - 1))' must have at least \(array.minItems) item\(array.minItems == 1 ? "" : "s")")
            }
            stack.removeLast()
            deliver(failure == nil ? .array(array.values) : nil)
        default:
            break
        }
    }

    func scalar(_ value: Scalar) {
        defer { previousEnd = consumed }
        switch stack.last {
        case .skip?, .capture?:
            return
        case nil:
            if case .line = mode {
                failStructure("a message must be a JSON object")
                return
            }
        case .envelope(let envelope)?:
            if envelope.pending != nil { failStructure("the value of '\(requestName ?? "")' must be an object") }
            return
        default:
            break
        }
        if case .object(let object)? = stack.last, object.isRequest, object.pending >= 0,
           object.schema.fields[object.pending].name == "cookie", case .string(let text) = value {
            cookie = String(decoding: text, as: UTF8.self)
        }
        guard var type = target() else {
            deliver(nil)
            return
        }
        if case .nullable(let inner) = type {
            if case .null = value {
                deliver(.null)
                return
            }
            type = inner
        }
        deliver(convert(value, to: type))
    }

    private func convert(_ value: Scalar, to type: WireType) -> WireValue? {
        switch (type, value) {
        case (.string(let minBytes, let maxBytes), .string(let text)):
            if text.count < minBytes {
                fail(minBytes == 1 ? "'\(path())' must not be empty" : "'\(path())' must be at least \(minBytes) bytes")
                return nil
            }
            if text.count > maxBytes {
                fail("'\(path())' must be at most \(maxBytes) bytes")
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
                fail("'\(path())' must be an integer between \(minimum) and \(maximum)")
                return nil
            }
            guard number >= minimum && number <= maximum else {
                fail("'\(path())' must be between \(minimum) and \(maximum)")
                return nil
            }
            return .integer(number)
        case (.id64, .number(let text)), (.id64, .string(let text)):
            guard let number = parseInteger(text), number >= 0 else {
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
            fail("'\(path())' is read-only")
            return nil
        default:
            failMismatch(type)
            return nil
        }
    }

    private func finishCapture(_ capture: CaptureFrame) {
        stack.removeLast()
        let raw = UnsafeRawBufferPointer(start: base! + capture.start, count: consumed - capture.start)
        let text = WireDecoder.minify(raw)
        switch capture.type {
        case .json(let objectOnly):
            if objectOnly && text.utf8.first != UInt8(ascii: "{") {
                failMismatch(capture.type)
                deliver(nil)
                return
            }
            deliver(.json(JSONValue(compactJSON: text)))
        case .union(let unionType):
            guard failure == nil else {
                deliver(nil)
                return
            }
            let isRequest: Bool
            if case .envelope? = stack.last { isRequest = true } else { isRequest = false }
            deliver(decodeUnion(unionType, text: text, isRequest: isRequest))
        default:
            deliver(nil)
        }
    }

    /// A union is decoded once its bytes are complete: the discriminator picks the
    /// variant, then the bytes are decoded again as that variant.
    private func decodeUnion(_ unionType: any WireUnionDecodable.Type, text: String, isRequest: Bool) -> WireValue? {
        let prefix = path()
        let tree = try? JSONTree.parse(text)
        if isRequest, let cookieValue = tree?["cookie"]?.stringValue { cookie = cookieValue }
        let discriminator = unionType.discriminator
        let names = unionType.variants.map(\.name)
        let qualified = prefix.isEmpty ? discriminator : prefix + "." + discriminator
        guard let chosen = tree?[discriminator] else {
            fail("'\(qualified)' is required")
            return nil
        }
        guard let name = chosen.stringValue, let variant = unionType.variants.first(where: { $0.name == name }) else {
            fail("'\(qualified)' must be one of " + names.map { "'\($0)'" }.joined(separator: ", "))
            return nil
        }
        do {
            let value = try WireDecoder.decodeValue(.object(variant.type), from: Array(text.utf8), pathPrefix: prefix)
            return value
        } catch let error as WireFailure {
            fail(error.reason, kind: error.kind)
            return nil
        } catch {
            fail("\(error)", kind: .internal)
            return nil
        }
    }

    /// `-?[0-9]+` within Int64; nil for fractions, exponents and overflow.
    private func parseInteger(_ text: UnsafeRawBufferPointer) -> Int64? {
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

private func bytes(_ pointer: UnsafePointer<UInt8>?, _ count: Int) -> UnsafeRawBufferPointer {
    UnsafeRawBufferPointer(start: pointer, count: count)
}

private let decodeCallbacks = yajl_callbacks(
    yajl_null: { context in DecodeContext.from(context).scalar(.null); return 1 },
    yajl_boolean: { context, value in DecodeContext.from(context).scalar(.bool(value != 0)); return 1 },
    yajl_integer: nil,
    yajl_double: nil,
    yajl_number: { context, pointer, count in
        DecodeContext.from(context).scalar(.number(UnsafeRawBufferPointer(start: pointer, count: count)))
        return 1
    },
    yajl_string: { context, pointer, count in DecodeContext.from(context).scalar(.string(bytes(pointer, count))); return 1 },
    yajl_start_map: { context in DecodeContext.from(context).startMap(); return 1 },
    yajl_map_key: { context, pointer, count in DecodeContext.from(context).mapKey(bytes(pointer, count)); return 1 },
    yajl_end_map: { context in DecodeContext.from(context).endMap(); return 1 },
    yajl_start_array: { context in DecodeContext.from(context).startArray(); return 1 },
    yajl_end_array: { context in DecodeContext.from(context).endArray(); return 1 }
)
