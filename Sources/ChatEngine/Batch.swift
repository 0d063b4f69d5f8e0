import ChatMetrics
import ChatProtocol
import ChatWire
import Storage

/// The outcome of one batch: the store writes, the events per session in order, and
/// what may only happen once the writes are durable.
///
/// Every work item of the batch is numbered, and every event is tagged with the item
/// that caused it. When a commit fails, `failAll` keeps only what is durable: the events
/// of items committed earlier in the batch (`commitSoFar`) and answers that never
/// depended on the store (decode failures); each request that was not committed gets
/// exactly one `Internal` answer in its place. When a commit conflicts with another
/// node's, `takeBack` keeps only the durable events and hands back the work taken since,
/// to be decided again.
final class Batch {
    var store = StoreBatch()
    /// Text for the search index, handed over once committed.
    var searchAdds: [SearchEntry] = []
    var searchRemovals: [Int64] = []
    /// Notifications for recipients of new messages (`--notify-url`), written with them.
    var notifications: [NotificationRow] = []
    /// The messages changed records are kept in until they are committed.
    let cache: MessageCache
    /// This batch's place in the engine's sequence of batches (its pins in the cache).
    let number: Int

    // The batch's parts (below): what it changed, its items and their effects, the
    // events it built, and the inbox work it took.
    let changes = Changes()
    let effects = Effects()
    let built = Built()
    let inbox = Taken()
    /// Bytes of events built so far.
    var builtBytes: Int { built.builtBytes }
    var inboxWork: [Engine.Work] {
        get { inbox.inboxWork }
        set { inbox.inboxWork = newValue }
    }

    init(cache: MessageCache, number: Int) {
        self.cache = cache
        self.number = number
    }

    /// What a work item is, for answering it when its commit fails.
    enum Item {
        /// A request (or authToken): answered with Internal when not committed.
        case request(name: String, cookie: String?, line: Int)
        /// Answers made without the store (decode failures): kept whatever happens.
        case answered
        /// Work without an answer (typing expiry, a stored attachment, a close).
        case `internal`
    }

    enum Entry {
        case begin(Int)
        /// An encoded event: bytes [start, end) of the session's output, and its item.
        case event(start: Int, end: Int, item: Int)
    }

    /// One session's events of this batch, encoded as they are emitted (so the engine
    /// knows how much output each session has being built).
    final class Output {
        let session: EngineSession
        var writer = JSONWriter(capacity: 1024)
        var entries: [Entry] = []
        /// The client's unread output, read once per batch (for stdio it takes a lock).
        lazy var backlog = session.sink?.backlog ?? 0

        init(session: EngineSession) { self.session = session }
    }

    private var current: Int { effects.items.count - 1 }

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

    struct RefKey: Hashable {
        let chat: Int64
        let target: Int64
        /// Byte for byte, as the store keys it.
        let tag: ExactText
    }

    // MARK: items and their effects

    /// Starts the next work item; what is emitted from now on belongs to it.
    func begin(_ item: Item, session: EngineSession?) {
        effects.items.append(item)
        if let session { append(.begin(current), to: session) }
    }

    /// The current request is answered by a later batch (off the engine thread meanwhile):
    /// this one neither answers it nor, if its commit fails, refuses it.
    func answeredLater() {
        effects.items[effects.items.count - 1] = .internal
        // Everything before it is durable (the search committed it), and it changes
        // nothing: it is never decided again, and its answer comes once.
        effects.committedItems = effects.items.count
    }

    /// Call before the current item changes who `session` is (its identity, user or
    /// endpoint): a failed commit puts it back.
    func willChangeSetup(of session: EngineSession) {
        effects.setupChanges.append((current, session, session.setup))
    }

    /// The current item ends `session`: it is closed once this batch's events are written.
    func close(_ session: EngineSession) {
        effects.closing.append((current, session))
    }

    /// `action` runs once what the current item changed is durable (removing a file the
    /// change releases, starting work that needs the change to exist).
    func whenCommitted(_ action: @escaping () -> Void) {
        effects.afterCommit.append((current, action))
    }

    /// Whether something waits for this batch's commit (it is then committed while the
    /// engine waits, before anything later is decided).
    var hasActionsAfterCommit: Bool { !effects.afterCommit.isEmpty }

