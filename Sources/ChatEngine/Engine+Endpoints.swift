import ChatProtocol
import Storage

/// An endpoint a user registered (engine thread only).
final class EndpointRecord {
    let id: Int64
    let user: Int64
    var description: String
    var nickname: String
    var isLegacyDelegate: Bool
    let ordinal: Int64
    /// `endpointUpdate`'s `pushToken` (nil: none).
    var pushToken: String?

    init(id: Int64, user: Int64, description: String, nickname: String, isLegacyDelegate: Bool, ordinal: Int64) {
        self.id = id
        self.user = user
        self.description = description
        self.nickname = nickname
        self.isLegacyDelegate = isLegacyDelegate
        self.ordinal = ordinal
    }

    convenience init(_ row: EndpointRow) {
        self.init(
            id: row.id, user: row.user, description: row.description, nickname: row.nickname, isLegacyDelegate: row.isLegacyDelegate,
            ordinal: row.ordinal)
        pushToken = row.pushToken
    }

    var row: EndpointRow {
        var row = EndpointRow(id: id, user: user, description: description, nickname: nickname, isLegacyDelegate: isLegacyDelegate, ordinal: ordinal)
        row.pushToken = pushToken
        return row
    }
}

/// Setup and endpoints (§3): every session is an endpoint of its user. An
/// endpoint that `endpointUpdate` named is registered (stored, kept across reconnects,
/// until `endpointDeregister`); a session that never names itself is an endpoint only
/// while it is connected. A user has at most `maxEndpoints` of both kinds together: a
/// session whose token is accepted when there is no room stays in setupState `Full`
/// until one is deregistered and it sends `setupRetry`.
extension Engine {
    // MARK: setting a session up

    /// Gives a session whose token was accepted for `user` its endpoint and sets it up,
    /// or leaves it in setupState Full. True when it is set up.
    func setUp(_ session: EngineSession, as user: Int64, batch: Batch) -> Bool {
        let pending = session.pendingEndpoint
        let endpoint: Int64
        if let claimed = pending?.endpointId, let registered = directory.endpoints[claimed], registered.user == user {
            // A reconnect: the session is that registered endpoint again.
            rename(registered, as: pending!, batch: batch)
            endpoint = registered.id
        } else {
            guard endpointCount(of: user) < quotas.limits.endpointsPerUser else { return false }
            endpoint = newEndpointId()
            if let pending { register(endpoint, of: user, as: pending, batch: batch) }
        }
        session.pendingEndpoint = nil
        session.endpoint = endpoint
        session.user = user
        directory.sessionsByUser[user, default: []].append(session)
        sessionsChanged(of: user)
        return true
    }

    /// How many endpoints `user` has now: registered ones, and connected sessions that
    /// have not registered.
    func endpointCount(of user: Int64) -> Int {
        (directory.endpointsOfUser[user]?.count ?? 0) + unregisteredSessions(of: user).count
    }

    /// The user's connected sessions that are endpoints only while connected.
    private func unregisteredSessions(of user: Int64) -> [EngineSession] {
        sessions(of: user).filter { session in session.endpoint.map { directory.endpoints[$0] == nil } ?? false }
    }

    /// A random positive 63-bit id no registered endpoint has (two sessions drawing the
    /// same one is as likely as guessing a 63-bit number).
    private func newEndpointId() -> Int64 {
        var generator = SystemRandomNumberGenerator()
        while true {
            let id = Int64.random(in: 1...Int64.max, using: &generator)
            if directory.endpoints[id] == nil { return id }
        }
    }

    private func register(_ id: Int64, of user: Int64, as update: EndpointUpdate, batch: Batch) {
        directory.lastEndpointOrdinal += 1
        let record = EndpointRecord(
            id: id, user: user, description: update.description, nickname: update.nickname ?? "",
            isLegacyDelegate: update.isLegacyDelegate ?? false, ordinal: directory.lastEndpointOrdinal)
        record.pushToken = update.pushToken.flatMap { $0.isEmpty ? nil : $0 }
        directory.endpoints[id] = record
        directory.endpointsOfUser[user, default: []].append(id)
        batch.changed(record)
    }

