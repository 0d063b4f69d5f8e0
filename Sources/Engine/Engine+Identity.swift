import Protocol
import Store

/// Authentication, identities, and the `global` and `user` lists (PROTOCOL.md §3, §4).
extension Engine {
    func authenticate(userId: String, cookie: String?, announce: Bool, session: EngineSession, batch: Batch) {
        if let current = session.user, let currentUser = users[current] {
            guard currentUser.userId == userId else {
                batch.emit(.setupError(SetupError(error: .alreadyAuthenticated, cookie: cookie)), to: session)
                return
            }
        } else {
            let user = users.ensure(userId: userId, batch: &batch.store)
            session.user = user.number
            sessionsByUser[user.number, default: []].append(session)
        }
        guard announce else { return }
        let elements = globalElements(of: session).map { GlobalChange(name: $0.name, value: .value($0.value)) }
        batch.emit(.listChange(.global(ListChangeGlobal(elements: elements))), to: session)
    }

    /// The session's `global` list: authTokenState, setupState, localUri, localRegId.
    func globalElements(of session: EngineSession) -> [Global] {
        guard let number = session.user, let user = users[number] else { return [] }
        return [
            Global(name: "authTokenState", value: .string("Ok")),
            Global(name: "setupState", value: .string("Success")),
            Global(name: "localUri", value: .string(user.uri)),
            Global(name: "localRegId", value: .string(String(user.regId))),
        ]
    }

    /// The users a user sees in their `user` list: themselves and everyone they share a chat with.
    func visibleUsers(of user: Int64) -> [UserRecord] {
        users[user].map { [$0] } ?? []
    }

    func identities(_ request: IdentitiesGet) -> Event {
        var found: [Identity] = []
        var seen = Set<Int64>()
        func add(_ user: UserRecord?) {
            guard let user, seen.insert(user.number).inserted else { return }
            found.append(Identity(userId: user.userId, regId: user.regId, uri: user.uri))
        }
        for userId in request.userIds ?? [] { add(users.find(userId: userId)) }
        for regId in request.regIds ?? [] { add(users.find(regId: regId)) }
        return .identities(Identities(cookie: request.cookie, identities: found))
    }

    func userElement(_ user: UserRecord) -> User {
        User(uri: user.uri, regId: user.regId, userId: user.userId)
    }

    func listAll(_ request: RequestListAll, user: Int64, session: EngineSession, batch: Batch) throws {
        let cookie = request.cookie
        switch request.type {
        case .global:
            for chunk in globalElements(of: session).chunked(Engine.chunkSize) {
                batch.emit(.listChunk(.global(ListChunkGlobal(cookie: cookie, elements: chunk))), to: session)
            }
        case .user:
            for chunk in visibleUsers(of: user).map(userElement).chunked(Engine.chunkSize) {
                batch.emit(.listChunk(.user(ListChunkUser(cookie: cookie, elements: chunk))), to: session)
            }
        case .chat, .chatParticipant, .typing:
            break
        case .chatMessage:
            throw ProtocolError.invalid("'type' chatMessage cannot be listed whole: use requestListMatching or requestListChanges")
        }
        batch.emit(.listAll(ListAll(type: request.type, cookie: cookie)), to: session)
    }

    func listElements(_ request: RequestListElements, user: Int64, session: EngineSession, batch: Batch) {
        switch request {
        case .global(let request):
            let all = globalElements(of: session)
            var found: [Global] = []
            var missing: [GlobalKey] = []
            for key in request.elements {
                if let element = all.first(where: { $0.name == key.name }) { found.append(element) } else { missing.append(key) }
            }
            for chunk in found.chunked(Engine.chunkSize) {
                batch.emit(.listChunk(.global(ListChunkGlobal(cookie: request.cookie, elements: chunk))), to: session)
            }
            batch.emit(.listElements(.global(ListElementsGlobal(cookie: request.cookie, missing: missing.isEmpty ? nil : missing))), to: session)
        case .user(let request):
            var found: [User] = []
            var missing: [UserKey] = []
            for key in request.elements {
                if let record = users.find(uri: key.uri) { found.append(userElement(record)) } else { missing.append(key) }
            }
            for chunk in found.chunked(Engine.chunkSize) {
                batch.emit(.listChunk(.user(ListChunkUser(cookie: request.cookie, elements: chunk))), to: session)
            }
            batch.emit(.listElements(.user(ListElementsUser(cookie: request.cookie, missing: missing.isEmpty ? nil : missing))), to: session)
        case .chat(let request):
            batch.emit(.listElements(.chat(ListElementsChat(cookie: request.cookie, missing: request.elements))), to: session)
        case .chatParticipant(let request):
            batch.emit(.listElements(.chatParticipant(ListElementsChatParticipant(cookie: request.cookie, missing: request.elements))), to: session)
        case .chatMessage(let request):
            batch.emit(.listElements(.chatMessage(ListElementsChatMessage(cookie: request.cookie, missing: request.elements))), to: session)
        case .typing(let request):
            batch.emit(.listElements(.typing(ListElementsTyping(cookie: request.cookie, missing: request.elements))), to: session)
        }
    }
}

extension Array {
    /// Consecutive pieces of at most `size` elements.
    func chunked(_ size: Int) -> [[Element]] {
        stride(from: 0, to: count, by: size).map { Array(self[$0..<Swift.min($0 + size, count)]) }
    }
}
