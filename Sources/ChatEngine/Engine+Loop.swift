import Attachments
import ChatMetrics
import ChatProtocol
import Foundation
import Logging
import Storage
import Synchronization
import Threads

// The engine thread's loop: batches of work taken from the inbox, each item decided in
// arrival order, parked work let go of when its session's output drained.

extension Engine {
    func run() {
        life.owner.store(EngineLife.currentThread, ordering: .relaxed)
        var stopping = false
        while !stopping {
            // While sessions wait for their clients to read, look again every 20 ms.
            let work = life.inbox.take(limit: commits.batchLimitNow, waitingAtMost: outputs.isAnyParked ? 0.02 : nil)
            if followsOthers {
                // A wake-up to follow, or a commit done, asks nobody anything.
                followOthers(
                    thoroughly: work.contains { item in
                        switch item {
                        case .othersActed, .committed: false
                        default: true
                        }
                    })
            }
            commits.batchNumber += 1
            let batch = Batch(cache: cache, number: commits.batchNumber)
            batch.inboxWork = work
            var barriers: [@Sendable () -> Void] = []
            takeUnparkedWork(batch: batch)
            var answeredOutside = false
            var taken = 0
            for (index, item) in work.enumerated() {
                if batch.builtBytes > Engine.batchOutputLimit {
                    life.inbox.putBack(work[index...])
                    break
                }
                switch item {
                case .barrier(let body):
                    barriers.append(body)
                case .stop:
                    stopping = true
                case .committed, .othersActed:
                    continue
                case .searchFound:
                    answeredOutside = true
                    take(item, batch: batch, inboxIndex: index)
                default:
                    take(item, batch: batch, inboxIndex: index)
                }
                taken += 1
            }
            if taken > 0 { ServiceMetrics.batchSize.record(taken) }
            // The sessions whose answers came back go on at once, not at the next look.
            if answeredOutside { takeUnparkedWork(batch: batch) }
            // Before its events reach anyone, the others know who is connected here now.
            if followsOthers { announcePresence() }
            // A batch decided again (its commit conflicted) is taken again, `stop` with it.
            if end(batch, barriers: barriers, stopping: stopping) { stopping = false }
            while !commits.decidedWhileWaiting.isEmpty {
                if end(commits.decidedWhileWaiting.removeFirst(), barriers: [], stopping: false) { stopping = false }
            }
            cache.trim()
        }
        // The thread object holds this engine through its closure: let go of it.
        life.thread = nil
        life.ended.change { $0 = true }
    }

    /// Decides one work item into the batch, or parks it behind the session's earlier
    /// work while the session's client has too much output to take. `inboxIndex`: where it
    /// is in `batch.inboxWork` (nil: it comes from elsewhere).
    func take(_ item: Work, batch: Batch, inboxIndex: Int? = nil) {
        if let session = item.session, session.isOpen {
            if outputs.isParked(session) {
                outputs.park(item, of: session)
                return
            }
            if case .request = item, !isShuttingDown,
                batch.pendingOutput(for: session) + commits.inFlight.reduce(0, { $0 + $1.batch.builtOutput(for: session) }) > outputs.mark
            {
                outputs.park(item, of: session)
                return
            }
        }
        // A commit that finished is delivered at once, not after everything this batch
        // takes (under a flood that would hold each batch's events for the next's decisions).
        settleFinished()
        // Between work items the cache gives back what it holds beyond its budget (never
        // what this batch changed): a request sees one record per message while it runs.
        cache.trim()
        if let inboxIndex {
            batch.took(inboxIndex: inboxIndex)
        } else {
            batch.took(item)
        }
        switch item {
        case .request(let request, let line, let session):
            let atOnce = session.isOpen && !isShuttingDown && answersAtOnce(request, session: session, batch: batch)
            batch.finish(session)
            guard session.isOpen else { return }
            if isShuttingDown {
                batch.begin(.answered, session: session)
                batch.emit(
                    ProtocolError(.internal, "the service is shutting down: the request was not started")
                        .requestFailed(request: request.name, cookie: request.cookie, line: line), to: session)
                return
            }
            let changed = atOnce ? batch.changeMark : 0
            batch.begin(.request(name: request.name, cookie: request.cookie, line: line), session: session)
            process(request, line: line, session: session, batch: batch)
            if atOnce && batch.changeMark == changed { batch.deliverAtOnce(session) }
        case .authenticate(let userId, let cookie, let line, let announce, let session):
            batch.finish(session)
            guard session.isOpen else { return }
            batch.begin(.request(name: "authToken", cookie: cookie, line: line), session: session)
            authenticate(userId: userId, cookie: cookie, line: line, announce: announce, session: session, batch: batch)
        case .passthrough(let events, let session):
            batch.finish(session)
            batch.begin(.answered, session: session)
            for event in events { batch.emit(event, to: session) }
        case .tokenRejected(let error, let session):
            batch.finish(session)
            batch.begin(.answered, session: session)
            tokenRejected(error, session: session, batch: batch)
        case .tokenExpired(let session):
            batch.finish(session)
            guard session.isOpen else { return }
            batch.begin(.answered, session: session)
            tokenExpired(session: session, batch: batch)
        case .close(let session):
            batch.begin(.internal, session: nil)
            detach(session)
        case .tick:
            batch.begin(.internal, session: nil)
            timed.tickAt = nil
            expireTyping(batch: batch)
            endPins(batch: batch)
            endMutes(batch: batch)
            showPresence(batch: batch)
        case .continueList(let list):
            listContinues(list, batch: batch)
        case .continueRecall(let recall):
            recallContinues(recall, batch: batch)
        case .deliverDue:
            batch.begin(.internal, session: nil)
            do {
                try deliverDue(batch: batch)
            } catch {
                logger.warning("deliveries were not marked: the store could not be read", metadata: ["error": "\(error)"])
            }
        case .attachmentsStored(let chat, let id, let thumb, let file, let error):
            batch.begin(.internal, session: nil)
            attachmentsStored(chat: chat, id: id, thumb: thumb, file: file, error: error, batch: batch)
        case .searchFound(let request, let line, let chatIds, let user, let hits, let session):
            outsideAnswered(session)
            quotas.endSearch(by: user)
            guard session.isOpen else { return }
            searchFound(request, line: line, chatIds: chatIds, user: user, hits: hits, session: session, batch: batch)
        case .deliverFollowed(let numbers):
            batch.begin(.internal, session: nil)
            deliverFollowed(numbers, batch: batch)
        case .composeNotifications(let rows, let previewLength, let reply):
            reply(composeNow(rows, previewLength: previewLength))
        case .barrier, .stop, .committed, .othersActed:
            break
        }
    }

