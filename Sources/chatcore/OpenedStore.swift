import Foundation
import Logging
import PostgresStorage
import SQLiteStorage
import Storage

/// The store the service was started with: SQLite in the data directory (the default,
/// needing nothing), or PostgreSQL (`--store postgres://…`).
enum OpenedStore {
    case sqlite(SQLiteStore)
    case postgres(PostgresStore)

    /// Opens what `--store` names (nil: SQLite in `directory`). The PostgreSQL password
    /// comes from `passwordFile`, else from PGPASSWORD: never from the command line.
    /// `allNodesDecide`, `besideTheWriter`: see `PostgresStore.init`.
    static func open(
        _ url: String?, passwordFile: String?, directory: URL, logger: Logger, writerLock: PostgresStore.WriterLock? = nil,
        allNodesDecide: Bool = false, besideTheWriter: Bool = false
    ) throws -> OpenedStore {
        guard let url else { return .sqlite(try SQLiteStore(directory: directory)) }
        return .postgres(
            try PostgresStore(
                location: try location(url, passwordFile: passwordFile), logger: logger, writerLock: writerLock,
                allNodesDecide: allNodesDecide, besideTheWriter: besideTheWriter))
    }

    /// Where the PostgreSQL store is, and the password to reach it.
    static func location(_ url: String, passwordFile: String?) throws -> PostgresStore.Location {
        var password = ProcessInfo.processInfo.environment["PGPASSWORD"]
        if let passwordFile {
            do {
                password = try String(contentsOfFile: passwordFile, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
            } catch {
                throw PostgresStore.OpenError(description: "cannot read --store-password-file \(passwordFile): \(error.localizedDescription)")
            }
        }
        return try PostgresStore.Location(url: url, password: password)
    }

    /// Whether other nodes may serve the same store (PostgreSQL).
    var isShared: Bool {
        if case .postgres = self { true } else { false }
    }

    /// How this process shares the store with other deciding processes: PostgreSQL's
    /// nodes, or nobody (SQLite).
    var coordination: any NodeCoordination {
        switch self {
        case .sqlite: SoloNode()
        case .postgres(let store): store
        }
    }

    var chatStore: any ChatStore {
        switch self {
        case .sqlite(let store): store
        case .postgres(let store): store
        }
    }

    /// What the log says of it at start-up.
    var description: String {
        switch self {
        case .sqlite(let store): store.directory?.path ?? "SQLite"
        case .postgres(let store): "\(store.location)"
        }
    }

    /// How much of it is checked after start-up (PostgreSQL checks its own files).
    var wholeFileCheck: String {
        switch self {
        case .sqlite(let store): store.isNew ? "none (new store)" : store.stoppedCleanly ? "none (stopped cleanly)" : "in the background"
        case .postgres: "none (PostgreSQL)"
        }
    }

    /// After a crash (or a change of the files while no chatcore had them), SQLite's
    /// file is checked whole in the background; `report` gets
    /// what is damaged.
    func checkInBackground(report: @escaping @Sendable (String?) -> Void) {
        guard case .sqlite(let store) = self, !store.stoppedCleanly else { return }
        store.checkInBackground(report: report)
    }

    /// A clean stop: nothing is written after it.
    func closeCleanly() {
        switch self {
        case .sqlite(let store): store.closeCleanly()
        case .postgres(let store): store.shutDown()
        }
    }
}
