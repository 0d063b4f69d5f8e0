import ChatProtocol

extension Engine {
    /// Routes an authenticated request to its handler.
    func handle(_ request: Request, user: Int64, session: EngineSession, line: Int, batch: Batch) throws {
        try quotas.take(1, of: .requests, by: user)
        switch request {
        case .authToken:
            throw ProtocolError(.internal, "authToken is handled by the session")
        case .syncStart, .setupRetry, .retryServerRequests:
            // Setup steps of BBMDS's key synchronisation and servers; setup is complete.
            break
        case .endpointUpdate(let request):
            endpointUpdate(request, session: session, batch: batch)
        case .endpointsGet(let request):
            batch.emit(try endpointsGet(request, session: session), to: session)
        case .endpointDeregister(let request):
            try endpointDeregister(request, session: session, batch: batch)
        case .identitiesGet(let request):
            batch.emit(identities(request, for: session), to: session)
        case .requestListAll(let request):
            try listAll(request, user: user, session: session, line: line, batch: batch)
        case .requestListElements(let request):
            listElements(request, user: user, session: session, batch: batch)
        case .requestListMatching(let request):
            try listMatching(request, user: user, session: session, batch: batch)
        case .requestListChange(.chat(let request)):
            try changeChats(request, user: user, batch: batch)
        case .requestListChange(.chatMessage(let request)):
            try setLocalData(request, user: user, batch: batch)
        case .requestListChanges(let request):
            batch.emit(try listChanges(request, user: user, batch: batch), to: session)
        case .chatStart(let request):
            try start(request, user: user, session: session, batch: batch)
        case .chatInvite(let request):
            try invite(request, user: user, batch: batch)
        case .chatLeave(let request):
            try leave(request, user: user, batch: batch)
        case .participantRemove(let request):
            try remove(request, user: user, batch: batch)
        case .participantPromote(let request):
            try setAdmin(chatId: request.chatId, userUri: request.userUri, admin: true, user: user, batch: batch)
        case .participantDemote(let request):
            try setAdmin(chatId: request.chatId, userUri: request.userUri, admin: false, user: user, batch: batch)
        case .participantMute(let request):
            try mute(request, user: user, batch: batch)
        case .participantBan(let request):
            try ban(request, user: user, batch: batch)
        case .userBlock(let request):
            try block(request, user: user, session: session, batch: batch)
        case .presenceSet(let request):
            try setPresence(request, user: user, session: session, batch: batch)
        case .chatHide(let request):
            try hide(request, user: user, batch: batch)
        case .chatMessageSend(let request):
            try send(request, user: user, session: session, batch: batch)
        case .chatMessageRead(let request):
            try read(request, user: user, batch: batch)
        case .chatMessageStateGet(let request):
            batch.emit(try stateGet(request, user: user), to: session)
        case .chatMessageDelete(let request):
            try deletePrivately(request, user: user, batch: batch)
        case .chatMessageReact(let request):
            try react(request, user: user, batch: batch)
        case .chatMessageReactionsGet(let request):
            batch.emit(try reactions(request, user: user), to: session)
        case .chatMessageMentionsGet(let request):
            batch.emit(try mentions(request, user: user), to: session)
        case .chatMessagePin(let request):
            try pin(request, user: user, batch: batch)
        case .chatMessageDestroy(let request):
            try destroy(request, user: user, session: session, line: line, batch: batch)
        case .chatTyping(let request):
            try quotas.take(1, of: .events, by: user)
            try startTyping(request, user: user, batch: batch)
        case .chatEventSend(let request):
            try quotas.take(1, of: .events, by: user)
            try sendEvent(request, user: user, session: session, batch: batch)
        case .search(let request):
            try search(request, user: user, session: session, line: line, batch: batch)
        case .chatMessageFileDownload(let request):
            try download(request, user: user, batch: batch)
        case .chatMessageDetach(let request):
            try detach(request, user: user, batch: batch)
        }
    }
}
