import Protocol
import Store

/// The outcome of one batch: the store writes, the events per session in order, and
/// what may only happen once the writes are durable.
///
/// Every work item of the batch is numbered, and every event is tagged with the item
/// that caused it. When a commit fails, `failAll` keeps only what is durable: the events
/// of items committed earlier in the batch (`commitSoFar`) and answers that never
/// depended on the store (decode failures); each request that was not committed gets
/// exactly one `Internal` answer in its place.
final class Batch {
    var store = StoreBatch()
    /// Records changed by the batch, written whole at commit (each once).
    private var dirtyChats: [Int64: ChatRecord] = [:]
    private var dirtyMembers: [RowKey: (chat: Int64, member: MemberRecord)] = [:]
    private var dirtyMessages: [RowKey: (chat: Int64, message: MessageRecord)] = [:]
    private var dirtyPrivate: [PrivateKey: (chat: Int64, message: MessageRecord, user: Int64)] = [:]
    /// Text for the search index, handed over once committed.
    var searchAdds: [SearchEntry] = []
    var searchRemovals: [Int64] = []

    /// What a work item is, for answering it when its commit fails.
    enum Item {
        /// A request (or authToken): answered with Internal when not committed.
        case request(name: String, cookie: String?, line: Int)
        /// Answers made without the store (decode failures): kept whatever happens.
        case answered
        /// Work without an answer (typing expiry, a stored attachment, a close).
        case `internal`
    }

    private enum Entry {
        case begin(Int)
        case event(Event, item: Int)
    }

    private var items: [Item] = []
    /// Items below this number are durable.
    private var committedItems = 0
    /// Sessions authenticated by an item (to be unauthenticated if it is not committed).
    private var authenticated: [(item: Int, session: EngineSession)] = []
    /// Done after the commit that covers them, in order; dropped if it fails.
    private var afterCommit: [(item: Int, action: () -> Void)] = []
    /// Done if the commit covering them fails (closing files a request opened).
    private var afterFailure: [() -> Void] = []

    private var outputs: [ObjectIdentifier: (session: EngineSession, entries: [Entry])] = [:]
    private var order: [ObjectIdentifier] = []
    private var finished: [ObjectIdentifier: Int] = [:]

    private var current: Int { items.count - 1 }

    func takeSearchAdds() -> [SearchEntry] {
        defer { searchAdds = [] }
        return searchAdds
    }

    func takeSearchRemovals() -> [Int64] {
        defer { searchRemovals = [] }
        return searchRemovals
    }

    struct RowKey: Hashable {
        let chat: Int64
        let item: Int64
    }

    struct PrivateKey: Hashable {
        let chat: Int64
        let message: Int64
        let user: Int64
    }

    // MARK: items and their effects

    /// Starts the next work item; what is emitted from now on belongs to it.
    func begin(_ item: Item, session: EngineSession?) {
        items.append(item)
        if let session { append(.begin(current), to: session) }
    }

    /// The current item made `session` authenticated.
    func authenticatedSession(_ session: EngineSession) {
        authenticated.append((current, session))
    }

    /// `action` runs once what the current item changed is durable (removing a file the
    /// change releases, starting work that needs the change to exist).
    func whenCommitted(_ action: @escaping () -> Void) {
        afterCommit.append((current, action))
    }

    /// `action` runs if the current item's changes are not committed.
    func ifNotCommitted(_ action: @escaping () -> Void) {
        afterFailure.append(action)
    }

    // MARK: store rows

    func changed(_ chat: ChatRecord) { dirtyChats[chat.number] = chat }

    func changed(_ member: MemberRecord, of chat: ChatRecord) {
        dirtyMembers[RowKey(chat: chat.number, item: member.user)] = (chat.number, member)
    }

    func changed(_ message: MessageRecord, of chat: ChatRecord) {
        dirtyMessages[RowKey(chat: chat.number, item: message.id)] = (chat.number, message)
    }

    func changedPrivately(_ message: MessageRecord, of chat: ChatRecord, for user: Int64) {
        dirtyPrivate[PrivateKey(chat: chat.number, message: message.id, user: user)] = (chat.number, message, user)
    }

    /// Turns the changed records into the rows of the store batch.
    func collectRows() {
        store.chats = dirtyChats.values.map(\.row)
        store.members = dirtyMembers.values.map { $0.member.row(chat: $0.chat) }
        store.messages = dirtyMessages.values.map { $0.message.row(chat: $0.chat) }
        store.messageUsers = dirtyPrivate.values.map { entry in
            let state = entry.message.privateStates[entry.user] ?? PrivateState()
            var row = MessageUserRow(chat: entry.chat, id: entry.message.id, user: entry.user, localData: state.localData?.json, isDeleted: state.isDeleted)
            row.thumbDetached = state.thumbDetached
            row.fileDownloaded = state.fileState == .done
            return row
        }
    }

    /// Everything so far is durable: later commits of this batch need not write it
    /// again, and what waited for it is done now. The current item stays uncommitted:
    /// it may change more after this point.
    func committed() {
        store = StoreBatch()
        dirtyChats = [:]
        dirtyMembers = [:]
        dirtyMessages = [:]
        dirtyPrivate = [:]
        committedItems = max(committedItems, current)
        let actions = afterCommit
        afterCommit = []
        afterFailure = []
        for entry in actions { entry.action() }
    }

    // MARK: events

    func emit(_ event: Event, to session: EngineSession) {
        append(.event(event, item: current), to: session)
    }

    private func append(_ entry: Entry, to session: EngineSession) {
        let key = ObjectIdentifier(session)
        if outputs[key] == nil {
            outputs[key] = (session, [entry])
            order.append(key)
        } else {
            outputs[key]!.entries.append(entry)
        }
    }

    func finish(_ session: EngineSession) {
        let key = ObjectIdentifier(session)
        if outputs[key] == nil {
            outputs[key] = (session, [])
            order.append(key)
        }
        finished[key, default: 0] += 1
    }

    /// The commit failed: keeps only what is durable or never depended on the store,
    /// answers every uncommitted request once with `Internal`, and returns the sessions
    /// the uncommitted items authenticated (the caller unauthenticates them).
    func failAll(reason: String) -> [EngineSession] {
        let durable = committedItems
        for key in order {
            var kept: [Entry] = []
            for entry in outputs[key]!.entries {
                switch entry {
                case .begin(let item):
                    guard item >= durable, case .request(let name, let cookie, let line) = items[item] else { continue }
                    kept.append(.event(ProtocolError(.internal, reason).requestFailed(request: name, cookie: cookie, line: line), item: item))
                case .event(_, let item):
                    if item < durable { kept.append(entry); continue }
                    if case .answered = items[item] { kept.append(entry) }
                }
            }
            outputs[key]!.entries = kept
        }
        // What the uncommitted rows would have released stays; what their requests
        // opened is let go.
        afterCommit = []
        let failures = afterFailure
        afterFailure = []
        for action in failures { action() }
        store = StoreBatch()
        searchAdds = []
        searchRemovals = []
        return authenticated.filter { $0.item >= durable }.map(\.session)
    }

    func deliver() {
        for key in order {
            let (session, entries) = outputs[key]!
            guard let sink = session.sink else { continue }
            if session.isOpen {
                var events: [Event] = []
                events.reserveCapacity(entries.count)
                for case .event(let event, _) in entries { events.append(event) }
                if !events.isEmpty { sink.deliver(events) }
            }
            if let count = finished[key] { sink.engineFinished(count) }
        }
        outputs = [:]
        order = []
        finished = [:]
    }
}
