import Testing

@testable import ChatWire

private func written(_ body: (inout JSONWriter) -> Void) -> String {
    var writer = JSONWriter()
    body(&writer)
    return String(decoding: writer.bytes, as: UTF8.self)
}

@Test func escapesWhatJSONRequires() {
    #expect(written { $0.string("a\"b\\c\nd\u{01}é😀/") } == #""a\"b\\c\nd\u0001é😀/""#)
}

@Test func separatesMembersAndElements() {
    let text = written { writer in
        writer.beginObject()
        writer.rawKey("\"a\":")
        writer.integer(Int64(-12))
        writer.rawKey("\"b\":")
        writer.beginArray()
        writer.bool(true)
        writer.null()
        writer.id64(42)
        writer.endArray()
        writer.key(dynamic: "c\"d")
        writer.json(JSONValue(compactJSON: "{\"x\":1E400}"))
        writer.endObject()
    }
    #expect(text == #"{"a":-12,"b":[true,null,"42"],"c\"d":{"x":1E400}}"#)
}

@Test func writesExtremeIntegers() {
    #expect(written { $0.integer(Int64.min) } == "-9223372036854775808")
    #expect(written { $0.id64(Int64.max) } == "\"9223372036854775807\"")
}

@Test func jsonValueBuildersKeepOrder() {
    let value = JSONValue.object(["z": .integer(1), "a": .array([.string("x"), .bool(false), .null])])
    #expect(value.json == #"{"z":1,"a":["x",false,null]}"#)
}

@Test func growsPastItsFirstBufferWhileEscaping() {
    // Every byte needs a six-byte escape: the worst case for the room reserved up front.
    let controls = String(repeating: "\u{01}", count: 5000)
    var writer = JSONWriter(capacity: 1)
    writer.beginArray()
    writer.string(controls)
    writer.string("tail\"")
    writer.integer(Int64(7))
    writer.endArray()
    let text = String(decoding: writer.bytes, as: UTF8.self)
    #expect(text == "[\"" + String(repeating: "\\u0001", count: 5000) + "\",\"tail\\\"\",7]")
    #expect(writer.count == text.utf8.count)
    writer.removeAll()
    writer.null()
    #expect(String(decoding: writer.bytes, as: UTF8.self) == "null")
}

@Test func replacesEveryWholeOccurrenceAfterTheStartOnly() {
    let needle = Array(#""bbmpim://user/id/12""#.utf8)
    let replacement = Array(#""bbmpim://user/id/0""#.utf8)
    let before = #"{"u":"bbmpim://user/id/12"}"#
    let after = #"["bbmpim://user/id/12","bbmpim://user/id/12""bbmpim://user/id/123","bbmpim://user/id/1",""bbmpim://user/id/12"]"#
    var writer = JSONWriter(capacity: 1)
    Array(before.utf8).withUnsafeBytes { writer.appendLines($0) }
    let start = writer.count
    Array(after.utf8).withUnsafeBytes { writer.appendLines($0) }
    writer.replaceAll(needle, with: replacement, from: start)
    // Adjacent and at both ends are replaced; a longer id, a shorter one and what lies
    // before `start` are not.
    #expect(
        String(decoding: writer.bytes, as: UTF8.self) == before
            + #"["bbmpim://user/id/0","bbmpim://user/id/0""bbmpim://user/id/123","bbmpim://user/id/1",""bbmpim://user/id/0"]"#)
    writer.replaceAll(needle, with: replacement, from: writer.count - 3)
    #expect(writer.count == before.utf8.count + after.utf8.count - 3)
    // The needle alone: it ends where the bytes end.
    var alone = JSONWriter()
    needle.withUnsafeBytes { alone.appendLines($0) }
    alone.replaceAll(needle, with: replacement, from: 0)
    #expect(alone.bytes == replacement)
}
