/// A value of a stored column, as the stores write and compare it.
public enum StoredValue: Sendable, Equatable {
    case int(Int64?)
    case text(String?)
    case bool(Bool)

    /// Text compares by its bytes, as the stores keep it (`differs`).
    public static func == (left: StoredValue, right: StoredValue) -> Bool {
        switch (left, right) {
        case (.int(let a), .int(let b)): a == b
        case (.bool(let a), .bool(let b)): a == b
        case (.text(let a), .text(let b)): !differs(a, b)
        default: false
        }
    }
}
