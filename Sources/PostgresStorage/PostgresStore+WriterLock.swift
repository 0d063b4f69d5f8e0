import Dispatch
import Foundation
import Logging
import NIOCore
import NIOPosix
import NIOSSL
import PostgresNIO
import Storage
import Synchronization
import Threads

// The writer lock, its epoch and beat, and the feed slots: which node decides, and how
// the others know it is alive and where it is.

extension PostgresStore {
    func takeFeedSlot() throws {
        guard let holder = shared.withLock({ s in s.lockHolder }) else { return }
        for slot in 0..<FeedSlots.count {
            if try lockFeedSlot(slot, on: holder) {
                shared.withLock { s in s.slot = slot }
                if slot != 0 { logger.info("another node holds feed slot 0: this node numbers its changes in another", metadata: ["feedSlot": "\(slot)"]) }
                return
            }
        }
        throw OpenError(description: "every one of the \(FeedSlots.count) feed slots of \(location) is held: another node must stop first")
    }

    /// Takes feed slot `slot`'s advisory lock for `connection`'s session, if no other holds it.
    func lockFeedSlot(_ slot: Int, on connection: PostgresConnection) throws -> Bool {
        try run(connection, "SELECT pg_try_advisory_lock(\(PostgresStore.feedSlotLockKey + Int64(slot)))").first?.decode(Bool.self) == true
    }

    /// Moves this node's feed slot's epoch on (`allNodesDecide`): a node that held the
    /// slot before can commit no more. What that node said of who was connected to it
    /// goes.
    func takeSlotEpoch() throws {
        let slot = Int64(feedSlot)
        try withConnection { connection in
            let rows = try runCommitted(
                connection,
                """
                WITH taken AS (UPDATE slot_epoch SET epoch = epoch + 1 WHERE slot = \(slot)::int RETURNING epoch),
                gone AS (DELETE FROM node_online WHERE slot = \(slot)::int)
                SELECT epoch FROM taken
                """)
            guard let taken = try rows.first?.decode(Int64.self) else {
                throw OpenError(description: "the store \(location) has no slot_epoch row for feed slot \(slot): it was changed by hand")
            }
            shared.withLock { s in s.slotEpoch = taken }
        }
    }

    /// A node deciding beside the writer holds its feed slot on a connection of its own:
    /// when that closes (PostgreSQL restarted), it takes the slot again at once, and stops
    /// if another node took it meanwhile (its epoch moved on).
    func watchSlotLock() {
        guard let connection = shared.withLock({ s in s.lockHolder }) else { return }
        connection.closeFuture.whenComplete { [weak self] _ in
            guard let store = self else { return }
            DispatchQueue.global().async {
                guard !store.shared.withLock({ s in s.isShutDown }) else { return }
                do {
                    try store.takeSlotAgain()
                } catch {
                    store.logger.error("the feed slot could not be taken again", metadata: ["error": "\(error)"])
                    store.onSuperseded?("\(error)")
                }
            }
        }
    }

    func takeSlotAgain() throws {
        let connection = try connect()
        let (slot, epoch) = shared.withLock { s in (s.slot, s.slotEpoch) }
        let current = try? run(connection, "SELECT epoch FROM slot_epoch WHERE slot = \(Int64(slot))::int").first?.decode(Int64.self)
        guard (try? lockFeedSlot(slot, on: connection)) == true, current == epoch else {
            try? connection.close().wait()
            throw StoreFailure(.superseded, "another node took feed slot \(slot), in which this node numbers its changes: this one stops")
        }
        shared.withLock { s in s.lockHolder = connection }
        watchSlotLock()
    }

    /// The advisory lock of feed slot 0; slot `s`'s is this plus `s`.
    static let feedSlotLockKey: Int64 = writerLockKey + 0x100

    /// Another process holds the writer lock of the database.
    public struct WriterLockHeld: Error, CustomStringConvertible {
        public let location: Location
        public var description: String {
            "another chatcore process is serving the database \(location) (it holds the writer lock)"
        }
    }

