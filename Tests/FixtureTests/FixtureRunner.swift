import ChatSession
import ChatWire
import Crypto
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Plays one transcript (format: Tests/Fixtures/README.md) against the real binary.
final class FixtureRunner {
    let file: URL
    let binary: URL
    let scratch: URL
    private var serverArguments: [String] = []
    private var secret: String?
    private var server: ServerProcess?
    private var sessions: [String: SocketConnection] = [:]
    private var captures: [String: String] = [:]
    private var steps: [(number: Int, text: String)] = []
    private var usesTCP = false
    private var usesUnix = false

    /// Arguments every server of this run gets (after the transcript's own).
    private let extraArguments: [String]

    init(file: URL, binary: URL, extraArguments: [String] = []) throws {
        self.file = file
        self.binary = binary
        self.extraArguments = extraArguments
        scratch = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("chatcore-fixture-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: scratch, withIntermediateDirectories: true)
        let text = try String(contentsOf: file, encoding: .utf8)
        for (index, raw) in text.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
            let line = String(raw)
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            if trimmed.isEmpty || trimmed.hasPrefix("#") { continue }
            steps.append((index + 1, line))
            if trimmed.hasPrefix("!connect ") {
                if trimmed.hasSuffix(" unix") { usesUnix = true } else { usesTCP = true }
            }
        }
    }

    deinit {
        server?.terminate(signal: SIGKILL)
        try? FileManager.default.removeItem(at: scratch)
    }

    var dataDirectory: URL { scratch.appendingPathComponent("data") }
    var socketPath: String { scratch.appendingPathComponent("chatcore.sock").path }
    var secretPath: String { scratch.appendingPathComponent("secret").path }

    private func fail(_ number: Int, _ message: String) -> FixtureError {
        var text = "\(file.lastPathComponent):\(number): \(message)"
        if let server {
            let log = server.stderr.drain().suffix(20).joined(separator: "\n  ")
            if !log.isEmpty { text += "\n  server log:\n  " + log }
        }
        return FixtureError(text)
    }

    func run() throws {
        for (number, line) in steps {
            try step(number, line)
        }
        try finish(steps.last?.number ?? 0)
    }

    // MARK: steps

    private func step(_ number: Int, _ line: String) throws {
        if line.hasPrefix("!") {
            let parts = line.dropFirst().split(separator: " ", maxSplits: 1).map(String.init)
            let rest = parts.count > 1 ? parts[1] : ""
            try directive(number, parts[0], rest)
            return
        }
        if let marker = line.range(of: "> ") ?? line.range(of: "< "), !line[..<marker.lowerBound].contains(" ") {
            let name = String(line[..<marker.lowerBound])
            let payload = try substitute(String(line[marker.upperBound...]), number)
            if line[marker].hasPrefix(">") {
                try send(number, name, Array(payload.utf8) + [0x0A])
            } else {
                try expect(number, name, payload)
            }
            return
        }
        throw fail(number, "cannot read this step: \(line)")
    }

