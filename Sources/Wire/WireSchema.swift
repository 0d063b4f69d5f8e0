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
        case .id64: return "an id (a decimal string or a non-negative integer)"
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
public struct WireSchema: Sendable {
    public let fields: [WireField]
    /// Unknown members are skipped instead of rejected (used for unknown requests,
    /// where only the cookie is of interest).
    public let ignoresUnknownFields: Bool
    /// How many members may be present (`minProperties`/`maxProperties`).
    public let members: ClosedRange<Int>

    public init(_ fields: [WireField], members: ClosedRange<Int>? = nil, ignoresUnknownFields: Bool = false) {
        self.fields = fields
        self.ignoresUnknownFields = ignoresUnknownFields
        self.members = members ?? 0...Int.max
    }

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

    @inline(__always)
    func index(of key: UnsafeRawBufferPointer) -> Int? {
        for index in fields.indices {
            let name = fields[index].nameBytes
            if name.count == key.count && name.withUnsafeBytes({ memcmp($0.baseAddress!, key.baseAddress!, key.count) == 0 }) {
                return index
            }
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
public enum WireValue: @unchecked Sendable {
    case string(String)
    case integer(Int64)
    case bool(Bool)
    case json(JSONValue)
    case object(any WireDecodable)
    case array([WireValue])
    case null
}

/// The checked members of one object, by schema index, handed to a generated initialiser.
public struct WireFields: Sendable {
    var values: [WireValue?]

    init(count: Int) {
        values = Array(repeating: nil, count: count)
    }

    public func has(_ index: Int) -> Bool { values[index] != nil }

    private func value(_ index: Int) throws -> WireValue {
        guard let value = values[index] else { throw WireFailure(.internal, "member \(index) is missing") }
        return value
    }

    public func string(_ index: Int) throws -> String { try value(index).string() }
    public func optionalString(_ index: Int) throws -> String? { try values[index].map { try $0.string() } }
    public func integer(_ index: Int) throws -> Int64 { try value(index).integer() }
    public func optionalInteger(_ index: Int) throws -> Int64? { try values[index].map { try $0.integer() } }
    public func bool(_ index: Int) throws -> Bool { try value(index).bool() }
    public func optionalBool(_ index: Int) throws -> Bool? { try values[index].map { try $0.bool() } }
    public func json(_ index: Int) throws -> JSONValue { try value(index).json() }
    public func optionalJSON(_ index: Int) throws -> JSONValue? { try values[index].map { try $0.json() } }

    public func object<T: WireDecodable>(_ index: Int, _ type: T.Type) throws -> T { try value(index).object(type) }
    public func optionalObject<T: WireDecodable>(_ index: Int, _ type: T.Type) throws -> T? {
        try values[index].map { try $0.object(type) }
    }
    public func union<T: WireUnionDecodable>(_ index: Int, _ type: T.Type) throws -> T { try value(index).union(type) }
    public func optionalUnion<T: WireUnionDecodable>(_ index: Int, _ type: T.Type) throws -> T? {
        try values[index].map { try $0.union(type) }
    }
    public func enumeration<T: RawRepresentable>(_ index: Int, _ type: T.Type) throws -> T where T.RawValue == String {
        try value(index).enumeration(type)
    }
    public func optionalEnumeration<T: RawRepresentable>(_ index: Int, _ type: T.Type) throws -> T? where T.RawValue == String {
        try values[index].map { try $0.enumeration(type) }
    }
    public func array<T>(_ index: Int, _ element: (WireValue) throws -> T) throws -> [T] {
        try value(index).array().map(element)
    }
    public func optionalArray<T>(_ index: Int, _ element: (WireValue) throws -> T) throws -> [T]? {
        try values[index].map { try $0.array().map(element) }
    }
    /// A member that may be absent, `null`, or a value (listChange elements, `localData: null`).
    public func nullable<T>(_ index: Int, _ element: (WireValue) throws -> T) throws -> Nullable<T>? {
        guard let value = values[index] else { return nil }
        if case .null = value { return .null }
        return .value(try element(value))
    }
}

extension WireValue {
    private func mismatch(_ what: String) -> WireFailure { WireFailure(.internal, "decoded value is not \(what)") }

    public func string() throws -> String {
        guard case .string(let value) = self else { throw mismatch("a string") }
        return value
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
        guard case .object(let value) = self, let typed = value as? T else { throw mismatch("\(T.self)") }
        return typed
    }
    public func union<T: WireUnionDecodable>(_ type: T.Type) throws -> T {
        guard case .object(let value) = self else { throw mismatch("\(T.self)") }
        return try T(variant: value)
    }
    public func enumeration<T: RawRepresentable>(_ type: T.Type) throws -> T where T.RawValue == String {
        guard case .string(let raw) = self, let value = T(rawValue: raw) else { throw mismatch("\(T.self)") }
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

extension Nullable: Equatable where Wrapped: Equatable {}
extension Nullable: Hashable where Wrapped: Hashable {}

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

extension WireFields {
    /// A required member, converted (generated initialisers call this).
    public func required<T>(_ index: Int, _ convert: (WireValue) throws -> T) throws -> T {
        guard let value = values[index] else { throw WireFailure(.internal, "member \(index) is missing") }
        return try convert(value)
    }

    /// An optional member, converted when present.
    public func optional<T>(_ index: Int, _ convert: (WireValue) throws -> T) throws -> T? {
        try values[index].map(convert)
    }
}

extension WireValue {
    /// `null` or a value (for `Nullable` members).
    public func nullable<T>(_ convert: (WireValue) throws -> T) throws -> Nullable<T> {
        if case .null = self { return .null }
        return .value(try convert(self))
    }
}