    /// `action` runs if the current item's changes are not committed.
    func ifNotCommitted(_ action: @escaping () -> Void) {
        effects.afterFailure.append(action)
    }

    // MARK: store rows

    func changed(_ chat: ChatRecord) {
        changes.dirtyChats[chat.number] = chat
        changes.uncommittedChats.insert(chat.number)
    }

    func changed(_ member: MemberRecord, of chat: ChatRecord) {
        changes.dirtyMembers[RowKey(chat: chat.number, item: member.user)] = (chat.number, member)
        changes.uncommittedChats.insert(chat.number)
    }

    func changed(settings: UserSettingsRow) {
        changes.dirtySettings[settings.user] = settings
    }

    func changed(_ message: MessageRecord) {
        changes.dirtyMessages[RowKey(chat: message.chat, item: message.id)] = message
        changes.uncommittedChats.insert(message.chat)
        cache.pin(message, batch: number)
    }

    func changedPrivately(_ message: MessageRecord, for user: Int64) {
        changes.dirtyPrivate[PrivateKey(chat: message.chat, message: message.id, user: user)] = (message, user)
        changes.uncommittedChats.insert(message.chat)
        cache.pin(message, batch: number)
    }

    /// `target.refBy[tag]` changed.
    func changedReferences(to target: MessageRecord, tag: String) {
        changes.dirtyRefCounts[RefKey(chat: target.chat, target: target.id, tag: ExactText(tag))] = target
        changed(target)
    }

    /// Message `id` of `chat`, not read, changed (its feed position is now `seq`).
    func touched(chat: Int64, id: Int64, seq: Int64) {
        changes.touches[RowKey(chat: chat, item: id)] = seq
        changes.uncommittedChats.insert(chat)
    }

    /// Many messages changed at once (a mark moved over them).
    func changed(_ range: RangeChangeRow) {
        changes.rangeChanges.append(range)
        changes.uncommittedChats.insert(range.chat)
    }

    /// One more (or one fewer) message holds on to a stored content.
    func uses(_ blob: String, _ delta: Int64) {
        changes.blobDeltas[blob, default: 0] += delta
    }

    /// An endpoint is written whole or removed, never both: the store may write the two
    /// at once.
    func changed(_ endpoint: EndpointRecord) {
        changes.dirtyEndpoints[endpoint.id] = endpoint
        changes.removedEndpoints.remove(endpoint.id)
    }

    func removed(_ endpoint: EndpointRecord) {
        changes.dirtyEndpoints[endpoint.id] = nil
        changes.removedEndpoints.insert(endpoint.id)
        changes.removedEndpointUsers.insert(endpoint.user)
    }

    /// The chats changed since the batch was last committed (`Engine.collect`).
    var changedChats: Set<Int64> { changes.uncommittedChats }

    /// Whether the batch made users or changed endpoints since it was last committed.
    var changedUsersOrEndpoints: Bool {
        !store.directory.newUsers.isEmpty || !changes.dirtyEndpoints.isEmpty || !changes.removedEndpoints.isEmpty
            || !changes.dirtySettings.isEmpty
    }

    /// Whether the store lacks something this batch changed in `chat`.
    func hasUncommittedChanges(in chat: Int64) -> Bool {
        changes.uncommittedChats.contains(chat)
    }

