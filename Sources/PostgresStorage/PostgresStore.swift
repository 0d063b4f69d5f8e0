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

/// `ChatStore` on a PostgreSQL database, through postgres-nio.
///
/// The engine calls the store synchronously from its own thread (never from an event
/// loop), so each call here runs its statements on a connection and waits for them.
/// Connections are kept and reused; one that breaks (the server restarted) is dropped and
/// a new one is made for the next call, waiting for the server up to `patience`.
///
/// One chatcore process serves a database at a time, as with SQLite's lock file: the
/// engine keeps users, chats and memberships in memory and allocates ids from it, so a
/// second writer would hand out the same ids. A session-level advisory lock, held on a
/// connection of its own for as long as the process runs, says so to a second process.
///
/// The lock alone does not fence a writer that lost it: its connection can close (the
/// server restarted, a backend was terminated, the network dropped it) while a commit of
/// the writer is under way on another connection, and the node that takes the lock next
/// could read the store before that commit lands, then hand out the same ids or write
/// over it from memory that is behind. So each writer also takes the next *writer epoch*
/// (a row it increments) once it holds the lock, and every commit checks, under a share
/// lock on that row held until it ends, that the epoch is still its own
/// (`chatcore_fence`): the next writer's increment waits for a commit that holds the row,
/// and a commit that reaches the row after the increment fails whole. A writer that finds
/// another epoch stops (`StoreFailure.superseded`).
public final class PostgresStore: Sendable {
    public let location: Location
    let logger: Logger

    deinit {
        shutDown()
    }

    public struct OpenError: Error, CustomStringConvertible {
        public let description: String

        public init(description: String) {
            self.description = description
        }
    }

    /// What the store's threads share.
    struct Shared {
        /// The pool and the task that runs it (`pool()`).
        var pool: (client: PostgresClient, running: Task<Void, Never>)?
        var nextConnectionID = 0
        /// Holds the advisory lock that makes this process the database's only writer.
        var lockHolder: PostgresConnection?
        /// Set by `shutDown`: a closed lock connection is then not replaced.
        var isShutDown = false
        /// The writer epoch this process took when it became the writer; every commit
        /// checks that it is still the database's.
        var epoch: Int64 = 0
        /// `feedSlot`.
        var slot = 0
        /// The epoch of its feed slot this process took with it.
        var slotEpoch: Int64 = 0
        /// What this node is told of the other deciding nodes' doings (`allNodesDecide`;
        /// PostgresStore+Following.swift).
        var told = Told()
        var superseded: (@Sendable (String) -> Void)?
    }

    let shared = Locked(Shared())
    /// One `listenIfDeaf` at a time.
    let relistening = Locked(())
    /// Whether every node on the database decides (`--all-nodes-decide`): each follows
    /// the others' commits (`othersActivity`), and its commits are fenced by its feed
    /// slot's epoch (`slotEpoch`), which a node that takes the slot after it moves on.
    public let allNodesDecide: Bool
    /// Whether this process holds the writer lock (else it decides beside the writer, and
    /// says nothing of where it accepts connections: nobody relays to it).
    public let isWriter: Bool
    /// Called (on another thread) when another process became the database's
    /// writer while this one was serving: its memory may be behind the store, so it
    /// must stop. Without it, the next commit fails and stops the service.
    public var onSuperseded: (@Sendable (String) -> Void)? {
        get { shared.withLock { s in s.superseded } }
        set { shared.withLock { s in s.superseded = newValue } }
    }
    /// One check of the writer lock at a time (the engine's and the watcher's).
    let relocking = Locked(())
    /// Whether each recent commit was applied, for the commit in flight after it.
    let outcomes = CommitOutcomes()
    /// How long a call waits for the server to come back before it fails.
    public let patience: Duration = .seconds(15)

    /// This process among the database's sessions (`application_name`): unique per
    /// process, short enough that PostgreSQL keeps it whole (63 bytes).
    public static let nodeName = "chatcore-\(ProcessInfo.processInfo.processIdentifier)-\(String(UInt64.random(in: 0...UInt64.max), radix: 16))"

    /// How often the writer says it is alive (`writer_beat`).
    static let beatSeconds = 1.0

    /// The advisory lock's key: "chatcore" read as a number.
    static let writerLockKey: Int64 = 0x6368_6174_636f_7265

    /// Opens the store as the database's writer: with the lock `writerLock` holds (taken
    /// by `WriterLock.wait`), else taking it now or failing (`WriterLockHeld`). With
    /// `allNodesDecide`, every node decides: with `besideTheWriter`, this one opens it
    /// without the writer lock, deciding beside the writer in a feed slot of its own.
    public init(location: Location, logger: Logger, writerLock: WriterLock? = nil, allNodesDecide: Bool = false, besideTheWriter: Bool = false) throws {
        self.location = location
        self.logger = logger
        self.allNodesDecide = allNodesDecide || besideTheWriter
        self.isWriter = !besideTheWriter
        do {
            if besideTheWriter {
                let connection = try connect()
                _ = try? run(connection, "SET synchronous_commit = off")
                shared.withLock { s in s.lockHolder = connection }
                try withConnection { connection in try migrate(connection) }
            } else {
                if let writerLock {
                    hold(writerLock.connection)
                } else {
                    try takeWriterLock()
                }
                try withConnection { connection in
                    try migrate(connection)
                    let taken = try takeEpoch(connection)
                    shared.withLock { s in s.epoch = taken }
                }
            }
            try takeFeedSlot()
            if self.allNodesDecide { try takeSlotEpoch() }
            if besideTheWriter { watchSlotLock() }
            startBeating()
        } catch let error as OpenError {
            shutDown()
            throw error
        } catch let error as WriterLockHeld {
            shutDown()
            throw error
        } catch {
            shutDown()
            throw OpenError(description: "cannot open the store \(location): \(PostgresStore.describe(error))")
        }
    }

    /// This node's feed slot (`FeedSlots`, `ChatStore.feedSlot`): the first one no other
    /// node holds, by an advisory lock of the session that holds the writer lock, so it is
    /// held exactly as long as the writer lock is. While one node decides that is slot 0
    /// (the one before it let go of it with the writer lock), unless something else holds
    /// it; with several deciding nodes (docs/several-deciding-nodes.md) each gets its own.
    public var feedSlot: Int { shared.withLock { s in s.slot } }

    /// Closes every connection (the advisory lock goes with its connection), the pool's
    /// within a few seconds.
    public func shutDown() {
        let (pool, connections) = shared.withLock { s -> (Task<Void, Never>?, [PostgresConnection]) in
            s.isShutDown = true
            let all = (s.lockHolder.map { [$0] } ?? []) + (s.told.listener.map { [$0] } ?? [])
            let pool = s.pool?.running
            s.pool = nil
            s.lockHolder = nil
            s.told.listener = nil
            return (pool, all)
        }
        if let pool {
            pool.cancel()
            let ended = Outcome<Void>()
            Task {
                await pool.value
                ended.complete(.success(()))
            }
            _ = ended.wait(until: .now + .seconds(5))
        }
        for connection in connections { try? connection.close().wait() }
    }

}
