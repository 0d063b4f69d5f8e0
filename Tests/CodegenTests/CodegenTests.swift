import Foundation
import Testing

/// The generator (`chatcore-codegen`) as CI runs it: a small schema set in, exactly the
/// expected Swift out; every construct it does not support refused with the file and
/// JSON pointer that holds it.
struct CodegenTests {
    static let here = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
    static let schemas = here.appendingPathComponent("Schemas")
    static let expected = here.appendingPathComponent("Expected")

    static var binary: URL {
        let beside = URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent()
        let candidates = [beside, Bundle.main.bundleURL, Bundle.main.bundleURL.deletingLastPathComponent()]
            .map { $0.appendingPathComponent("chatcore-codegen") }
        return candidates.first { FileManager.default.isExecutableFile(atPath: $0.path) } ?? candidates[0]
    }

    struct Run {
        let status: Int32
        let output: String
    }

    static func run(_ arguments: [String]) throws -> Run {
        let process = Process()
        process.executableURL = binary
        process.arguments = arguments
        // Under `make asan` the generator is built with AddressSanitizer too. It is a
        // one-shot tool that keeps every schema tree until it exits, and LeakSanitizer
        // cannot follow Swift's tagged enum payload pointers, so it reports those trees
        // as leaked; leak checking means nothing for it, memory errors still do.
        var environment = ProcessInfo.processInfo.environment
        environment["ASAN_OPTIONS"] = (environment["ASAN_OPTIONS"].map { $0 + ":" } ?? "") + "detect_leaks=0"
        process.environment = environment
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        try process.run()
        let data = pipe.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return Run(status: process.terminationStatus, output: String(decoding: data, as: UTF8.self))
    }

    static func temporaryDirectory() throws -> URL {
        let url = FileManager.default.temporaryDirectory.appendingPathComponent("codegen-tests-\(UUID())")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
        return url
    }

    static func files(under root: URL, ending suffix: String) throws -> [String: String] {
        var found: [String: String] = [:]
        let enumerator = FileManager.default.enumerator(at: root, includingPropertiesForKeys: nil)
        while let url = enumerator?.nextObject() as? URL {
            guard url.path.hasSuffix(suffix) else { continue }
            let relative = String(url.standardizedFileURL.path.dropFirst(root.standardizedFileURL.path.count + 1).dropLast(suffix.count))
            found[relative] = try String(contentsOf: url, encoding: .utf8)
        }
        return found
    }

    @Test func aSmallSchemaGeneratesExactlyTheExpectedCode() throws {
        let output = try Self.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: output) }
        let result = try Self.run([Self.schemas.path, output.path])
        #expect(result.status == 0, "\(result.output)")
        let generated = try Self.files(under: output, ending: ".swift")
        let expected = try Self.files(under: Self.expected, ending: ".swift.expected")
        #expect(generated.keys.sorted() == expected.keys.sorted())
        for (name, text) in expected {
            #expect(generated[name] == text, "\(name) differs from Tests/CodegenTests/Expected")
        }
        // --check agrees, and notices a change.
        #expect(try Self.run(["--check", Self.schemas.path, output.path]).status == 0)
        try "// edited by hand\n".write(to: output.appendingPathComponent("Request.swift"), atomically: true, encoding: .utf8)
        let check = try Self.run(["--check", Self.schemas.path, output.path])
        #expect(check.status == 1 && check.output.contains("out of date: Request.swift"), "\(check.output)")
    }

    /// A property of requests/ping.json replaced by something the generator refuses.
    static let refused: [(property: String, message: String)] = [
        (
            #"{"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false}"#,
            "an object with properties needs a title"
        ),
        (
            #"{"title": "Open", "type": "object", "properties": {"a": {"type": "string"}}}"#,
            "objects must say additionalProperties: false"
        ),
        (#"{"type": "string", "pattern": "^a"}"#, "unsupported keyword 'pattern' here"),
        (#"{"anyOf": [{"type": "string"}, {"type": "integer"}]}"#, "anyOf is supported only as"),
        (#"{"type": ["string", "boolean"]}"#, "a list of types is supported only as"),
        (#"{"type": "array"}"#, "an array needs items"),
        (#"{"type": "string", "enum": [1, 2]}"#, "enum values must be strings"),
        (#"{"type": "string", "maxLength": 10}"#, "a string limit needs both maxLength and x-maxBytes"),
        (#"{"type": "string", "minLength": 2}"#, "minLength above 1 counts characters"),
        (#"{"const": 3}"#, "only string constants are supported"),
        (#"{"oneOf": [{"type": "string"}, {"type": "integer"}]}"#, "oneOf is supported only for objects"),
        (#"{"$ref": "../nowhere.json"}"#, "$ref to unknown file"),
        (#"{"$ref": "../../outside.json"}"#, "$ref leaves Schemas/"),
        (#"{"$ref": "../events/pong.json#/$defs/missing"}"#, "the pointer leads nowhere"),
        (#"{"type": "tuple"}"#, "unsupported type")
    ]

    @Test(arguments: refused.indices)
    func everyUnsupportedConstructIsRefusedWhereItIs(_ index: Int) throws {
        let (property, message) = Self.refused[index]
        let root = try Self.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: root) }
        let schemas = root.appendingPathComponent("Schemas")
        try FileManager.default.copyItem(at: Self.schemas, to: schemas)
        let ping = schemas.appendingPathComponent("requests/ping.json")
        var text = try String(contentsOf: ping, encoding: .utf8)
        text = text.replacingOccurrences(of: #""properties": {"#, with: #""properties": {"bad": \#(property),"#)
        try text.write(to: ping, atomically: true, encoding: .utf8)
        let result = try Self.run([schemas.path, root.appendingPathComponent("out").path])
        #expect(result.status == 1)
        #expect(result.output.contains("Schemas/requests/ping.json#/properties/bad"), "\(result.output)")
        #expect(result.output.contains(message), "\(result.output)")
    }
}
