import ArgumentParser
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

@main
struct Chatcore: AsyncParsableCommand {
    static let version = "0.3.0"

    static let configuration = CommandConfiguration(
        commandName: "chatcore",
        abstract: "A chat messaging core speaking BBMDS-style newline-delimited JSON.",
        discussion: """
            Start it with `chatcore serve --user alice` and write requests to its standard input, \
            or listen on a socket with `chatcore serve --listen 127.0.0.1:7400 --auth-secret-file SECRET`. \
            The protocol is described in docs/protocol.md, generated from Schemas/.
            """,
        version: version,
        subcommands: [Serve.self, Token.self],
        defaultSubcommand: nil
    )

    /// Arguments must be UTF-8: Swift reads other bytes as U+FFFD, so `--data-dir` would
    /// name another directory than the one given and `--user` another user, silently.
    static func main() async {
        for index in 1..<Int(CommandLine.argc) {
            guard let raw = CommandLine.unsafeArgv[index], String(validatingCString: raw) == nil else { continue }
            let shown = String(decoding: UnsafeRawBufferPointer(start: raw, count: strlen(raw)), as: UTF8.self)
            FileHandle.standardError.write(Data("Error: argument \(index) (\(shown)) is not UTF-8: give paths and user ids in UTF-8\n".utf8))
            Glibc.exit(64)
        }
        await main(nil)
    }
}
