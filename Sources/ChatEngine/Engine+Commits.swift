import Attachments
import ChatMetrics
import ChatProtocol
import Foundation
import Logging
import Storage
import Synchronization
import Threads

// Group commit: a batch's rows handed to the committer, its events delivered once they
// are durable, and recovery when a commit fails or conflicts.

extension Engine {
    /// A batch handed to the committer: its rows, and what follows once they are durable.
    final class Commit: @unchecked Sendable {  // the engine thread's, but for `outcome`, which the committer sets
        let batch: Batch
        let rows: StoreBatch
        let counters: StoreCounters
        let barriers: [@Sendable () -> Void]
        /// Set by the committer once the store answered (`finish`): the error, if it
        /// failed, and how long it took.
        private let outcome = Locked<(error: Error?, took: Duration)?>(nil)

        init(batch: Batch, counters: StoreCounters, barriers: [@Sendable () -> Void]) {
            self.batch = batch
            self.rows = batch.store
            self.counters = counters
            self.barriers = barriers
        }

        func finish(error: Error? = nil, took: Duration = .zero) {
            outcome.change { $0 = (error, took) }
        }

        /// Whether the committer finished (looked at between work items, without waiting).
        var isFinished: Bool { outcome.withLock { $0 != nil } }

        /// Whether the committer finished, waiting for it at most `seconds`.
        func isFinished(waitingAtMost seconds: Double) -> Bool {
            outcome.wait(until: { $0 != nil }, deadline: Date(timeIntervalSinceNow: seconds)) { $0 != nil }
        }

        /// Waits until the committer finished.
        func waitUntilFinished() -> (error: Error?, took: Duration) {
            outcome.wait(until: { $0 != nil }) { $0! }
        }
    }

    /// Ends a decided batch: its rows go to the committer and the engine goes on deciding
    /// the next batch while they are written; its events are delivered when the commit
    /// is done, after those of the batches committed before it and before anything decided
    /// later. With the store's `commitsInFlight` at 1, a batch is handed over once the one
    /// before it is durable and delivered (`settle`); with 2 (PostgreSQL), while it may
    /// still be committing (the store applies a batch only after, and only if, the one it
    /// `follows`). The next batch is decided on memory that already holds this one's
    /// changes (its changed messages stay pinned in the cache, and a query of the store
    /// waits for the commit: `commitIfChanged`), so when this commit fails every batch
    /// after it fails with it. A batch that something waits for (removing files, starting
    /// attachment copies), and the last one, are committed while the engine waits.
    ///
    /// When a commit conflicts (another node committed first to a chat it changes), the
    /// batches that failed with it are decided again instead (`redo`). Returns whether they
    /// were: their work, and `stop` when `stopping`, is then in the inbox again.
    func end(_ batch: Batch, barriers: [@Sendable () -> Void], stopping: Bool) -> Bool {
        let later = !stopping && !batch.hasActionsAfterCommit
        settleFinished()
        if later {
            while commits.inFlight.count >= commits.limit && commits.failed == nil {
                answerReadsWhileWaiting(for: commits.inFlight[0], before: batch)
                settleOldest()
            }
        } else {
            settle()
        }
        if let failed = commits.failed {
            commits.failed = nil
            if redo(failed.commits.map { ($0.batch, $0.barriers) } + [(batch, barriers)], stopping: stopping, after: failed.error) {
                return true
            }
            fail([batch] + failed.commits.reversed().map(\.batch), with: failed.error)
            for commit in failed.commits { deliver(commit.batch, then: commit.barriers) }
            deliver(batch, then: barriers)
            return false
        }
        guard later else {
            do {
                try writeChanges(batch)
            } catch {
                if redo([(batch, barriers)], stopping: stopping, after: error) { return true }
                fail([batch], with: error)
            }
            deliver(batch, then: barriers)
            return false
        }
        let counters = collect(batch)
        batch.takeAsWritten()
        if batch.store.isEmpty && commits.inFlight.isEmpty {
            batch.committed()
            deliver(batch, then: barriers)
            return false
        }
        // The store applies it only after the last commit in flight, and only if that is.
        batch.store.follows = commits.inFlight.last { !$0.rows.isEmpty }?.rows.sequence
        let commit = Commit(batch: batch, counters: counters, barriers: barriers)
        commits.inFlight.append(commit)
        // A batch that wrote nothing behind commits in flight waits for them, in order.
        guard !commit.rows.isEmpty else {
            commit.finish()
            return false
        }
        let store = self.store
        commits.committer.async { [self] in
            let started = ContinuousClock.now
            var failure: Error?
            do {
                try store.commit(commit.rows)
            } catch {
                failure = error
            }
            commit.finish(error: failure, took: ContinuousClock.now - started)
            // Wakes the engine when it waits for work: the events are due.
            put(.committed)
        }
        return false
    }

