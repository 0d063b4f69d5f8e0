import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// Unions: a value captured as text while its variant is unknown, decoded again once it is.
extension DecodeState {
    mutating func finishCapture() {
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
    mutating func decodeUnion(_ unionType: any WireUnionDecodable.Type, text: String, isRequest: Bool) -> WireValue? {
        let prefix = path()
        let tree = try? JSONTree.parse(text)
        if isRequest, let cookieValue = tree?["cookie"]?.stringValue { request.cookie = cookieValue }
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
}
