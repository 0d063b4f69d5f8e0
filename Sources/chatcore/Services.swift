import ChatEngine
import ChatServer
import ChatSession
import Foundation
import Logging
import NIOCore
import Notifier
import ServiceLifecycle
import Threads
import UnixSignals

// The long-running pieces of a node, as services of swift-service-lifecycle. `Serve.run`
// puts the metrics endpoint, the key reload and the node in one `ServiceGroup`, which
// turns SIGTERM and SIGINT into a graceful shutdown; the node, once it decides, runs its
// store, engine, sockets and standard input/output as a group of their own. A group
// shuts its services down in the reverse of their order, each once the one after it has
// returned: input stops and answers are written first, the store is closed last.

/// Runs `body`, which blocks (a lock wait, a drain, a flush), on a thread of the global
/// queue and returns its result: the services' cooperative threads never block.
func blocking<T: Sendable>(_ body: @escaping @Sendable () -> T) async -> T {
    await withCheckedContinuation { done in
        DispatchQueue.global().async { done.resume(returning: body()) }
    }
}

/// The metrics endpoint, bound before the store opens (so that it is served while this
/// node waits for the store or relays to the node that decides): closed last.
struct MetricsService: Service {
    let channel: any Channel

    func run() async throws {
        try? await gracefulShutdown()
        try? await channel.close()
    }
}

/// SIGHUP: reads the JWKS file and the TLS certificate and key again; on failure, what is
/// in use stays.
struct KeyReloadService: Service {
    let authenticator: Authenticator
    let tls: TLSIdentity?
    let logger: Logger

    func run() async throws {
        for await _ in await UnixSignalsSequence(trapping: .sighup).cancelOnGracefulShutdown() {
            do {
                let count = try await authenticator.reloadKeys()
                if count > 0 { logger.info("reloaded the JWKS file", metadata: ["keys": "\(count)"]) }
            } catch {
                logger.error("the JWKS file was not reloaded: the keys in use stay", metadata: ["error": "\(error)"])
            }
            guard let tls else { continue }
            do {
                try tls.reload()
                logger.info("reloaded the TLS certificate and key: new connections present them", metadata: ["certificate": "\(tls.certificatePath)"])
            } catch {
                logger.error("the TLS certificate and key were not reloaded: the ones in use stay", metadata: ["error": "\(error)"])
            }
        }
    }
}

/// How a deciding node's stop went: its exit code, and whether the engine stopped with
/// everything committed (then the store is closed cleanly). Shared by its services.
final class StopState: Sendable {
    /// Clients that do not read their answers are given this long.
    static let flushSeconds = 5.0

    private struct State {
        var exitCode: Int32 = 0
        var engineStopped = false
        var deadline: Date?
    }

    private let state = Locked(State())

    var exitCode: Int32 { state.withLock { $0.exitCode } }

    /// The process exits with `code` (the first failure's stays).
    func fail(_ code: Int32) { state.withLock { if $0.exitCode == 0 { $0.exitCode = code } } }

    /// Until when output is flushed: `flushSeconds` from the first asking.
    var flushDeadline: Date {
        state.withLock {
            if $0.deadline == nil { $0.deadline = Date(timeIntervalSinceNow: StopState.flushSeconds) }
            return $0.deadline!
        }
    }

    var engineStopped: Bool {
        get { state.withLock { $0.engineStopped } }
        set { state.withLock { $0.engineStopped = newValue } }
    }
}

/// The store: closed cleanly last, when the engine stopped with everything committed (a
/// store not closed so is checked whole at the next start).
struct StoreService: Service {
    let store: OpenedStore
    let stop: StopState

    func run() async throws {
        try? await gracefulShutdown()
        if stop.exitCode == 0 && stop.engineStopped { await blocking { [store] in store.closeCleanly() } }
    }
}

/// The engine's thread, started before the group; when other processes decide on the
/// store too, it is woken every `interval` to follow what they committed. Its stop waits
/// for the last commit.
struct EngineService: Service {
    let engine: Engine
    /// How often what other processes committed is looked at (nil: none decide).
    let followEvery: Duration?
    let stop: StopState

    func run() async throws {
        let engine = self.engine
        if let followEvery {
            // Ends at the group's graceful shutdown (the sleep is cancelled then).
            await cancelWhenGracefulShutdown {
                while !Task.isCancelled {
                    try? await Task.sleep(for: followEvery)
                    engine.othersActed()
                }
            }
        } else {
            try? await gracefulShutdown()
        }
        guard engine.storeFailure == nil, stop.exitCode == 0 else { return }
        stop.engineStopped = await blocking { engine.stop(waitingAtMost: StopState.flushSeconds) }
    }
}