    /// Waits for the oldest batch in flight, then delivers its events. When its commit
    /// failed, the batches in flight after it are waited for too, and the failure of all
    /// of them is kept for the end of the batch being decided (`end`).
    func settleOldest() {
        guard !commits.inFlight.isEmpty else { return }
        let commit = commits.inFlight.removeFirst()
        let outcome = commit.waitUntilFinished()
        if let error = outcome.error {
            ServiceMetrics.commitFailures.increment()
            for later in commits.inFlight { _ = later.waitUntilFinished() }
            commits.failed = ([commit] + commits.inFlight, error)
            commits.inFlight = []
            return
        }
        if !commit.rows.isEmpty {
            ServiceMetrics.committed(in: outcome.took)
            conflictsResolved()
        }
        wrote(commit.batch, counters: commit.counters)
        deliver(commit.batch, then: commit.barriers)
    }

    /// Waits for every batch in flight (see `settleOldest`).
    func settle() {
        while !commits.inFlight.isEmpty { settleOldest() }
    }

    /// Delivers the batches in flight whose commits are done, oldest first, without
    /// waiting for any.
    func settleFinished() {
        while let oldest = commits.inFlight.first, oldest.isFinished { settleOldest() }
    }

    /// Hands the batch's events to its sessions, then runs what waited for them (`drain`'s
    /// barriers).
    func deliver(_ batch: Batch, then barriers: [@Sendable () -> Void]) {
        batch.deliver()
        for body in barriers { body() }
    }

    /// Writes what the batch changed so far in one transaction, then hands the text of
    /// what was committed to the search index and carries out what had to wait for the
    /// commit (removing files, starting attachment copies). On a throw nothing was
    /// written and the batch keeps its rows.
    func writeChanges(_ batch: Batch) throws {
        let counters = collect(batch)
        if !batch.store.isEmpty {
            // Nothing is in flight (callers settle first): it follows no commit.
            let started = ContinuousClock.now
            do {
                try store.commit(batch.store)
            } catch {
                ServiceMetrics.commitFailures.increment()
                throw error
            }
            ServiceMetrics.committed(in: ContinuousClock.now - started)
            conflictsResolved()
            wrote(batch, counters: counters)
        } else {
            batch.committed()
        }
    }

    /// Turns what the batch changed into its store rows, numbered as the next commit when
    /// there are any (`StoreBatch.sequence`); returns the counters they hold.
    func collect(_ batch: Batch) -> StoreCounters {
        let counters = StoreCounters(changeSeq: directory.changeSeq, slot: following.feedSlot, searchRow: searches.lastRow)
        // The counters as the store will hold them once the commits in flight are applied
        // (this one is applied only after them): unmoved, they are not written again, and
        // a batch that changed nothing is not committed at all.
        let stored = commits.inFlight.last { !$0.rows.isEmpty }?.counters ?? directory.storedCounters
        batch.collectRows(counters: counters == stored ? nil : counters)
        // Each chat changed is decided on the version memory has; the next commit expects
        // the one after (a commit in flight that fails makes memory be read again). A
        // batch that writes nothing is not committed, so it moves no version on.
        if commits.comparesChatVersions && !batch.store.isEmpty {
            batch.store.chatVersions = batch.changedChats.sorted().compactMap { number in
                guard let chat = directory.chats[number] else { return nil }
                defer { chat.version += 1 }
                return ChatVersion(chat: number, version: chat.version)
            }
        }
        if !batch.store.isEmpty {
            commits.lastSequence += 1
            batch.store.sequence = commits.lastSequence
            batch.store.feedSlot = following.feedSlot
        }
        return counters
    }

