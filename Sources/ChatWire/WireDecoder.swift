import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// The set of messages a line may carry (the generated `Request`): maps a top-level
/// member name to the type of its value, and builds the message from the decoded value.
public protocol WireMessageSet: Sendable {
    /// Every message: its name and the type of its value, as members of one table.
    static var wireMessages: WireSchema { get }
    static func wireType(named name: String) -> WireType?
    /// Builds a message whose value was decoded as a whole (a union).
    init(name: String, value: WireValue) throws
    /// Builds the message at `messageIndex` of `wireMessages` straight from its members.
    init(messageIndex: Int, fields: WireFields) throws
}

/// How a decoded request's value is handed over.
public enum DecodedRequest {
    /// The members of the request object, to build in place (valid during the call only).
    case fields(messageIndex: Int, WireFields)
    /// A value decoded as a whole (unions).
    case value(WireValue)
}

/// The outcome of decoding one line: the message, or why not, with what the error
/// answer needs (§2): the member name when the line is an object with
/// exactly one member, and the cookie when its value is an object with a string cookie.
public struct DecodedLine<Message: Sendable>: Sendable {
    public let request: String?
    public let cookie: String?
    public let result: Result<Message, WireFailure>

    @inlinable
    public init(request: String?, cookie: String?, result: Result<Message, WireFailure>) {
        self.request = request
        self.cookie = cookie
        self.result = result
    }
}

/// Decodes lines with YAJL's callbacks straight into generated types.
///
/// No tree is built for known members: each callback either fills a typed slot of the
/// object being decoded (after checking type and limits) or is skipped. Free-form values
/// are captured as their original bytes, minus whitespace. The whole line is always
/// parsed, so that a syntax error anywhere wins over a semantic one and a cookie after
/// an offending member is still found; after the first semantic failure, values are
/// only skipped.
///
/// A decoder is reused line after line by one thread at a time (a session's transport):
/// its state lives behind a pointer and keeps its buffers, so a line costs no
/// allocation beyond the values it produces.
public final class LineDecoder {
    private let state: UnsafeMutablePointer<DecodeState>

    public init() {
        state = .allocate(capacity: 1)
        state.initialize(to: DecodeState())
    }

    deinit {
        if let handle = state.pointee.handle { yajl_free(handle) }
        state.pointee.frames.release()
        state.deinitialize(count: 1)
        state.deallocate()
    }

    @inlinable
    public func decode<M: WireMessageSet>(_ line: UnsafeRawBufferPointer, as type: M.Type) -> DecodedLine<M> {
        var message: M?
        let outcome = decode(line, messages: type) { name, request in
            switch request {
            case .fields(let index, let fields): message = try M(messageIndex: index, fields: fields)
            case .value(let value): message = try M(name: name, value: value)
            }
        }
        switch outcome.failure {
        case let failure?:
            return DecodedLine(request: outcome.request, cookie: outcome.cookie, result: .failure(failure))
        case nil:
            return DecodedLine(request: outcome.request, cookie: outcome.cookie, result: .success(message!))
        }
    }

    /// What a line decoded to, before the message is built.
    public struct Outcome {
        public let request: String?
        public let cookie: String?
        public let failure: WireFailure?
    }

    /// Decodes a line; on success calls `build` (while the line's bytes are still valid)
    /// with the request name and value.
    public func decode(_ line: UnsafeRawBufferPointer, messages: any WireMessageSet.Type, build: (String, DecodedRequest) throws -> Void) -> Outcome {
        state.pointee.begin(base: line.baseAddress, count: line.count, mode: .line(messages), pathPrefix: "")
        defer { state.pointee.end() }
        if let syntax = run(line) {
            if state.pointee.depth.tooDeep {
                // Not valid JSON at all: that is what the client needs to hear first.
                if let syntax = YAJL.syntaxError(in: line) {
                    return Outcome(request: nil, cookie: nil, failure: WireFailure(.parseError, "invalid JSON: \(syntax.message)"))
                }
                // Whatever of the line was read names the request (and maybe the cookie).
                return Outcome(
                    request: state.pointee.request.name, cookie: state.pointee.request.cookie,
                    failure: WireFailure(.tooLarge, "the line's \(JSONLimits.tooDeep)"))
            }
            return Outcome(request: nil, cookie: nil, failure: WireFailure(.parseError, "invalid JSON: \(syntax.message)"))
        }
        let requestName = state.pointee.request.name
        let cookie = state.pointee.request.cookie
        if let structural = state.pointee.structural {
            return Outcome(request: requestName, cookie: requestName == nil ? nil : cookie, failure: structural)
        }
        if let failure = state.pointee.failure {
            return Outcome(request: requestName, cookie: cookie, failure: failure)
        }
        guard let name = requestName, let value = state.pointee.result else {
            return Outcome(request: requestName, cookie: cookie, failure: WireFailure(.parseError, "a message must be one object with one member"))
        }
        do {
            let base = state.pointee.request.slotBase
            if base >= 0 {
                let index = state.pointee.request.messageIndex
                let count = state.pointee.request.slotCount
                try state.pointee.slots.withUnsafeMutableBufferPointer { slots in
                    try build(name, .fields(messageIndex: index, WireFields(base: slots.baseAddress! + base, count: count)))
                }
            } else {
                try build(name, .value(value))
            }
            return Outcome(request: name, cookie: cookie, failure: nil)
        } catch let failure as WireFailure {
            return Outcome(request: name, cookie: cookie, failure: failure)
        } catch {
            return Outcome(request: name, cookie: cookie, failure: WireFailure(.internal, "\(error)"))
        }
    }