    /// Turns the changed records into the writes of the store batch: new rows whole,
    /// changed rows by the columns that changed.
    func collectRows(counters: StoreCounters?) {
        changes.written = []
        for chat in changes.dirtyChats.values {
            let row = chat.row
            if let old = chat.stored {
                let columns = row.columns(changedFrom: old)
                if !columns.isEmpty { store.directory.chatUpdates.append(Update(row, columns: columns)) }
            } else {
                store.directory.newChats.append(row)
            }
            changes.written.append { chat.stored = row }
        }
        store.directory.userSettings = changes.dirtySettings.values.sorted { $0.user < $1.user }
        for (chat, member) in changes.dirtyMembers.values {
            let row = member.row(chat: chat)
            if let old = member.stored {
                let columns = row.columns(changedFrom: old)
                if !columns.isEmpty { store.directory.memberUpdates.append(Update(row, columns: columns)) }
            } else {
                store.directory.members.append(row)
            }
            changes.written.append { member.stored = row }
        }
        for message in changes.dirtyMessages.values {
            let row = message.row
            if let old = message.stored {
                let columns = row.columns(changedFrom: old)
                if !columns.isEmpty { store.messageUpdates.append(Update(row, columns: columns)) }
                if old.hasReferences && row.refs.isEmpty { store.droppedReferences.append((message.chat, message.id)) }
            } else {
                store.newMessages.append(row)
            }
            changes.written.append {
                message.stored = MessageColumns(row)
                message.mentionedUsers = []
            }
        }
        store.touches = changes.touches.compactMap { key, seq in changes.dirtyMessages[key] == nil ? (key.chat, key.item, seq) : nil }
        store.rangeChanges = changes.rangeChanges
        store.refCounts = changes.dirtyRefCounts.map { key, target in
            let count = target.refBy[key.tag]
            return RefCountRow(chat: key.chat, target: key.target, tag: key.tag.text, count: count?.count ?? 0, newest: count?.newest ?? 0)
        }
        store.privateStates = changes.dirtyPrivate.values.map { entry in
            let state = entry.message.privateStates[entry.user] ?? PrivateState()
            var row = MessageUserRow(
                chat: entry.message.chat, id: entry.message.id, user: entry.user, localData: state.localData?.json,
                isDeleted: state.isDeleted)
            row.thumbDetached = state.thumbDetached
            row.fileDownloaded = state.fileState == .done
            row.reactions = GivenReaction.stored(state.reactions)
            return row
        }
        store.blobUses = changes.blobDeltas.filter { $0.value != 0 }
        store.directory.endpoints = changes.dirtyEndpoints.values.map(\.row)
        store.directory.removedEndpoints = Array(changes.removedEndpoints)
        store.directory.endpointUsers = changes.removedEndpointUsers.sorted()
        store.counters = counters
        store.notifications = notifications
        notifications = []
    }

    /// The rows collected last are handed to the committer: the records take them as
    /// stored now, not once they are durable, so that a batch decided while they are in
    /// flight writes only what it changes after them (a message this one inserts is
    /// updated by the next, not inserted twice). Nothing needs undoing if the commit fails:
    /// memory is then read back from the store.
    func takeAsWritten() {
        for update in changes.written { update() }
        changes.written = []
    }

    /// Everything so far is durable: later commits of this batch need not write it
    /// again, and what waited for it is done now. The current item stays uncommitted:
    /// it may change more after this point.
    func committed() {
        for update in changes.written { update() }
        changes.written = []
        store = StoreBatch()
        changes.dirtyChats = [:]
        changes.dirtyMembers = [:]
        changes.dirtySettings = [:]
        changes.dirtyMessages = [:]
        changes.dirtyPrivate = [:]
        changes.dirtyRefCounts = [:]
        changes.touches = [:]
        changes.rangeChanges = []
        changes.blobDeltas = [:]
        changes.dirtyEndpoints = [:]
        changes.removedEndpoints = []
        changes.removedEndpointUsers = []
        changes.uncommittedChats = []
        cache.unpin(through: number)
        effects.committedItems = max(effects.committedItems, current)
        let actions = effects.afterCommit
        effects.afterCommit = []
        effects.afterFailure = []
        for entry in actions { entry.action() }
    }

    // MARK: events

    func emit(_ event: Event, to session: EngineSession) {
        ServiceMetrics.count(event)
        let output = self.output(of: session)
        let start = output.writer.count
        event.encode(to: &output.writer)
        appended(to: output, from: start)
    }

    /// Emits an event that other sessions may receive alike. With `sameAsLast`, the caller
    /// knows it equal to the event of the last call: its bytes are copied, not encoded
    /// again (a group's members see a new message alike: encoding it for each was a
    /// sixth of a send into a chat of 100).
    func emit(_ event: Event, to session: EngineSession, sameAsLast: Bool) {
        if !sameAsLast {
            built.alikeBytes.removeAll()
            event.encode(to: &built.alikeBytes)
            built.alikeUsers = built.alikeBytes.quotedNumbers(after: Batch.quotedURIPrefix)
        }
        ServiceMetrics.count(event)
        emitLastAgain(to: session)
    }

