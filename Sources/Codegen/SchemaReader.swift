import ChatWire
import Foundation

/// Reads every schema file and turns the nodes it reaches into declarations.
///
/// Every keyword of every node is checked against what the generator supports: anything
/// else stops generation with the file and JSON pointer, so a schema never says more
/// than the generated code enforces.
final class SchemaReader {
    let root: URL
    private(set) var files: [String: JSONTree] = [:]
    /// Declarations by the file that defines them, in the order they were met.
    private(set) var declarations: [String: [Declaration]] = [:]
    private var declared: [String: String] = [:]  // "file#pointer" -> type name
    private var typeOwner: [String: String] = [:]  // type name -> "file#pointer"
    /// Wire names of messages, by type name (for `static let name`).
    private(set) var wireNames: [String: String] = [:]

    /// Keywords that only annotate.
    private static let annotations: Set<String> = [
        "title", "description", "$comment", "default", "examples", "readOnly", "$schema", "$id", "$defs", "x-key", "format"
    ]

    init(root: URL) throws {
        self.root = root
        let enumerator = FileManager.default.enumerator(at: root, includingPropertiesForKeys: nil)
        while let url = enumerator?.nextObject() as? URL {
            guard url.pathExtension == "json" else { continue }
            let relative = String(url.standardizedFileURL.path.dropFirst(root.standardizedFileURL.path.count + 1))
            let data = try Data(contentsOf: url)
            do {
                files[relative] = try JSONTree.parse([UInt8](data))
            } catch {
                throw GeneratorError(description: "\(relative): \(error)")
            }
        }
    }

    /// The wire names of a message set (`request.json`, `event.json`), in its order.
    func messageNames(in set: String) -> [String] {
        files[set]?["properties"]?.members?.map(\.0) ?? []
    }

    /// The events that answer a request (`x-answer`; none: only a failure is answered).
    func answers(toRequestIn file: String) -> [String] {
        files[file]?["x-answer"]?.elements?.compactMap(\.stringValue) ?? []
    }

    /// The list whose `listAdd` element answers a request (`x-answer-list`: chatStart's chat).
    func answerList(ofRequestIn file: String) -> String? {
        files[file]?["x-answer-list"]?.stringValue
    }

    /// The type of a list's elements (the title of `elements/LIST.json`).
    func elementType(ofList list: String) -> String? {
        files["elements/\(list).json"]?["title"]?.stringValue
    }

    /// The type of an event (the title of `events/NAME.json`).
    func eventType(named name: String) -> String? {
        files["events/\(name).json"]?["title"]?.stringValue
    }

    func run(messageSets: [String]) throws {
        for file in messageSets {
            guard let tree = files[file] else { throw GeneratorError(description: "missing \(file)") }
            try readMessageSet(tree, file: file)
        }
        // Every other schema file's root is a type too, reached or not.
        for file in files.keys.sorted() where !messageSets.contains(file) {
            if files[file]?["title"] != nil, files[file]?["type"] != nil || files[file]?["oneOf"] != nil {
                _ = try shape(of: files[file]!, file: file, pointer: "")
            }
        }
    }

    // MARK: message sets

    private func readMessageSet(_ tree: JSONTree, file: String) throws {
        guard let name = tree["title"]?.stringValue, let properties = tree["properties"]?.members,
            tree["minProperties"]?.integerValue == 1, tree["maxProperties"]?.integerValue == 1,
            tree["additionalProperties"]?.boolValue == false
        else {
            throw GeneratorError(description: "\(file): a message set needs title, properties, minProperties 1, maxProperties 1 and additionalProperties false")
        }
        var messages: [(String, FieldShape)] = []
        for (wireName, node) in properties {
            let shape = try shape(of: node, file: file, pointer: "/properties/\(wireName)")
            switch shape {
            case .object(let type), .union(let type):
                if let existing = wireNames[type], existing != wireName {
                    throw GeneratorError(description: "\(file): \(type) is both \(existing) and \(wireName)")
                }
                wireNames[type] = wireName
            default:
                throw GeneratorError(description: "\(file)#/properties/\(wireName): a message must be an object")
            }
            messages.append((wireName, shape))
        }
        try declare(.messageSet(name: name, description: tree["description"]?.stringValue, messages: messages), file: file, key: "\(file)#")
    }

