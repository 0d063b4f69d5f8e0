import Testing

@testable import ChatWire

/// Collects what a framer hands out for a sequence of chunks.
private func frames(_ chunks: [String], limit: Int = 16, finish: Bool = true) -> [String] {
    var framer = LineFramer(maxLineBytes: limit)
    var out: [String] = []
    let collect: (LineFramer.Frame) -> Void = { frame in
        switch frame {
        case .line(let bytes, let number): out.append("\(number):" + String(decoding: bytes, as: UTF8.self))
        case .tooLarge(let number): out.append("\(number):TooLarge")
        }
    }
    for chunk in chunks {
        Array(chunk.utf8).withUnsafeBytes { framer.feed($0, collect) }
    }
    if finish { framer.finish(collect) }
    return out
}

@Test func splitsLinesAcrossChunks() {
    #expect(frames(["ab", "c\nde", "f\n"]) == ["1:abc", "2:def"])
}

@Test func dropsTrailingCarriageReturn() {
    #expect(frames(["x\r\ny\n"]) == ["1:x", "2:y"])
}

@Test func skipsBlankLinesButCountsThem() {
    #expect(frames(["\n  \n\t\r\nz\n"]) == ["4:z"])
}

@Test func formFeedIsNotBlank() {
    #expect(frames(["\u{0C}\n"]) == ["1:\u{0C}"])
}

@Test func overlongLineIsReportedOnceAndDiscarded() {
    #expect(frames(["0123456789", "0123456789", "0123456789\nok\n"]) == ["1:TooLarge", "2:ok"])
    #expect(frames([String(repeating: "x", count: 17) + "\nok\n"]) == ["1:TooLarge", "2:ok"])
}

@Test func lineExactlyAtTheLimitIsKept() {
    let sixteen = String(repeating: "y", count: 16)
    #expect(frames([sixteen + "\n"]) == ["1:" + sixteen])
    #expect(frames([String(sixteen.prefix(15)) + "\r\n"]) == ["1:" + String(sixteen.prefix(15))])
}

@Test func lastLineWithoutNewlineCountsAtEnd() {
    #expect(frames(["a\nb"]) == ["1:a", "2:b"])
    #expect(frames(["a\nb"], finish: false) == ["1:a"])
}

@Test func discardingDoesNotBuffer() {
    var framer = LineFramer(maxLineBytes: 8)
    let chunk = [UInt8](repeating: 0x78, count: 1 << 16)
    var reports = 0
    for _ in 0..<64 {
        chunk.withUnsafeBytes { framer.feed($0) { _ in reports += 1 } }
        #expect(framer.isAtLineBoundary == false)
    }
    #expect(reports == 1)
}
