import ChatProtocol
import Foundation
import Testing

@testable import ChatWire

private func decode(_ line: String) -> DecodedLine<Request> {
    WireDecoder.decodeLine(line, as: Request.self)
}

@Test func freeFormValuesRoundTripExactly() throws {
    let data = #"{"big":123456789012345678901234567890,"inf":1E400,"neg":-0,"esc":"\u00e9\n\/","order":{"z":1,"a":[1.50,2e-3]},"t":true}"#
    let decoded = decode(#"{"chatMessageSend":{"chatId":"1","tag":"T","data":  "# + data.replacingOccurrences(of: ",", with: " , ") + "  }}")
    guard case .success(.chatMessageSend(let send)) = decoded.result else {
        Issue.record("expected a chatMessageSend, got \(decoded.result)")
        return
    }
    #expect(send.data?.json == data)
    var writer = JSONWriter()
    send.encode(to: &writer)
    #expect(String(decoding: writer.bytes, as: UTF8.self).contains(data))
}

@Test func idsAcceptStringsAndIntegersAndWriteStrings() throws {
    for spelling in ["7", "\"7\""] {
        let decoded = decode(#"{"chatMessageRead":{"chatId":"c","messageId":"# + spelling + "}}")
        guard case .success(.chatMessageRead(let read)) = decoded.result else {
            Issue.record("\(decoded.result)")
            continue
        }
        #expect(read.messageId == 7)
        var writer = JSONWriter()
        read.encode(to: &writer)
        #expect(String(decoding: writer.bytes, as: UTF8.self) == #"{"chatId":"c","messageId":"7"}"#)
    }
}

@Test func escapedStringsAreDecoded() throws {
    let decoded = decode(#"{"search":{"text":"caf\u00e9 \"x\"","cookie":"k"}}"#)
    guard case .success(.search(let search)) = decoded.result else {
        Issue.record("\(decoded.result)")
        return
    }
    #expect(search.text == "café \"x\"")
}

@Test func failuresNameTheFieldAndKeepTheCookie() {
    let decoded = decode(#"{"chatMessageSend":{"zzz":[{"a":1}],"chatId":"1","tag":"T","cookie":"after"}}"#)
    #expect(decoded.request == "chatMessageSend")
    #expect(decoded.cookie == "after")
    #expect(decoded.result == .failure(WireFailure(.invalidParameter, "unknown field 'zzz'")))
}

@Test func syntaxErrorsWinOverEverythingElse() {
    let decoded = decode(#"{"chatMessageSend":{"zzz":1,"cookie":"c"}} x"#)
    #expect(decoded.request == nil)
    #expect(decoded.cookie == nil)
    if case .failure(let failure) = decoded.result { #expect(failure.kind == .parseError) } else { Issue.record("decoded") }
}

@Test func aDecoderRecoversAfterEveryKindOfBadLine() {
    let decoder = LineDecoder()
    let bad = ["{", "{\"a\":{}} {\"b\":{}}", "[1]", "5", "{\"a\":{}}5", "\"x", "{\"a\":{\"b\":[1,2"]
    for line in bad {
        var text = line
        let result = text.withUTF8 { decoder.decode(UnsafeRawBufferPointer($0), as: Request.self) }
        if case .failure(let failure) = result.result { #expect(failure.kind == .parseError, "\(line)") } else { Issue.record("\(line) decoded") }
        var good = #"{"chatTyping":{"chatId":"x"}}"#
        let next = good.withUTF8 { decoder.decode(UnsafeRawBufferPointer($0), as: Request.self) }
        #expect(next.result == .success(.chatTyping(ChatTyping(chatId: "x"))), "after \(line)")
    }
}

@Test func unionsPickTheirVariant() {
    let decoded = decode(#"{"requestListChange":{"elements":[{"chatId":"1","localData":null}],"type":"chat"}}"#)
    #expect(decoded.result == .success(.requestListChange(.chat(RequestListChangeChat(elements: [ChatSettable(chatId: "1", localData: .null)])))))
}

@Test func unionsDecodeTheSameWhereverTheDiscriminatorStands() {
    let expected = Request.requestListMatching(
        .chatMessage(
            RequestListMatchingChatMessage(
                criteria: ChatMessageCriteria(chatId: "1", notRefTag: "Thread"), window: Window(messageId: 9, before: 5), cookie: "k")))
    let first = decode(
        #"{"requestListMatching":{"type":"chatMessage","criteria":{"chatId":"1","notRefTag":"Thread"},"window":{"messageId":"9","before":5},"cookie":"k"}}"#)
    let last = decode(
        #"{"requestListMatching":{"criteria":{"chatId":"1","notRefTag":"Thread"},"window":{"messageId":9,"before":5},"cookie":"k","type":"chatMessage"}}"#)
    #expect(first.result == .success(expected))
    #expect(last.result == .success(expected))
}

@Test func aBadDiscriminatorNamesTheChoicesAndKeepsTheCookie() {
    for line in [
        #"{"requestListMatching":{"type":"typing","criteria":{},"cookie":"c"}}"#,
        #"{"requestListMatching":{"type":{"x":[1]},"criteria":{},"cookie":"c"}}"#,
        #"{"requestListMatching":{"criteria":{},"type":"typing","cookie":"c"}}"#
    ] {
        let decoded = decode(line)
        #expect(decoded.cookie == "c", "\(line)")
        #expect(decoded.result == .failure(WireFailure(.invalidParameter, "'type' must be one of 'chatMessage', 'chatParticipant', 'chat', 'user'")), "\(line)")
    }
    let missing = decode(#"{"requestListMatching":{"cookie":"c"}}"#)
    #expect(missing.result == .failure(WireFailure(.invalidParameter, "'type' is required")))
}

@Test func errorsInsideAVariantNameTheirPath() {
    let decoded = decode(#"{"requestListMatching":{"type":"chatMessage","criteria":{"chatId":"1","bogus":1}}}"#)
    #expect(decoded.result == .failure(WireFailure(.invalidParameter, "unknown field 'criteria.bogus'")))
}

/// The check before YAJL agrees with Swift's own UTF-8 validation on every sequence of up
/// to three bytes drawn from the bytes where UTF-8's rules change, and on random ones.
@Test func theUTF8CheckAgreesWithSwiftsValidation() {
    let interesting: [UInt8] = [
        0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
        0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xF7, 0xF8, 0xFF
    ]
    func agrees(_ bytes: [UInt8]) -> Bool {
        let valid = String(validating: bytes, as: UTF8.self) != nil
        return bytes.withUnsafeBytes { YAJL.firstInvalidUTF8($0) == nil } == valid
    }
    var disagreements: [[UInt8]] = []
    for a in interesting {
        for b in interesting {
            for c in interesting {
                // Each alone, and behind eight ASCII bytes (past the fast path's first step).
                for bytes in [[a, b, c], [a, b, c, 0x80, 0x80], Array("abcdefgh".utf8) + [a, b, c]] where !agrees(bytes) {
                    disagreements.append(bytes)
                }
            }
        }
    }
    var generator = SystemRandomNumberGenerator()
    for _ in 0..<20_000 {
        let bytes = (0..<Int.random(in: 1...24, using: &generator)).map { _ in
            Bool.random(using: &generator) ? UInt8.random(in: 0x20...0x7E, using: &generator) : UInt8.random(in: 0x80...0xFF, using: &generator)
        }
        if !agrees(bytes) { disagreements.append(bytes) }
    }
    #expect(Array(disagreements.prefix(5)) == [])
    // Where it points: the first byte of the first bad sequence.
    let line = Array("{\"x\":\"ok\u{10FFFF}\u{E9}".utf8) + [0xED, 0xA0, 0x80] + Array("\"}".utf8)
    #expect(line.withUnsafeBytes { YAJL.firstInvalidUTF8($0) } == line.firstIndex(of: 0xED))
}

/// Generated types compare text byte for byte, at every depth and in every shape a field
/// takes (text, optional text, lists of text, a change's nullable text, nested elements):
/// two spellings of one word are two values, as they are on the wire and in the stores.
@Test func generatedTypesCompareTextByteForByte() {
    let composed = "caf\u{E9}"
    let decomposed = "cafe\u{301}"
    #expect(composed == decomposed, "Swift's own == is canonical equivalence")
    func chat(_ subject: String) -> Chat {
        Chat(
            chatId: "1", subject: subject, state: .ready, flags: "", lastMessage: 1, numMessages: 1, numUnread: 0, numUnreadMentions: 0,
            lastActivity: 0, invitePolicy: .participantsOnly, pinPolicy: .adminsOnly)
    }
    #expect(chat(composed) != chat(decomposed))
    #expect(chat(composed) == chat(composed))
    #expect(ChatChange(chatId: "1", subject: .value(composed)) != ChatChange(chatId: "1", subject: .value(decomposed)))
    #expect(ChatChange(chatId: "1", subject: .null) == ChatChange(chatId: "1", subject: .null))
    #expect(IdentitiesGet(cookie: "c", appUserIds: [composed]) != IdentitiesGet(cookie: "c", appUserIds: [decomposed]))
    #expect(IdentitiesGet(cookie: composed) != IdentitiesGet(cookie: decomposed))
    func message(_ tag: String) -> ChatMessage {
        ChatMessage(
            chatId: "1", messageId: 2, senderUri: "bbmpim://user/id/0", tag: "Text", flags: "", state: .sent, stateIsPartial: false,
            ref: [MessageRef(tag: tag, messageId: 1)], timestamp: 0)
    }
    #expect(message(composed) != message(decomposed))
    #expect(message(composed) == message(composed))
}

/// `sameBytes` compares bytes, whatever the lengths and wherever the strings' storage is:
/// canonically equivalent spellings of the same length differ, long texts built apart
/// are equal, and a difference in the last byte counts.
@Test func sameBytesComparesEveryByte() {
    let dotAboveFirst = "\u{1E0B}\u{323}"
    let dotBelowFirst = "\u{1E0D}\u{307}"
    #expect(dotAboveFirst.utf8.count == dotBelowFirst.utf8.count && dotAboveFirst == dotBelowFirst)
    #expect(!sameBytes(dotAboveFirst, dotBelowFirst))
    let long = String(repeating: "lunch tomorrow ", count: 20)
    #expect(sameBytes(long + "a", String(repeating: "lunch tomorrow ", count: 20) + "a"))
    #expect(!sameBytes(long + "a", long + "b"))
    #expect(!sameBytes(long, long + "b"))
    #expect(sameBytes("", ""))
    #expect(!sameBytes("", "a"))
    #expect(sameBytes(Optional(long), Optional(long)) && !sameBytes(Optional(long), nil))
}