    // MARK: nodes

    private func fail(_ file: String, _ pointer: String, _ message: String) -> GeneratorError {
        GeneratorError(description: "Schemas/\(file)#\(pointer): \(message)")
    }

    private func check(_ node: JSONTree, file: String, pointer: String, allowed: Set<String>) throws {
        guard let members = node.members else { throw fail(file, pointer, "a schema must be an object") }
        for (keyword, _) in members where !allowed.contains(keyword) && !SchemaReader.annotations.contains(keyword) && !keyword.hasPrefix("x-") {
            throw fail(file, pointer, "unsupported keyword '\(keyword)' here")
        }
    }

    /// Resolves a `$ref` (standing at `pointer` of `file`) relative to `file`: returns the
    /// target's file and pointer. Failures name where the `$ref` stands.
    private func resolve(_ reference: String, from file: String, at referencePointer: String = "") throws -> (String, String) {
        let parts = reference.split(separator: "#", maxSplits: 1, omittingEmptySubsequences: false)
        var targetFile = file
        if let path = parts.first, !path.isEmpty {
            var components = file.split(separator: "/").dropLast().map(String.init)
            for component in path.split(separator: "/") {
                if component == ".." {
                    guard !components.isEmpty else { throw fail(file, referencePointer, "$ref leaves Schemas/: \(reference)") }
                    components.removeLast()
                } else if component != "." {
                    components.append(String(component))
                }
            }
            targetFile = components.joined(separator: "/")
        }
        let pointer = parts.count > 1 ? String(parts[1]) : ""
        guard files[targetFile] != nil else { throw fail(file, referencePointer, "$ref to unknown file \(reference)") }
        do {
            _ = try node(in: targetFile, at: pointer)
        } catch {
            throw fail(file, referencePointer, "$ref \(reference): the pointer leads nowhere")
        }
        return (targetFile, pointer)
    }

    private func node(in file: String, at pointer: String) throws -> JSONTree {
        var current = files[file]!
        for token in pointer.split(separator: "/") {
            let key = token.replacingOccurrences(of: "~1", with: "/").replacingOccurrences(of: "~0", with: "~")
            guard let next = current[key] else { throw fail(file, pointer, "the pointer leads nowhere") }
            current = next
        }
        return current
    }

