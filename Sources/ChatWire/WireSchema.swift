/// The decoder's view of a message: what the generated code (from `Schemas/`) tells the
/// runtime about each object, so that YAJL's callbacks can be turned straight into typed
/// values with every limit checked on the way.

/// The type of one field, as the schema gives it.
public indirect enum WireType: Sendable {
    /// A UTF-8 string whose byte length must lie in the range.
    case string(minBytes: Int, maxBytes: Int)
    /// A string that must be one of the given values.
    case enumeration([String])
    /// A string that must be exactly this value (a union's discriminator).
    case constant(String)
    case integer(min: Int64, max: Int64)
    /// A non-negative 64-bit id: a decimal string or a JSON integer.
    case id64
    case boolean
    /// Free-form JSON kept verbatim; `objectOnly` when the schema says `type: object`.
    case json(objectOnly: Bool)
    case object(any WireDecodable.Type)
    /// An object whose shape depends on its discriminator member.
    case union(any WireUnionDecodable.Type)
    case array(WireType, minItems: Int, maxItems: Int)
    /// The value may also be `null` (a field that went away, `localData: null` removes it).
    case nullable(WireType)
    /// The field exists but may not be given: it is read-only ("'state' is read-only").
    case rejected

    /// How a reason sentence names what was expected.
    var expectation: String {
        switch self {
        case .string: return "a string"
        case .enumeration(let values): return "one of " + values.map { "'\($0)'" }.joined(separator: ", ")
        case .constant(let value): return "'\(value)'"
        case .integer: return "an integer"
        case .id64: return "an id (a decimal string without leading zeros, or a non-negative integer)"
        case .boolean: return "true or false"
        case .json(let objectOnly): return objectOnly ? "an object" : "a JSON value"
        case .object, .union: return "an object"
        case .array: return "an array"
        case .nullable(let inner): return inner.expectation + " or null"
        case .rejected: return "absent"
        }
    }
}

/// One member of an object.
public struct WireField: Sendable {
    public let name: String
    public let type: WireType
    public let required: Bool
    let nameBytes: [UInt8]

    public init(_ name: String, _ type: WireType, required: Bool = false) {
        self.name = name
        self.type = type
        self.required = required
        self.nameBytes = Array(name.utf8)
    }
}

/// The members of an object, in schema order. Unknown members are rejected.
///
/// A class, made once per type and never changed (hence `@unchecked Sendable`: its
/// tables are raw memory): the decoder keeps an unowned reference per open object,
/// and looks member names up in one flat byte table (no per-lookup copies or retains).
public final class WireSchema: @unchecked Sendable {  // immutable once made: its tables are raw memory, never written again
    public let fields: [WireField]
    /// Unknown members are skipped instead of rejected (used for unknown requests,
    /// where only the cookie is of interest).
    public let ignoresUnknownFields: Bool
    /// How many members may be present (`minProperties`/`maxProperties`).
    public let members: ClosedRange<Int>
    /// The index of the `cookie` member, if the object has one.
    let cookieIndex: Int
    /// The member types in memory that is never freed (schemas are made once per type and
    /// live as long as the process), so the decoder can read them without retaining.
    let typeTable: UnsafePointer<WireType>
    let required: ContiguousArray<Bool>
    let hasRequired: Bool
    /// Every member name, back to back, and where each starts (count + 1 offsets), in
    /// never-freed memory like `typeTable`.
    private let nameBytes: UnsafePointer<UInt8>
    private let nameOffsets: UnsafePointer<Int>

    public init(_ fields: [WireField], members: ClosedRange<Int>? = nil, ignoresUnknownFields: Bool = false) {
        self.fields = fields
        self.ignoresUnknownFields = ignoresUnknownFields
        self.members = members ?? 0...Int.max
        let table = UnsafeMutablePointer<WireType>.allocate(capacity: max(fields.count, 1))
        table.initialize(from: fields.map(\.type), count: fields.count)
        self.typeTable = UnsafePointer(table)
        self.required = ContiguousArray(fields.map(\.required))
        self.hasRequired = fields.contains { $0.required }
        var bytes: [UInt8] = []
        var offsets: [Int] = [0]
        for field in fields {
            bytes.append(contentsOf: field.nameBytes)
            offsets.append(bytes.count)
        }
        let names = UnsafeMutablePointer<UInt8>.allocate(capacity: max(bytes.count, 1))
        names.initialize(from: bytes, count: bytes.count)
        let starts = UnsafeMutablePointer<Int>.allocate(capacity: offsets.count)
        starts.initialize(from: offsets, count: offsets.count)
        self.nameBytes = UnsafePointer(names)
        self.nameOffsets = UnsafePointer(starts)
        self.cookieIndex = fields.firstIndex { $0.name == "cookie" } ?? -1
    }