    /// Emits the event of the last `emit(_:to:sameAsLast:)` again, to `session`: its bytes
    /// copied, without the event itself (the members of a big chat are given what the
    /// member before was given, and making or passing the event along for each cost its
    /// retains and releases). Events shared so are new messages and changes, never
    /// answers: there is nothing to count (`ServiceMetrics.count`).
    func emitLastAgain(to session: EngineSession) {
        let output = self.output(of: session)
        let start = output.writer.count
        built.alikeBytes.withBytes { output.writer.appendLines($0) }
        // The viewer's own uri is searched for only where the event names them: the bytes
        // were searched once for every uri they hold.
        let namesViewer = session.user.map { user in built.alikeUsers.map { $0.contains(user) } ?? true } ?? false
        appended(to: output, from: start, namesViewer: namesViewer)
    }

    private static let quotedURIPrefix = Array("\"\(UserRecord.uriPrefix)".utf8)

    /// The event at `start` of `output` is written: its uris are the viewer's, and it
    /// belongs to the current item. `namesViewer`: false when the event is known not to
    /// hold the viewer's uri.
    private func appended(to output: Output, from start: Int, namesViewer: Bool = true) {
        // In a user's own view that user is bbmpim://user/id/0 (§3): every
        // string that is exactly this viewer's uri, wherever it stands.
        if namesViewer, let own = output.session.quotedOwnURI {
            output.writer.replaceAll(own, with: UserRecord.quotedLocalURI, from: start)
        }
        output.entries.append(.event(start: start, end: output.writer.count, item: current))
        built.builtBytes += output.writer.count - start
    }

    /// The session's output that its client has not taken: what this batch built for it
    /// so far, and its unread backlog when the batch began to build for it.
    func pendingOutput(for session: EngineSession) -> Int {
        let output = self.output(of: session)
        return output.writer.count + output.backlog
    }

    /// The output this batch built for `session` so far (none when it has none).
    func builtOutput(for session: EngineSession) -> Int {
        built.outputs[ObjectIdentifier(session)]?.writer.count ?? 0
    }

    private func append(_ entry: Entry, to session: EngineSession) {
        output(of: session).entries.append(entry)
    }

    private func output(of session: EngineSession) -> Output {
        let key = ObjectIdentifier(session)
        if let output = built.outputs[key] { return output }
        let output = Output(session: session)
        built.outputs[key] = output
        built.order.append(key)
        return output
    }

    func finish(_ session: EngineSession) {
        built.finished[ObjectIdentifier(output(of: session).session), default: 0] += 1
    }

    // MARK: answers given at once

    /// Whether the batch holds anything for `session`: events, answers counted, or its end.
    func holdsOutput(for session: EngineSession) -> Bool {
        let key = ObjectIdentifier(session)
        if let output = built.outputs[key], !output.entries.isEmpty { return true }
        if built.finished[key, default: 0] > 0 { return true }
        return effects.closing.contains { $0.session === session }
    }

    /// Whether the batch holds nothing for sessions other than `session`.
    func holdsOutputOnly(for session: EngineSession) -> Bool {
        built.order.allSatisfy { $0 == ObjectIdentifier(session) } && effects.closing.allSatisfy { $0.session === session }
    }

    /// A count of what the batch changed and has to do once committed (or not): the
    /// same before and after an item that changed nothing.
    var changeMark: Int {
        changes.dirtyChats.count + changes.dirtyMembers.count + changes.dirtySettings.count + changes.dirtyMessages.count
            + changes.dirtyPrivate.count + changes.dirtyRefCounts.count + changes.touches.count + changes.rangeChanges.count
            + changes.blobDeltas.count + changes.dirtyEndpoints.count + changes.removedEndpoints.count
            + changes.removedEndpointUsers.count + changes.uncommittedChats.count + store.directory.newUsers.count
            + searchAdds.count + searchRemovals.count + notifications.count + effects.afterCommit.count
            + effects.afterFailure.count + effects.setupChanges.count + effects.closing.count
    }

