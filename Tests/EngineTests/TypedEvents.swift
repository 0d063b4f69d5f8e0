import ChatProtocol
import ChatWire

// What the engine's tests read of its events: the generated `Event` types, decoded from
// what each session was sent by the generated decoder (as a client would), never a JSON
// dictionary.

extension EngineHarness {
    /// Session `name`'s events so far, typed.
    func typedEvents(_ name: String) -> [Event] {
        EngineHarness.typed(events(name))
    }

    /// `lines`, each one event, typed (a line the generated types do not decode fails
    /// the test that reads it).
    static func typed(_ lines: [String]) -> [Event] {
        lines.map(typed)
    }

    static func typed(_ line: String) -> Event {
        switch WireDecoder.decodeLine(line, as: Event.self).result {
        case .success(let event): event
        case .failure(let failure): fatalError("an event the generated types do not decode (\(failure)): \(line)")
        }
    }
}

extension Event {
    var requestFailed: RequestFailed? {
        if case .requestFailed(let body) = self { body } else { nil }
    }

    var searchResult: SearchResult? {
        if case .searchResult(let body) = self { body } else { nil }
    }

    var endpoints: Endpoints? {
        if case .endpoints(let body) = self { body } else { nil }
    }

    var listChanges: ListChanges? {
        if case .listChanges(let body) = self { body } else { nil }
    }

    /// The header of a `requestListMatching` answer over chat messages.
    var messagesMatching: ListMatchingChatMessage? {
        if case .listMatching(.chatMessage(let header)) = self { header } else { nil }
    }

    /// A `listChunk` of chat messages.
    var messageChunk: ListChunkChatMessage? {
        if case .listChunk(.chatMessage(let chunk)) = self { chunk } else { nil }
    }

    /// The chat messages a `listAdd` of chat messages carries.
    var addedMessages: [ChatMessage] {
        if case .listAdd(.chatMessage(let add)) = self { add.elements } else { [] }
    }

    /// The chats a `listAdd` of chats carries.
    var addedChats: [Chat] {
        if case .listAdd(.chat(let add)) = self { add.elements } else { [] }
    }

    /// The chat messages a `listChunk` of chat messages carries.
    var chunkMessages: [ChatMessage] {
        if case .listChunk(.chatMessage(let chunk)) = self { chunk.elements } else { [] }
    }

    /// The chats a `listChunk` of chats carries.
    var chunkChats: [Chat] {
        if case .listChunk(.chat(let chunk)) = self { chunk.elements } else { [] }
    }

    /// What a `listChange` of chat messages changed.
    var messageChanges: [ChatMessageChange] {
        if case .listChange(.chatMessage(let change)) = self { change.elements } else { [] }
    }
}
