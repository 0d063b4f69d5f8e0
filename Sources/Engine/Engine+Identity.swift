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
            batch.authenticatedSession(session)
        }
        if announce {
            let elements = globalElements(of: session).map { GlobalChange(name: $0.name, value: .value($0.value)) }
            batch.emit(.listChange(.global(ListChangeGlobal(elements: elements))), to: session)
        }
        if let user = session.user { deliverPending(to: user, batch: batch) }
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
        var numbers: Set<Int64> = [user]
        for number in chatsOfUser[user] ?? [] {
            for member in chats[number]?.activeMembers ?? [] { numbers.insert(member.user) }
        }
        return numbers.sorted().compactMap { users[$0] }
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
}

extension Array {
    /// Consecutive pieces of at most `size` elements.
    func chunked(_ size: Int) -> [[Element]] {
        stride(from: 0, to: count, by: size).map { Array(self[$0..<Swift.min($0 + size, count)]) }
    }
}
