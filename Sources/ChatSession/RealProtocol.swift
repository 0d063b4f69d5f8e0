import ChatProtocol
import ChatWire

/// Requests of the real BBMDS protocol (what bbmcore's clients may send) that chatcore does
/// not serve, and why: a client sending one gets `UnknownRequest` with this reason rather
/// than a bare "unknown request".
enum RealProtocol {
    static let unsupported: [String: String] = {
        let keys = "chatcore keeps no end-to-end keys (the service itself is the trusted party): key management has no meaning here"
        return [
            "chatKeyExport": keys,
            "chatKeysImport": keys,
            "profileKeysExport": keys,
            "profileKeysImport": keys,
            "userKeysImport": keys,
            "syncPasscodeChange": keys,
            "requestPin": "chatcore has no PINs: users are named by userId, regId and uri",
            "wipe": "chatcore does not wipe its store on request: stop it and remove its data directory",
            "statsCommitted": "chatcore keeps no usage statistics",
            "requestListAdd": "lists change through the requests that own them (chatStart, chatMessageSend, chatInvite, ...): requestListAdd is not supported",
            "requestListRemove":
                "lists change through the requests that own them (chatLeave, participantRemove, chatMessageDestroy, ...): requestListRemove is not supported",
            "chatParticipantTimesGet": "chatcore keeps no per-participant times: chatMessageStateGet gives each recipient's state of a message"
        ]
    }()

    /// Lists of the real protocol that chatcore does not have, and why.
    static let missingLists: [String: String] = [
        "appMessage": "there are no messages from BlackBerry's servers to the application",
        "stat": "chatcore keeps no usage statistics",
        "chatMessageFileProgress": "attachments are stored and downloaded whole: a message's fileState says where its file is"
    ]

    /// The answer to a line that failed to decode, with the reason for a known request of
    /// the real protocol that chatcore does not serve, or for a list it does not have.
    static func failure(_ failure: WireFailure, request: String?, line: UnsafeRawBufferPointer) -> ProtocolError {
        if failure.kind == .unknownRequest, let request, let why = unsupported[request] {
            return ProtocolError(.unknownRequest, "'\(request)' is not served by chatcore: \(why)")
        }
        // Only on this (rare) path is the line read again, to see which list was meant.
        if failure.kind == .invalidParameter, let request, request.hasPrefix("requestList"), failure.reason.hasPrefix("'type' must be one of"),
            let tree = try? JSONTree.parse(line), let type = tree[request]?["type"]?.stringValue, let why = missingLists[type]
        {
            return ProtocolError(.invalidParameter, "'type' \(type) is a list of the real protocol that chatcore does not have: \(why)")
        }
        return ProtocolError(failure)
    }
}
