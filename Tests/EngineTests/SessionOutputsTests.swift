import Synchronization
import Testing

@testable import ChatEngine

/// Per-session output alone: work parked behind a client that does not read, released in
/// order once it has read, and counted until it is taken.
@Suite struct SessionOutputsTests {
    /// A client whose unread output is set by the test.
    final class Client: EventSink {
        let unread = Atomic<Int>(0)
        func deliver(_ lines: UnsafeRawBufferPointer) {}
        var backlog: Int { unread.load(ordering: .relaxed) }
        func engineFinished(_ count: Int) {}
        func endSession() {}
    }

    static func session(_ id: Int, unread: Int = 0) -> (EngineSession, Client) {
        let client = Client()
        client.unread.store(unread, ordering: .relaxed)
        return (EngineSession(id: id, transport: .unix, sink: client), client)
    }

    /// The sessions the released work items belong to, in order.
    static func owners(_ work: [Engine.Work]) -> [Int] {
        work.map { item in
            guard case .close(let session) = item else { return -1 }
            return session.id
        }
    }

    @Test func workWaitsInOrderUntilTheClientHasReadDownToHalfTheMark() {
        let outputs = SessionOutputs(mark: 1000)
        let (slow, client) = Self.session(1, unread: 900)
        outputs.park(.close(slow), of: slow)
        outputs.park(.close(slow), of: slow)
        #expect(outputs.isParked(slow))
        #expect(outputs.parkedCount.load(ordering: .relaxed) == 2)
        #expect(outputs.release(everyone: false).isEmpty, "900 unread is above half the mark")
        client.unread.store(500, ordering: .relaxed)
        let released = outputs.release(everyone: false)
        #expect(Self.owners(released) == [1, 1])
        #expect(!outputs.isParked(slow) && !outputs.isAnyParked)
        #expect(outputs.parkedCount.load(ordering: .relaxed) == 2, "counted until taken: drain must not see it done")
        outputs.taken(2)
        #expect(outputs.parkedCount.load(ordering: .relaxed) == 0)
        withExtendedLifetime(client) {}
    }

    @Test func sessionsAreReleasedInTheOrderTheyWereParkedAndOnlyThoseThatRead() {
        let outputs = SessionOutputs(mark: 1000)
        // The clients are kept: a session holds its sink weakly.
        let (first, firstClient) = Self.session(1)
        let (stuck, stuckClient) = Self.session(2, unread: 2000)
        let (third, thirdClient) = Self.session(3)
        for session in [first, stuck, third] { outputs.park(.close(session), of: session) }
        #expect(Self.owners(outputs.release(everyone: false)) == [1, 3])
        #expect(outputs.isParked(stuck))
        #expect(Self.owners(outputs.release(everyone: true)) == [2], "everyone: when shutting down or after a conflict")
        withExtendedLifetime((firstClient, stuckClient, thirdClient)) {}
    }

    @Test func aClosedSessionIsReleasedWhateverItsBacklog() {
        let outputs = SessionOutputs(mark: 1000)
        let (gone, client) = Self.session(1, unread: 5000)
        outputs.park(.close(gone), of: gone)
        gone.isOpen = false
        #expect(Self.owners(outputs.release(everyone: false)) == [1])
        withExtendedLifetime(client) {}
    }

    @Test func aSessionAwaitingAnAnswerFromOutsideWaitsWhateverElseHappens() {
        let outputs = SessionOutputs(mark: 1000)
        let (searching, client) = Self.session(1)
        defer { withExtendedLifetime(client) {} }
        outputs.awaitOutside(searching)
        #expect(outputs.isParked(searching), "its next work queues behind the answer")
        outputs.park(.close(searching), of: searching)
        #expect(outputs.release(everyone: true).isEmpty)
        outputs.outsideAnswered(searching)
        #expect(Self.owners(outputs.release(everyone: false)) == [1])
    }
}
