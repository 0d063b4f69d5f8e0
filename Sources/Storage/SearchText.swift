/// How a search matches text, the same for every index: a message is found when the
/// query's text is in its content ignoring case, each character of both lowercased on
/// its own (`lowered`). An index only narrows the candidates; `SearchNeedle` decides.
public enum SearchText {
    /// The Unicode scalars of `text`, each lowercased on its own (as `SearchNeedle` lowers a
    /// candidate): one scalar can lower to several ("İ"), never depending on its neighbours.
    public static func lowered(_ text: String) -> [UInt32] {
        var out: [UInt32] = []
        out.reserveCapacity(text.utf8.count)
        for scalar in text.unicodeScalars {
            let value = scalar.value
            if value < 0x80 {
                out.append(value >= 0x41 && value <= 0x5A ? value | 0x20 : value)
            } else {
                for lowered in String(scalar).lowercased().unicodeScalars { out.append(lowered.value) }
            }
        }
        return out
    }

    /// The keys under which an index files a message of `chat` (its `scope`): each distinct
    /// character (its scalar value, 0 to 0x10FFFF) and each distinct run of three (hashed,
    /// negative) of the lowered text. A query of one or two characters looks for those
    /// characters, a longer one for some of its runs of three (`queryKeys`): every
    /// message that holds the query has its keys.
    ///
    /// A text with more than `maxKeys` of them (several kilobytes of varied text: random
    /// text of 70 KB has 70,000) is filed under its chat and `longKey` only, and every
    /// query looks there too (the needle decides): a batch of such messages made the
    /// keys of one commit over a hundred megabytes.
    public static func keys(of text: String, chat: Int64) -> [Int32] {
        let scalars = lowered(text)
        var keys = Set<Int32>(minimumCapacity: min(scalars.count * 2, maxKeys) + 1)
        for (index, scalar) in scalars.enumerated() {
            keys.insert(Int32(scalar))
            if index + 2 < scalars.count { keys.insert(triple(scalar, scalars[index + 1], scalars[index + 2])) }
            if keys.count > maxKeys { return [longKey, scope(chat)] }
        }
        keys.insert(scope(chat))
        return keys.sorted()
    }

    /// The most keys a message is filed under (`keys(of:chat:)`).
    public static let maxKeys = 4096

    /// The key of the messages with too many keys of their own: above every character,
    /// below every chat.
    public static let longKey: Int32 = 0x1F_FFFF

    /// The keys a message holding `text` has (all of them: `keys(of:)`): its runs of
    /// three, at most `maxQueryKeys` of them, spread over it. The query is lowered whole,
    /// as `SearchNeedle` lowers it: what the needle finds in a candidate lowered character
    /// by character is a run of the candidate's scalars.
    public static func queryKeys(_ text: String) -> [Int32] {
        let scalars = text.lowercased().unicodeScalars.map(\.value)
        guard scalars.count >= 3 else { return Array(Set(scalars.map { Int32($0) })).sorted() }
        let runs = scalars.count - 2
        let asked = min(runs, maxQueryKeys)
        let starts = (0..<asked).map { $0 * (runs - 1) / max(asked - 1, 1) }
        return Array(Set(starts.map { triple(scalars[$0], scalars[$0 + 1], scalars[$0 + 2]) })).sorted()
    }

    /// The most runs of three a query looks for. Three let a phrase of common words
    /// ("coffee deadline") match every message holding both words anywhere, all of which
    /// the needle then reads and refuses; more narrow the candidates to those holding the
    /// words' joins, at the cost of one more GIN entry each.
    public static let maxQueryKeys = 8

    /// The key of a chat: at 0x200000 and above, apart from characters, runs and `longKey` (chats
    /// past 2³¹ − 0x200000 share keys, and are told apart by their numbers).
    public static func scope(_ chat: Int64) -> Int32 {
        Int32(0x200000 + chat % (Int64(Int32.max) - 0x200000))
    }

    /// A run of three characters: their values mixed (murmur3's finaliser), the sign bit set.
    static func triple(_ a: UInt32, _ b: UInt32, _ c: UInt32) -> Int32 {
        // Characters take 21 bits: three of them in 63, mixed into 32 (each bit of the
        // input moves about half of the output's).
        var mixed = UInt64(a) << 42 | UInt64(b) << 21 | UInt64(c)
        mixed = (mixed ^ mixed >> 33) &* 0xFF51_AFD7_ED55_8CCD
        mixed = (mixed ^ mixed >> 33) &* 0xC4CE_B9FE_1A85_EC53
        mixed ^= mixed >> 33
        return Int32(truncatingIfNeeded: mixed | 0x8000_0000)
    }
}