    /// Decodes a whole JSON text as one value of `type`.
    func decodeValue(_ type: WireType, from text: UnsafeRawBufferPointer, pathPrefix: String) throws -> WireValue {
        state.pointee.begin(base: text.baseAddress, count: text.count, mode: .document(type), pathPrefix: pathPrefix)
        defer { state.pointee.end() }
        if let syntax = run(text) {
            if state.pointee.depth.tooDeep { throw WireFailure(.tooLarge, "'\(pathPrefix)': \(JSONLimits.tooDeep)") }
            throw WireFailure(.parseError, "invalid JSON: \(syntax.message)")
        }
        if let failure = state.pointee.structural ?? state.pointee.failure { throw failure }
        guard let value = state.pointee.result else { throw WireFailure(.parseError, "no value") }
        return value
    }

    private func run(_ text: UnsafeRawBufferPointer) -> YAJL.SyntaxError? {
        let state = self.state
        // Callbacks ask the handle for offsets: it is in the state before parsing starts.
        if state.pointee.handle == nil {
            state.pointee.handle = YAJL.makeReusableHandle(callbacks: decodeCallbacks, context: UnsafeMutableRawPointer(state))
        }
        guard let handle = state.pointee.handle else { return YAJL.SyntaxError(message: "out of memory") }
        let (error, reusable) = YAJL.parse(text, with: handle) {
            state.pointee.incompleteness(lineLength: text.count, text: text)
        }
        if !reusable {
            yajl_free(handle)
            state.pointee.handle = nil
        }
        return error
    }
}

/// One-off decoding, for tests, tools and nested values.
public enum WireDecoder {
    public static func decodeLine<M: WireMessageSet>(_ line: UnsafeRawBufferPointer, as type: M.Type) -> DecodedLine<M> {
        LineDecoder().decode(line, as: type)
    }

    public static func decodeLine<M: WireMessageSet>(_ line: String, as type: M.Type) -> DecodedLine<M> {
        var line = line
        return line.withUTF8 { decodeLine(UnsafeRawBufferPointer($0), as: type) }
    }

    /// Decodes a whole JSON text as one value of `type`.
    public static func decode<T: WireDecodable>(_ type: T.Type, from json: String) throws -> T {
        let value = try decodeValue(.object(type), from: Array(json.utf8), pathPrefix: "")
        return try value.object(type)
    }

    static func decodeValue(_ type: WireType, from bytes: [UInt8], pathPrefix: String) throws -> WireValue {
        try bytes.withUnsafeBytes { try LineDecoder().decodeValue(type, from: $0, pathPrefix: pathPrefix) }
    }

    /// Removes the whitespace outside strings from a valid JSON text (and a leading
    /// `:` or `,` left over from the member or element before it).
    static func minify(_ raw: UnsafeRawBufferPointer) -> String {
        var start = 0
        while start < raw.count, [0x20, 0x09, 0x0A, 0x0D, UInt8(ascii: ":"), UInt8(ascii: ",")].contains(raw[start]) { start += 1 }
        let body = UnsafeRawBufferPointer(rebasing: raw[start...])
        // Fast path: nothing to remove outside strings.
        if !containsWhitespaceOutsideStrings(body) { return String(decoding: body, as: UTF8.self) }
        var out: [UInt8] = []
        out.reserveCapacity(body.count)
        var inString = false
        var escaped = false
        for byte in body {
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
            case UInt8(ascii: "\""):
                inString = true
                out.append(byte)
            default:
                out.append(byte)
            }
        }
        return String(decoding: out, as: UTF8.self)
    }

    private static func containsWhitespaceOutsideStrings(_ body: UnsafeRawBufferPointer) -> Bool {
        var inString = false
        var escaped = false
        for byte in body {
            if inString {
                if escaped { escaped = false } else if byte == UInt8(ascii: "\\") { escaped = true } else if byte == UInt8(ascii: "\"") { inString = false }
            } else if byte == UInt8(ascii: "\"") {
                inString = true
            } else if byte == 0x20 || byte == 0x09 || byte == 0x0A || byte == 0x0D {
                return true
            }
        }
        return false
    }
}

/// The request-level schema used for a name that is not a known request: every member is
/// skipped but a string `cookie`, which is still echoed.
struct UnknownRequest: WireDecodable {
    static let wireSchema = WireSchema([WireField("cookie", .string(minBytes: 0, maxBytes: Int.max))], ignoresUnknownFields: true)
    init(wire fields: WireFields) throws {}
}
