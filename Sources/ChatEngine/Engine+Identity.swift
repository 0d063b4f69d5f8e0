import ChatProtocol
import Storage

/// Authentication, identities, and the `global` and `user` lists (docs/protocol.md §3, §4).
extension Engine {
    /// A token for `userId` was accepted (or the session was started trusted as it). The
    /// session is then set up on an endpoint of the user, or waits in setupState Full
    /// when the user has no endpoint free. With `announce` it receives its `global`
    /// list as it now is.
    func authenticate(userId: String, cookie: String?, line: Int, announce: Bool, session: EngineSession, batch: Batch) {
        if let current = session.identity, let currentUser = directory.users[current] {
            guard sameBytes(currentUser.userId, userId) else {
                batch.emit(.setupError(SetupError(error: .alreadyAuthenticated, cookie: cookie)), to: session)
                return
            }
        } else {
            if directory.users.find(userId: userId) == nil && directory.users.find(regId: RegId.derive(userId)) != nil {
                // Made, it would take a regId another user has: this sign-in fails, not
                // the commit of everyone's.
                batch.emit(
                    ProtocolError.invalid("the user id cannot be used: the regId derived from it is another user's")
                        .requestFailed(request: "authToken", cookie: cookie, line: line), to: session)
                return
            }
            batch.willChangeSetup(of: session)
            session.identity = directory.users.ensure(userId: userId, batch: &batch.store) { newNumber(for: .user, after: $0) }.number
        }
        let user = session.identity!
        session.tokenExpired = false
        var setUpNow = false
        if session.user == nil {
            batch.willChangeSetup(of: session)
            setUpNow = setUp(session, as: user, batch: batch)
        }
        if announce {
            let elements = globalElements(of: session).map { GlobalChange(name: $0.name, value: .value($0.value)) }
            batch.emit(.listChange(.global(ListChangeGlobal(elements: elements))), to: session)
        }
        if setUpNow { finishSetUp(session, user: user, batch: batch) }
    }

    /// A token was refused (the session layer checked it): answered here so that it keeps
    /// its place, and the `authTokenState` of a session no token was accepted for becomes
    /// `Rejected`.
    func tokenRejected(_ error: SetupError, session: EngineSession, batch: Batch) {
        if session.identity == nil {
            session.tokenRejected = true
            let change = GlobalChange(name: "authTokenState", value: .value(.string("Rejected")))
            batch.emit(.listChange(.global(ListChangeGlobal(elements: [change]))), to: session)
        }
        batch.emit(.setupError(error), to: session)
    }

    /// The token of a signed-in session expired: it needs a new one (as bbmcore says when
    /// its token runs out).
    func tokenExpired(session: EngineSession, batch: Batch) {
        guard session.identity != nil, !session.tokenExpired else { return }
        session.tokenExpired = true
        let change = GlobalChange(name: "authTokenState", value: .value(.string("Needed")))
        batch.emit(.listChange(.global(ListChangeGlobal(elements: [change]))), to: session)
    }

    /// The session's `global` list (§3). Before a token is accepted:
    /// authTokenState (`Needed`, or `Rejected` after a refused token) and setupState
    /// `{"state":"NotRequested"}`. Accepted but no endpoint free: authTokenState `Ok`,
    /// setupState `{"state":"Full"}`. Set up: authTokenState `Ok`, setupState
    /// `{"state":"Success"}`, localUri (`bbmpim://user/id/0` once rendered for the
    /// session), localRegId, endpointId.
    func globalElements(of session: EngineSession) -> [Global] {
        func setupState(_ state: String) -> Global {
            Global(name: "setupState", value: .object([("state", .string(state))]))
        }
        guard session.identity != nil else {
            return [Global(name: "authTokenState", value: .string(session.tokenRejected ? "Rejected" : "Needed")), setupState("NotRequested")]
        }
        let tokenState = Global(name: "authTokenState", value: .string(session.tokenExpired ? "Needed" : "Ok"))
        guard let number = session.user, let user = directory.users[number], let endpoint = session.endpoint else {
            return [tokenState, setupState("Full")]
        }
        var globals = [
            tokenState,
            setupState("Success"),
            Global(name: "localUri", value: .string(user.uri)),
            Global(name: "localRegId", value: .string(String(user.regId))),
            Global(name: "endpointId", value: .string(String(endpoint)))
        ]
        // Only once hidden: BBMDS's globals are what they were for everyone else.
        if settings(of: number).presenceHidden { globals.append(Global(name: "presenceHidden", value: .bool(true))) }
        return globals
    }

    /// Lists the session asked for before it was set up were empty for it: now they get
    /// what the user sees, as `listAdd`s.
    func bringUpToDate(_ session: EngineSession, user: Int64, batch: Batch) {
        let listed = session.listedEarly
        session.listedEarly = []
        if listed.contains(.user) {
            let elements = visibleUsers(of: user).map { userElement($0, for: session, viewer: user) }
            if !elements.isEmpty { batch.emit(.listAdd(.user(ListAddUser(elements: elements))), to: session) }
        }
        if listed.contains(.chat) {
            for chunk in chatElements(of: user).chunked(Engine.chunkSize) { batch.emit(.listAdd(.chat(ListAddChat(elements: chunk))), to: session) }
        }
        if listed.contains(.chatParticipant) {
            for chunk in participantElements(of: user).chunked(Engine.chunkSize) {
                batch.emit(.listAdd(.chatParticipant(ListAddChatParticipant(elements: chunk))), to: session)
            }
        }
        if listed.contains(.typing) {
            let elements = typingSeen(by: user)
            if !elements.isEmpty { batch.emit(.listAdd(.typing(ListAddTyping(elements: elements))), to: session) }
        }
    }

    /// The users a user sees in their `user` list: themselves and everyone they share a chat with.
    func visibleUsers(of user: Int64) -> [UserRecord] {
        var numbers: Set<Int64> = [user]
        for number in directory.chatsOfUser[user] ?? [] {
            for member in directory.chats[number]?.activeMembers ?? [] { numbers.insert(member.user) }
        }
        return numbers.sorted().compactMap { directory.users[$0] }
    }

    /// The users the session asked for by id; from then on it may list them (`knows`).
    func identities(_ request: IdentitiesGet, for session: EngineSession) -> Event {
        var found: [Identity] = []
        var seen = Set<Int64>()
        func add(_ user: UserRecord?) {
            guard let user, seen.insert(user.number).inserted else { return }
            found.append(Identity(appUserId: user.userId, regId: user.regId, uri: user.uri))
            session.lookedUp(user.number)
        }
        for userId in request.appUserIds ?? [] { add(directory.users.find(userId: userId)) }
        for regId in request.regIds ?? [] { add(directory.users.find(regId: regId)) }
        return .identities(Identities(cookie: request.cookie, result: "Success", info: found))
    }

    /// Whether `viewer` may see `other` in the `user` list: themselves, anyone they share
    /// or shared a chat with, and anyone their session looked up by id (`identitiesGet`),
    /// as a device's bbmcore knows them. Nobody else: a uri is a number, and trying them
    /// one by one would list every user of the service.
    func knows(_ other: Int64, viewer: Int64, session: EngineSession) -> Bool {
        if other == viewer || session.hasLookedUp(other) { return true }
        for number in directory.chatsOfUser[viewer] ?? [] where directory.chats[number]?.members[other] != nil { return true }
        return false
    }
}

extension Array {
    /// Consecutive pieces of at most `size` elements.
    func chunked(_ size: Int) -> [[Element]] {
        stride(from: 0, to: count, by: size).map { Array(self[$0..<Swift.min($0 + size, count)]) }
    }
}