    /// Becomes the database's only writer, or says who is. Taken again (an epoch is
    /// held), the lock is this process's only if no other writer took an epoch meanwhile.
    func takeWriterLock() throws {
        let connection = try connect()
        let rows = try run(connection, "SELECT pg_try_advisory_lock(\(PostgresStore.writerLockKey))")
        guard let row = rows.first, try row.decode(Bool.self) else {
            try? connection.close().wait()
            throw WriterLockHeld(location: location)
        }
        let held = shared.withLock { s in s.epoch }
        if held != 0 {
            let current: Int64?
            do {
                current = try run(connection, "SELECT epoch FROM writer_epoch WHERE id = 1").first?.decode(Int64.self)
            } catch {
                try? connection.close().wait()
                throw error
            }
            guard current == held else {
                try? connection.close().wait()
                throw StoreFailure(.superseded, supersededReason)
            }
            // The feed slot went with the old connection too: this node's changes go on
            // numbered in it, so it must be the same one.
            let slot = shared.withLock { s in s.slot }
            guard (try? lockFeedSlot(slot, on: connection)) == true else {
                try? connection.close().wait()
                throw StoreFailure(.superseded, "another node took feed slot \(slot), in which this node numbers its changes")
            }
            // Beat at once: after a long restart of the server the last beat is old, and
            // a waiting node would take this writer for a silent one.
            try? beat(on: connection)
        }
        hold(connection)
    }

    /// Keeps `connection`, which holds the writer lock, and watches it. Its beats need
    /// not wait for the disk.
    func hold(_ connection: PostgresConnection) {
        _ = try? run(connection, "SET synchronous_commit = off")
        shared.withLock { s in s.lockHolder = connection }
        watchWriterLock(connection)
    }

    /// Says that this writer is alive now (`writer_beat`), if its epoch is still the one.
    func beat(on connection: PostgresConnection) throws {
        let epoch = shared.withLock { s in s.epoch }
        try run(connection, "UPDATE writer_beat SET beat = now() WHERE id = 1 AND epoch = \(epoch)")
    }

    /// Says that this writer is alive every `beatSeconds` (`writer_beat`, on the lock's
    /// connection, not waiting for the disk), until the store is shut down. A writer that
    /// stops answering (its machine gone, the process stopped, the network cut) stops
    /// beating, and a waiting node ends its sessions and takes over (`WriterLock.wait`);
    /// the epoch fences it if it wakes.
    func startBeating() {
        let thread = Thread { [weak self] in
            nameCurrentThread("writer-beat")
            while let store = self, !store.shared.withLock({ s in s.isShutDown }) {
                if let connection = store.shared.withLock({ s in s.lockHolder }), !connection.isClosed {
                    do {
                        // Any deciding node trims, so that the log stays short when the
                        // writer is gone.
                        if store.isWriter { try store.beat(on: connection) }
                        if store.allNodesDecide {
                            try store.trimFollowed(on: connection)
                            store.listenIfDeaf()
                        }
                    } catch {
                        store.logger.debug("a writer beat failed", metadata: ["error": "\(PostgresStore.describe(error))"])
                    }
                }
                Thread.sleep(forTimeInterval: PostgresStore.beatSeconds)
            }
        }
        thread.start()
    }

    /// Takes the next writer epoch (holding the writer lock), and removes the previous
    /// writer's address. The increment waits for a commit of the previous writer that
    /// holds a share lock on the row, so what this process reads next includes it, and
    /// every commit of the previous writer that reaches the row later fails its fence.
    func takeEpoch(_ connection: PostgresConnection) throws -> Int64 {
        // One statement, so one transaction: the next epoch, this node's first beat, and
        // the previous writer's address gone, at once. Where the previous writer accepted
        // connections is not where this one will: relaying nodes wait for this writer's own
        // address (`advertise`, once it serves) instead of relaying to the old one, or to a
        // new process bound there that is not serving yet, with the old credential; with
        // three statements, a relaying node could read the old address after the epoch
        // moved on.
        let rows = try runCommitted(
            connection,
            """
            WITH taken AS (UPDATE writer_epoch SET epoch = epoch + 1, since = now() WHERE id = 1 RETURNING epoch),
            beat AS (INSERT INTO writer_beat (id, node, epoch, beat) SELECT 1, \(PostgresStore.nodeName), epoch, now() FROM taken
                     ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, epoch = EXCLUDED.epoch, beat = EXCLUDED.beat),
            gone AS (DELETE FROM writer_node)
            SELECT epoch FROM taken
            """)
        guard let taken = try rows.first?.decode(Int64.self) else {
            throw OpenError(description: "the store \(location) has no writer_epoch row: it was changed by hand")
        }
        logger.debug("took the writer epoch", metadata: ["epoch": "\(taken)"])
        return taken
    }