    var count: Int { fields.count }

    /// The reason given when the number of members is out of `members`.
    func memberCountReason(path: String) -> String {
        let names = fields.map { "'\($0.name)'" }.joined(separator: ", ")
        let subject = path.isEmpty ? "the object" : "'\(path)'"
        if members.lowerBound == 1 && members.upperBound == 1 {
            return "\(subject) must have exactly one of \(names)"
        }
        if members.upperBound == Int.max {
            return "\(subject) must have at least \(members.lowerBound) of \(names)"
        }
        return "\(subject) must have between \(members.lowerBound) and \(members.upperBound) of \(names)"
    }

    /// The index of the member with this name, or -1.
    func index(ofName name: String) -> Int {
        var name = name
        return name.withUTF8 { index(of: UnsafeRawBufferPointer($0)) } ?? -1
    }

    @inline(__always)
    func index(of key: UnsafeRawBufferPointer) -> Int? {
        let length = key.count
        guard let keyBase = key.baseAddress?.assumingMemoryBound(to: UInt8.self) else {
            for index in 0..<count where nameOffsets[index + 1] == nameOffsets[index] { return index }
            return nil
        }
        let first = keyBase[0]
        for index in 0..<count {
            let start = nameOffsets[index]
            guard nameOffsets[index + 1] - start == length, nameBytes[start] == first else { continue }
            if memcmp(nameBytes + start, keyBase, length) == 0 { return index }
        }
        return nil
    }
}

/// A type the decoder can build from an object's members (generated).
public protocol WireDecodable: Sendable {
    static var wireSchema: WireSchema { get }
    /// Called once every member was checked against the schema and every required
    /// member is present.
    init(wire fields: WireFields) throws
}

/// A type decoded as one of several object types, chosen by a string member (generated
/// from a `oneOf` whose alternatives each fix that member with `const`).
extension WireSchema {
    /// Makes every schema reachable from `schema` now (they are otherwise made on first
    /// use). The fuzzer calls it before its first input, so that these once-only
    /// allocations are not taken for leaks of an input.
    public static func prepare(_ schema: WireSchema) {
        var seen = Set<ObjectIdentifier>()
        func visit(_ type: WireType) {
            switch type {
            case .object(let decodable):
                guard seen.insert(ObjectIdentifier(decodable)).inserted else { return }
                for field in decodable.wireSchema.fields { visit(field.type) }
            case .union(let union):
                guard seen.insert(ObjectIdentifier(union)).inserted else { return }
                for variant in union.variants { visit(.object(variant.type)) }
            case .array(let element, _, _), .nullable(let element):
                visit(element)
            default:
                return
            }
        }
        for field in schema.fields { visit(field.type) }
    }
}

public protocol WireUnionDecodable: Sendable {
    static var discriminator: String { get }
    static var variants: [(name: String, type: any WireDecodable.Type)] { get }
    init(variant: any WireDecodable) throws
}

/// A type that can be written as compact JSON (generated).
public protocol WireEncodable: Sendable {
    func encode(to writer: inout JSONWriter)
}

/// Why a line was not decoded: one of the wire error codes, and a sentence naming the
/// field or limit.
public struct WireFailure: Error, Sendable, Equatable {
    public enum Kind: String, Sendable {
        case parseError = "ParseError"
        case unknownRequest = "UnknownRequest"
        case invalidParameter = "InvalidParameter"
        case tooLarge = "TooLarge"
        case `internal` = "Internal"
    }

    public let kind: Kind
    public let reason: String

    public init(_ kind: Kind, _ reason: String) {
        self.kind = kind
        self.reason = reason
    }
}

/// A value the decoder produced for one member, before the generated initialiser moves
/// it into its typed property.
public enum WireValue {
    case string(String)
    /// A string still in the line being decoded (it had no escapes): made into a
    /// `String` only when a generated initialiser asks for it, so a request that fails
    /// never pays for its strings. Valid only while that line is being decoded.
    case text(UnsafeRawBufferPointer)
    case integer(Int64)
    case bool(Bool)
    case json(JSONValue)
    case object(WireBox)
    case array([WireValue])
    case null
}

