import ChatWire

/// What the generator understands of a schema node, and the declarations it makes.
indirect enum SwiftType: Equatable {
    case string
    case int64
    case bool
    case json
    case named(String)
    case array(SwiftType)
    case nullable(SwiftType)

    var spelled: String {
        switch self {
        case .string: return "String"
        case .int64: return "Int64"
        case .bool: return "Bool"
        case .json: return "JSONValue"
        case .named(let name): return name
        case .array(let element): return "[\(element.spelled)]"
        case .nullable(let wrapped): return "Nullable<\(wrapped.spelled)>"
        }
    }
}

/// How a field is checked and stored.
indirect enum FieldShape: Equatable {
    case string(minBytes: Int, maxBytes: Int)
    case enumeration(typeName: String?, values: [String])
    case constant(String)
    case integer(min: Int64, max: Int64)
    case id64
    case boolean
    case json(objectOnly: Bool)
    case object(String)
    case union(String)
    case array(FieldShape, minItems: Int, maxItems: Int)
    case nullable(FieldShape)
    case rejected

    var swiftType: SwiftType? {
        switch self {
        case .string: return .string
        case .enumeration(let name, _): return name.map { .named($0) } ?? .string
        case .constant, .rejected: return nil
        case .integer, .id64: return .int64
        case .boolean: return .bool
        case .json: return .json
        case .object(let name), .union(let name): return .named(name)
        case .array(let element, _, _): return element.swiftType.map { .array($0) }
        case .nullable(let inner): return inner.swiftType.map { .nullable($0) }
        }
    }
}

struct Field {
    let name: String
    let shape: FieldShape
    let required: Bool
    let description: String?
    /// The schema's `default`, as compact JSON (documentation only: the engine applies it).
    var defaultValue: String? = nil
}

enum Declaration {
    case structure(Structure)
    case enumeration(name: String, description: String?, values: [String])
    case union(name: String, description: String?, discriminator: String, variants: [(value: String, type: String)])
    case messageSet(name: String, description: String?, messages: [(wireName: String, shape: FieldShape)])

    var name: String {
        switch self {
        case .structure(let structure): return structure.name
        case .enumeration(let name, _, _), .union(let name, _, _, _), .messageSet(let name, _, _): return name
        }
    }
}

struct Structure {
    let name: String
    let description: String?
    let fields: [Field]
    let members: ClosedRange<Int>?
}

struct GeneratorError: Error, CustomStringConvertible {
    let description: String
}

extension JSONTree {
    var members: [(String, JSONTree)]? {
        if case .object(let members) = self { return members }
        return nil
    }

    var elements: [JSONTree]? {
        if case .array(let elements) = self { return elements }
        return nil
    }

    var integerValue: Int64? {
        if case .number(let text) = self { return Int64(text) }
        return nil
    }

    var boolValue: Bool? {
        if case .bool(let value) = self { return value }
        return nil
    }
}

extension JSONTree {
    /// Compact JSON text (for documentation).
    var compactText: String {
        switch self {
        case .null: return "null"
        case .bool(let value): return value ? "true" : "false"
        case .number(let text): return text
        case .string(let text): return "\"" + text.replacingOccurrences(of: "\\", with: "\\\\").replacingOccurrences(of: "\"", with: "\\\"") + "\""
        case .array(let elements): return "[" + elements.map(\.compactText).joined(separator: ",") + "]"
        case .object(let members): return "{" + members.map { JSONTree.string($0.0).compactText + ":" + $0.1.compactText }.joined(separator: ",") + "}"
        }
    }
}
