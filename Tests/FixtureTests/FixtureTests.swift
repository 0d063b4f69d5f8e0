import Foundation
import Testing

/// Plays every transcript under Tests/Fixtures against the real `chatcore` binary.
struct FixtureTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().appendingPathComponent("Fixtures")

    static var fixtures: [String] {
        let enumerator = FileManager.default.enumerator(at: root, includingPropertiesForKeys: nil)
        var names: [String] = []
        while let url = enumerator?.nextObject() as? URL {
            if url.pathExtension == "transcript" {
                names.append(String(url.path.dropFirst(root.path.count + 1)))
            }
        }
        return names.sorted()
    }

    /// The chatcore binary built beside the tests (or $CHATCORE_BINARY).
    static var binary: URL {
        if let path = ProcessInfo.processInfo.environment["CHATCORE_BINARY"] { return URL(fileURLWithPath: path) }
        let candidates = [
            URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent().appendingPathComponent("chatcore"),
            Bundle.main.bundleURL.appendingPathComponent("chatcore"),
            Bundle.main.bundleURL.deletingLastPathComponent().appendingPathComponent("chatcore")
        ]
        return candidates.first { FileManager.default.isExecutableFile(atPath: $0.path) } ?? candidates[0]
    }

    @Test("transcript", arguments: fixtures)
    func play(_ name: String) throws {
        let runner = try FixtureRunner(file: Self.root.appendingPathComponent(name), binary: Self.binary)
        try runner.run()
    }

    /// Every transcript again with no message kept in memory: every message a request
    /// needs is read from the store (its indexes), so the cache cannot hide a difference.
    @Test("transcript without a message cache", arguments: fixtures)
    func playWithoutCache(_ name: String) throws {
        let runner = try FixtureRunner(file: Self.root.appendingPathComponent(name), binary: Self.binary, extraArguments: ["--cache-mb", "0"])
        try runner.run()
    }
}
