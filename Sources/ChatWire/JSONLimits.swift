/// Limits every JSON reader in chatcore keeps.
public enum JSONLimits {
    /// Objects and arrays nest at most this deep in one line. Everything that walks a
    /// value (decoding, minifying, re-decoding a union kept as bytes, encoding, freeing a
    /// tree) recurses, so a deeper line is refused before any of it runs: a 120 KB line
    /// of brackets would otherwise overflow a thread's stack.
    public static let maxNesting = 128

    static let tooDeep = "objects and arrays nest deeper than the limit of \(maxNesting) levels"
}
