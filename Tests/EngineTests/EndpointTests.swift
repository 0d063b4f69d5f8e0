import ChatProtocol
import Foundation
import GRDB
import SQLiteStorage
import Testing

@testable import ChatEngine

/// Endpoints under failed commits (§3): a deregistration or a registration
/// that the store did not take changes nobody's session and nothing that is listed.
@Suite(.serialized) final class EndpointTests {
    private func harness() throws -> (EngineHarness, FailingStore) {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        return (try EngineHarness(store: store), store)
    }

    private func endpoints(_ h: EngineHarness, _ name: String) -> [RegisteredEndpoint] {
        _ = h.events(name)
        h.submit(name, #"{"endpointsGet":{"cookie":"list"}}"#)
        return h.typedEvents(name).last?.endpoints?.registeredEndpoints ?? []
    }

    @Test func aDeregistrationThatIsNotCommittedClosesNothing() throws {
        let (h, store) = try harness()
        h.connect("a", as: "alice")
        h.connect("b", as: "alice")
        h.send("b", #"{"endpointUpdate":{"cookie":"u","description":"tablet"}}"#)
        let listed = endpoints(h, "a")
        #expect(listed.count == 2)
        let tablet = try #require(listed.first { $0.description == "tablet" }?.endpointId)

        store.failing.store(true, ordering: .relaxed)
        let refused = h.send("a", #"{"endpointDeregister":{"cookie":"d","endpointId":"\#(tablet)"}}"#)
        #expect(refused.count == 1)
        #expect(refused[0].contains(#""error":"Internal""#), "\(refused)")
        #expect(h.events("b") == [], "the tablet was told of a deregistration that did not happen")
        #expect(h.ended("b") == 0)

        store.failing.store(false, ordering: .relaxed)
        // Still set up: it is served and receives its user's events.
        let served = h.send("b", #"{"identitiesGet":{"cookie":"i","appUserIds":["alice"]}}"#)
        #expect(served.joined().contains(#""identities""#), "\(served)")
        #expect(endpoints(h, "a").count == 2)

        // Committed, it happens: told, ended, gone from the list.
        let done = h.send("a", #"{"endpointDeregister":{"cookie":"d","endpointId":"\#(tablet)"}}"#)
        #expect(done == ([#"{"endpointDeregisterResult":{"cookie":"d","result":"Success"}}"#]))
        #expect(h.events("b") == ([#"{"endpointDeregistered":{}}"#]))
        #expect(h.ended("b") == 1)
        #expect(endpoints(h, "a").count == 1)
    }

    @Test func aRegistrationThatIsNotCommittedIsNotListed() throws {
        let (h, store) = try harness()
        h.connect("a", as: "alice")
        store.failing.store(true, ordering: .relaxed)
        let refused = h.send("a", #"{"endpointUpdate":{"cookie":"u","description":"phone","nickname":"mine"}}"#)
        #expect(refused.joined().contains(#""error":"Internal""#), "\(refused)")
        store.failing.store(false, ordering: .relaxed)
        let listed = endpoints(h, "a")
        #expect(listed.count == 1)
        #expect(listed.first?.description == "", "an endpoint the store did not take is shown as registered")
        #expect(listed.first?.isCurrent == true)
    }

    /// A batch writes an endpoint whole or removes it, never both: the PostgreSQL store
    /// writes a batch as one statement, whose clauses must not touch the same row.
    @Test func aBatchWritesAnEndpointOrRemovesItNeverBoth() {
        func endpoint(_ id: Int64) -> EndpointRecord {
            EndpointRecord(id: id, user: 1, description: "d\(id)", nickname: "", isLegacyDelegate: false, ordinal: id)
        }
        let batch = Batch(cache: MessageCache(budget: 0), number: 1)
        batch.changed(endpoint(1))
        batch.removed(endpoint(1))
        batch.removed(endpoint(2))
        batch.changed(endpoint(2))
        batch.removed(endpoint(3))
        batch.collectRows(counters: nil)
        #expect(batch.store.directory.endpoints.map(\.id) == [2], "the last word on 2 is a registration")
        #expect(batch.store.directory.removedEndpoints.sorted() == ([1, 3]))
    }
}
