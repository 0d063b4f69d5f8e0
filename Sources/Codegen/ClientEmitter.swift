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
        /// The list whose `listAdd` element answers it (`x-answer-list`).
        let answerList: String?
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
            let answerList = reader.answerList(ofRequestIn: file)
            switch catalogue[typeName] {
            case .structure(let structure)?:
                return RequestInfo(
                    wireName: wireName, typeName: typeName, builders: [Builder(suffix: "", discriminator: nil, structure: structure)],
                    answers: answers, answerList: answerList, description: structure.description)
            case .union(_, let description, let discriminator, let variants)?:
                let builders = variants.compactMap { variant -> Builder? in
                    guard case .structure(let structure)? = catalogue[variant.type] else { return nil }
                    return Builder(suffix: variant.value, discriminator: (discriminator, variant.value), structure: structure)
                }
                return RequestInfo(
                    wireName: wireName, typeName: typeName, builders: builders, answers: answers, answerList: answerList, description: description)
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

    /// What a client's `request` resolves with for one builder's request (the clients'
    /// "Reference" in docs/protocol.md): read from the request's `x-answer` and
    /// `x-answer-list`.
    enum Outcome {
        /// Answered only when it fails.
        case nothing
        /// `authToken`: the `global` values once set up.
        case globals
        /// A list request: its header and every element, of this type.
        case list(element: String)
        /// `requestListAll`: a list of the elements of its `type`, by that value.
        case listByType([(list: String, element: String)])
        /// The `listAdd` element that carries the request's cookie (a started chat).
        case element(String)
        /// The answer event's fields.
        case event(String)
    }

    func outcome(of request: RequestInfo, _ builder: Builder) -> Outcome {
        let answers = request.answers
        guard let first = answers.first else { return .nothing }
        if answers.contains("listChunk") {
            if let (_, list) = builder.discriminator, let element = reader.elementType(ofList: list) { return .list(element: element) }
            if let field = builder.parameters.first(where: { $0.name == "type" }), case .enumeration(_, let lists) = field.shape {
                return .listByType(lists.compactMap { list in reader.elementType(ofList: list).map { (list, $0) } })
            }
        }
        if answers.contains("listAdd"), let list = request.answerList, let element = reader.elementType(ofList: list) { return .element(element) }
        if answers.contains("listChange") { return .globals }
        return reader.eventType(named: first).map { .event($0) } ?? .nothing
    }

    /// The types a request may carry: ids in them may be given as numbers too. The others
    /// (events, list elements) are only written by the service, whose ids are strings.
    var inputTypes: Set<String> {
        var found: Set<String> = []
        func visit(_ shape: FieldShape) {
            switch shape {
            case .object(let name), .union(let name):
                guard found.insert(name).inserted else { return }
                switch catalogue[name] {
                case .structure(let structure)?:
                    for field in structure.fields { visit(field.shape) }
                case .union(_, _, _, let variants)?:
                    for variant in variants { visit(.object(variant.type)) }
                default: break
                }
            case .array(let element, _, _): visit(element)
            case .nullable(let inner): visit(inner)
            default: break
            }
        }
        for request in requests {
            for builder in request.builders {
                found.insert(builder.structure.name)
                for field in builder.structure.fields { visit(field.shape) }
            }
        }
        return found
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
        // No Any: a value of Any in an answer's type would make `Client.request`'s overloads
        // ambiguous to mypy, which then types the outcome Any. What the caller gives is read
        // only (Mapping, covariant); what the service gives is a dict of values to narrow.
        case .json(let objectOnly): return objectOnly ? (input ? "Mapping[str, object]" : "dict[str, object]") : "object"
        case .object(let name), .union(let name): return name
        case .array(let element, _, _): return "list[\(python(element, input: input))]"
        case .nullable(let inner): return python(inner, input: input) + " | None"
        case .rejected: return "Any"
        }
    }

    static func python(_ outcome: Outcome) -> String {
        switch outcome {
        case .nothing: return "None"
        case .globals: return "dict[str, object]"
        case .list(let element): return "ListAnswer[\(element)]"
        case .listByType: return "ListAnswer[Any]"
        case .element(let type), .event(let type): return type
        }
    }

    func renderPython() -> String {
        var out = """
            \"\"\"The chatcore protocol's types and request builders, generated by chatcore-codegen from
            Schemas/ (see docs/protocol.md). Do not edit: run `make generate`.\"\"\"
            from __future__ import annotations

            from collections.abc import Mapping
            from typing import Any, Generic, Literal, NotRequired, TypedDict, TypeVar, Union, overload

            Answer = TypeVar("Answer")
            Element = TypeVar("Element")


            class RequestLine(dict[str, Any], Generic[Answer]):
                \"\"\"One request's line, `{name: {fields}}`, typed by what `Client.request` resolves
                with for it (`Answer`).\"\"\"


            class ListAnswer(TypedDict, Generic[Element]):
                \"\"\"What a list request resolves with: its header and the elements of every chunk.\"\"\"
                header: ListAll | ListElements | ListMatching
                elements: list[Element]


            def _message(name: str, fields: dict[str, Any]) -> RequestLine[Any]:
                return RequestLine({name: {key: value for key, value in fields.items() if value is not None}})


            # Objects and values (requests, events, list elements and what they share).

            """
        let inputs = inputTypes
        for name in catalogue.keys.sorted() {
            switch catalogue[name]! {
            case .structure(let structure):
                out += "\(name) = TypedDict(\(ClientEmitter.quoted(name)), {\n"
                for field in structure.fields where field.shape != .rejected {
                    let type = ClientEmitter.python(field.shape, input: inputs.contains(name))
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
        out += "\n# Request builders: each returns the line's object, {name: {fields}}, typed by what\n"
        out += "# Client.request resolves with for it; None leaves a field out.\n\n"
        for request in requests {
            for builder in request.builders {
                let function = ClientEmitter.snake(request.wireName) + (builder.suffix.isEmpty ? "" : "_" + ClientEmitter.snake(builder.suffix))
                let fields = builder.parameters
                let ordered = fields.filter(Builder.isRequired) + fields.filter { !Builder.isRequired($0) }
                func parameters(type: (Field) -> String) -> String {
                    var parameters = ordered.map { field in "\(field.name): \(type(field))" + (Builder.isRequired(field) ? "" : " | None = None") }
                    if !parameters.isEmpty { parameters.insert("*", at: 0) }
                    return parameters.joined(separator: ", ")
                }
                let outcome = outcome(of: request, builder)
                if case .listByType(let lists) = outcome {
                    // One overload per list: the answer's elements are that list's.
                    for (list, element) in lists {
                        let typed = parameters { field in
                            field.name == "type" ? "Literal[\(ClientEmitter.quoted(list))]" : ClientEmitter.python(field.shape, input: true)
                        }
                        out += "@overload\ndef \(function)(\(typed)) -> RequestLine[ListAnswer[\(element)]]: ...\n\n\n"
                    }
                }
                let answer = ClientEmitter.python(outcome)
                out += "def \(function)(\(parameters { ClientEmitter.python($0.shape, input: true) })) -> RequestLine[\(answer)]:\n"
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

    static func typescript(_ outcome: Outcome) -> String {
        switch outcome {
        case .nothing: return "undefined"
        case .globals: return "Record<string, unknown>"
        case .list(let element): return "ListAnswer<\(element)>"
        case .listByType: return "ListAnswer<Elements[T]>"
        case .element(let type), .event(let type): return type
        }
    }

    /// The declarations of the ES module: every type, the builders, the events.
    func renderDeclarations() -> String {
        var out = """
            // The chatcore protocol's types, generated by chatcore-codegen from Schemas/ (see
            // docs/protocol.md). Do not edit: run `make generate`.

            /** A builder's fields: the cookie may be left out (the client gives each request one). */
            export type CookieOptional<T> = T extends { cookie: string } ? Omit<T, "cookie"> & { cookie?: string } : T;

            declare const answer: unique symbol;

            /** What `Client.request` resolves with for a line built here (a type only: the line has no such property). */
            export interface Answered<Answer> {
              readonly [answer]?: Answer;
            }

            /** What a list request resolves with: its header and the elements of every chunk. */
            export interface ListAnswer<Element> {
              header: ListAll | ListElements | ListMatching;
              elements: Element[];
            }


            """
        let inputs = inputTypes
        for name in catalogue.keys.sorted() {
            switch catalogue[name]! {
            case .structure(let structure):
                if let description = structure.description { out += "/** \(ClientEmitter.comment(description)) */\n" }
                out += "export interface \(name) {\n"
                for field in structure.fields where field.shape != .rejected {
                    if let description = field.description { out += "  /** \(ClientEmitter.comment(description)) */\n" }
                    out += "  \(field.name)\(field.required ? "" : "?"): \(ClientEmitter.typescript(field.shape, input: inputs.contains(name)));\n"
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
        var lists: [(list: String, element: String)] = []
        for request in requests {
            for builder in request.builders {
                if case .listByType(let byType) = outcome(of: request, builder) { lists = byType }
            }
        }
        out += "/** Each list's element type, by the list's name. */\n"
        out += "export interface Elements {\n"
        for (list, element) in lists { out += "  \(list): \(element);\n" }
        out += "}\n\n"
        for request in requests {
            for builder in request.builders {
                let function = ClientEmitter.camel(request.wireName, builder.suffix)
                let parameter = builder.discriminator.map { "Omit<\(builder.structure.name), \(ClientEmitter.quoted($0.key))>" } ?? builder.structure.name
                let outcome = outcome(of: request, builder)
                let line = "{ \(request.wireName): \(request.typeName) } & Answered<\(ClientEmitter.typescript(outcome))>"
                out += "/** \(ClientEmitter.comment(builder.structure.description ?? request.description)) */\n"
                if case .listByType = outcome {
                    // Generic in its list: the answer's elements are that list's.
                    out += "export function \(function)<T extends keyof Elements>(fields: CookieOptional<\(parameter)> & { type: T }): \(line);\n\n"
                } else {
                    out += "export function \(function)(fields\(builder.needsFields ? "" : "?"): CookieOptional<\(parameter)>): \(line);\n\n"
                }
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