    /// Hands `session` what the current item built for it now, ahead of the rest of the
    /// batch, and takes it out of the batch, which then holds nothing of that item: it is
    /// answered whatever becomes of the commit. The caller made sure that the answer
    /// shows only what is durable, that the item changed nothing, and that neither this
    /// batch nor one before it holds anything else for the session (its answers keep
    /// their order).
    func deliverAtOnce(_ session: EngineSession) {
        let key = ObjectIdentifier(session)
        effects.items[current] = .internal
        // Never decided again (`takeBack`): it is answered.
        if inbox.taken.last?.item == current { inbox.taken.removeLast() }
        guard let output = built.outputs.removeValue(forKey: key) else { return }
        built.order.removeAll { $0 == key }
        built.builtBytes -= output.writer.count
        let finished = built.finished.removeValue(forKey: key)
        guard let sink = session.sink else { return }
        if session.isOpen && !output.writer.isEmpty { output.writer.withBytes { sink.deliver($0) } }
        if let finished { sink.engineFinished(finished) }
    }

    // MARK: when the commit fails

    /// The engine takes `inboxWork[index]` into the batch (it is decided again if the
    /// commit conflicts).
    func took(inboxIndex index: Int) {
        inbox.taken.append((effects.items.count, index))
    }

    /// The engine takes `work`, which is not from `inboxWork`, into the batch.
    func took(_ work: Engine.Work) {
        inbox.takenElsewhere.append(work)
        inbox.taken.append((effects.items.count, -inbox.takenElsewhere.count))
    }

    /// The commit failed: keeps only what is durable or never depended on the store,
    /// answers every uncommitted request once with `Internal`, and returns the sessions
    /// whose setup the uncommitted items changed, latest change first, with what each
    /// was before (the caller puts them back).
    func failAll(reason: String) -> [(session: EngineSession, before: EngineSession.Setup)] {
        keepDurableOutput(answering: reason)
        return dropUncommitted()
    }

    /// The commit conflicted (`StoreFailure.Kind.conflict`): the uncommitted work is
    /// decided again, on what the store has now, so nothing of it is kept (no answer, no
    /// event, no close, nothing that waited for the commit); what is durable keeps its
    /// events. Returns that work in order, and the sessions whose setup it changed, as
    /// `failAll` does.
    func takeBack() -> (work: [Engine.Work], setups: [(session: EngineSession, before: EngineSession.Setup)]) {
        let durable = effects.committedItems
        keepDurableOutput(answering: nil)
        let work = inbox.taken.filter { $0.item >= durable }.map { $0.index >= 0 ? inboxWork[$0.index] : inbox.takenElsewhere[-$0.index - 1] }
        // A session's work that is decided again is finished again then.
        for item in work {
            if let session = item.session { built.finished[ObjectIdentifier(session)]! -= 1 }
        }
        inbox.taken = []
        inbox.takenElsewhere = []
        inboxWork = []
        return (work, dropUncommitted())
    }

    /// Keeps each session's events of durable items and, when answering (`reason`), the
    /// answers that never depended on the store, with one `Internal` answer for each
    /// uncommitted request.
    private func keepDurableOutput(answering reason: String?) {
        let durable = effects.committedItems
        for key in built.order {
            let output = built.outputs[key]!
            var kept = JSONWriter(capacity: max(256, output.writer.count))
            output.writer.withBytes { built in
                for entry in output.entries {
                    switch entry {
                    case .begin(let item):
                        guard let reason, item >= durable, case .request(let name, let cookie, let line) = effects.items[item] else { continue }
                        ServiceMetrics.failed(name, error: ErrorCode.internal.rawValue)
                        ProtocolError(.internal, reason).requestFailed(request: name, cookie: cookie, line: line).encode(to: &kept)
                    case .event(let start, let end, let item):
                        var keep = item < durable
                        if reason != nil, case .answered = effects.items[item] { keep = true }
                        if keep { kept.appendLines(UnsafeRawBufferPointer(rebasing: built[start..<end])) }
                    }
                }
            }
            output.writer = kept
            output.entries = []
        }
    }

