import CYAJL

/// A parsed JSON document, for code that must look inside a value (tests, token claims,
/// the few free-form values the engine reads). The hot path never builds one.
public indirect enum JSONTree: Sendable, Equatable {
    case null
    case bool(Bool)
    /// A number, spelled exactly as in the text.
    case number(String)
    case string(String)
    case array([JSONTree])
    /// Members in document order.
    case object([(String, JSONTree)])

    public static func == (lhs: JSONTree, rhs: JSONTree) -> Bool {
        switch (lhs, rhs) {
        case (.null, .null): return true
        case (.bool(let a), .bool(let b)): return a == b
        case (.number(let a), .number(let b)): return a == b
        case (.string(let a), .string(let b)): return a == b
        case (.array(let a), .array(let b)): return a == b
        case (.object(let a), .object(let b)):
            return a.count == b.count && zip(a, b).allSatisfy { $0.0 == $1.0 && $0.1 == $1.1 }
        default: return false
        }
    }

    public subscript(key: String) -> JSONTree? {
        guard case .object(let members) = self else { return nil }
        return members.last(where: { $0.0 == key })?.1
    }

    public var stringValue: String? {
        if case .string(let value) = self { return value }
        return nil
    }

    public struct SyntaxError: Error, CustomStringConvertible {
        public let description: String
    }

    public static func parse(_ bytes: [UInt8]) throws -> JSONTree {
        try bytes.withUnsafeBytes { try parse($0) }
    }

    public static func parse(_ text: String) throws -> JSONTree {
        try parse(Array(text.utf8))
    }

    public static func parse(_ text: UnsafeRawBufferPointer) throws -> JSONTree {
        let builder = TreeBuilder()
        let context = Unmanaged.passUnretained(builder).toOpaque()
        let error = withUnsafePointer(to: treeCallbacks) { callbacks in
            YAJL.parse(text, callbacks: callbacks, context: context)
        }
        if builder.tooDeep { throw SyntaxError(description: JSONLimits.tooDeep) }
        if let error { throw SyntaxError(description: error.message) }
        guard let root = builder.root else { throw SyntaxError(description: "no value") }
        return root
    }
}

/// Builds a `JSONTree` from YAJL's callbacks.
private final class TreeBuilder {
    enum Container {
        case array([JSONTree])
        case object([(String, JSONTree)], pendingKey: String?)
    }

    var stack: [Container] = []
    var root: JSONTree?

    func add(_ value: JSONTree) {
        guard let top = stack.popLast() else {
            root = value
            return
        }
        switch top {
        case .array(var elements):
            elements.append(value)
            stack.append(.array(elements))
        case .object(var members, let key):
            members.append((key ?? "", value))
            stack.append(.object(members, pendingKey: nil))
        }
    }

    /// Starts a container, or stops parsing (0) past `JSONLimits.maxNesting`: a deeper
    /// tree would overflow the stack of whatever walks it (or frees it).
    func open(_ container: Container) -> Int32 {
        guard stack.count < JSONLimits.maxNesting else {
            tooDeep = true
            return 0
        }
        stack.append(container)
        return 1
    }

    var tooDeep = false

    static func from(_ context: UnsafeMutableRawPointer?) -> TreeBuilder {
        Unmanaged<TreeBuilder>.fromOpaque(context!).takeUnretainedValue()
    }
}

private func text(_ pointer: UnsafePointer<UInt8>?, _ count: Int) -> String {
    guard let pointer else { return "" }
    return String(decoding: UnsafeBufferPointer(start: pointer, count: count), as: UTF8.self)
}

private let treeCallbacks = yajl_callbacks(
    yajl_null: { context in
        TreeBuilder.from(context).add(.null)
        return 1
    },
    yajl_boolean: { context, value in
        TreeBuilder.from(context).add(.bool(value != 0))
        return 1
    },
    yajl_integer: nil,
    yajl_double: nil,
    yajl_number: { context, pointer, count in
        let spelled = String(decoding: UnsafeRawBufferPointer(start: pointer, count: count), as: UTF8.self)
        TreeBuilder.from(context).add(.number(spelled))
        return 1
    },
    yajl_string: { context, pointer, count in
        TreeBuilder.from(context).add(.string(text(pointer, count)))
        return 1
    },
    yajl_start_map: { context in TreeBuilder.from(context).open(.object([], pendingKey: nil)) },
    yajl_map_key: { context, pointer, count in
        let builder = TreeBuilder.from(context)
        if case .object(let members, _) = builder.stack.popLast()! {
            builder.stack.append(.object(members, pendingKey: text(pointer, count)))
        }
        return 1
    },
    yajl_end_map: { context in
        let builder = TreeBuilder.from(context)
        if case .object(let members, _) = builder.stack.popLast()! { builder.add(.object(members)) }
        return 1
    },
    yajl_start_array: { context in TreeBuilder.from(context).open(.array([])) },
    yajl_end_array: { context in
        let builder = TreeBuilder.from(context)
        if case .array(let elements) = builder.stack.popLast()! { builder.add(.array(elements)) }
        return 1
    }
)
