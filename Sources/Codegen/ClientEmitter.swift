/// Writes the typed parts of the clients in other languages from the same declarations:
/// for Python a module of `TypedDict`s and request builders, for TypeScript an ES module of
/// request builders with its declarations (`.d.ts`). The hand-written client of each
/// language (connection, correlation, events) imports them.
struct ClientEmitter {
    let reader: SchemaReader
    let catalogue: [String: Declaration]
    let requests: [RequestInfo]

    /// One builder function: a request, or one variant of a request that has several.
    struct Builder {
        /// The variant's discriminator value ("" for a request of one form).
        let suffix: String
        let discriminator: (key: String, value: String)?
        let structure: Structure

        /// What the caller gives: every field but those never sent and the discriminator.
        var parameters: [Field] {
            structure.fields.filter { $0.shape != .rejected && $0.name != discriminator?.key }
        }

        /// A field the caller must give (a cookie never: the client gives each request one).
        static func isRequired(_ field: Field) -> Bool {
            field.required && field.name != "cookie"
        }

        var needsFields: Bool { parameters.contains(where: Builder.isRequired) }
    }

    /// A request, as the clients need it: its wire name, its fields or variants, and what
    /// answers it.
    struct RequestInfo {
        let wireName: String
        let typeName: String
        /// One builder per variant (`requestListMatching` has several), or one.
        let builders: [Builder]
        let answers: [String]
        let description: String?

        var takesCookie: Bool { builders.allSatisfy { $0.structure.fields.contains { $0.name == "cookie" } } }
    }

    init(reader: SchemaReader, catalogue: [String: Declaration]) {
        self.reader = reader
        self.catalogue = catalogue
        requests = reader.messageNames(in: "request.json").compactMap { wireName in
            let file = "requests/\(wireName).json"
            guard let typeName = reader.files[file]?["title"]?.stringValue else { return nil }
            let answers = reader.answers(toRequestIn: file)
            switch catalogue[typeName] {
            case .structure(let structure)?:
                return RequestInfo(
                    wireName: wireName, typeName: typeName, builders: [Builder(suffix: "", discriminator: nil, structure: structure)],
                    answers: answers, description: structure.description)
            case .union(_, let description, let discriminator, let variants)?:
                let builders = variants.compactMap { variant -> Builder? in
                    guard case .structure(let structure)? = catalogue[variant.type] else { return nil }
                    return Builder(suffix: variant.value, discriminator: (discriminator, variant.value), structure: structure)
                }
                return RequestInfo(wireName: wireName, typeName: typeName, builders: builders, answers: answers, description: description)
            default:
                return nil
            }
        }
    }

    func eventTypes() -> [(wireName: String, typeName: String)] {
        reader.messageNames(in: "event.json").compactMap { name in
            reader.files["events/\(name).json"]?["title"]?.stringValue.map { (name, $0) }
        }
    }

    static func snake(_ name: String) -> String {
        var out = ""
        for character in name {
            if character.isUppercase {
                if !out.isEmpty { out += "_" }
                out += character.lowercased()
            } else {
                out.append(character)
            }
        }
        return out
    }

    static func quoted(_ text: String) -> String {
        "\"" + text.replacingOccurrences(of: "\\", with: "\\\\").replacingOccurrences(of: "\"", with: "\\\"") + "\""
    }

    static func comment(_ text: String?) -> String {
        (text ?? "").replacingOccurrences(of: "\n", with: " ").replacingOccurrences(of: "*/", with: "* /")
    }

    // MARK: Python

    static func python(_ shape: FieldShape, input: Bool) -> String {
        switch shape {
        case .string: return "str"
        case .enumeration(_, let values): return "Literal[" + values.map(quoted).joined(separator: ", ") + "]"
        case .constant(let value): return "Literal[\(quoted(value))]"
        case .integer: return "int"
        case .id64: return input ? "str | int" : "str"
        case .boolean: return "bool"
        case .json(let objectOnly): return objectOnly ? "dict[str, Any]" : "Any"
        case .object(let name), .union(let name): return name
        case .array(let element, _, _): return "list[\(python(element, input: input))]"
        case .nullable(let inner): return python(inner, input: input) + " | None"
        case .rejected: return "Any"
        }
    }

