import Logging
import Storage
import Synchronization
import Testing

@testable import ChatEngine

/// The directory's numbering alone: new chats, users and search rows numbered by the
/// store's coordination a block at a time, or by memory when the process is alone.
@Suite struct DirectoryTests {
    /// A coordination that hands out the blocks it is given, one per call, and counts
    /// the calls (or fails every call).
    final class Blocks: NodeCoordination, @unchecked Sendable {
        var blocks: [[ClosedRange<Int64>]]
        var asked: [Int] = []
        var failing = false

        init(_ blocks: [[ClosedRange<Int64>]]) { self.blocks = blocks }

        struct Unreachable: Error {}

        func takeNumbers(for kind: NumberedKind, count: Int) throws -> [ClosedRange<Int64>]? {
            asked.append(count)
            if failing { throw Unreachable() }
            return blocks.isEmpty ? [] : blocks.removeFirst()
        }

        var comparesChatVersions: Bool { true }
        var feedSlot: Int { 0 }
        var othersDecide: Bool { true }
        func othersActivity(besides slot: Int, after cursor: FollowCursor?, thoroughly: Bool) throws -> OthersActivity? { nil }
        func announceOnline(slot: Int, joined: [Int64], left: [Int64]) throws {}
        func announce(_ event: TransientEvent, slot: Int) throws {}
        func wakeWhenOthersAct(_ wake: @escaping @Sendable () -> Void) -> Bool { false }
    }

    let logger = Logger(label: "directory-tests")

    @Test func aProcessAloneNumbersAfterTheHighestItKnows() {
        let directory = Directory()
        #expect(directory.newNumber(for: .chat, after: 41, from: SoloNode(), logger: logger) == 42)
        #expect(directory.newNumber(for: .user, after: 7, from: SoloNode(), logger: logger) == 8)
    }

    @Test func numbersFromTheStoreAreHandedOutInOrderAndAskedForOncePerBlock() {
        let blocks = Blocks([[100...102, 200...200]])
        let directory = Directory()
        let numbers = (0..<4).map { _ in directory.newNumber(for: .chat, after: 1, from: blocks, logger: logger) }
        #expect(numbers == [100, 101, 102, 200])
        #expect(blocks.asked == [1], "one round trip for the block")
    }

    @Test func aRequestAboutToMakeManyReservesThemInOneRoundTrip() {
        let blocks = Blocks([[10...259]])
        let directory = Directory()
        directory.reserveNumbers(for: .user, count: 250, from: blocks, logger: logger)
        directory.reserveNumbers(for: .user, count: 249, from: blocks, logger: logger)  // held already
        let numbers = (0..<250).map { _ in directory.newNumber(for: .user, after: 1, from: blocks, logger: logger) }
        #expect(numbers == Array(10...259))
        #expect(blocks.asked == [250])
    }

    @Test func whenTheStoreGivesNoneTheNextMemoryKnowsIsTakenAndTheCommitJudgesIt() {
        let blocks = Blocks([])
        blocks.failing = true
        let directory = Directory()
        #expect(directory.newNumber(for: .searchRow, after: 99, from: blocks, logger: logger) == 100)
        #expect(blocks.asked == [1])
    }
}