    func shape(of node: JSONTree, file: String, pointer: String) throws -> FieldShape {
        if let reference = node["$ref"]?.stringValue {
            try check(node, file: file, pointer: pointer, allowed: ["$ref"])
            let (targetFile, targetPointer) = try resolve(reference, from: file, at: pointer)
            return try shape(of: try self.node(in: targetFile, at: targetPointer), file: targetFile, pointer: targetPointer)
        }
        if let alternatives = node["anyOf"]?.elements {
            try check(node, file: file, pointer: pointer, allowed: ["anyOf"])
            guard alternatives.count == 2, alternatives[1]["type"]?.stringValue == "null", alternatives[1].members?.count == 1 else {
                throw fail(file, pointer, "anyOf is supported only as [<schema>, {\"type\": \"null\"}]")
            }
            return .nullable(try shape(of: alternatives[0], file: file, pointer: pointer + "/anyOf/0"))
        }
        if node["oneOf"] != nil {
            return try unionShape(node, file: file, pointer: pointer)
        }
        if let constant = node["const"] {
            try check(node, file: file, pointer: pointer, allowed: ["const"])
            guard let value = constant.stringValue else { throw fail(file, pointer, "only string constants are supported") }
            return .constant(value)
        }
        if let not = node["not"] {
            try check(node, file: file, pointer: pointer, allowed: ["not"])
            guard not.members?.isEmpty == true, node["readOnly"]?.boolValue == true else {
                throw fail(file, pointer, "'not' is supported only as {\"not\": {}, \"readOnly\": true}")
            }
            return .rejected
        }
        switch node["type"] {
        case nil:
            try check(node, file: file, pointer: pointer, allowed: [])
            return .json(objectOnly: false)
        case .array(let types)?:
            try check(node, file: file, pointer: pointer, allowed: ["type", "pattern", "minimum", "maximum"])
            guard types == [.string("string"), .string("integer")], node["format"]?.stringValue == "int64" else {
                throw fail(file, pointer, "a list of types is supported only as [\"string\", \"integer\"] with format int64")
            }
            return .id64
        case .string("string")?:
            return try stringShape(node, file: file, pointer: pointer)
        case .string("integer")?:
            try check(node, file: file, pointer: pointer, allowed: ["type", "minimum", "maximum"])
            return .integer(min: node["minimum"]?.integerValue ?? Int64.min, max: node["maximum"]?.integerValue ?? Int64.max)
        case .string("boolean")?:
            try check(node, file: file, pointer: pointer, allowed: ["type"])
            return .boolean
        case .string("array")?:
            try check(node, file: file, pointer: pointer, allowed: ["type", "items", "minItems", "maxItems"])
            guard let items = node["items"] else { throw fail(file, pointer, "an array needs items") }
            let element = try shape(of: items, file: file, pointer: pointer + "/items")
            let minItems = Int(node["minItems"]?.integerValue ?? 0)
            let maxItems = node["maxItems"]?.integerValue.map { Int($0) } ?? Int.max
            return .array(element, minItems: minItems, maxItems: maxItems)
        case .string("object")?:
            if node["properties"] == nil {
                try check(node, file: file, pointer: pointer, allowed: ["type"])
                return .json(objectOnly: true)
            }
            return .object(try structure(node, file: file, pointer: pointer))
        default:
            throw fail(file, pointer, "unsupported type \(String(describing: node["type"]))")
        }
    }

    private func stringShape(_ node: JSONTree, file: String, pointer: String) throws -> FieldShape {
        try check(node, file: file, pointer: pointer, allowed: ["type", "enum", "minLength", "maxLength"])
        if let values = node["enum"]?.elements {
            let strings = values.compactMap(\.stringValue)
            guard strings.count == values.count, !strings.isEmpty else { throw fail(file, pointer, "enum values must be strings") }
            guard let name = node["title"]?.stringValue else {
                return .enumeration(typeName: nil, values: strings)
            }
            try declare(.enumeration(name: name, description: node["description"]?.stringValue, values: strings), file: file, key: "\(file)#\(pointer)")
            return .enumeration(typeName: name, values: strings)
        }
        let minLength = node["minLength"]?.integerValue ?? 0
        guard minLength <= 1 else {
            throw fail(file, pointer, "minLength above 1 counts characters, not bytes: unsupported")
        }
        var maxBytes = Int.max
        if node["maxLength"] != nil || node["x-maxBytes"] != nil {
            guard let bytes = node["x-maxBytes"]?.integerValue, node["maxLength"]?.integerValue == bytes else {
                throw fail(file, pointer, "a string limit needs both maxLength and x-maxBytes, equal (the protocol counts bytes)")
            }
            maxBytes = Int(bytes)
        }
        return .string(minBytes: Int(minLength), maxBytes: maxBytes)
    }