/// Sends notifications of offline recipients (`Notifier`) until the group shuts down:
/// stopped before the engine, so a batch it took is finished or left to its lease.
struct NotifierService: Service {
    let notifier: Notifier
    let engine: Engine

    func run() async throws {
        let (notifier, engine) = (notifier, engine)
        await cancelWhenGracefulShutdown { await notifier.run(engine: engine) }
    }
}

/// The socket sessions: at the stop, no connection is accepted, requests not begun are
/// refused ("shutting down"), and what was answered is written out, within the deadline
/// for clients that do not read.
struct SocketsService: Service {
    let server: SocketServer
    let engine: Engine
    let stop: StopState

    func run() async throws {
        try? await gracefulShutdown()
        let (server, engine, deadline) = (server, engine, stop.flushDeadline)
        await blocking {
            engine.beginShutdown()
            server.stopAccepting()
            engine.drain()
            let left = max(0, deadline.timeIntervalSinceNow)
            server.flushAndCloseAll(deadline: .now() + .milliseconds(Int64(left * 1000)))
        }
    }
}

/// The standard input/output session, read on a thread of its own. At the end of its
/// input every answer is written; then the node stops, unless it serves sockets too
/// (`endsTheNode`). At a stop before that, input stops and what was answered is written
/// out, within the deadline for a parent that does not read.
struct StdioService: Service {
    let stdio: StdioTransport
    let engine: Engine
    let server: SocketServer?
    let stop: StopState
    /// Whether the end of standard input stops the node.
    let endsTheNode: Bool
    let logger: Logger

    func run() async throws {
        let ended = OneShot<Bool>()
        let (stdio, engine, server, stop) = (stdio, engine, server, stop)
        let inputEnded = await withGracefulShutdownHandler {
            await ended.wait {
                let thread = Thread {
                    nameCurrentThread("stdin")
                    stdio.run()
                    ended.resume(true)
                }
                thread.start()
            }
        } onGracefulShutdown: {
            DispatchQueue.global().async {
                engine.beginShutdown()
                server?.stopAccepting()
                engine.drain()
                stdio.flushForShutdown(deadline: stop.flushDeadline)
                ended.resume(false)
            }
        }
        guard inputEnded else { return }
        if endsTheNode {
            if server != nil {
                logger.info("end of standard input: stopping (sessions relayed here end, and another node takes over)")
            } else {
                logger.debug("end of standard input: every answer is written")
            }
            return
        }
        logger.info("end of standard input; still serving sockets")
        try? await gracefulShutdown()
    }
}

/// A value handed over once, from whichever side comes first; later ones are dropped.
final class OneShot<Value: Sendable>: Sendable {
    private let state = Locked<(continuation: CheckedContinuation<Value, Never>?, value: Value?)>((nil, nil))

    /// Calls `start` and waits for the first `resume`.
    func wait(_ start: () -> Void) async -> Value {
        await withCheckedContinuation { continuation in
            let early: Value? = state.withLock {
                if let value = $0.value { return value }
                $0.continuation = continuation
                return nil
            }
            if let early { continuation.resume(returning: early) } else { start() }
        }
    }

    func resume(_ value: Value) {
        let waiting = state.withLock { state -> CheckedContinuation<Value, Never>? in
            guard state.value == nil else { return nil }
            state.value = value
            defer { state.continuation = nil }
            return state.continuation
        }
        waiting?.resume(returning: value)
    }
}

/// Stops a group from callbacks that may come before it exists (it then stops as soon
/// as it runs).
final class Stopper: Sendable {
    private let state = Locked<(group: ServiceGroup?, requested: Bool)>((nil, false))

    func attach(_ group: ServiceGroup) {
        let requested = state.withLock {
            $0.group = group
            return $0.requested
        }
        if requested { Task { await group.triggerGracefulShutdown() } }
    }

    func stop() {
        let group = state.withLock {
            $0.requested = true
            return $0.group
        }
        if let group { Task { await group.triggerGracefulShutdown() } }
    }
}

// What the group's log calls each service (not a dump of what it holds).
extension MetricsService: CustomStringConvertible { var description: String { "metrics" } }
extension KeyReloadService: CustomStringConvertible { var description: String { "key reload" } }
extension StoreService: CustomStringConvertible { var description: String { "store" } }
extension EngineService: CustomStringConvertible { var description: String { "engine" } }
extension NotifierService: CustomStringConvertible { var description: String { "notifier" } }
extension SocketsService: CustomStringConvertible { var description: String { "sockets" } }
extension StdioService: CustomStringConvertible { var description: String { "standard input/output" } }
extension NodeService: CustomStringConvertible { var description: String { "node" } }