/// A query's text, found in a candidate's UTF-8 ignoring case: the candidate is
/// lowercased into a reused buffer as it is compared, ASCII by folding its bytes, other
/// characters by their lowercase mapping (looked up once per character and kept). No
/// string is made per candidate: Foundation's case-insensitive `range(of:)` took 80%
/// of a search's time on Linux, and `lowercased()` of every candidate most of the rest.
/// One per search (it keeps buffers): not for several threads.
///
/// The comparison takes time linear in the candidate's length whatever the query
/// (Knuth–Morris–Pratt): comparing at every start, a query of 1,022 `a` and `bb` against
/// 70,000 `a` took 70 million steps per message.
public final class SearchNeedle {
    private let bytes: [UInt8]
    /// For each prefix of `bytes`, the length of its longest proper prefix that is also
    /// its suffix (where to go on after a mismatch).
    private let fallback: [Int]
    private var lowered: [UInt8] = []
    private var mappings: [UInt32: [UInt8]] = [:]

    public init(_ text: String) {
        bytes = Array(text.lowercased().utf8)
        var fallback = [Int](repeating: 0, count: bytes.count)
        var matched = 0
        for index in bytes.indices.dropFirst() {
            while matched > 0 && bytes[index] != bytes[matched] { matched = fallback[matched - 1] }
            if bytes[index] == bytes[matched] { matched += 1 }
            fallback[index] = matched
        }
        self.fallback = fallback
    }

    public func isFound(in candidate: String) -> Bool {
        var candidate = candidate
        return candidate.withUTF8 { isFound(in: $0) }
    }

    public func isFound(in candidate: UnsafeBufferPointer<UInt8>) -> Bool {
        guard !bytes.isEmpty else { return true }
        if let found = findInASCII(candidate) { return found }
        let input = candidate
        // Worked on as locals: a stored property of a class is checked for exclusive
        // access at every use, which took most of the time of a long candidate.
        var lowered: [UInt8] = []
        var mappings: [UInt32: [UInt8]] = [:]
        swap(&lowered, &self.lowered)
        swap(&mappings, &self.mappings)
        defer {
            swap(&lowered, &self.lowered)
            swap(&mappings, &self.mappings)
        }
        lowered.removeAll(keepingCapacity: true)
        var index = 0
        while index < input.count {
            let byte = input[index]
            if byte < 0x80 {
                lowered.append(byte >= 0x41 && byte <= 0x5A ? byte | 0x20 : byte)
                index += 1
                continue
            }
            let length = byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : byte >= 0xC0 ? 2 : 1
            let end = min(index + length, input.count)
            var value: UInt32 = 0
            for position in index..<end { value = value << 8 | UInt32(input[position]) }
            if let mapping = mappings[value] {
                lowered.append(contentsOf: mapping)
            } else {
                let original = Array(input[index..<end])
                let mapping = Array(String(decoding: original, as: UTF8.self).lowercased().utf8)
                mappings[value] = mapping
                lowered.append(contentsOf: mapping)
            }
            index = end
        }
        return lowered.withUnsafeBufferPointer { haystack in
            bytes.withUnsafeBufferPointer { needle in
                fallback.withUnsafeBufferPointer { fallback in
                    guard haystack.count >= needle.count else { return false }
                    var matched = 0
                    for byte in haystack {
                        while matched > 0 && byte != needle[matched] { matched = fallback[matched - 1] }
                        if byte == needle[matched] {
                            matched += 1
                            if matched == needle.count { return true }
                        }
                    }
                    return false
                }
            }
        }
    }

    /// The match over a candidate that is ASCII, folded as it is read (no copy); nil as
    /// soon as a byte is not ASCII (then the candidate is lowered whole first).
    private func findInASCII(_ input: UnsafeBufferPointer<UInt8>) -> Bool? {
        bytes.withUnsafeBufferPointer { needle in
            fallback.withUnsafeBufferPointer { fallback in
                var matched = 0
                for raw in input {
                    guard raw < 0x80 else { return nil }
                    let byte = raw >= 0x41 && raw <= 0x5A ? raw | 0x20 : raw
                    while matched > 0 && byte != needle[matched] { matched = fallback[matched - 1] }
                    if byte == needle[matched] {
                        matched += 1
                        if matched == needle.count { return true }
                    }
                }
                return false
            }
        }
    }
}
