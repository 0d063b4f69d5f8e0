/// A free-form JSON value (`data`, `localData`, `global.value`), kept as the compact
/// JSON text it arrived as.
///
/// Nothing is normalised but whitespace: big integers, `1E400`, `-0`, string escapes and
/// member order come back exactly as they were sent. Values the service makes itself are
/// built with the static constructors, which encode through `JSONWriter`.
public struct JSONValue: Sendable, Hashable, CustomStringConvertible {
    /// Compact JSON text (no whitespace outside strings).
    public let json: String

    /// Wraps text that is already compact, valid JSON (from the decoder or the store).
    public init(compactJSON: String) {
        self.json = compactJSON
    }

    public var description: String { json }

    /// Byte for byte: Swift's `==` on strings is canonical equivalence, under which
    /// `{"a":"\u{E9}"}` and `{"a":"e\u{301}"}` (as UTF-8, not escapes) would be one value, and a
    /// change from one to the other would not be announced.
    public static func == (lhs: JSONValue, rhs: JSONValue) -> Bool {
        lhs.json.utf8.elementsEqual(rhs.json.utf8)
    }

    public func hash(into hasher: inout Hasher) {
        var json = json
        json.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
    }

    public static let null = JSONValue(compactJSON: "null")
    public static let emptyObject = JSONValue(compactJSON: "{}")

    public var isNull: Bool { json == "null" }
    public var isObject: Bool { json.utf8.first == UInt8(ascii: "{") }

    /// The number of bytes of the compact text (the size limits of docs/protocol.md §6 count these).
    public var byteCount: Int { json.utf8.count }

    public static func string(_ value: String) -> JSONValue {
        build { $0.string(value) }
    }

    public static func bool(_ value: Bool) -> JSONValue {
        build { $0.bool(value) }
    }

    public static func integer(_ value: Int64) -> JSONValue {
        build { $0.integer(value) }
    }

    /// An object whose members are written in the order given.
    public static func object(_ members: KeyValuePairs<String, JSONValue>) -> JSONValue {
        object(members.map { ($0.key, $0.value) })
    }

    /// An object whose members are written in the order given (built at run time).
    public static func object(_ members: [(String, JSONValue)]) -> JSONValue {
        build { writer in
            writer.beginObject()
            for (name, value) in members {
                writer.key(dynamic: name)
                writer.json(value)
            }
            writer.endObject()
        }
    }

    public static func array(_ elements: [JSONValue]) -> JSONValue {
        build { writer in
            writer.beginArray()
            for element in elements { writer.json(element) }
            writer.endArray()
        }
    }

    private static func build(_ body: (inout JSONWriter) -> Void) -> JSONValue {
        var writer = JSONWriter(capacity: 32)
        body(&writer)
        return JSONValue(compactJSON: String(decoding: writer.bytes, as: UTF8.self))
    }

    /// Parses the value into a tree, for the few places that must look inside.
    public func tree() throws -> JSONTree {
        try JSONTree.parse(Array(json.utf8))
    }
}
