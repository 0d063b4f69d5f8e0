import CYAJL
import ChatProtocol
import ChatWire
import Foundation

// chatcore-bench: codec speed on a corpus file, one JSON line per request.
//
//     chatcore-bench codec FILE     prints "name lines seconds" rows for:
//       yajl-raw        YAJL parsing each line, no callbacks (the floor)
//       decode          chatcore's generated decoders (YAJL callbacks -> typed values)
//       decode+encode   decode, then encode the request again (or its requestFailed)
//       foundation      JSONSerialization: parse each line, write it again

func lines(of data: [UInt8]) -> [Range<Int>] {
    var result: [Range<Int>] = []
    var start = 0
    for (index, byte) in data.enumerated() where byte == 0x0A {
        result.append(start..<index)
        start = index + 1
    }
    if start < data.count { result.append(start..<data.count) }
    return result
}

/// Only these measurements, when named after the file (for profiling one of them).
let only = Set(CommandLine.arguments.dropFirst(3))

func measure(_ name: String, lines: Int, repeats: Int = 3, _ body: () -> Void) {
    if !only.isEmpty && !only.contains(name) { return }
    var best = Double.infinity
    for _ in 0..<repeats {
        let start = DispatchTime.now().uptimeNanoseconds
        body()
        let seconds = Double(DispatchTime.now().uptimeNanoseconds - start) / 1e9
        best = min(best, seconds)
    }
    print("\(name) \(lines) \(String(format: "%.6f", best))")
}

let arguments = CommandLine.arguments
guard arguments.count >= 3, arguments[1] == "codec" else {
    FileHandle.standardError.write(Data("usage: chatcore-bench codec FILE [MEASUREMENT...]\n".utf8))
    exit(2)
}
let data = [UInt8](try Data(contentsOf: URL(fileURLWithPath: arguments[2])))
let ranges = lines(of: data)
var sink = 0

data.withUnsafeBytes { all in
    let base = all.baseAddress!.assumingMemoryBound(to: UInt8.self)
    measure("yajl-raw", lines: ranges.count) {
        for range in ranges {
            let handle = yajl_alloc(nil, nil, nil)
            if yajl_parse(handle, base + range.lowerBound, range.count) == yajl_status_ok { _ = yajl_complete_parse(handle) }
            yajl_free(handle)
        }
    }
    let decoder = LineDecoder()
    measure("decode", lines: ranges.count) {
        for range in ranges {
            let decoded = decoder.decode(UnsafeRawBufferPointer(rebasing: all[range]), as: Request.self)
            if case .success = decoded.result { sink &+= 1 }
        }
    }
    var writer = JSONWriter(capacity: 1 << 20)
    measure("decode+encode", lines: ranges.count) {
        for (number, range) in ranges.enumerated() {
            let decoded = decoder.decode(UnsafeRawBufferPointer(rebasing: all[range]), as: Request.self)
            switch decoded.result {
            case .success(let request): request.encode(to: &writer)
            case .failure(let failure):
                ProtocolError(failure).requestFailed(request: decoded.request, cookie: decoded.cookie, line: number + 1).encode(to: &writer)
            }
            if writer.count > 1 << 20 {
                sink &+= writer.count
                writer.removeAll()
            }
        }
    }
    measure("foundation", lines: ranges.count) {
        for range in ranges {
            let line = Data(all[range])
            if let object = try? JSONSerialization.jsonObject(with: line), let again = try? JSONSerialization.data(withJSONObject: object) {
                sink &+= again.count
            }
        }
    }
}
if sink == 42 { print("") }