/// A decoded object, boxed so that `WireValue` stays small; `TypedWireBox<T>` holds it.
public class WireBox {
    /// The decoded value, for code that does not know its type.
    public var anyValue: any WireDecodable { fatalError("abstract") }
}

public final class TypedWireBox<T: WireDecodable>: WireBox {
    public let value: T

    public init(_ value: T) {
        self.value = value
    }

    public override var anyValue: any WireDecodable { value }
}

extension WireDecodable {
    /// Builds the value and boxes it (called through the metatype, so the box is typed).
    public static func decodeBox(_ fields: WireFields) throws -> WireBox {
        TypedWireBox(try Self(wire: fields))
    }
}

/// The checked members of one object, by schema index, handed to a generated
/// initialiser. A view over the decoder's slots: valid only during that call.
public struct WireFields {
    let base: UnsafeMutablePointer<WireValue?>
    let count: Int

    @inline(__always)
    public func has(_ index: Int) -> Bool { base[index] != nil }

    private func value(_ index: Int) throws -> WireValue {
        guard let value = base[index] else { throw WireFailure(.internal, "member \(index) is missing") }
        return value
    }

    /// A required member, converted (generated initialisers call this).
    @inline(__always)
    public func required<T>(_ index: Int, _ convert: (WireValue) throws -> T) throws -> T {
        try convert(try value(index))
    }

    /// An optional member, converted when present.
    @inline(__always)
    public func optional<T>(_ index: Int, _ convert: (WireValue) throws -> T) throws -> T? {
        guard let value = base[index] else { return nil }
        return try convert(value)
    }
}

extension WireValue {
    private func mismatch(_ what: String) -> WireFailure { WireFailure(.internal, "decoded value is not \(what)") }

    public func string() throws -> String {
        switch self {
        case .string(let value): return value
        case .text(let bytes): return String(decoding: bytes, as: UTF8.self)
        default: throw mismatch("a string")
        }
    }
    public func integer() throws -> Int64 {
        guard case .integer(let value) = self else { throw mismatch("an integer") }
        return value
    }
    public func bool() throws -> Bool {
        guard case .bool(let value) = self else { throw mismatch("a boolean") }
        return value
    }
    public func json() throws -> JSONValue {
        guard case .json(let value) = self else { throw mismatch("JSON") }
        return value
    }
    public func object<T: WireDecodable>(_ type: T.Type) throws -> T {
        guard case .object(let box) = self, let typed = box as? TypedWireBox<T> else { throw mismatch("\(T.self)") }
        return typed.value
    }
    public func union<T: WireUnionDecodable>(_ type: T.Type) throws -> T {
        guard case .object(let box) = self else { throw mismatch("\(T.self)") }
        return try T(variant: box.anyValue)
    }
    public func enumeration<T: RawRepresentable>(_ type: T.Type) throws -> T where T.RawValue == String {
        guard let value = T(rawValue: try string()) else { throw mismatch("\(T.self)") }
        return value
    }
    public func array() throws -> [WireValue] {
        guard case .array(let values) = self else { throw mismatch("an array") }
        return values
    }
}

/// A member that can be `null` on the wire as well as absent (`Optional<Nullable<T>>`).
public enum Nullable<Wrapped: Sendable>: Sendable {
    case null
    case value(Wrapped)

    public var value: Wrapped? {
        if case .value(let wrapped) = self { return wrapped }
        return nil
    }
}

extension Nullable: Equatable where Wrapped: Equatable {
    /// Written out and inlinable: the derived one was called unspecialized across modules,
    /// instantiating generic metadata at every compare (a sixth of the chat changes of a
    /// send into a chat of 250).
    @inlinable
    public static func == (lhs: Nullable, rhs: Nullable) -> Bool {
        switch (lhs, rhs) {
        case (.null, .null): true
        case (.value(let left), .value(let right)): left == right
        default: false
        }
    }
}
extension Nullable: Hashable where Wrapped: Hashable {}

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#elseif canImport(Darwin)
    import Darwin
#endif

extension WireValue {
    /// `null` or a value (for `Nullable` members).
    public func nullable<T>(_ convert: (WireValue) throws -> T) throws -> Nullable<T> {
        if case .null = self { return .null }
        return .value(try convert(self))
    }
}