    /// Drops what the uncommitted items would have written and done; returns the sessions
    /// whose setup they changed, latest change first, with what each was before.
    private func dropUncommitted() -> [(session: EngineSession, before: EngineSession.Setup)] {
        let durable = effects.committedItems
        // What the uncommitted rows would have released stays; what their requests
        // opened is let go.
        effects.afterCommit = []
        let failures = effects.afterFailure
        effects.afterFailure = []
        for action in failures { action() }
        store = StoreBatch()
        changes.written = []
        searchAdds = []
        searchRemovals = []
        notifications = []
        effects.closing.removeAll { $0.item >= durable }
        return effects.setupChanges.filter { $0.item >= durable }.reversed().map { ($0.session, $0.before) }
    }

    /// Hands every session its events, then ends the sessions the batch closes.
    func deliver() {
        for key in built.order {
            let output = built.outputs[key]!
            guard let sink = output.session.sink else { continue }
            if output.session.isOpen && !output.writer.isEmpty {
                output.writer.withBytes { sink.deliver($0) }
            }
            if let count = built.finished[key] { sink.engineFinished(count) }
        }
        for (_, session) in effects.closing where session.isOpen {
            session.sink?.endSession()
        }
    }
}

extension Batch {
    /// What the batch changed, by record: written at commit by the columns that changed.
    final class Changes {
        /// Records changed by the batch: written at commit by the columns that changed.
        var dirtyChats: [Int64: ChatRecord] = [:]
        var dirtyMembers: [RowKey: (chat: Int64, member: MemberRecord)] = [:]
        var dirtySettings: [Int64: UserSettingsRow] = [:]
        var dirtyMessages: [RowKey: MessageRecord] = [:]
        var dirtyPrivate: [PrivateKey: (message: MessageRecord, user: Int64)] = [:]
        var dirtyRefCounts: [RefKey: MessageRecord] = [:]
        /// Messages whose own change position moved without being read.
        var touches: [RowKey: Int64] = [:]
        var rangeChanges: [RangeChangeRow] = []
        var blobDeltas: [String: Int64] = [:]
        var dirtyEndpoints: [Int64: EndpointRecord] = [:]
        var removedEndpoints: Set<Int64> = []
        var removedEndpointUsers: Set<Int64> = []
        /// Chats with changes the store does not have yet.
        var uncommittedChats: Set<Int64> = []
        /// What was written by the last collect, to become the records' `stored` rows.
        var written: [() -> Void] = []
    }

    /// The batch's work items, and what follows their commit or its failure.
    final class Effects {
        var items: [Item] = []
        /// Items below this number are durable.
        var committedItems = 0
        /// Sessions whose setup an item changed (authenticated, set up, deregistered), with
        /// what they were before: restored if the item is not committed.
        var setupChanges: [(item: Int, session: EngineSession, before: EngineSession.Setup)] = []
        /// Sessions the service ends once their events of this batch are written.
        var closing: [(item: Int, session: EngineSession)] = []
        /// Done after the commit that covers them, in order; dropped if it fails.
        var afterCommit: [(item: Int, action: () -> Void)] = []
        /// Done if the commit covering them fails (closing files a request opened).
        var afterFailure: [() -> Void] = []
    }

    /// The events the batch built, per session, as encoded bytes.
    final class Built {
        var outputs: [ObjectIdentifier: Output] = [:]
        var order: [ObjectIdentifier] = []
        var finished: [ObjectIdentifier: Int] = [:]
        /// The event `emit(_:to:sameAsLast:)` encoded last, as encoded (before a session's own
        /// uri is replaced in its copy).
        var alikeBytes = JSONWriter(capacity: 1024)
        /// The users whose uris `alikeBytes` hold (nil: unknown, search for each).
        var alikeUsers: [Int64]?
        /// Bytes of events this batch built, for every session together.
        var builtBytes = 0
    }

    /// The inbox work the batch took, and where each item went.
    final class Taken {
        /// What the engine took from its inbox for this batch (`took(inboxIndex:)` refers to
        /// it: kept whole, the work is not copied item by item).
        var inboxWork: [Engine.Work] = []
        /// The work the batch took, in order, with the number of the first item each began
        /// (`takeBack`): an index into `inboxWork`, or (below 0) into `takenElsewhere`.
        var taken: [(item: Int, index: Int)] = []
        /// Work taken from elsewhere than the inbox (parked work let go).
        var takenElsewhere: [Engine.Work] = []
    }
}