    private func directive(_ number: Int, _ name: String, _ rest: String) throws {
        switch name {
        case "server":
            serverArguments = rest.split(separator: " ").map(String.init)
        case "secret":
            secret = rest
            try rest.write(toFile: secretPath, atomically: true, encoding: .utf8)
        case "connect":
            let parts = rest.split(separator: " ").map(String.init)
            guard parts.count == 2 else { throw fail(number, "!connect NAME tcp|unix") }
            let server = try ensureServer(number)
            do {
                sessions[parts[0]] = parts[1] == "unix" ? try SocketConnection(unixPath: socketPath) : try SocketConnection(tcpPort: server.tcpPort ?? 0)
            } catch {
                throw fail(number, "\(error)")
            }
        case "close":
            if rest == "stdio" {
                try ensureServer(number).closeInput()
            } else {
                guard let connection = sessions.removeValue(forKey: rest) else { throw fail(number, "no session \(rest)") }
                connection.close()
            }
        case "ended":
            // The service closed session NAME: nothing more comes, then its end.
            guard let connection = sessions.removeValue(forKey: rest) else { throw fail(number, "no session \(rest)") }
            switch connection.stream.next() {
            case .endOfStream: connection.close()
            case .line(let text): throw fail(number, "\(rest): expected the service to close the session, got \(text)")
            case .timedOut: throw fail(number, "\(rest): the service did not close the session within \(Int(LineStream.patience)) s")
            }
        case "big":
            let parts = rest.split(separator: " ").map(String.init)
            guard parts.count >= 2, let count = Int(parts[1]) else { throw fail(number, "!big NAME BYTES") }
            try send(number, parts[0], [UInt8](repeating: UInt8(ascii: "x"), count: count) + [0x0A])
        case "raw":
            let parts = rest.split(separator: " ", maxSplits: 1).map(String.init)
            guard parts.count == 2, let bytes = hexBytes(parts[1]) else { throw fail(number, "!raw NAME HEX") }
            try send(number, parts[0], bytes)
        case "restart", "kill":
            try ensureServer(number)
            for (_, connection) in sessions { connection.close() }
            sessions.removeAll()
            server!.terminate(signal: name == "kill" ? SIGKILL : SIGTERM)
            let status = server!.waitForExit()
            if name == "restart" && status != 0 { throw fail(number, "the server exited with \(status) on SIGTERM") }
            server = nil
            _ = try ensureServer(number)
        case "sleep":
            usleep(UInt32((Int(rest) ?? 0) * 1000))
        case "fails":
            // !fails ARGS... => TEXT : `chatcore serve ARGS` must exit non-zero and say TEXT.
            let halves = rest.components(separatedBy: " => ")
            guard halves.count == 2 else { throw fail(number, "!fails ARGS => TEXT") }
            var arguments = ["serve", "--data-dir", scratch.appendingPathComponent("fails-data").path]
            arguments += halves[0].split(separator: " ").map(String.init)
            let (status, output) = ServerProcess.runToEnd(binary: binary, arguments: arguments)
            if status == 0 { throw fail(number, "expected chatcore \(arguments.joined(separator: " ")) to fail") }
            if !output.contains(halves[1]) { throw fail(number, "expected the output to mention '\(halves[1])', got: \(output)") }
        default:
            throw fail(number, "unknown directive !\(name)")
        }
    }

    @discardableResult
    private func ensureServer(_ number: Int) throws -> ServerProcess {
        if let server { return server }
        var arguments = ["serve", "--data-dir", dataDirectory.path]
        if usesTCP { arguments += ["--listen", "127.0.0.1:0"] }
        if usesUnix { arguments += ["--listen", "unix:\(socketPath)"] }
        if secret != nil { arguments += ["--auth-secret-file", secretPath] }
        arguments += serverArguments + extraArguments
        do {
            server = try ServerProcess(binary: binary, arguments: arguments, waitForListeners: (usesTCP ? 1 : 0) + (usesUnix ? 1 : 0))
        } catch {
            throw fail(number, "cannot start chatcore: \(error)")
        }
        return server!
    }

    private func send(_ number: Int, _ name: String, _ bytes: [UInt8]) throws {
        if name == "stdio" {
            try ensureServer(number).sendInput(bytes)
            return
        }
        guard let connection = sessions[name] else { throw fail(number, "no session \(name): !connect it first") }
        try connection.send(bytes)
    }

    private func stream(_ number: Int, _ name: String) throws -> LineStream {
        if name == "stdio" { return try ensureServer(number).stdout }
        guard let connection = sessions[name] else { throw fail(number, "no session \(name)") }
        return connection.stream
    }

    private func expect(_ number: Int, _ name: String, _ expectedText: String) throws {
        let expected: JSONTree
        do {
            expected = try JSONTree.parse(expectedText)
        } catch {
            throw fail(number, "the expected line is not JSON: \(error)")
        }
        switch try stream(number, name).next() {
        case .timedOut:
            throw fail(number, "\(name): no line came within \(Int(LineStream.patience)) s; expected \(expectedText)")
        case .endOfStream:
            throw fail(number, "\(name): the stream ended; expected \(expectedText)")
        case .line(let actualText):
            guard let actual = try? JSONTree.parse(actualText) else {
                throw fail(number, "\(name): the service wrote a line that is not JSON: \(actualText)")
            }
            if let difference = Matcher.match(expected, actual, captures: &captures, path: "") {
                throw fail(number, "\(name): \(difference)\n  expected: \(expectedText)\n  actual:   \(actualText)")
            }
        }
    }

