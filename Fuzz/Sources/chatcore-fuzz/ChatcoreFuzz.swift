// chatcore-fuzz: libFuzzer targets for the line decoder and the whole request path.
//
//   make fuzz                     builds with -sanitize=fuzzer,address and runs both targets
//                                 (time-bounded), seeded with every request of the fixtures
//   chatcore-fuzz TARGET FILE...  (a normal build) runs inputs once: reproduces a finding
//
// TARGET is `decoder` (one line: decode; a decoded request must encode and decode to
// itself) or `request` (lines through decode, then a real engine on a scratch SQLite
// store, as an authenticated user with a chat, then encoding every event).
import ChatEngine
import ChatProtocol
import ChatWire
import Foundation
import Logging
import SQLiteStorage

nonisolated(unsafe) let decoder = LineDecoder()

func fuzzDecoder(_ bytes: UnsafeRawBufferPointer) {
    let decoded = decoder.decode(bytes, as: Request.self)
    guard case .success(let request) = decoded.result else { return }
    var writer = JSONWriter()
    request.encode(to: &writer)
    let again = writer.withBytes { LineDecoder().decode($0, as: Request.self) }
    guard case .success(let same) = again.result, same == request else {
        fatalError("a decoded request does not survive encoding: \(String(decoding: writer.bytes, as: UTF8.self))")
    }
}

/// Takes the encoded events (the engine encodes them: the encoders are on the path).
final class Sink: EventSink, @unchecked Sendable {
    var delivered = 0
    var backlog: Int { 0 }
    func deliver(_ lines: UnsafeRawBufferPointer) {
        delivered += lines.count
    }
    func engineFinished(_ count: Int) {}
    func endSession() {}
}

/// A fresh engine on a fresh store with alice and bob in a chat. Replaced every few
/// hundred inputs, so that the state (and each input's cost) does not grow without end.
final class RequestPath {
    let engine: Engine
    let session: EngineSession
    let other: EngineSession
    /// Engine sessions hold their sinks weakly: these keep them.
    let sinks = [Sink(), Sink()]
    let directory: URL
    var line = 0
    var inputs = 0

    init() {
        // A scratch store in memory when possible: every input commits (and syncs).
        let scratch = FileManager.default.fileExists(atPath: "/dev/shm") ? URL(fileURLWithPath: "/dev/shm") : FileManager.default.temporaryDirectory
        directory = scratch.appendingPathComponent("chatcore-fuzz-\(getpid())-\(UInt32.random(in: 0...UInt32.max))")
        try? FileManager.default.removeItem(at: directory)
        var logger = Logger(label: "fuzz")
        logger.logLevel = .critical
        engine = try! Engine(store: try! SQLiteStore(directory: directory), logger: logger, clock: { 1_700_000_000 })
        engine.start()
        session = engine.openSession(transport: .tcp, sink: sinks[0])
        other = engine.openSession(transport: .tcp, sink: sinks[1])
        engine.authenticate(userId: "alice", cookie: nil, line: 0, announce: true, session: session)
        engine.authenticate(userId: "bob", cookie: nil, line: 0, announce: true, session: other)
        let start = #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"fuzz"}}"#
        run(Array(start.utf8))
        engine.drain()
    }

    func finish() {
        engine.drain()
        engine.stop()
        try? FileManager.default.removeItem(at: directory)
    }

    func run(_ bytes: [UInt8]) {
        inputs += 1
        for piece in bytes.split(separator: 0x0A, omittingEmptySubsequences: true) {
            line += 1
            piece.withUnsafeBytes { raw in
                if case .success(let request) = decoder.decode(raw, as: Request.self).result {
                    engine.submit(request, line: line, from: line % 5 == 0 ? other : session)
                }
            }
        }
        engine.drain()
    }
}

nonisolated(unsafe) var requestPath: RequestPath?

func fuzz(_ target: String, _ bytes: UnsafeRawBufferPointer) {
    switch target {
    case "request":
        if let path = requestPath, path.inputs >= 256 {
            path.finish()
            requestPath = nil
        }
        if requestPath == nil { requestPath = RequestPath() }
        requestPath!.run(Array(bytes))
    default:
        fuzzDecoder(bytes)
    }
}

#if FUZZING
    @_cdecl("LLVMFuzzerInitialize")
    public func fuzzerInitialize(_ argc: UnsafeMutablePointer<CInt>?, _ argv: UnsafeMutablePointer<UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>?>?)
        -> CInt
    {
        WireSchema.prepare(Request.wireMessages)
        if ProcessInfo.processInfo.environment["CHATCORE_FUZZ_TARGET"] == "request" { requestPath = RequestPath() }
        return 0
    }

    @_cdecl("LLVMFuzzerTestOneInput")
    public func fuzzerTestOneInput(_ data: UnsafePointer<UInt8>?, _ size: Int) -> CInt {
        let target = ProcessInfo.processInfo.environment["CHATCORE_FUZZ_TARGET"] ?? "decoder"
        fuzz(target, UnsafeRawBufferPointer(start: data, count: size))
        return 0
    }

    @_silgen_name("LLVMFuzzerRunDriver")
    func runFuzzerDriver(
        _ argc: UnsafeMutablePointer<CInt>,
        _ argv: UnsafeMutablePointer<UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>?>,
        _ callback: @convention(c) (UnsafePointer<UInt8>?, Int) -> CInt
    ) -> CInt

    /// SwiftPM links an executable's entry point under this name: hand over to libFuzzer.
    @_cdecl("chatcore_fuzz_main")
    public func fuzzMain(_ argc: CInt, _ argv: UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>?) -> CInt {
        var count = argc
        var vector = argv
        return runFuzzerDriver(&count, &vector) { data, size in fuzzerTestOneInput(data, size) }
    }
#else
    @main
    enum ChatcoreFuzz {
        static func main() throws {
            let arguments = CommandLine.arguments
            guard arguments.count >= 3 else {
                FileHandle.standardError.write(Data("usage: chatcore-fuzz decoder|request FILE...\n".utf8))
                exit(2)
            }
            for path in arguments.dropFirst(2) {
                let data = try [UInt8](Data(contentsOf: URL(fileURLWithPath: path)))
                data.withUnsafeBytes { fuzz(arguments[1], $0) }
            }
            print("ran \(arguments.count - 2) inputs through \(arguments[1])")
        }
    }
#endif