    private func rename(_ endpoint: EndpointRecord, as update: EndpointUpdate, batch: Batch) {
        endpoint.description = update.description
        if let nickname = update.nickname { endpoint.nickname = nickname }
        if let isLegacyDelegate = update.isLegacyDelegate { endpoint.isLegacyDelegate = isLegacyDelegate }
        if let pushToken = update.pushToken { endpoint.pushToken = pushToken.isEmpty ? nil : pushToken }
        batch.changed(endpoint)
    }

    /// The session is set up: it sees what its user sees, and what waited for one of its
    /// endpoints is delivered.
    func finishSetUp(_ session: EngineSession, user: Int64, batch: Batch) {
        bringUpToDate(session, user: user, batch: batch)
        do {
            try deliverPending(to: user, batch: batch)
        } catch {
            // Marks the next authentication moves again: nothing is lost by waiting.
            logger.warning("deliveries were not marked: the store could not be read", metadata: ["error": "\(error)"])
        }
    }

    /// `NotAuthenticated` for a request a session that is not set up may not make.
    func notSetUp(_ session: EngineSession) -> ProtocolError {
        guard let identity = session.identity else {
            return ProtocolError(.notAuthenticated, "the session is not authenticated: send authToken first")
        }
        let name = directory.users[identity]?.userId ?? String(identity)
        return ProtocolError(
            .notAuthenticated,
            "setup is not complete (setupState Full): '\(name)' already has the most endpoints allowed "
                + "(\(quotas.limits.endpointsPerUser), --max-endpoints); deregister one (endpointsGet, endpointDeregister), then send setupRetry")
    }

    // MARK: requests

    func endpointUpdate(_ request: EndpointUpdate, session: EngineSession, batch: Batch) {
        func answer(_ result: EndpointResult) {
            batch.emit(.endpointUpdateResult(EndpointUpdateResult(cookie: request.cookie, result: result)), to: session)
        }
        guard let user = session.user, let own = session.endpoint else {
            // Not set up yet: it describes the endpoint the session will be.
            batch.willChangeSetup(of: session)
            session.pendingEndpoint = request
            answer(.success)
            return
        }
        let target = request.endpointId ?? own
        if let registered = directory.endpoints[target], registered.user == user {
            if target != own && directory.endpoints[own] == nil {
                // A session that never registered names a registered endpoint: it is that
                // endpoint again (a reconnect that authenticated first).
                batch.willChangeSetup(of: session)
                session.endpoint = target
                emitGlobals(["endpointId"], to: session, batch: batch)
            }
            rename(registered, as: request, batch: batch)
            answer(.success)
        } else if unregisteredSessions(of: user).contains(where: { $0.endpoint == target }) {
            // An endpoint that lasted only while connected is registered from now on.
            register(target, of: user, as: request, batch: batch)
            answer(.success)
        } else {
            answer(.failure)
        }
    }

    func endpointsGet(_ request: EndpointsGet, session: EngineSession) throws -> Event {
        guard let user = session.identity else { throw notSetUp(session) }
        var list: [RegisteredEndpoint] = []
        for id in directory.endpointsOfUser[user] ?? [] {
            guard let endpoint = directory.endpoints[id] else { continue }
            list.append(
                RegisteredEndpoint(
                    endpointId: id, description: endpoint.description, nickname: endpoint.nickname,
                    isCurrent: id == session.endpoint))
        }
        for other in unregisteredSessions(of: user).sorted(by: { $0.id < $1.id }) {
            guard let id = other.endpoint else { continue }
            list.append(RegisteredEndpoint(endpointId: id, description: "", nickname: "", isCurrent: id == session.endpoint))
        }
        return .endpoints(Endpoints(cookie: request.cookie, result: .success, registeredEndpoints: list, maxEndpoints: Int64(quotas.limits.endpointsPerUser)))
    }