    /// Every session must have nothing more to say: a marker request's answer must be
    /// the next line of each; then standard input ends and the process must exit 0.
    private func finish(_ number: Int) throws {
        guard let server else { return }
        for (index, name) in sessions.keys.sorted().enumerated() {
            let marker = "__fixture_end_\(index)"
            try sessions[name]!.send(Array("{\"__end\":{\"cookie\":\"\(marker)\"}}\n".utf8))
            switch sessions[name]!.stream.next() {
            case .line(let text) where text.contains(marker):
                continue
            case .line(let text):
                throw fail(number, "\(name): an event nobody expected: \(text)")
            default:
                throw fail(number, "\(name): the session ended or went silent before the end marker")
            }
        }
        for (_, connection) in sessions { connection.close() }
        let listens = server.arguments.contains("--listen")
        if server.servesStdio && listens {
            // Standard input ending does not stop a server that listens: sync it like a socket.
            try server.sendInput(Array("{\"__end\":{\"cookie\":\"__fixture_end_stdio\"}}\n".utf8))
            switch server.stdout.next() {
            case .line(let text) where text.contains("__fixture_end_stdio"): break
            case .line(let text): throw fail(number, "stdio: an event nobody expected: \(text)")
            default: throw fail(number, "stdio: went silent before the end marker")
            }
        } else if server.servesStdio {
            try server.closeInput()
            switch server.stdout.next() {
            case .line(let text): throw fail(number, "stdio: an event nobody expected: \(text)")
            case .timedOut: throw fail(number, "stdio: standard output did not end after standard input ended")
            case .endOfStream: break
            }
        }
        if listens { server.terminate(signal: SIGTERM) }
        let status = server.waitForExit()
        if status != 0 { throw fail(number, "chatcore exited with status \(status)") }
        self.server = nil
    }

    // MARK: substitution

    private func substitute(_ text: String, _ number: Int) throws -> String {
        var result = ""
        var rest = Substring(text)
        while let start = rest.range(of: "${") {
            result += rest[..<start.lowerBound]
            guard let end = rest[start.upperBound...].firstIndex(of: "}") else { throw fail(number, "unclosed ${") }
            let name = String(rest[start.upperBound..<end])
            result += try value(of: name, number)
            rest = rest[rest.index(after: end)...]
        }
        return result + rest
    }

    private func value(of name: String, _ number: Int) throws -> String {
        if name.hasPrefix("token:") {
            let parts = name.split(separator: ":").map(String.init)
            guard parts.count >= 2 else { throw fail(number, "${token:USER[:expired|:wrongkey]}") }
            let key = Array((parts.count > 2 && parts[2] == "wrongkey" ? "not the secret" : (secret ?? "")).utf8)
            let now = parts.count > 2 && parts[2] == "expired" ? Date(timeIntervalSinceNow: -7200) : Date()
            return try issueToken(userId: parts[1], secret: key, now: now)
        }
        if name == "bytes:long-cookie" { return String(repeating: "c", count: 300) }
        if name.hasPrefix("x:") {
            guard let count = Int(name.dropFirst(2)), (0...(64 << 20)).contains(count) else { throw fail(number, "${x:COUNT}") }
            return String(repeating: "x", count: count)
        }
        guard let captured = captures[name] else { throw fail(number, "nothing was captured as '\(name)'") }
        return captured
    }

    private func hexBytes(_ text: String) -> [UInt8]? {
        let digits = Array(text.filter { !$0.isWhitespace })
        guard digits.count % 2 == 0 else { return nil }
        var bytes: [UInt8] = []
        for index in stride(from: 0, to: digits.count, by: 2) {
            guard let byte = UInt8(String(digits[index...index + 1]), radix: 16) else { return nil }
            bytes.append(byte)
        }
        return bytes
    }
}