    /// The SELECT of every commit (the commit's writes are its WITH clauses): it fails
    /// (SQLSTATE `CCW01`), and the commit with it, unless this process's epoch is still
    /// the database's, and holds the row so the next writer's increment waits for the
    /// commit.
    func fence() -> SQL {
        let (epoch, slot, slotEpoch) = shared.withLock { s in (s.epoch, s.slot, s.slotEpoch) }
        let slotFence: SQL = "chatcore_slot_fence(\(Int64(slot))::int, \(slotEpoch))"
        guard isWriter else { return "SELECT " + slotFence }
        let writerFence: SQL = "chatcore_fence(\(epoch))"
        return "SELECT " + (allNodesDecide ? writerFence + ", " + slotFence : writerFence)
    }

    /// The clause that moves on the versions of the chats a batch changes, or raises
    /// `CCC01` (`chatcore_claim`); nil when it changes none.
    static func claim(_ versions: [ChatVersion]) -> SQL? {
        guard !versions.isEmpty else { return nil }
        return "chatcore_claim(\(versions.map(\.chat))::bigint[], \(versions.map(\.version))::bigint[])"
    }

    /// SQLSTATEs of a commit that lost to another node's and may be decided again: the
    /// claim's (`chatcore_claim`), a key another node inserted first (unique_violation),
    /// and two commits that locked each other's chats (deadlock_detected) or were
    /// serialised (serialization_failure).
    static let conflictStates: Set<String> = ["CCC01", "23505", "40P01", "40001"]

    /// The SQLSTATE of a failed fence.
    static let supersededState = "CCW01"

    var supersededReason: String {
        "another chatcore process became the writer of \(location): this one stops (what it holds in memory may be behind the store); its clients connect to the node serving now"
    }

    /// When the connection holding the writer lock closes (PostgreSQL restarted), the lock
    /// is taken again at once, not at the next commit: relaying nodes waiting for it give
    /// the writer a moment (`WriterLock.wait`), so an idle writer stays the writer.
    func watchWriterLock(_ connection: PostgresConnection) {
        connection.closeFuture.whenComplete { [weak self] _ in
            guard let store = self else { return }
            DispatchQueue.global().async {
                guard !store.shared.withLock({ s in s.isShutDown }) else { return }
                do {
                    try store.checkWriterLock()
                } catch {
                    store.logger.error("the writer lock could not be taken again", metadata: ["error": "\(error)"])
                    if let failure = error as? StoreFailure, failure.kind == .superseded { store.onSuperseded?(failure.description) }
                }
            }
        }
    }

    /// After the server restarted, the lock went with the old connection: take it again
    /// before writing (and stop if another process took it meanwhile).
    func checkWriterLock() throws {
        try relocking.exclusively { try takeWriterLockAgainIfLost() }
    }

    func takeWriterLockAgainIfLost() throws {
        let (holder, shutDown) = shared.withLock { s in (s.lockHolder, s.isShutDown) }
        // A store shut down (the service stopping) let its lock go on purpose: a commit or
        // a follow still running then fails instead of taking the lock, and a new epoch,
        // again.
        if shutDown { throw StoreFailure(.other, "the store \(location) was shut down (the service is stopping)") }
        guard holder == nil || holder!.isClosed else { return }
        logger.warning("the connection holding the writer lock was lost: taking it again", metadata: ["store": "\(location)"])
        if let holder { try? holder.close().wait() }
        shared.withLock { s in s.lockHolder = nil }
        do {
            try takeWriterLock()
        } catch is WriterLockHeld {
            throw StoreFailure(.superseded, supersededReason)
        }
    }

    /// Says where this node (the writer) accepts connections, for the other nodes, and
    /// its `instance`: a random value, not a secret, to which the tokens of nodes relaying
    /// a trusted standard input/output session here are bound (empty: this writer accepts
    /// none, it has no node key).
    public func advertise(_ address: String, instance: String) throws {
        try withConnection { connection in
            _ = try runCommitted(
                connection,
                """
                INSERT INTO writer_node (id, address, instance, since) VALUES (1, \(address), \(instance), now())
                ON CONFLICT (id) DO UPDATE SET address = EXCLUDED.address, instance = EXCLUDED.instance, since = EXCLUDED.since
                """)
        }
    }

    /// The writer lock of a database, taken by a node that waited for it (`wait`), and
    /// where the writer is meanwhile (`writerAddress`).
    public final class WriterLock: Sendable {
        let connection: PostgresConnection

        private init(connection: PostgresConnection) {
            self.connection = connection
        }

