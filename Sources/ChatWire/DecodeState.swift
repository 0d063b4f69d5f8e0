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

}
