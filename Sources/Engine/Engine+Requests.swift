import Protocol

extension Engine {
    /// Routes an authenticated request to its handler.
    func handle(_ request: Request, user: Int64, session: EngineSession, batch: Batch) throws {
        switch request {
        case .authToken:
            throw ProtocolError(.internal, "authToken is handled by the session")
        case .identitiesGet(let request):
            batch.emit(identities(request), to: session)
        case .requestListAll(let request):
            try listAll(request, user: user, session: session, batch: batch)
        case .requestListElements(let request):
            listElements(request, user: user, session: session, batch: batch)
        default:
            throw ProtocolError(.internal, "'\(request.name)' is not carried out by this version of chatcore yet")
        }
    }
}
