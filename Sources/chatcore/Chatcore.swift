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
    /// `serve`'s options not on the command line come from the environment and the config
    /// file (`Settings`) and are parsed as if typed.
    static func main() async {
        for index in 1..<Int(CommandLine.argc) {
            guard let raw = CommandLine.unsafeArgv[index], String(validatingCString: raw) == nil else { continue }
            let shown = String(decoding: UnsafeRawBufferPointer(start: raw, count: strlen(raw)), as: UTF8.self)
            FileHandle.standardError.write(Data("Error: argument \(index) (\(shown)) is not UTF-8: give paths and user ids in UTF-8\n".utf8))
            Glibc.exit(64)
        }
        var arguments = Array(CommandLine.arguments.dropFirst())
        var settings: Settings?
        let environment = ProcessInfo.processInfo.environment
        let serveArguments = Array(arguments.dropFirst())
        if arguments.first == Serve._commandName, Settings.mayAdd(to: serveArguments, environment: environment) {
            do {
                let completed = try await Settings(arguments: serveArguments, options: Settings.options(of: Serve.self), environment: environment)
                arguments = [Serve._commandName] + completed.arguments
                settings = completed
            } catch {
                FileHandle.standardError.write(Data("Error: \(error)\n".utf8))
                Glibc.exit(64)
            }
        }
        var command: ParsableCommand
        do {
            command = try parseAsRoot(arguments)
        } catch {
            // A value from the environment or the file is named by its option: say where it was set.
            let origins = settings?.origins(of: fullMessage(for: error)) ?? []
            guard !origins.isEmpty else { exit(withError: error) }
            FileHandle.standardError.write(Data((fullMessage(for: error) + "\n" + origins.joined(separator: "\n") + "\n").utf8))
            Glibc.exit(exitCode(for: error).rawValue)
        }
        if let serve = command as? Serve, serve.configuration.showConfig, let settings {
            print(settings.yaml)
            return
        }
        do {
            if var asyncCommand = command as? AsyncParsableCommand {
                try await asyncCommand.run()
            } else {
                try command.run()
            }
        } catch {
            exit(withError: error)
        }
    }
}
