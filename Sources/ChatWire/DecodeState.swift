import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// What one line's decoding holds between YAJL's callbacks, and where decoded values go.

struct DecodeState {
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
    /// Values completed at the top level (a line must hold exactly one), and where the
    /// first ended.
    var topLevel = (values: 0, end: 0)
    var frames = FrameStack()
    /// Members of every open object, back to back; `slotCount` are in use (the rest are
    /// left over from earlier objects and cleared when reused).
    var slots = ContiguousArray<WireValue?>()
    var slotCount = 0
    /// The offset just past the token of the previous callback.
    var previousEnd = 0

    var failure: WireFailure?
    var structural: WireFailure?
    /// What the line says of its request.
    var request = Request()
    var result: WireValue?

    /// Objects and arrays open now; parsing stops past `JSONLimits.maxNesting`.
    var depth = (nesting: 0, tooDeep: false)

    /// What the line says of its request: its name and cookie (echoed in a failure), and
    /// the request object's members, left in the arena for the message to be built from.
    struct Request {
        var name: String?
        var cookie: String?
        var slotBase = -1
        var slotCount = 0
        var messageIndex = -1
    }

    /// A container opens: false (stop parsing) when it would be too deep.
    mutating func enter() -> Bool {
        depth.nesting += 1
        if depth.nesting > JSONLimits.maxNesting {
            depth.tooDeep = true
            return false
        }
        return true
    }

    mutating func begin(base: UnsafeRawPointer?, count: Int, mode: Mode, pathPrefix: String) {
        depth = (0, false)
        self.base = base
        self.count = count
        self.mode = mode
        self.pathPrefix = pathPrefix
        previousEnd = 0
        topLevel = (0, 0)
        request = Request()
        failure = nil
        structural = nil
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
            let pending = frames[top].pointee.object.pending
            return pending >= 0 ? frames[top].pointee.object.types![pending] : nil
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
            let pending = frames[top].pointee.object.pending
            if pending >= 0, let value { slots[frames[top].pointee.object.slotBase + pending] = value }
            frames[top].pointee.object.pending = -1
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
    mutating func rejectNestedDiscriminator() {
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
        frame.pointee.object.schemaReference = Unmanaged.passUnretained(schema)
        frame.pointee.object.cookieIndex = schema.cookieIndex
        frame.pointee.object.types = schema.typeTable
        frame.pointee.object.objectType = type
        frame.pointee.object.isRequest = isRequest
        frame.pointee.object.slotBase = slotCount
        slotCount = needed
    }

    mutating func pushCapture(_ type: WireType) {
        var frame = Frame(kind: .capture)
        frame.start = previousEnd
        frame.type = type
        frames.append(frame)
    }

}