    func renderPython() -> String {
        var out = """
            \"\"\"The chatcore protocol's types and request builders, generated by chatcore-codegen from
            Schemas/ (see docs/protocol.md). Do not edit: run `make generate`.\"\"\"
            from __future__ import annotations

            from typing import Any, Literal, NotRequired, TypedDict, Union


            def _message(name: str, fields: dict[str, Any]) -> dict[str, Any]:
                return {name: {key: value for key, value in fields.items() if value is not None}}


            # Objects and values (requests, events, list elements and what they share).

            """
        for name in catalogue.keys.sorted() {
            switch catalogue[name]! {
            case .structure(let structure):
                out += "\(name) = TypedDict(\(ClientEmitter.quoted(name)), {\n"
                for field in structure.fields where field.shape != .rejected {
                    let type = ClientEmitter.python(field.shape, input: true)
                    out += "    \(ClientEmitter.quoted(field.name)): \(ClientEmitter.quoted(field.required ? type : "NotRequired[\(type)]")),\n"
                }
                out += "})\n"
                if let description = structure.description { out += "\"\"\"\(description.replacingOccurrences(of: "\"\"\"", with: "'''"))\"\"\"\n" }
                out += "\n"
            case .enumeration(_, _, let values):
                out += "\(name) = Literal[\(values.map(ClientEmitter.quoted).joined(separator: ", "))]\n\n"
            case .union(_, _, _, let variants):
                out += "\(name) = Union[\(variants.map { ClientEmitter.quoted($0.type) }.joined(separator: ", "))]\n\n"
            case .messageSet:
                break
            }
        }
        out += "\n# Request builders: each returns the line's object, {name: {fields}}; None leaves a field out.\n\n"
        for request in requests {
            for builder in request.builders {
                let function = ClientEmitter.snake(request.wireName) + (builder.suffix.isEmpty ? "" : "_" + ClientEmitter.snake(builder.suffix))
                let fields = builder.parameters
                let ordered = fields.filter(Builder.isRequired) + fields.filter { !Builder.isRequired($0) }
                var parameters = ordered.map { field in
                    "\(field.name): \(ClientEmitter.python(field.shape, input: true))" + (Builder.isRequired(field) ? "" : " | None = None")
                }
                if !parameters.isEmpty { parameters.insert("*", at: 0) }
                out += "def \(function)(\(parameters.joined(separator: ", "))) -> dict[str, Any]:\n"
                out +=
                    "    \"\"\"\((builder.structure.description ?? request.description ?? request.wireName).replacingOccurrences(of: "\"\"\"", with: "'''"))\"\"\"\n"
                var members = ordered.map { "\(ClientEmitter.quoted($0.name)): \($0.name)" }
                if let (key, value) = builder.discriminator { members.insert("\(ClientEmitter.quoted(key)): \(ClientEmitter.quoted(value))", at: 0) }
                out += "    return _message(\(ClientEmitter.quoted(request.wireName)), {\(members.joined(separator: ", "))})\n\n\n"
            }
        }
        out += "# What answers each request (docs/protocol.md): the events that carry its cookie; none\n"
        out += "# when only a failure is answered.\n"
        out += "ANSWERS: dict[str, tuple[str, ...]] = {\n"
        for request in requests {
            out +=
                "    \(ClientEmitter.quoted(request.wireName)): (\(request.answers.map(ClientEmitter.quoted).joined(separator: ", "))\(request.answers.count == 1 ? "," : "")),\n"
        }
        out += "}\n\n"
        out += "# Requests that take a cookie.\n"
        out += "TAKES_COOKIE: frozenset[str] = frozenset({\n"
        for request in requests where request.takesCookie {
            out += "    \(ClientEmitter.quoted(request.wireName)),\n"
        }
        out += "})\n\n"
        out += "# Event names and their types.\n"
        out += "EVENTS: dict[str, str] = {\n"
        for event in eventTypes() { out += "    \(ClientEmitter.quoted(event.wireName)): \(ClientEmitter.quoted(event.typeName)),\n" }
        out += "}\n"
        return out
    }

    // MARK: TypeScript

    static func typescript(_ shape: FieldShape, input: Bool) -> String {
        switch shape {
        case .string: return "string"
        case .enumeration(_, let values): return values.map(quoted).joined(separator: " | ")
        case .constant(let value): return quoted(value)
        case .integer: return "number"
        case .id64: return input ? "string | number" : "string"
        case .boolean: return "boolean"
        case .json(let objectOnly): return objectOnly ? "Record<string, unknown>" : "unknown"
        case .object(let name), .union(let name): return name
        case .array(let element, _, _):
            let inner = typescript(element, input: input)
            return inner.contains(" ") ? "Array<\(inner)>" : "\(inner)[]"
        case .nullable(let inner): return "\(typescript(inner, input: input)) | null"
        case .rejected: return "never"
        }
    }

    static func camel(_ wireName: String, _ suffix: String) -> String {
        suffix.isEmpty ? wireName : wireName + suffix.prefix(1).uppercased() + suffix.dropFirst()
    }

    /// The ES module (builders and tables).
    func renderJavaScript() -> String {
        var out = """
            // The chatcore protocol's request builders, generated by chatcore-codegen from Schemas/
            // (see docs/protocol.md). Do not edit: run `make generate`. Types: protocol.d.ts.

            function message(name, fields) {
              const body = {};
              for (const [key, value] of Object.entries(fields)) if (value !== undefined) body[key] = value;
              return { [name]: body };
            }


            """
        for request in requests {
            for builder in request.builders {
                let function = ClientEmitter.camel(request.wireName, builder.suffix)
                var members = ["...fields"]
                if let (key, value) = builder.discriminator { members.insert("\(key): \(ClientEmitter.quoted(value))", at: 0) }
                out += "/** \(ClientEmitter.comment(builder.structure.description ?? request.description)) */\n"
                out += "export function \(function)(fields\(builder.needsFields ? "" : " = {}")) {\n"
                out += "  return message(\(ClientEmitter.quoted(request.wireName)), { \(members.joined(separator: ", ")) });\n}\n\n"
            }
        }
        out += "/** What answers each request: the events that carry its cookie; none when only a failure is answered. */\n"
        out += "export const ANSWERS = Object.freeze({\n"
        for request in requests { out += "  \(request.wireName): [\(request.answers.map(ClientEmitter.quoted).joined(separator: ", "))],\n" }
        out += "});\n\n"
        out += "/** Requests that take a cookie. */\n"
        out += "export const TAKES_COOKIE = new Set([\n"
        for request in requests where request.takesCookie {
            out += "  \(ClientEmitter.quoted(request.wireName)),\n"
        }
        out += "]);\n\n"
        out += "/** Every event's name. */\n"
        out += "export const EVENTS = Object.freeze([\(eventTypes().map { ClientEmitter.quoted($0.wireName) }.joined(separator: ", "))]);\n"
        return out
    }

    /// The declarations of the ES module: every type, the builders, the events.
    func renderDeclarations() -> String {
        var out = """
            // The chatcore protocol's types, generated by chatcore-codegen from Schemas/ (see
            // docs/protocol.md). Do not edit: run `make generate`.

            /** A builder's fields: the cookie may be left out (the client gives each request one). */
            export type CookieOptional<T> = T extends { cookie: string } ? Omit<T, "cookie"> & { cookie?: string } : T;


            """
        for name in catalogue.keys.sorted() {
            switch catalogue[name]! {
            case .structure(let structure):
                if let description = structure.description { out += "/** \(ClientEmitter.comment(description)) */\n" }
                out += "export interface \(name) {\n"
                for field in structure.fields where field.shape != .rejected {
                    if let description = field.description { out += "  /** \(ClientEmitter.comment(description)) */\n" }
                    out += "  \(field.name)\(field.required ? "" : "?"): \(ClientEmitter.typescript(field.shape, input: true));\n"
                }
                out += "}\n\n"
            case .enumeration(_, _, let values):
                out += "export type \(name) = \(values.map(ClientEmitter.quoted).joined(separator: " | "));\n\n"
            case .union(_, _, _, let variants):
                out += "export type \(name) = \(variants.map(\.type).joined(separator: " | "));\n\n"
            case .messageSet:
                break
            }
        }
        for request in requests {
            for builder in request.builders {
                let function = ClientEmitter.camel(request.wireName, builder.suffix)
                let parameter = builder.discriminator.map { "Omit<\(builder.structure.name), \(ClientEmitter.quoted($0.key))>" } ?? builder.structure.name
                out += "/** \(ClientEmitter.comment(builder.structure.description ?? request.description)) */\n"
                out +=
                    "export function \(function)(fields\(builder.needsFields ? "" : "?"): CookieOptional<\(parameter)>): { \(request.wireName): \(request.typeName) };\n\n"
            }
        }
        out += "/** Every request, by its name. */\n"
        out += "export interface Requests {\n"
        for request in requests { out += "  \(request.wireName): \(request.typeName);\n" }
        out += "}\n\n"
        out += "/** Every event, by its name. */\n"
        out += "export interface Events {\n"
        for event in eventTypes() { out += "  \(event.wireName): \(event.typeName);\n" }
        out += "}\n\n"
        out += "/** One line the service writes: one event. */\n"
        out += "export type Event = { [Name in keyof Events]: { [K in Name]: Events[K] } }[keyof Events];\n\n"
        out += "export const ANSWERS: Readonly<Record<keyof Requests, readonly (keyof Events)[]>>;\n"
        out += "export const TAKES_COOKIE: ReadonlySet<keyof Requests>;\n"
        out += "export const EVENTS: readonly (keyof Events)[];\n"
        return out
    }
}