    /// Whether `request` is a read answered as soon as it is decided, not once the
    /// batch it is in and those before it are committed: reads of messages (`window`s,
    /// thread children, messages by key) of chats that neither this batch nor one being
    /// committed changed, by a session that has nothing in them (its answers keep their
    /// order), while no user or endpoint is being made. It shows only what is durable.
    /// Beside a session sending without pause, every read waited for the commit of the
    /// sends decided before it and with it (on the 10M-message store, with 20 readers,
    /// window p50 118–163 ms: docs/benchmarks.md). If deciding it changes anything after
    /// all, it is answered with its batch (`Batch.changeMark`). Not while other nodes
    /// decide: what they committed is read before a batch that answers requests, not
    /// before each read.
    func answersAtOnce(_ request: Request, session: EngineSession, batch: Batch) -> Bool {
        let chats: [String]
        switch request {
        case .requestListMatching(.chatMessage(let read)): chats = [read.criteria.chatId]
        case .requestListElements(.chatMessage(let read)): chats = read.elements.map(\.chatId)
        default: return false
        }
        guard session.user != nil, !followsOthers, commits.failed == nil, commits.brokenStore == nil,
            !batch.holdsOutput(for: session), !batch.changedUsersOrEndpoints
        else { return false }
        // A chat that is not there (or misspelled) is answered as any other.
        let numbers = chats.compactMap { Int64($0) }
        if numbers.contains(where: batch.hasUncommittedChanges(in:)) { return false }
        // The batches not committed yet: in flight, and reads to end after this batch.
        let pending = commits.inFlight.lazy.map(\.batch) + commits.decidedWhileWaiting
        return !pending.contains { other in
            other.holdsOutput(for: session) || other.changedUsersOrEndpoints || numbers.contains(where: other.hasUncommittedChanges(in:))
        }
    }