    /// The batch's rows are durable: the index gets their text, and what waited is done.
    func wrote(_ batch: Batch, counters: StoreCounters) {
        directory.storedCounters = counters
        searches.index?.add(batch.takeSearchAdds(), removing: batch.takeSearchRemovals())
        batch.committed()
    }

    /// Commits what the batch changed so far (before reading from the store), after the
    /// batch before it. If that fails, the batch keeps its rows: its final commit fails
    /// again and answers all. If it conflicted, the batch is decided again at its end
    /// (`redo`), whatever its final commit would do, and nothing more of it reads the store.
    func commitSoFar(_ batch: Batch) throws {
        try settleBeforeReading()
        do {
            try writeChanges(batch)
        } catch {
            if (error as? StoreFailure)?.kind == .conflict { commits.failed = ([], error) }
            throw ProtocolError(.internal, Engine.storeFailure(error))
        }
    }

    /// Waits until the store has the batches before this one (before reading what they
    /// changed); throws when a commit failed (this batch then fails whole at its end).
    func settleBeforeReading() throws {
        settle()
        if let failedCommit = commits.failed {
            throw ProtocolError(.internal, Engine.storeFailure(failedCommit.error))
        }
    }

    /// Whether a batch being committed changed `chat` (the store may not have it yet).
    func committing(_ chat: Int64) -> Bool {
        commits.inFlight.contains { $0.batch.hasUncommittedChanges(in: chat) }
    }

    static func storeFailure(_ error: Error) -> String {
        "the store failed to commit the change, so nothing of this request was done (\(error))"
    }

    /// Decides the work of `batches` (oldest first, each with the barriers waiting for
    /// it) again, when their commit conflicted (`StoreFailure.Kind.conflict`: another node
    /// committed first to a chat they change): memory is read again from the store, each
    /// batch keeps only its durable events (`Batch.takeBack`) and delivers them, and its
    /// other work goes back to the front of the inbox, in order, ahead of everything that
    /// came later, so the next batch decides it on what the store has now. Work parked
    /// behind it (a session whose client was slow) follows it there, except that of
    /// sessions waiting for a search's answer (their work was never in these batches);
    /// barriers and `stop` come last. A conflict on chats not read yet is progress: a node
    /// whose memory of many chats is behind meets them one batch at a time. One on chats
    /// just read again (another node moved them on again) makes batches smaller
    /// (`batchLimitNow`). Returns false, having done nothing, when the failure is no
    /// conflict, when the store cannot be read, or when `maxRedos` such conflicts came
    /// with batches of one work item, since a commit was last applied (the caller answers
    /// `Internal`).
    func redo(_ batches: [(batch: Batch, barriers: [@Sendable () -> Void])], stopping: Bool, after error: Error) -> Bool {
        let uncommitted = Engine.uncommitted(batches.map(\.batch))
        let repeated = commits.readAfterConflicts.map { read in uncommitted?.isSubset(of: read) ?? false } ?? true
        guard (error as? StoreFailure)?.kind == .conflict, !repeated || commits.repeatedConflicts < Engine.maxRedos else { return false }
        do {
            try readAgain(uncommitted)
        } catch {
            return false
        }
        if followsOthers { readAhead(uncommitted) }
        commits.readAfterConflicts = uncommitted.flatMap { chats in commits.readAfterConflicts?.union(chats) }
        ServiceMetrics.commitConflicts.increment()
        logger.info("a commit conflicted with another node's: deciding its requests again", metadata: ["error": "\(error)"])
        var work: [[Work]] = []
        for (batch, _) in batches.reversed() {
            let (taken, setups) = batch.takeBack()
            putBack(setups)
            work.insert(taken, at: 0)
        }
        for (batch, _) in batches { batch.deliver() }
        var again = work.flatMap { $0 }
        let released = unparkedWork(whateverTheBacklog: true)
        again += released
        again += batches.flatMap(\.barriers).map { Work.barrier($0) }
        if stopping { again.append(.stop) }
        if repeated {
            // Smaller batches are progress too: only conflicts of one work item at a time
            // count toward answering `Internal`.
            if commits.batchLimitNow == 1 { commits.repeatedConflicts += 1 }
            commits.batchLimitNow = max(1, commits.batchLimitNow / 4)
        }
        life.inbox.putBack(again)
        // Counted as parked until they are in the inbox (`drain` looks at both).
        outputs.taken(released.count)
        life.settle()
        return true
    }