/// Compares an expected JSON line with an actual one. Objects must have exactly the same
/// members (order aside), arrays the same elements in order, scalars the same spelling.
/// Strings match when their bytes do. In the expected line, the strings "$any", "$int",
/// "$id" and "$capture:NAME" match any value, any integer, any decimal-string id, and
/// anything (remembering it as NAME).
enum Matcher {
    static func match(_ expected: JSONTree, _ actual: JSONTree, captures: inout [String: String], path: String) -> String? {
        if case .string(let pattern) = expected, pattern.hasPrefix("$") {
            switch pattern {
            case "$any":
                return nil
            case "$int":
                if case .number(let text) = actual, Int64(text) != nil { return nil }
                return "\(place(path)) expected an integer"
            case "$id":
                if case .string(let text) = actual, !text.isEmpty, text.allSatisfy(\.isNumber) { return nil }
                return "\(place(path)) expected a decimal-string id"
            default:
                if pattern.hasPrefix("$capture:") {
                    let name = String(pattern.dropFirst("$capture:".count))
                    switch actual {
                    case .string(let text): captures[name] = text
                    case .number(let text): captures[name] = text
                    default: captures[name] = "\(actual)"
                    }
                    return nil
                }
            }
        }
        switch (expected, actual) {
        case (.object(let expectedMembers), .object(let actualMembers)):
            let expectedKeys = Set(expectedMembers.map(\.0))
            let actualKeys = Set(actualMembers.map(\.0))
            if let missing = expectedKeys.subtracting(actualKeys).sorted().first { return "\(place(path)) lacks '\(missing)'" }
            if let extra = actualKeys.subtracting(expectedKeys).sorted().first { return "\(place(path)) has an unexpected '\(extra)'" }
            for (key, value) in expectedMembers {
                let other = actualMembers.first(where: { $0.0 == key })!.1
                if let difference = match(value, other, captures: &captures, path: path.isEmpty ? key : path + "." + key) { return difference }
            }
            return nil
        case (.array(let expectedElements), .array(let actualElements)):
            if expectedElements.count != actualElements.count {
                return "\(place(path)) has \(actualElements.count) elements, expected \(expectedElements.count)"
            }
            for (index, pair) in zip(expectedElements, actualElements).enumerated() {
                if let difference = match(pair.0, pair.1, captures: &captures, path: "\(path)[\(index)]") { return difference }
            }
            return nil
        case (.string(let expectedText), .string(let actualText)):
            // Byte for byte: Swift's `==` would take "e\u{301}" for "\u{E9}".
            return expectedText.utf8.elementsEqual(actualText.utf8) ? nil : "\(place(path)) differs"
        default:
            return expected == actual ? nil : "\(place(path)) differs"
        }
    }

    private static func place(_ path: String) -> String { path.isEmpty ? "the line" : "'\(path)'" }
}

/// An HS256 token for `userId` signed with `secret`, expiring an hour after `now`. Made
/// here with swift-crypto rather than with the service's own JWT library, so that the
/// transcripts check that tokens from elsewhere are understood.
private func issueToken(userId: String, secret: [UInt8], now: Date) throws -> String {
    func base64URL(_ bytes: [UInt8]) -> String {
        Data(bytes).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
    let issued = Int64(now.timeIntervalSince1970)
    let header = #"{"alg":"HS256","typ":"JWT"}"#
    let subject = String(decoding: try JSONSerialization.data(withJSONObject: userId, options: .fragmentsAllowed), as: UTF8.self)
    let payload = #"{"sub":\#(subject),"iat":\#(issued),"exp":\#(issued + 3600)}"#
    let signingInput = base64URL(Array(header.utf8)) + "." + base64URL(Array(payload.utf8))
    let signature = HMAC<SHA256>.authenticationCode(for: Array(signingInput.utf8), using: SymmetricKey(data: secret))
    return signingInput + "." + base64URL(Array(signature))
}
