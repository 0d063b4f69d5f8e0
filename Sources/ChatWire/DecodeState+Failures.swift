import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// What went wrong in a line, said once, with the path where it did.
extension DecodeState {
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
                let pending = frame.pointee.object.pending
                guard pending >= 0, let schema = frame.pointee.object.schemaReference else { continue }
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

}