        /// Blocks until this process holds the writer lock: the writer stopped or died
        /// (PostgreSQL releases a session's lock when its connection ends), or it has not
        /// said it is alive (`writer_beat`) for `takeoverAfter` seconds — its machine is
        /// gone, the process stopped, the network cut it off — and this node ends the
        /// writer's sessions (by its `application_name`), which releases the lock and
        /// rolls back what it had in flight. The epoch fences that writer if it wakes.
        /// A connection lost while waiting (PostgreSQL restarted) is made again and the
        /// wait goes on: a relaying node outlives a restart of the database.
        public static func wait(location: Location, logger: Logger, takeoverAfter: Double = 10) throws -> WriterLock {
            var lost = false
            while true {
                // A connection that had to wait for the server (it was restarting: this
                // node's first connection can come during a restart too) is as one lost.
                let connection = try PostgresStore.connect(location, id: 1_000_000, patience: .seconds(3600), logger: logger) { lost = true }
                if lost {
                    // The server restarted: the writer takes its lock again at once;
                    // asking now could take it from a writer that is alive.
                    Thread.sleep(forTimeInterval: 2)
                }
                do {
                    while true {
                        let taken = try ask(connection, "SELECT pg_try_advisory_lock(\(PostgresStore.writerLockKey))", logger: logger)
                        if try taken.first?.decode(Bool.self) == true { return WriterLock(connection: connection) }
                        try endSilentWriter(connection, after: takeoverAfter, logger: logger)
                        Thread.sleep(forTimeInterval: 0.2)
                    }
                } catch {
                    try? connection.close().wait()
                    lost = true
                    logger.warning(
                        "lost the connection waiting for the writer lock: waiting again",
                        metadata: ["store": "\(location)", "error": "\(PostgresStore.describe(error))"])
                    Thread.sleep(forTimeInterval: 0.2)
                }
            }
        }

        /// One statement of the waiting connection, which fails (instead of waiting for
        /// ever) when the connection closes under it (PostgreSQL restarted).
        private static func ask(_ connection: PostgresConnection, _ sql: SQL, logger: Logger) throws -> PostgresQueryResult {
            try PostgresStore.wait(for: connection.query(sql.query, logger: logger), on: connection, patience: .seconds(60))
        }

        /// Ends the sessions of a writer whose last beat is more than `seconds` old (by
        /// the server's clock, the same for every node). Nothing when the database has no
        /// beat yet (a new store, or one of an older release being migrated).
        private static func endSilentWriter(_ connection: PostgresConnection, after seconds: Double, logger: Logger) throws {
            let query: SQL = """
                SELECT node, extract(epoch FROM now() - beat)::float8 FROM writer_beat
                WHERE id = 1 AND now() - beat > make_interval(secs => \(seconds))
                """
            guard let rows = try? ask(connection, query, logger: logger), let row = rows.first else { return }
            let (node, silent) = try row.decode((String, Double).self)
            let ended = try ask(
                connection,
                """
                SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
                WHERE application_name = \(node) AND pid <> pg_backend_pid()
                """, logger: logger)
            let count = try ended.first?.decode(Int64.self) ?? 0
            if count > 0 {
                logger.warning(
                    "the writer has not said it is alive: ending its sessions to take over",
                    metadata: ["writer": "\(node)", "silentSeconds": "\(Int(silent))", "sessionsEnded": "\(count)"])
            }
        }

        /// Where the writer accepts connections now, as it advertised (nil: none yet, or
        /// the database cannot be read).
        public static func writerAddress(location: Location, logger: Logger) -> String? {
            // The instance's column exists only once a writer of this release migrated
            // the database: not asked for here.
            try? advertised("address", location: location, logger: logger)?.decode(String.self)
        }

        /// Where the writer accepts connections now and its instance, to which node
        /// tokens for relayed standard input/output sessions are bound, as it advertised
        /// (nil: none yet, or the database cannot be read).
        public static func writer(location: Location, logger: Logger) -> (address: String, instance: String)? {
            try? advertised("address, instance", location: location, logger: logger)?.decode((String, String).self)
        }

        /// The `columns` of what the writer advertised (`advertise`), read on a connection
        /// of its own.
        private static func advertised(_ columns: String, location: Location, logger: Logger) -> PostgresRow? {
            guard let connection = try? PostgresStore.connect(location, id: 1_000_001, patience: .seconds(5), logger: logger) else { return nil }
            defer { try? connection.close().wait() }
            // The table exists once a writer migrated the database.
            let query: SQL = "SELECT \(unescaped: columns) FROM writer_node WHERE id = 1"
            return (try? PostgresStore.wait(for: connection.query(query.query, logger: logger), on: connection, patience: connectionPatience))?.first
        }
    }
}