    /// How many conflicts that found nothing more to read, with batches of one work item,
    /// may be decided again before the batch is answered `Internal` (`redo`).
    static let maxRedos = 8

    /// Sessions whose setup uncommitted work changed are as they were before it (`setups`:
    /// the latest change first).
    func putBack(_ setups: [(session: EngineSession, before: EngineSession.Setup)]) {
        for (session, before) in setups {
            unregister(session)
            session.setup = before
            if let user = session.user, session.isOpen {
                directory.sessionsByUser[user, default: []].append(session)
                sessionsChanged(of: user)
            }
        }
    }

    /// A commit was applied: conflicts start over, and batches grow again.
    func conflictsResolved() {
        commits.readAfterConflicts = []
        commits.repeatedConflicts = 0
        if commits.batchLimitNow < Engine.batchLimit { commits.batchLimitNow = min(Engine.batchLimit, commits.batchLimitNow * 2) }
    }

    /// The commit of `batches` (the latest first) failed. Nothing since their last
    /// commit is durable: none of their events may be seen, every request they held gets
    /// one Internal answer, sessions they authenticated are unauthenticated again (the
    /// latest change undone first), and memory of what they changed is read again from the
    /// store (`readAgain`), so no number handed out by them is remembered.
    func fail(_ batches: [Batch], with error: Error) {
        logger.error("commit failed: the requests of the batch are answered with Internal", metadata: ["error": "\(error)"])
        let uncommitted = Engine.uncommitted(batches)
        for batch in batches {
            putBack(batch.failAll(reason: Engine.storeFailure(error)))
        }
        if let failure = error as? StoreFailure, failure.stopsTheService {
            // SQLite keeps the connection in an error state after an I/O error, and
            // the kernel may have dropped what it did not sync: only opening the store
            // again (a restart, which recovers the WAL) is sound. Another writer
            // (superseded) may have changed what memory holds. Refuse everything from
            // now on and let the process answer what it has and stop.
            logger.critical(
                failure.kind == .io ? "the store hit an I/O error: stopping" : "another process writes the store: stopping",
                metadata: ["error": "\(failure)"])
            storeIsBroken(failure)
            return
        }
        if followsOthers { readAhead(uncommitted) }
        do {
            try readAgainWaiting(uncommitted)
        } catch {
            // Memory and store may now disagree: serving on could announce what is
            // not durable. Every answer decided so far is delivered by the caller's
            // shutdown path; the process must not go on.
            logger.critical("cannot reload the store after a failed commit: stopping", metadata: ["error": "\(error)"])
            storeIsBroken(error)
        }
    }

    /// How long memory is tried to be read back after a failed commit before the service
    /// stops (`readAgainWaiting`).
    static let readBackPatience = 10.0

    /// `readAgain`, tried again every 0.2 s for up to `readBackPatience` while it fails: a
    /// commit fails most often because the store went away for a moment (PostgreSQL
    /// restarting), and a read right after it can still meet a connection the server
    /// closed before the process saw it close. Each try reads everything it needs again
    /// before memory takes it, so one that failed half-way leaves nothing to undo.
    func readAgainWaiting(_ numbers: Set<Int64>?) throws {
        let deadline = ContinuousClock.now + .seconds(Engine.readBackPatience)
        while true {
            do {
                return try readAgain(numbers)
            } catch {
                guard ContinuousClock.now < deadline else { throw error }
                logger.warning("cannot read the store back after a failed commit: trying again", metadata: ["error": "\(error)"])
                Thread.sleep(forTimeInterval: 0.2)
            }
        }
    }
}
