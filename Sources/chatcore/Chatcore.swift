import ArgumentParser

@main
struct Chatcore: AsyncParsableCommand {
    static let version = "0.1.0"

    static let configuration = CommandConfiguration(
        commandName: "chatcore",
        abstract: "A chat messaging core speaking BBMDS-style newline-delimited JSON.",
        discussion: """
            Start it with `chatcore serve --user alice` and write requests to its standard input, \
            or listen on a socket with `chatcore serve --listen 127.0.0.1:7400 --auth-secret-file SECRET`. \
            The protocol is described in the README and in Schemas/.
            """,
        version: version,
        subcommands: [Serve.self, Token.self],
        defaultSubcommand: nil
    )
}