    /// While `batch` waits for `commit`, the one before it (`end`), answers the reads in the
    /// inbox that `answersAtOnce` allows, each the first work of its session there, until
    /// the commit is done: each decided in a batch of its own and, if it changed nothing,
    /// delivered at once. The engine waited for the commit idle, and reads came only after
    /// it and the batch being decided (on the 10M-message store beside a session sending
    /// without pause, a commit of about a thousand sends took tens of milliseconds). It
    /// looks at the inbox every `readLookInterval`, each item once: woken by every item
    /// put in, the engine thread would be woken for each of a pipelining sender's.
    func answerReadsWhileWaiting(for commit: Commit, before batch: Batch) {
        guard !isShuttingDown else { return }
        var examined = 0
        var blocked: Set<ObjectIdentifier> = []
        while !commit.isFinished(waitingAtMost: Engine.readLookInterval) {
            // Under the inbox's lock: nothing here takes another lock.
            let reads = life.inbox.takeOut(examined: &examined, blocked: &blocked, session: { $0.session.map(ObjectIdentifier.init) }) { item in
                guard case .request(let request, _, let session) = item, session.isOpen, !self.outputs.isParked(session) else { return false }
                return self.answersAtOnce(request, session: session, batch: batch)
            }
            var back: [Work] = []
            for case .request(let request, let line, let session) in reads {
                // A client with too much output unread: its read waits for the batch, and is
                // parked there (a standard output's backlog is read under a lock of its
                // own), and so does what it sent after.
                let key = ObjectIdentifier(session)
                guard !blocked.contains(key), (session.sink?.backlog ?? 0) <= outputs.mark else {
                    blocked.insert(key)
                    back.append(.request(request, line: line, session: session))
                    continue
                }
                let read = Batch(cache: cache, number: commits.batchNumber)
                read.took(Work.request(request, line: line, session: session))
                read.finish(session)
                read.begin(.request(name: request.name, cookie: request.cookie, line: line), session: session)
                process(request, line: line, session: session, batch: read)
                if read.changeMark == 0 && read.holdsOutputOnly(for: session) {
                    read.deliverAtOnce(session)
                } else {
                    commits.decidedWhileWaiting.append(read)
                    blocked.insert(key)
                }
            }
            // Taken out in their sessions' order: in front of the rest, they keep it.
            if !back.isEmpty {
                life.inbox.putBack(back)
                examined += back.count
            }
        }
    }

    /// Takes the parked work of every session whose client has taken enough of its output
    /// (or that closed, or of everyone when shutting down), in the order it was parked.
    /// Each item stops counting as parked only once it is taken (parked again, or begun):
    /// `drain` may read the count in the middle (a commit that settles runs its barriers),
    /// and work let go of and not yet taken must not look done. It did: a search at the
    /// end of the input, parked behind a large output, was let go of, `drain` saw nothing
    /// left, the session closed, and the search's answer was dropped.
    func takeUnparkedWork(batch: Batch) {
        for item in unparkedWork() {
            take(item, batch: batch)
            outputs.taken(1)
            life.settle()
        }
    }

    /// The parked work that `takeUnparkedWork` takes, still counted as parked; with
    /// `whateverTheBacklog`, that of every session not waiting for an answer from outside
    /// (`redo`).
    func unparkedWork(whateverTheBacklog: Bool = false) -> [Work] {
        outputs.release(everyone: whateverTheBacklog || isShuttingDown)
    }

    func process(_ request: Request, line: Int, session: EngineSession, batch: Batch) {
        do {
            if let brokenStore = commits.brokenStore {
                throw ProtocolError(.internal, "the store failed and the service is stopping: \(brokenStore)")
            }
            guard let user = session.user else {
                if try serveBeforeSetUp(request, session: session, line: line, batch: batch) { return }
                throw notSetUp(session)
            }
            try handle(request, user: user, session: session, line: line, batch: batch)
        } catch {
            refuse(request.name, cookie: request.cookie, line: line, with: error, session: session, batch: batch)
        }
    }

    /// The `requestFailed` answer to a request that threw `error` (Internal when it is not
    /// a protocol error).
    func refuse(_ name: String, cookie: String?, line: Int, with error: Error, session: EngineSession, batch: Batch) {
        let failure = error as? ProtocolError ?? ProtocolError(.internal, "\(error)")
        batch.emit(failure.requestFailed(request: name, cookie: cookie, line: line), to: session)
    }

    /// A request answered a page per batch goes on with `next` in a later batch, once this
    /// one is committed; the session's later requests wait for it (`resume`). A page whose
    /// commit fails ends it, and they go on.
    func continueLater(_ next: Work, for session: EngineSession, batch: Batch) {
        awaitOutside(session)
        batch.whenCommitted { [self] in put(next) }
        batch.ifNotCommitted { [self] in outsideAnswered(session) }
    }

    /// The next page of a request `continueLater` put off, as part of that request
    /// (`name`, `cookie`, `line`); nothing when its session has closed since.
    func resume(_ name: String, cookie: String?, line: Int, session: EngineSession, batch: Batch, page: () throws -> Void) {
        outsideAnswered(session)
        guard session.isOpen else { return }
        batch.begin(.request(name: name, cookie: cookie, line: line), session: session)
        do {
            try page()
        } catch {
            refuse(name, cookie: cookie, line: line, with: error, session: session, batch: batch)
        }
    }

    func detach(_ session: EngineSession) {
        if session.isOpen { ServiceMetrics.sessions.decrement() }
        session.isOpen = false
        unregister(session)
    }

    /// The session no longer receives its user's events.
    func unregister(_ session: EngineSession) {
        guard let user = session.user else { return }
        directory.sessionsByUser[user]?.removeAll { $0 === session }
        if directory.sessionsByUser[user]?.isEmpty == true { directory.sessionsByUser[user] = nil }
        sessionsChanged(of: user)
    }
}
