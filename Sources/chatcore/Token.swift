import ArgumentParser
import ChatSession

/// `chatcore token`: prints a JWT for a user, signed with the server's secret.
struct Token: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Print an authToken (a JWT, HS256) for a user, on a line of its own."
    )

    @Option(name: .long, help: "The user id the token is for (its 'sub').")
    var user: String

    @Option(name: .long, help: "A file whose bytes, as they are (at least 32), are the HMAC key; the same file `serve` uses.")
    var authSecretFile: String

    @Option(name: .long, help: "Seconds until the token expires (serve refuses more than its --auth-max-lifetime, a day by default).")
    var expiresIn: Int64 = 86_400

    @Option(name: .long, help: "The token's 'aud', for a service started with --auth-audience.")
    var audience: String?

    @Option(name: .long, help: "The token's 'iss', for a service started with --auth-issuer.")
    var issuer: String?

    func validate() throws {
        guard !user.isEmpty, user.utf8.count <= 128 else { throw ValidationError("--user must be 1 to 128 bytes") }
        guard expiresIn > 0 else { throw ValidationError("--expires-in must be positive") }
    }

    func run() async throws {
        let secret: [UInt8]
        do {
            secret = try Authenticator.loadSecret(path: authSecretFile)
        } catch {
            // A sentence, not the usage: the command line was right, the file is not.
            throw CleanFailure(description: "cannot read --auth-secret-file: \(error)")
        }
        print(try await Authenticator.issue(userId: user, secret: secret, expiresIn: expiresIn, audience: audience, issuer: issuer))
    }
}

/// A failure to say in one line (`Error: ...`, exit 1), without the usage that follows a
/// mistake on the command line.
struct CleanFailure: Error, CustomStringConvertible {
    let description: String
}
