import ArgumentParser
import Foundation
import Logging
import Synchronization

/// How logs are written to standard error (`--log-format`).
enum LogFormat: String, ExpressibleByArgument, CaseIterable {
    /// swift-log's own lines, for people.
    case text
    /// One JSON object per line, for log collectors: `time` (UTC, milliseconds), `level`,
    /// `message`, `source` (the module), and the message's fields as strings.
    case json
}

/// A `LogHandler` writing one JSON object per line to standard error.
struct JSONLogHandler: LogHandler {
    var logLevel: Logger.Level
    var metadata: Logger.Metadata = [:]
    let label: String

    /// One line at a time, from every thread.
    private static let output = Mutex<Void>(())

    init(label: String, level: Logger.Level) {
        self.label = label
        self.logLevel = level
    }

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    func log(event: LogEvent) {
        var fields: [String: Any] = [:]
        for (key, value) in metadata.merging(event.metadata ?? [:], uniquingKeysWith: { $1 }) { fields[key] = Self.plain(value) }
        let object: [String: Any] = [
            "time": Self.time(Date()), "level": "\(event.level)", "message": "\(event.message)", "source": event.source, "logger": label,
            "fields": fields
        ]
        guard var line = try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys, .withoutEscapingSlashes]) else { return }
        line.append(0x0A)
        Self.output.withLock { _ in
            // One write(2) per line: lines of several threads never interleave.
            line.withUnsafeBytes { bytes in
                var offset = 0
                while offset < bytes.count {
                    let written = write(2, bytes.baseAddress! + offset, bytes.count - offset)
                    if written <= 0 { break }
                    offset += written
                }
            }
        }
    }

    private static func plain(_ value: Logger.MetadataValue) -> Any {
        switch value {
        case .string(let text): text
        case .stringConvertible(let value): "\(value)"
        case .array(let values): values.map(plain)
        case .dictionary(let values): values.mapValues(plain)
        }
    }

    private static func time(_ date: Date) -> String {
        date.formatted(.iso8601.year().month().day().time(includingFractionalSeconds: true).timeZone(separator: .omitted))
    }
}
