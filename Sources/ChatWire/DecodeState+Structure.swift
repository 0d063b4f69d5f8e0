import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// Objects, arrays and members as YAJL reports them: which type each value is decoded
// as, and where it goes.
extension DecodeState {
    // MARK: callbacks

    /// Nil for one complete value and nothing after it but JSON whitespace; otherwise
    /// what is wrong, in words.
    func incompleteness(lineLength: Int, text: UnsafeRawBufferPointer) -> String? {
        // Made only when needed: this runs for every line.
        func afterFirst() -> String {
            "the line holds more than one JSON value (the next starts near byte \(topLevel.end + 1)): send one message per line"
        }
        if topLevel.values > 1 { return afterFirst() }
        guard topLevel.values == 1, frames.isEmpty else { return YAJL.cutShort }
        var index = topLevel.end
        while index < lineLength {
            let byte = text[index]
            guard byte == 0x20 || byte == 0x09 || byte == 0x0D || byte == 0x0A else { return afterFirst() }
            index += 1
        }
        return nil
    }

    /// Called when the stack empties: a top-level value is complete.
    mutating func topValueEnded() {
        topLevel.values += 1
        if topLevel.values == 1 { topLevel.end = consumed }
        if topLevel.values > 1 { failStructure("a line must hold one JSON object") }
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
            frame.object.isRequest = topIsEnvelope
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
                request.name = nil
                frames[top].pointee.type = nil
                return
            }
            let name = String(decoding: key, as: UTF8.self)
            request.name = name
            if case .line(let messages) = mode, let index = messages.wireMessages.index(of: key) {
                request.messageIndex = index
                frames[top].pointee.type = messages.wireMessages.typeTable[index]
            } else {
                fail("unknown request '\(name)'", kind: .unknownRequest)
                frames[top].pointee.type = .object(UnknownRequest.self)
            }
        case .object:
            let found = frames[top].pointee.object.schemaReference!._withUnsafeGuaranteedRef { $0.index(of: key) }
            guard let index = found else {
                frames[top].pointee.object.pending = -1
                let ignores = frames[top].pointee.object.schemaReference!._withUnsafeGuaranteedRef { $0.ignoresUnknownFields }
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
            if failure != nil && !(frames[top].pointee.object.isRequest && index == frames[top].pointee.object.cookieIndex) {
                frames[top].pointee.object.pending = -1
                return
            }
            frames[top].pointee.object.pending = index
            if slots[frames[top].pointee.object.slotBase + index] != nil {
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
    mutating func chooseVariant(_ top: Int, _ value: Scalar) {
        let unionType = frames[top].pointee.unionType!
        let isRequest = frames[top].pointee.object.isRequest
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
            slots[frames[object].pointee.object.slotBase + index] = .string(variant.name)
        }
    }

    mutating func finishObject(_ top: Int) {
        let slotBase = frames[top].pointee.object.slotBase
        let isRequest = frames[top].pointee.object.isRequest
        let objectType = frames[top].pointee.object.objectType!
        let schema = frames[top].pointee.object.schemaReference!.takeUnretainedValue()
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
            request.slotBase = slotBase
            request.slotCount = schema.count
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
    mutating func closeNested(_ top: Int) {
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
            if frames[frames.count - 1].pointee.type != nil { failStructure("the value of '\(request.name ?? "")' must be an object") }
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
                if frames[top].pointee.type != nil { failStructure("the value of '\(request.name ?? "")' must be an object") }
                return
            case .object:
                if frames[top].pointee.object.isRequest, frames[top].pointee.object.pending >= 0,
                    frames[top].pointee.object.pending == frames[top].pointee.object.cookieIndex,
                    case .string(let text) = value
                {
                    request.cookie = String(decoding: text, as: UTF8.self)
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

}
