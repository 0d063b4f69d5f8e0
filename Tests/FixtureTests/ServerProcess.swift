import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// The real `chatcore serve` in a child process, with its standard streams on pipes.
final class ServerProcess {
    let process = Process()
    let arguments: [String]
    private let input = Pipe()
    let stdout: LineStream
    let stderr: LineStream
    private(set) var tcpPort: Int?
    private var inputClosed = false

    var servesStdio: Bool { arguments.contains("--user") || !arguments.contains("--listen") }

    init(binary: URL, arguments: [String], waitForListeners: Int) throws {
        self.arguments = arguments
        let output = Pipe()
        let errors = Pipe()
        process.executableURL = binary
        process.arguments = arguments
        // Timestamps in transcripts are exact: the server's clock stands still.
        var environment = ProcessInfo.processInfo.environment
        environment["CHATCORE_FIXED_TIME"] = "1700000000"
        process.environment = environment
        process.standardInput = input
        process.standardOutput = output
        process.standardError = errors
        try process.run()
        // Copies: the pipes close their own descriptors when this object goes.
        stdout = LineStream(descriptor: dup(output.fileHandleForReading.fileDescriptor))
        stderr = LineStream(descriptor: dup(errors.fileHandleForReading.fileDescriptor))
        var listening = 0
        var seen: [String] = []
        while listening < waitForListeners {
            switch stderr.next(timeout: 20) {
            case .line(let line):
                seen.append(line)
                guard line.contains("listening") else { continue }
                listening += 1
                if let range = line.range(of: #"port=(\d+)"#, options: .regularExpression) {
                    let port = Int(line[range].dropFirst(5)) ?? 0
                    if port != 0 { tcpPort = port }
                }
            default:
                throw FixtureError("chatcore did not start listening: \(seen.joined(separator: "\n"))")
            }
        }
    }

    func sendInput(_ bytes: [UInt8]) throws {
        try writeAll(input.fileHandleForWriting.fileDescriptor, bytes)
    }

    func closeInput() throws {
        guard !inputClosed else { return }
        inputClosed = true
        try input.fileHandleForWriting.close()
    }

    func terminate(signal: Int32) {
        if process.isRunning { kill(process.processIdentifier, signal) }
    }

    /// Waits for the process to end (20 s at most, then kills it) and returns its status.
    func waitForExit() -> Int32 {
        let deadline = Date(timeIntervalSinceNow: 20)
        while process.isRunning && Date() < deadline { usleep(10_000) }
        if process.isRunning {
            kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
            return -1
        }
        process.waitUntilExit()
        return process.terminationStatus
    }

    /// Runs chatcore to its end; returns its status and everything it printed.
    static func runToEnd(binary: URL, arguments: [String]) -> (Int32, String) {
        let process = Process()
        let pipe = Pipe()
        process.executableURL = binary
        process.arguments = arguments
        process.standardOutput = pipe
        process.standardError = pipe
        process.standardInput = FileHandle.nullDevice
        do { try process.run() } catch { return (-1, "\(error)") }
        let data = pipe.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return (process.terminationStatus, String(decoding: data, as: UTF8.self))
    }
}
