import Foundation
import Logging
import PostgresStore
import SQLiteStore
import Store
import Threads

/// Keeps a relaying node's search index up to date with the store while another node
/// writes (a thread, `search-follow`): every second it hands the index what the store has
/// beyond it. Without it, a node that takes over first indexes everything written while
/// it relayed, and searches wait for that (about 7 minutes for 10,000,000 messages).
/// What it cannot see is a recall made meanwhile (a recall leaves no search row behind):
/// a search checks every hit against the store, so such a message is not found.
final class SearchFollower: @unchecked Sendable {
    private let index: SQLiteSearchIndex
    private let feed: PostgresStore.SearchFeed
    private let logger: Logger
    private let condition = NSCondition()
    private var stopping = false
    private var stopped = false

    init(index: SQLiteSearchIndex, feed: PostgresStore.SearchFeed, logger: Logger) {
        self.index = index
        self.feed = feed
        self.logger = logger
        let thread = Thread { [self] in
            nameCurrentThread("search-follow")
            follow()
        }
        thread.start()
    }

    private var goOn: Bool {
        condition.withLock { !stopping }
    }

    private func follow() {
        var lastComplaint: ContinuousClock.Instant?
        while goOn {
            do {
                _ = try index.fill(after: index.indexedUpTo(), from: feed.entries, while: { goOn })
            } catch {
                // The database restarting, the index failing: said at most once a minute,
                // and tried again; the node that takes over fills what is still missing.
                if lastComplaint.map({ ContinuousClock.now - $0 > .seconds(60) }) ?? true {
                    logger.warning("the search index cannot follow the store now: trying again", metadata: ["error": "\(error)"])
                    lastComplaint = ContinuousClock.now
                }
            }
            condition.withLock {
                if !stopping { _ = condition.wait(until: Date(timeIntervalSinceNow: 1)) }
            }
        }
        feed.close()
        condition.withLock {
            stopped = true
            condition.broadcast()
        }
    }

    /// Ends the following and waits until it has (this node writes from now on: the
    /// engine alone hands the index what it lacks).
    func stop() {
        condition.withLock {
            stopping = true
            condition.broadcast()
            while !stopped { condition.wait() }
        }
    }
}
