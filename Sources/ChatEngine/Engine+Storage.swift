import ChatProtocol
import Storage

/// Reading messages: from the cache when they are hot, from the store otherwise (its
/// indexes), so that memory follows what is used, not what was ever said.
extension Engine {
    /// The answer when the store cannot be read.
    func unreadable(_ error: Error) -> ProtocolError {
        if let error = error as? ProtocolError { return error }
        return ProtocolError(.internal, "the store could not be read: \(error)")
    }

    /// Message `id` of `chat`, or nil when the chat has none.
    func loadMessage(_ id: Int64, in chat: ChatRecord) throws -> MessageRecord? {
        guard id >= 1 && id <= chat.lastMessage else { return nil }
        if let cached = cache.get(chat: chat.number, id: id) { return cached }
        do {
            guard let row = try store.messages(chat: chat.number, in: id...id).first else { return nil }
            return remember(row)
        } catch {
            throw unreadable(error)
        }
    }

    /// The messages of `chat` with ids in `range` (clamped to the chat's), ascending.
    func loadMessages(in chat: ChatRecord, _ range: ClosedRange<Int64>) throws -> [MessageRecord] {
        let low = max(range.lowerBound, 1)
        let high = min(range.upperBound, chat.lastMessage)
        guard low <= high else { return [] }
        var found: [MessageRecord?] = []
        found.reserveCapacity(Int(high - low + 1))
        var firstMiss: Int64?
        var lastMiss: Int64 = 0
        for id in low...high {
            let cached = cache.get(chat: chat.number, id: id)
            found.append(cached)
            if cached == nil {
                if firstMiss == nil { firstMiss = id }
                lastMiss = id
            }
        }
        if let firstMiss {
            do {
                for row in try store.messages(chat: chat.number, in: firstMiss...lastMiss) {
                    let index = Int(row.id - low)
                    if found[index] == nil { found[index] = remember(row) }
                }
            } catch {
                throw unreadable(error)
            }
        }
        return found.compactMap { $0 }
    }

    /// The messages of `chat` with these ids, in the order given (ids it does not have are
    /// left out).
    func loadMessages(in chat: ChatRecord, ids: [Int64]) throws -> [MessageRecord] {
        var byId: [Int64: MessageRecord] = [:]
        var missing: [Int64] = []
        for id in ids where id >= 1 && id <= chat.lastMessage {
            if let cached = cache.get(chat: chat.number, id: id) { byId[id] = cached } else { missing.append(id) }
        }
        if !missing.isEmpty {
            do {
                for row in try store.messages(chat: chat.number, ids: Array(Set(missing)).sorted()) { byId[row.id] = remember(row) }
            } catch {
                throw unreadable(error)
            }
        }
        return ids.compactMap { byId[$0] }
    }

    private func remember(_ row: MessageRow) -> MessageRecord {
        let record = MessageRecord(row, storing: attachmentWork.inFlight[Batch.RowKey(chat: row.chat, item: row.id)] != nil)
        cache.put(record)
        return record
    }

    /// Ids of `chat` matching `filter`, from `start` up or down: the store's indexes. The
    /// store must have what this batch changed in the chat first, so it is committed.
    func matchingIds(in chat: ChatRecord, _ filter: MessageFilter, from start: Int64, ascending: Bool, limit: Int, batch: Batch) throws -> [Int64] {
        try commitIfChanged(chat, batch: batch)
        do {
            return try store.messageIds(chat: chat.number, matching: filter, from: start, ascending: ascending, limit: limit)
        } catch {
            throw unreadable(error)
        }
    }

    /// Makes the store hold `chat` as memory has it (before a query the store answers
    /// from its indexes): waits for the batch being committed when it changed the chat,
    /// and commits what this batch changed so far when it did.
    func commitIfChanged(_ chat: ChatRecord, batch: Batch) throws {
        if committing(chat.number) { try settleBeforeReading() }
        if batch.hasUncommittedChanges(in: chat.number) { try commitSoFar(batch) }
    }
}