    func endpointDeregister(_ request: EndpointDeregister, session: EngineSession, batch: Batch) throws {
        guard let user = session.identity else { throw notSetUp(session) }
        let target = request.endpointId
        let holders = sessions(of: user).filter { $0.endpoint == target }
        if let registered = directory.endpoints[target], registered.user == user {
            directory.endpoints[target] = nil
            directory.endpointsOfUser[user]?.removeAll { $0 == target }
            if directory.endpointsOfUser[user]?.isEmpty == true { directory.endpointsOfUser[user] = nil }
            batch.removed(registered)
        } else if holders.isEmpty {
            batch.emit(.endpointDeregisterResult(EndpointDeregisterResult(cookie: request.cookie, result: .failure)), to: session)
            return
        }
        batch.emit(.endpointDeregisterResult(EndpointDeregisterResult(cookie: request.cookie, result: .success)), to: session)
        // Every session that is this endpoint is told, stops receiving the user's events
        // at once, and is closed once that is written.
        for holder in holders {
            batch.emit(.endpointDeregistered(EndpointDeregistered()), to: holder)
            batch.willChangeSetup(of: holder)
            unregister(holder)
            holder.setup = EngineSession.Setup()
            batch.close(holder)
        }
    }

    /// `setupRetry`: a session in setupState Full tries again to get an endpoint.
    func retrySetUp(_ session: EngineSession, batch: Batch) {
        guard session.user == nil, let identity = session.identity else { return }
        batch.willChangeSetup(of: session)
        if setUp(session, as: identity, batch: batch) {
            emitGlobals(["setupState", "localUri", "localRegId", "endpointId"], to: session, batch: batch)
            finishSetUp(session, user: identity, batch: batch)
        } else {
            // Still full: said again, so that a client waiting for a change hears it.
            emitGlobals(["setupState"], to: session, batch: batch)
        }
    }

    /// A `listChange` on `global` with these of the session's globals.
    func emitGlobals(_ names: [String], to session: EngineSession, batch: Batch) {
        let all = globalElements(of: session)
        let elements = names.compactMap { name in all.first { $0.name == name } }.map { GlobalChange(name: $0.name, value: .value($0.value)) }
        batch.emit(.listChange(.global(ListChangeGlobal(elements: elements))), to: session)
    }

    /// Before a session is set up it may list (§3): `global` shows
    /// authTokenState and setupState, every other list is empty for it and is brought up
    /// to date once it is set up. It may make setup requests, and once its token was
    /// accepted (setupState Full) manage its user's endpoints. False: the request is not
    /// served before setup.
    func serveBeforeSetUp(_ request: Request, session: EngineSession, line: Int, batch: Batch) throws -> Bool {
        switch request {
        case .requestListAll(let request):
            if request.type != .global && request.type != .chatMessage { session.listedEarly.insert(request.type) }
            try listAll(request, user: Engine.nobody, session: session, line: line, batch: batch)
        case .requestListElements(let request):
            switch request {
            case .global: break
            case .user: session.listedEarly.insert(.user)
            case .chat: session.listedEarly.insert(.chat)
            case .chatParticipant: session.listedEarly.insert(.chatParticipant)
            case .chatMessage: break
            case .typing: session.listedEarly.insert(.typing)
            }
            listElements(request, user: Engine.nobody, session: session, batch: batch)
        case .requestListMatching(.chatParticipant(let request)):
            session.listedEarly.insert(.chatParticipant)
            answer(.listMatching(.chatParticipant(ListMatchingChatParticipant(cookie: request.cookie))), [ChatParticipant](), to: session, batch: batch) {
                .chatParticipant(ListChunkChatParticipant(cookie: request.cookie, elements: $0, last: $1))
            }
        case .requestListMatching(.chatMessage(let request)):
            answer(.listMatching(.chatMessage(ListMatchingChatMessage(cookie: request.cookie))), [ChatMessage](), to: session, batch: batch) {
                .chatMessage(ListChunkChatMessage(cookie: request.cookie, elements: $0, last: $1))
            }
        case .requestListMatching(let request):
            try listMatching(request, user: Engine.nobody, session: session, batch: batch)
        case .syncStart, .retryServerRequests:
            // Key synchronisation and BlackBerry's servers: nothing to do here.
            break
        case .setupRetry:
            retrySetUp(session, batch: batch)
        case .endpointUpdate(let request):
            endpointUpdate(request, session: session, batch: batch)
        case .endpointsGet(let request):
            batch.emit(try endpointsGet(request, session: session), to: session)
        case .endpointDeregister(let request):
            try endpointDeregister(request, session: session, batch: batch)
        default:
            return false
        }
        return true
    }
}
