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
            if state.pointee.tooDeep {
                // Not valid JSON at all: that is what the client needs to hear first.
                if let syntax = YAJL.syntaxError(in: line) {
                    return Outcome(request: nil, cookie: nil, failure: WireFailure(.parseError, "invalid JSON: \(syntax.message)"))
                }
                // Whatever of the line was read names the request (and maybe the cookie).
                return Outcome(
                    request: state.pointee.requestName, cookie: state.pointee.cookie, failure: WireFailure(.tooLarge, "the line's \(JSONLimits.tooDeep)"))
            }
            return Outcome(request: nil, cookie: nil, failure: WireFailure(.parseError, "invalid JSON: \(syntax.message)"))
        }
        let requestName = state.pointee.requestName
        let cookie = state.pointee.cookie
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
            let base = state.pointee.requestSlotBase
            if base >= 0 {
                let index = state.pointee.requestMessageIndex
                let count = state.pointee.requestSlotCount
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
            if state.pointee.tooDeep { throw WireFailure(.tooLarge, "'\(pathPrefix)': \(JSONLimits.tooDeep)") }
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

// MARK: - State

/// An open object, array or skipped/captured value.
private struct Frame {
    enum Kind: UInt8 {
        /// The line's outer object `{"<request>": ...}`.
        case envelope
        case object
        case array
        /// A free-form value or a union, kept as bytes.
        case capture
        /// A union before its first member: if that is the discriminator, the frame becomes
        /// the chosen variant's object; otherwise it becomes a capture.
        case union
        case skip
    }

    var kind: Kind
    /// capture/skip: nesting depth inside the value.
    var depth = 1
    /// capture: where the value's bytes start.
    var start = 0
    /// object: the member whose value comes next (-1: skip it).
    var pending = -1
    /// envelope: members seen.
    var members = 0
    /// array: index of the next element.
    var index = 0
    /// object: first of its slots in the arena.
    var slotBase = 0
    /// object: the request itself (its `cookie` is echoed in failures).
    var isRequest = false
    /// object: its schema (schemas are static: they outlive every decoder, so no
    /// reference is counted for them).
    var schemaReference: Unmanaged<WireSchema>?
    /// object: the index of its `cookie` member (-1 when none).
    var cookieIndex = -1
    /// object: the schema's member types, read without reference counting.
    var types: UnsafePointer<WireType>?
    var objectType: (any WireDecodable.Type)?
    /// envelope: the type of the request value; capture: the captured type; array: element type.
    var type: WireType?
    var maxItems = 0
    var minItems = 0
    var values: [WireValue] = []
    /// union: its type, and whether the discriminator's value comes next.
    var unionType: (any WireUnionDecodable.Type)?
    var awaitingDiscriminator = false

    init(kind: Kind) {
        self.kind = kind
    }
}

/// The open frames, in memory of their own: a field of a frame is read and written in
/// place (an array subscript would copy the whole frame to read one field).
private struct FrameStack {
    private(set) var base: UnsafeMutablePointer<Frame>
    private(set) var count = 0
    private var capacity: Int

    init() {
        capacity = 16
        base = .allocate(capacity: capacity)
    }

    var isEmpty: Bool { count == 0 }

    /// A new top frame of this kind, made in place; returns where it is.
    @discardableResult
    mutating func push(_ kind: Frame.Kind) -> UnsafeMutablePointer<Frame> {
        grow()
        let slot = base + count
        slot.initialize(to: Frame(kind: kind))
        count += 1
        return slot
    }

    mutating func append(_ frame: Frame) {
        grow()
        (base + count).initialize(to: frame)
        count += 1
    }

    private mutating func grow() {
        if count == capacity {
            let larger = UnsafeMutablePointer<Frame>.allocate(capacity: capacity * 2)
            larger.moveInitialize(from: base, count: count)
            base.deallocate()
            base = larger
            capacity *= 2
        }
    }

    /// Drops the top frame in place.
    mutating func removeLast() {
        count -= 1
        (base + count).deinitialize(count: 1)
    }

    /// Takes the top frame out (when its contents are needed afterwards).
    mutating func popLast() -> Frame {
        count -= 1
        return (base + count).move()
    }

    mutating func removeAll() {
        base.deinitialize(count: count)
        count = 0
    }

    func release() {
        base.deinitialize(count: count)
        base.deallocate()
    }

    subscript(index: Int) -> UnsafeMutablePointer<Frame> { base + index }
}

private enum Scalar {
    case null
    case bool(Bool)
    case number(UnsafeRawBufferPointer)
    case string(UnsafeRawBufferPointer)
}

private struct DecodeState {
    enum Mode {
        case idle
        case line(any WireMessageSet.Type)
        case document(WireType)
    }

    var base: UnsafeRawPointer?
    var count = 0
    var mode: Mode = .idle
    var pathPrefix = ""
    /// Kept from line to line until a line leaves it mid-value (see `YAJL.parse(_:with:isComplete:)`).
    var handle: yajl_handle?
    /// Values completed at the top level (a line must hold exactly one).
    var topValues = 0
    /// Where the top-level value ended.
    var topEnd = 0
    var frames = FrameStack()
    /// Members of every open object, back to back; `slotCount` are in use (the rest are
    /// left over from earlier objects and cleared when reused).
    var slots = ContiguousArray<WireValue?>()
    var slotCount = 0
    /// The offset just past the token of the previous callback.
    var previousEnd = 0

    var failure: WireFailure?
    var structural: WireFailure?
    /// The request object's members, left in the arena for the message to be built from.
    var requestSlotBase = -1
    var requestSlotCount = 0
    var requestMessageIndex = -1
    var requestName: String?
    var cookie: String?
    var result: WireValue?

    /// Objects and arrays open now; parsing stops past `JSONLimits.maxNesting`.
    var nesting = 0
    var tooDeep = false

    /// A container opens: false (stop parsing) when it would be too deep.
    mutating func enter() -> Bool {
        nesting += 1
        if nesting > JSONLimits.maxNesting {
            tooDeep = true
            return false
        }
        return true
    }

    mutating func begin(base: UnsafeRawPointer?, count: Int, mode: Mode, pathPrefix: String) {
        nesting = 0
        tooDeep = false
        self.base = base
        self.count = count
        self.mode = mode
        self.pathPrefix = pathPrefix
        previousEnd = 0
        topValues = 0
        topEnd = 0
        requestSlotBase = -1
        requestSlotCount = 0
        requestMessageIndex = -1
        failure = nil
        structural = nil
        requestName = nil
        cookie = nil
        result = nil
    }

    mutating func end() {
        frames.removeAll()
        for index in 0..<slotCount { slots[index] = nil }
        slotCount = 0
        result = nil
        mode = .idle
        base = nil
    }

    @inline(__always)
    var consumed: Int { Int(yajl_get_bytes_consumed(handle)) }

    var isLineMode: Bool {
        if case .line = mode { return true }
        return false
    }

    // MARK: failures

    mutating func fail(_ reason: String, kind: WireFailure.Kind = .invalidParameter) {
        if failure == nil { failure = WireFailure(kind, reason) }
    }

    mutating func failStructure(_ reason: String) {
        if structural == nil { structural = WireFailure(.parseError, reason) }
    }

    /// The dotted path of the member being decoded: `criteria.window.before`, `invitees[2].regId`.
    func path(last: String? = nil, through endIndex: Int? = nil) -> String {
        var parts = ""
        if var last {
            last.withUTF8 { appendPath(to: &parts, last: UnsafeRawBufferPointer($0), through: endIndex) }
        } else {
            appendPath(to: &parts, last: nil, through: endIndex)
        }
        return parts
    }

    /// Appends the dotted path (see `path`) to `text`, ending with the member named by the
    /// UTF-8 bytes `last` when given.
    func appendPath(to text: inout String, last: UnsafeRawBufferPointer?, through endIndex: Int? = nil) {
        let start = text.utf8.count
        text += pathPrefix
        let end = endIndex ?? frames.count
        for index in 0..<end {
            let frame = frames[index]
            switch frame.pointee.kind {
            case .object:
                let pending = frame.pointee.pending
                guard pending >= 0, let schema = frame.pointee.schemaReference else { continue }
                if text.utf8.count > start { text += "." }
                schema._withUnsafeGuaranteedRef { text += $0.fields[pending].name }
            case .array:
                text += "["
                text += String(frame.pointee.index)
                text += "]"
            default:
                continue
            }
        }
        if let last {
            if text.utf8.count > start { text += "." }
            text += String(decoding: last, as: UTF8.self)
        }
    }

    mutating func failMismatch(_ type: WireType) {
        if failure == nil {
            let reason = "'\(path())' must be \(type.expectation)"
            fail(reason)
        }
    }

    // MARK: targets and delivery

    /// The type of the value that comes next, or nil when it is to be skipped.
    func target() -> WireType? {
        let top = frames.count - 1
        guard top >= 0 else {
            if case .document(let type) = mode { return type }
            return nil
        }
        switch frames[top].pointee.kind {
        case .envelope, .array: return frames[top].pointee.type
        case .object:
            let pending = frames[top].pointee.pending
            return pending >= 0 ? frames[top].pointee.types![pending] : nil
        case .capture, .skip, .union: return nil
        }
    }

    mutating func deliver(_ value: WireValue?) {
        let top = frames.count - 1
        guard top >= 0 else {
            result = value
            return
        }
        switch frames[top].pointee.kind {
        case .envelope:
            result = value
        case .object:
            let pending = frames[top].pointee.pending
            if pending >= 0, let value { slots[frames[top].pointee.slotBase + pending] = value }
            frames[top].pointee.pending = -1
        case .array:
            if let value {
                if frames[top].pointee.values.count >= frames[top].pointee.maxItems {
                    let reason = "'\(path(through: top))' must have at most \(frames[top].pointee.maxItems) items"
                    fail(reason)
                } else {
                    frames[top].pointee.values.append(value)
                }
            }
            frames[top].pointee.index += 1
        case .capture, .skip, .union:
            break
        }
    }

    /// A union whose discriminator is given an object or array: not a variant name.
    private mutating func rejectNestedDiscriminator() {
        let top = frames.count - 1
        if top >= 0 && frames[top].pointee.kind == .union { chooseVariant(top, .null) }
    }

    /// Inside a skipped or captured value only depth counts.
    mutating func nest() -> Bool {
        let top = frames.count - 1
        guard top >= 0, frames[top].pointee.kind == .skip || frames[top].pointee.kind == .capture else { return false }
        frames[top].pointee.depth += 1
        return true
    }

    mutating func pushSkip() {
        frames.push(.skip)
    }

    mutating func pushObject(_ type: any WireDecodable.Type, isRequest: Bool) {
        let schema = type.wireSchema
        let needed = slotCount + schema.count
        while slots.count < needed { slots.append(nil) }
        let frame = frames.push(.object)
        frame.pointee.schemaReference = Unmanaged.passUnretained(schema)
        frame.pointee.cookieIndex = schema.cookieIndex
        frame.pointee.types = schema.typeTable
        frame.pointee.objectType = type
        frame.pointee.isRequest = isRequest
        frame.pointee.slotBase = slotCount
        slotCount = needed
    }

    mutating func pushCapture(_ type: WireType) {
        var frame = Frame(kind: .capture)
        frame.start = previousEnd
        frame.type = type
        frames.append(frame)
    }

    // MARK: callbacks

    /// Nil for one complete value and nothing after it but JSON whitespace; otherwise
    /// what is wrong, in words.
    func incompleteness(lineLength: Int, text: UnsafeRawBufferPointer) -> String? {
        // Made only when needed: this runs for every line.
        func afterFirst() -> String {
            "the line holds more than one JSON value (the next starts near byte \(topEnd + 1)): send one message per line"
        }
        if topValues > 1 { return afterFirst() }
        guard topValues == 1, frames.isEmpty else { return YAJL.cutShort }
        var index = topEnd
        while index < lineLength {
            let byte = text[index]
            guard byte == 0x20 || byte == 0x09 || byte == 0x0D || byte == 0x0A else { return afterFirst() }
            index += 1
        }
        return nil
    }

    /// Called when the stack empties: a top-level value is complete.
    mutating func topValueEnded() {
        topValues += 1
        if topValues == 1 { topEnd = consumed }
        if topValues > 1 { failStructure("a line must hold one JSON object") }
    }

    mutating func startMap() {
        defer { previousEnd = consumed }
        rejectNestedDiscriminator()
        if nest() { return }
        if frames.isEmpty, isLineMode {
            frames.push(.envelope)
            return
        }
        let topIsEnvelope = !frames.isEmpty && frames[frames.count - 1].pointee.kind == .envelope
        guard var type = target() else {
            pushSkip()
            return
        }
        if case .nullable(let inner) = type { type = inner }
        switch type {
        case .object(let objectType):
            pushObject(objectType, isRequest: topIsEnvelope)
        case .union(let unionType):
            var frame = Frame(kind: .union)
            frame.start = consumed - 1
            frame.unionType = unionType
            frame.isRequest = topIsEnvelope
            frames.append(frame)
        case .json:
            pushCapture(type)
        case .rejected:
            let reason = "'\(path())' is read-only"
            fail(reason)
            pushSkip()
        default:
            failMismatch(type)
            pushSkip()
        }
    }

    mutating func mapKey(_ key: UnsafeRawBufferPointer) {
        defer { previousEnd = consumed }
        let top = frames.count - 1
        guard top >= 0 else { return }
        switch frames[top].pointee.kind {
        case .union:
            let unionType = frames[top].pointee.unionType!
            if unionType.discriminator.utf8.elementsEqual(key) {
                frames[top].pointee.awaitingDiscriminator = true
            } else {
                // The discriminator comes later: keep the bytes, decode them at the end.
                frames[top].pointee.kind = .capture
                frames[top].pointee.depth = 1
                frames[top].pointee.type = .union(unionType)
            }
        case .envelope:
            frames[top].pointee.members += 1
            if frames[top].pointee.members > 1 {
                failStructure("a message must have exactly one member, the request name: {\"<request>\":{...}}")
                requestName = nil
                frames[top].pointee.type = nil
                return
            }
            let name = String(decoding: key, as: UTF8.self)
            requestName = name
            if case .line(let messages) = mode, let index = messages.wireMessages.index(of: key) {
                requestMessageIndex = index
                frames[top].pointee.type = messages.wireMessages.typeTable[index]
            } else {
                fail("unknown request '\(name)'", kind: .unknownRequest)
                frames[top].pointee.type = .object(UnknownRequest.self)
            }
        case .object:
            let found = frames[top].pointee.schemaReference!._withUnsafeGuaranteedRef { $0.index(of: key) }
            guard let index = found else {
                frames[top].pointee.pending = -1
                let ignores = frames[top].pointee.schemaReference!._withUnsafeGuaranteedRef { $0.ignoresUnknownFields }
                if !ignores && failure == nil {
                    // One string, made once: with an unknown last member, this is what
                    // a client's mistake costs on every line.
                    var reason = "unknown field '"
                    reason.reserveCapacity(reason.utf8.count + pathPrefix.utf8.count + key.count + 32)
                    appendPath(to: &reason, last: key)
                    reason += "'"
                    fail(reason)
                }
                return
            }
            if failure != nil && !(frames[top].pointee.isRequest && index == frames[top].pointee.cookieIndex) {
                frames[top].pointee.pending = -1
                return
            }
            frames[top].pointee.pending = index
            if slots[frames[top].pointee.slotBase + index] != nil {
                let reason = "'\(path())' is given twice"
                fail(reason)
            }
        default:
            return
        }
    }

    mutating func endMap() {
        defer {
            previousEnd = consumed
            if frames.isEmpty { topValueEnded() }
        }
        let top = frames.count - 1
        guard top >= 0 else { return }
        switch frames[top].pointee.kind {
        case .skip, .capture:
            closeNested(top)
        case .envelope:
            let members = frames[top].pointee.members
            frames.removeLast()
            if members == 0 {
                failStructure("a message must have exactly one member, the request name: {\"<request>\":{...}}")
            }
        case .object:
            finishObject(top)
        case .union:
            let discriminator = frames[top].pointee.unionType!.discriminator
            let reason = "'\(path(last: discriminator, through: top))' is required"
            fail(reason)
            frames.removeLast()
            deliver(nil)
        case .array:
            break
        }
    }

    /// The discriminator's value picks the variant: the union frame becomes its object.
    private mutating func chooseVariant(_ top: Int, _ value: Scalar) {
        let unionType = frames[top].pointee.unionType!
        let isRequest = frames[top].pointee.isRequest
        var chosen: (name: String, type: any WireDecodable.Type)?
        if case .string(let text) = value {
            chosen = unionType.variants.first { $0.name.utf8.elementsEqual(text) }
        }
        guard let variant = chosen else {
            let names = unionType.variants.map { "'\($0.name)'" }.joined(separator: ", ")
            let reason = "'\(path(last: unionType.discriminator, through: top))' must be one of \(names)"
            fail(reason)
            frames.removeLast()
            if isRequest {
                // Still echo the request's cookie.
                pushObject(UnknownRequest.self, isRequest: true)
            } else {
                pushSkip()
            }
            return
        }
        frames.removeLast()
        pushObject(variant.type, isRequest: isRequest)
        let object = frames.count - 1
        let index = variant.type.wireSchema.index(ofName: unionType.discriminator)
        if index >= 0 {
            slots[frames[object].pointee.slotBase + index] = .string(variant.name)
        }
    }

    private mutating func finishObject(_ top: Int) {
        let slotBase = frames[top].pointee.slotBase
        let isRequest = frames[top].pointee.isRequest
        let objectType = frames[top].pointee.objectType!
        let schema = frames[top].pointee.schemaReference!.takeUnretainedValue()
        if failure == nil {
            if schema.hasRequired {
                for index in 0..<schema.count where schema.required[index] && slots[slotBase + index] == nil {
                    let reason = "'\(path(last: schema.fields[index].name, through: top))' is required"
                    fail(reason)
                    break
                }
            }
            if schema.members.lowerBound > 0 || schema.members.upperBound < Int.max {
                var present = 0
                for index in 0..<schema.count where slots[slotBase + index] != nil { present += 1 }
                if !schema.members.contains(present) {
                    fail(schema.memberCountReason(path: path(through: top)))
                }
            }
        }
        if isRequest, failure == nil, case .line = mode, case .object? = frames[top - 1].pointee.type {
            // The message is built from these slots once the line is through.
            requestSlotBase = slotBase
            requestSlotCount = schema.count
            frames.removeLast()
            deliver(.null)
            return
        }
        var value: WireValue?
        if failure == nil {
            do {
                let box = try slots.withUnsafeMutableBufferPointer { buffer in
                    try objectType.decodeBox(WireFields(base: buffer.baseAddress! + slotBase, count: schema.count))
                }
                value = .object(box)
            } catch let error as WireFailure {
                fail(error.reason, kind: error.kind)
            } catch {
                fail("\(error)", kind: .internal)
            }
        }
        frames.removeLast()
        for index in slotBase..<slotCount { slots[index] = nil }
        slotCount = slotBase
        deliver(value)
    }

    /// A `}` or `]` inside a skipped or captured value: the value ends when its depth does.
    private mutating func closeNested(_ top: Int) {
        frames[top].pointee.depth -= 1
        guard frames[top].pointee.depth == 0 else { return }
        if frames[top].pointee.kind == .capture {
            finishCapture()
        } else {
            frames.removeLast()
            deliver(nil)
        }
    }

    mutating func startArray() {
        defer { previousEnd = consumed }
        rejectNestedDiscriminator()
        if nest() { return }
        if frames.isEmpty, isLineMode {
            failStructure("a message must be a JSON object")
            pushSkip()
            return
        }
        if !frames.isEmpty && frames[frames.count - 1].pointee.kind == .envelope {
            if frames[frames.count - 1].pointee.type != nil { failStructure("the value of '\(requestName ?? "")' must be an object") }
            pushSkip()
            return
        }
        guard var type = target() else {
            pushSkip()
            return
        }
        if case .nullable(let inner) = type { type = inner }
        switch type {
        case .array(let element, let minItems, let maxItems):
            var frame = Frame(kind: .array)
            frame.type = element
            frame.minItems = minItems
            frame.maxItems = maxItems
            frames.append(frame)
        case .json(objectOnly: false):
            pushCapture(type)
        case .rejected:
            let reason = "'\(path())' is read-only"
            fail(reason)
            pushSkip()
        default:
            failMismatch(type)
            pushSkip()
        }
    }

    mutating func endArray() {
        defer {
            previousEnd = consumed
            if frames.isEmpty { topValueEnded() }
        }
        let top = frames.count - 1
        guard top >= 0 else { return }
        switch frames[top].pointee.kind {
        case .skip, .capture:
            closeNested(top)
        case .array:
            let frame = frames.popLast()
            if frame.values.count < frame.minItems {
                let reason = "'\(path())' must have at least \(frame.minItems) item\(frame.minItems == 1 ? "" : "s")"
                fail(reason)
            }
            deliver(failure == nil ? .array(frame.values) : nil)
        default:
            break
        }
    }

    mutating func scalar(_ value: Scalar) {
        let atTop = frames.isEmpty
        defer {
            previousEnd = consumed
            if atTop { topValueEnded() }
        }
        let top = frames.count - 1
        if top < 0 {
            if isLineMode {
                failStructure("a message must be a JSON object")
                return
            }
        } else {
            switch frames[top].pointee.kind {
            case .skip, .capture:
                return
            case .union:
                chooseVariant(top, value)
                return
            case .envelope:
                if frames[top].pointee.type != nil { failStructure("the value of '\(requestName ?? "")' must be an object") }
                return
            case .object:
                if frames[top].pointee.isRequest, frames[top].pointee.pending >= 0, frames[top].pointee.pending == frames[top].pointee.cookieIndex,
                    case .string(let text) = value
                {
                    cookie = String(decoding: text, as: UTF8.self)
                }
            case .array:
                break
            }
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

    private mutating func convert(_ value: Scalar, to type: WireType) -> WireValue? {
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

    private mutating func finishCapture() {
        let frame = frames.popLast()
        let raw = UnsafeRawBufferPointer(start: base! + frame.start, count: consumed - frame.start)
        let text = WireDecoder.minify(raw)
        switch frame.type {
        case .json(let objectOnly)?:
            if objectOnly && text.utf8.first != UInt8(ascii: "{") {
                failMismatch(frame.type!)
                deliver(nil)
                return
            }
            deliver(.json(JSONValue(compactJSON: text)))
        case .union(let unionType)?:
            guard failure == nil else {
                deliver(nil)
                return
            }
            let isRequest = !frames.isEmpty && frames[frames.count - 1].pointee.kind == .envelope
            deliver(decodeUnion(unionType, text: text, isRequest: isRequest))
        default:
            deliver(nil)
        }
    }

    /// A union is decoded once its bytes are complete: the discriminator picks the
    /// variant, then the bytes are decoded again as that variant.
    private mutating func decodeUnion(_ unionType: any WireUnionDecodable.Type, text: String, isRequest: Bool) -> WireValue? {
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
            return try WireDecoder.decodeValue(.object(variant.type), from: Array(text.utf8), pathPrefix: prefix)
        } catch let error as WireFailure {
            fail(error.reason, kind: error.kind)
            return nil
        } catch {
            fail("\(error)", kind: .internal)
            return nil
        }
    }

    /// The first `\uXXXX` escape in one JSON string token (and what precedes it in `raw`:
    /// a colon, a comma, white space) that is a surrogate not paired high-then-low, as
    /// its four hex digits.
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

    private static func hexDigit(_ byte: UInt8) -> UInt8? {
        switch byte {
        case UInt8(ascii: "0")...UInt8(ascii: "9"): byte - UInt8(ascii: "0")
        case UInt8(ascii: "a")...UInt8(ascii: "f"): byte - UInt8(ascii: "a") + 10
        case UInt8(ascii: "A")...UInt8(ascii: "F"): byte - UInt8(ascii: "A") + 10
        default: nil
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

@inline(__always)
private func state(_ context: UnsafeMutableRawPointer?) -> UnsafeMutablePointer<DecodeState> {
    context!.assumingMemoryBound(to: DecodeState.self)
}

@inline(__always)
private func bytes(_ pointer: UnsafePointer<UInt8>?, _ count: Int) -> UnsafeRawBufferPointer {
    UnsafeRawBufferPointer(start: pointer, count: count)
}

/// YAJL keeps a pointer to its callbacks for the life of a handle, and handles live from
/// line to line: the table has storage of its own that is never freed.
nonisolated(unsafe) private let decodeCallbacks: UnsafePointer<yajl_callbacks> = {
    let table = UnsafeMutablePointer<yajl_callbacks>.allocate(capacity: 1)
    table.initialize(to: decodeCallbackTable)
    return UnsafePointer(table)
}()

private let decodeCallbackTable = yajl_callbacks(
    yajl_null: { context in
        state(context).pointee.scalar(.null)
        return 1
    },
    yajl_boolean: { context, value in
        state(context).pointee.scalar(.bool(value != 0))
        return 1
    },
    yajl_integer: nil,
    yajl_double: nil,
    yajl_number: { context, pointer, count in
        state(context).pointee.scalar(.number(UnsafeRawBufferPointer(start: pointer, count: count)))
        return 1
    },
    yajl_string: { context, pointer, count in
        state(context).pointee.scalar(.string(bytes(pointer, count)))
        return 1
    },
    yajl_start_map: { context in
        let state = state(context)
        guard state.pointee.enter() else { return 0 }
        state.pointee.startMap()
        return 1
    },
    yajl_map_key: { context, pointer, count in
        state(context).pointee.mapKey(bytes(pointer, count))
        return 1
    },
    yajl_end_map: { context in
        state(context).pointee.nesting -= 1
        state(context).pointee.endMap()
        return 1
    },
    yajl_start_array: { context in
        let state = state(context)
        guard state.pointee.enter() else { return 0 }
        state.pointee.startArray()
        return 1
    },
    yajl_end_array: { context in
        state(context).pointee.nesting -= 1
        state(context).pointee.endArray()
        return 1
    }
)
