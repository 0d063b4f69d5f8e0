import Foundation

/// chatcore-codegen: turns Schemas/ into Swift types and codecs.
///
///     chatcore-codegen SCHEMAS_DIR OUTPUT_DIR [--docs FILE]           write the generated files
///     chatcore-codegen --check SCHEMAS_DIR OUTPUT_DIR [--docs FILE]   exit 1 if they differ
///
/// `--docs FILE` also writes the protocol reference (prose from SCHEMAS_DIR/protocol.md),
/// `--python FILE` the Python client's protocol module, `--typescript DIR` the TypeScript
/// client's `protocol.js` and `protocol.d.ts`.
var arguments = Array(CommandLine.arguments.dropFirst())
let checkOnly = arguments.first == "--check"
if checkOnly { arguments.removeFirst() }
var extraOutputs: [String: URL] = [:]
while let index = arguments.firstIndex(where: { $0.hasPrefix("--") }), index + 1 < arguments.count {
    extraOutputs[String(arguments[index].dropFirst(2))] = URL(fileURLWithPath: arguments[index + 1])
    arguments.removeSubrange(index...index + 1)
}
guard arguments.count == 2, Set(extraOutputs.keys).isSubset(of: ["docs", "python", "typescript"]) else {
    FileHandle.standardError.write(Data("usage: chatcore-codegen [--check] SCHEMAS_DIR OUTPUT_DIR [--docs FILE] [--python FILE] [--typescript DIR]\n".utf8))
    exit(2)
}
let schemas = URL(fileURLWithPath: arguments[0], isDirectory: true)
let output = URL(fileURLWithPath: arguments[1], isDirectory: true)

/// The top-level message sets: what may arrive, and what may be sent.
let messageSets = ["request.json", "event.json"]

/// Generated/<Folder>/<Title>.swift: one file per schema file, named by its root title.
func outputName(for schemaFile: String, title: String?) -> String {
    let parts = schemaFile.split(separator: "/").map(String.init)
    let base = title ?? String(parts.last!.dropLast(5))
    let directory = parts.dropLast().map { $0.prefix(1).uppercased() + $0.dropFirst() }
    return (directory + [base + ".swift"]).joined(separator: "/")
}

do {
    let reader = try SchemaReader(root: schemas)
    try reader.run(messageSets: messageSets)
    var catalogue: [String: Declaration] = [:]
    for declarations in reader.declarations.values {
        for declaration in declarations { catalogue[declaration.name] = declaration }
    }
    var emitter = Emitter(wireNames: reader.wireNames, catalogue: catalogue)
    var generated: [String: String] = [:]
    for file in reader.declarations.keys.sorted() {
        let declarations = reader.declarations[file]!
        generated[outputName(for: file, title: reader.files[file]?["title"]?.stringValue)] = emitter.render(file: file, declarations: declarations)
    }
    var existing: [String: String] = [:]
    if let enumerator = FileManager.default.enumerator(at: output, includingPropertiesForKeys: nil) {
        while let url = enumerator.nextObject() as? URL {
            guard url.pathExtension == "swift" else { continue }
            let relative = String(url.standardizedFileURL.path.dropFirst(output.standardizedFileURL.path.count + 1))
            existing[relative] = try String(contentsOf: url, encoding: .utf8)
        }
    }
    // Files outside OUTPUT_DIR, by path.
    var others: [URL: String] = [:]
    if let docs = extraOutputs["docs"] {
        let prose = try String(contentsOf: schemas.appendingPathComponent("protocol.md"), encoding: .utf8)
        var emitter = DocsEmitter(reader: reader, catalogue: catalogue, prose: prose)
        others[docs] = emitter.render()
    }
    let clients = ClientEmitter(reader: reader, catalogue: catalogue)
    if let python = extraOutputs["python"] { others[python] = clients.renderPython() }
    if let typescript = extraOutputs["typescript"] {
        others[typescript.appendingPathComponent("protocol.js")] = clients.renderJavaScript()
        others[typescript.appendingPathComponent("protocol.d.ts")] = clients.renderDeclarations()
    }
    let othersChanged = others.keys.filter { (try? String(contentsOf: $0, encoding: .utf8)) != others[$0] }.sorted { $0.path < $1.path }
    let stale = existing.keys.filter { generated[$0] == nil }.sorted()
    let changed = generated.keys.filter { existing[$0] != generated[$0] }.sorted()
    if checkOnly {
        for url in othersChanged { print("out of date: \(url.relativePath)") }
        if stale.isEmpty && changed.isEmpty && othersChanged.isEmpty {
            print("generated code is up to date with Schemas/ (\(generated.count + others.count) files)")
            exit(0)
        }
        for name in changed { print("out of date: \(name)") }
        for name in stale { print("not generated from any schema: \(name)") }
        print("run `make generate` and commit the result")
        exit(1)
    }
    for name in stale { try FileManager.default.removeItem(at: output.appendingPathComponent(name)) }
    for name in changed {
        let url = output.appendingPathComponent(name)
        try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
        try generated[name]!.write(to: url, atomically: true, encoding: .utf8)
    }
    for url in othersChanged {
        try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
        try others[url]!.write(to: url, atomically: true, encoding: .utf8)
    }
    print("wrote \(changed.count) of \(generated.count) files, removed \(stale.count); \(othersChanged.count) of \(others.count) other files")
} catch {
    FileHandle.standardError.write(Data("chatcore-codegen: \(error)\n".utf8))
    exit(1)
}