    private func structure(_ node: JSONTree, file: String, pointer: String) throws -> String {
        try check(node, file: file, pointer: pointer, allowed: ["type", "properties", "required", "additionalProperties", "minProperties", "maxProperties"])
        guard let name = node["title"]?.stringValue else { throw fail(file, pointer, "an object with properties needs a title (its Swift type name)") }
        let key = "\(file)#\(pointer)"
        if let existing = declared[key] { return existing }
        guard node["additionalProperties"]?.boolValue == false else {
            throw fail(file, pointer, "objects must say additionalProperties: false (unknown fields are rejected)")
        }
        declared[key] = name
        let required = Set((node["required"]?.elements ?? []).compactMap(\.stringValue))
        var fields: [Field] = []
        for (property, child) in node["properties"]?.members ?? [] {
            let shape = try shape(of: child, file: file, pointer: pointer + "/properties/" + property)
            fields.append(
                Field(
                    name: property, shape: shape, required: required.contains(property), description: describe(child, file: file),
                    defaultValue: defaultValue(child, file: file)))
        }
        for name in required where !fields.contains(where: { $0.name == name }) {
            throw fail(file, pointer, "'\(name)' is required but not a property")
        }
        var members: ClosedRange<Int>?
        if node["minProperties"] != nil || node["maxProperties"] != nil {
            let lower = Int(node["minProperties"]?.integerValue ?? 0)
            let upper = node["maxProperties"]?.integerValue.map { Int($0) } ?? Int.max
            members = lower...upper
        }
        try declare(.structure(Structure(name: name, description: node["description"]?.stringValue, fields: fields, members: members)), file: file, key: key)
        return name
    }

    private func unionShape(_ node: JSONTree, file: String, pointer: String) throws -> FieldShape {
        try check(node, file: file, pointer: pointer, allowed: ["type", "oneOf"])
        guard let name = node["title"]?.stringValue, let discriminator = node["x-discriminator"]?.stringValue,
            node["type"]?.stringValue == "object", let alternatives = node["oneOf"]?.elements
        else {
            throw fail(file, pointer, "oneOf is supported only for objects with a title and x-discriminator")
        }
        let key = "\(file)#\(pointer)"
        if declared[key] == nil {
            declared[key] = name
            var variants: [(String, String)] = []
            for (index, alternative) in alternatives.enumerated() {
                let altPointer = pointer + "/oneOf/\(index)"
                guard case .object(let typeName) = try shape(of: alternative, file: file, pointer: altPointer) else {
                    throw fail(file, altPointer, "each alternative must be an object with a title")
                }
                guard let value = alternative["properties"]?[discriminator]?["const"]?.stringValue,
                    (alternative["required"]?.elements ?? []).contains(.string(discriminator))
                else {
                    throw fail(file, altPointer, "each alternative must require '\(discriminator)' with a const string")
                }
                variants.append((value, typeName))
            }
            try declare(
                .union(name: name, description: node["description"]?.stringValue, discriminator: discriminator, variants: variants), file: file, key: key)
        }
        return .union(name)
    }

    private func describe(_ node: JSONTree, file: String) -> String? {
        if let text = node["description"]?.stringValue { return text }
        if let reference = node["$ref"]?.stringValue, let (targetFile, targetPointer) = try? resolve(reference, from: file),
            let target = try? self.node(in: targetFile, at: targetPointer)
        {
            return describe(target, file: targetFile)
        }
        return nil
    }

    private func defaultValue(_ node: JSONTree, file: String) -> String? {
        if let value = node["default"] { return value.compactText }
        if let reference = node["$ref"]?.stringValue, let (targetFile, targetPointer) = try? resolve(reference, from: file),
            let target = try? self.node(in: targetFile, at: targetPointer)
        {
            return defaultValue(target, file: targetFile)
        }
        return nil
    }

    private var enumValues: [String: [String]] = [:]

    private func declare(_ declaration: Declaration, file: String, key: String) throws {
        if let owner = typeOwner[declaration.name] {
            // One name, one type: a second node may reuse a name only for the same enum.
            if owner == key { return }
            if case .enumeration(let name, _, let values) = declaration, enumValues[name] == values { return }
            throw GeneratorError(description: "the type name \(declaration.name) is declared at \(owner) and at \(key)")
        }
        if case .enumeration(let name, _, let values) = declaration { enumValues[name] = values }
        typeOwner[declaration.name] = key
        declarations[file, default: []].append(declaration)
    }
}
