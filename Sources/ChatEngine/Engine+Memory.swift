import Attachments
import ChatMetrics
import ChatProtocol
import Foundation
import Logging
import Storage
import Synchronization
import Threads

// Memory as the store has it: read at start-up, read again (in part) after a failed
// commit, and the numbers taken from the store for new chats, users and search rows.

extension Engine {
    /// Reads what is per user and per chat from the store (never every message): at
    /// start-up, and after a failed commit, when memory must be what the store has.
    func reload() throws {
        let loaded = try store.loadDirectory()
        directory.users = UserDirectory(loaded.users)
        directory.settings = [:]
        directory.blockers = [:]
        for row in loaded.userSettings { learn(settings: row) }
        directory.endpoints = [:]
        directory.endpointsOfUser = [:]
        directory.lastEndpointOrdinal = 0
        for row in loaded.endpoints {
            directory.endpoints[row.id] = EndpointRecord(row)
            directory.endpointsOfUser[row.user, default: []].append(row.id)
            directory.lastEndpointOrdinal = max(directory.lastEndpointOrdinal, row.ordinal)
        }
        directory.chats = [:]
        directory.chatsOfUser = [:]
        directory.lastChatNumber = 0
        install(loaded)
        cache.removeAll()
        timed.typing = [:]
        following.followedFeed = loaded.feedPositions
        try refillSearchIndex()
    }

    /// The directory's chats with their memberships, and its counters, into memory
    /// (unless not `takingCounters`).
    func install(_ loaded: StoreDirectory, takingCounters: Bool = true) {
        for row in loaded.chats {
            let chat = ChatRecord(row)
            chat.version = loaded.chatVersions[row.number] ?? 0
            directory.chats[row.number] = chat
            schedulePinEnds(of: chat)
            directory.lastChatNumber = max(directory.lastChatNumber, row.number)
        }
        for row in loaded.members {
            guard let chat = directory.chats[row.chat] else { continue }
            chat.members[row.user] = MemberRecord(row)
            if row.isActive { directory.chatsOfUser[row.user, default: []].insert(row.chat) }
            if let until = row.mutedUntil, until != 0 { scheduleMuteEnd(MemberKey(chat: row.chat, user: row.user), until: until) }
        }
        guard takingCounters else { return }
        directory.changeSeq = loaded.feedPositions[following.feedSlot] ?? FeedSlots.base(of: following.feedSlot)
        searches.lastRow = loaded.counters.searchRow
        directory.storedCounters = StoreCounters(changeSeq: directory.changeSeq, slot: following.feedSlot, searchRow: searches.lastRow)
    }

    /// What memory must read again after `batches` failed to commit: the chats they changed
    /// since they were last committed, or everything (nil) when they made users or changed
    /// endpoints. Asked before the batches drop what they changed (`Batch.failAll`).
    static func uncommitted(_ batches: [Batch]) -> Set<Int64>? {
        guard !batches.contains(where: \.changedUsersOrEndpoints) else { return nil }
        return batches.reduce(into: []) { $0.formUnion($1.changedChats) }
    }

    /// Makes memory what the store has after a failed commit, reading only the chats that
    /// commit changed (`uncommitted`): their records, memberships and versions, and the
    /// counters; their messages leave the cache. The rest of memory never held anything
    /// the commit had, so it stays (a directory of a million chats is not read again for
    /// one chat's conflict). `nil`: everything (`reload`).
    func readAgain(_ numbers: Set<Int64>?) throws {
        guard let numbers else { return try reload() }
        replace(numbers, with: try store.loadChats(numbers.sorted()))
    }

    /// Memory of the chats `numbers` becomes `directory` (what the store has of them): their
    /// messages leave the cache, or only `messages` of them. Not `takingCounters`, this
    /// process's counters stay as memory has them (what the others did is followed: the
    /// directory was read while a commit of this process may have been in flight, and
    /// its counters would take this process's feed positions and search rows back).
    func replace(
        _ numbers: Set<Int64>, with loaded: StoreDirectory, droppingOnly messages: [Int64: Set<Int64>]? = nil,
        takingCounters: Bool = true
    ) {
        if let messages {
            for (chat, ids) in messages { cache.remove(chat: chat, ids: ids) }
        } else {
            cache.remove(chats: numbers)
        }
        // This process's messages whose attachments it is storing stay its senders' alone,
        // whatever else is read again.
        var pending: [Int64: [Int64: Int64]] = [:]
        for number in numbers {
            guard let old = directory.chats.removeValue(forKey: number) else { continue }
            let storing = old.pendingSends.filter { attachmentWork.inFlight[Batch.RowKey(chat: number, item: $0.key)] != nil }
            if !storing.isEmpty { pending[number] = storing }
            for (user, member) in old.members where member.isActive {
                directory.chatsOfUser[user]?.remove(number)
                if directory.chatsOfUser[user]?.isEmpty == true { directory.chatsOfUser[user] = nil }
            }
        }
        // A chat the batches made is not in the store: its number is free again.
        if loaded.chats.count < numbers.count && numbers.contains(directory.lastChatNumber) { directory.lastChatNumber = directory.chats.keys.max() ?? 0 }
        install(loaded, takingCounters: takingCounters)
        for (number, sends) in pending { directory.chats[number]?.pendingSends = sends }
    }

    /// The number of a new chat, user or search row (`Directory.newNumber`).
    func newNumber(for kind: NumberedKind, after last: Int64) -> Int64 {
        directory.newNumber(for: kind, after: last, from: coordination, logger: logger)
    }

    /// Makes sure memory holds `count` numbers of `kind` (`Directory.reserveNumbers`).
    func reserveNumbers(for kind: NumberedKind, count: Int) {
        directory.reserveNumbers(for: kind, count: count, from: coordination, logger: logger)
    }

    /// Hands the index every searchable message it does not have yet (it lags commits, may
    /// lose its tail in a crash, and is rebuilt whole when its file is lost or laid out by
    /// an older release): the store finds them by search row, on a thread of its own, so
    /// that start-up does not wait; a search waits for it (`searchRefill`).
    func refillSearchIndex() throws {
        guard let searchIndex = searches.index else { return }
        let indexed = try searchIndex.indexedUpTo()
        let upTo = searches.lastRow
        guard indexed < upTo else { return }
        logger.info(
            "the search index lacks messages: filling it from the store in the background (searches wait for it)",
            metadata: ["indexedUpTo": "\(indexed)", "storeUpTo": "\(upTo)"])
        let store = self.store
        let logger = self.logger
        searches.refill.enter()
        let thread = Thread { [searchRefill = searches.refill] in
            nameCurrentThread("search-refill")
            do {
                _ = try searchIndex.fill(after: indexed, upTo: upTo, from: store.searchEntries)
                searchIndex.bulkLoadEnded()
            } catch {
                logger.error("the search index could not be refilled: searches may miss messages", metadata: ["error": "\(error)"])
            }
            searchRefill.leave()
        }
        thread.start()
    }
}
