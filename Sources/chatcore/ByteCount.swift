import ArgumentParser

/// A number of bytes on the command line: `1048576`, `1MiB`, `64 MiB`, `512KiB`, `2GiB` (K, M
/// and G alone are binary too), shown in `--help` as people read it (`1 MiB`).
struct ByteCount: ExpressibleByArgument, Equatable {
    let bytes: Int

    init(_ bytes: Int) { self.bytes = bytes }

    private static let units: [(suffixes: [String], shift: Int)] = [
        (["gib", "gi", "g", "gb"], 30), (["mib", "mi", "m", "mb"], 20), (["kib", "ki", "k", "kb"], 10), (["b", ""], 0)
    ]

    init?(argument: String) {
        let text = argument.lowercased().replacingOccurrences(of: " ", with: "").replacingOccurrences(of: "_", with: "")
        for (suffixes, shift) in Self.units {
            for suffix in suffixes where text.hasSuffix(suffix) {
                guard let number = Int(text.dropLast(suffix.count)), number >= 0 else { continue }
                let (value, overflow) = number.multipliedReportingOverflow(by: 1 << shift)
                guard !overflow else { return nil }
                self.bytes = value
                return
            }
        }
        return nil
    }

    var defaultValueDescription: String { description }

    static var defaultCompletionKind: CompletionKind { .default }

    /// The largest unit that divides it exactly: `64 MiB`, `1536 KiB`, `1000 bytes`.
    var description: String {
        for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] where bytes != 0 && bytes % (1 << shift) == 0 {
            return "\(bytes >> shift) \(unit)"
        }
        return "\(bytes) bytes"
    }
}
