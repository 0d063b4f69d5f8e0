@_exported import struct ChatWire.JSONValue
@_exported import enum ChatWire.Nullable

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// The chatcore protocol: every request, event and list element of docs/protocol.md, as Swift
// types generated from `Schemas/` (see `Generated/`). Modules above this one speak these
// types and never see JSON; `JSONValue` and `Nullable` are re-exported because the
// generated types use them.

// Generated types compare text byte for byte (their `==` calls `sameBytes` on each
// property): Swift's `==` on strings is canonical equivalence, under which "caf\u{E9}"
// and "cafe\u{301}" are equal, while the wire, both stores and identity providers tell
// them apart. A value respelled is a change. Everything without text compares with `==`.

@inline(__always)
func sameBytes<T: Equatable>(_ a: T, _ b: T) -> Bool { a == b }

/// Text equal byte for byte (the engine compares user ids and tags with it too).
///
/// One `memcmp` of the two strings' bytes when both have them in one piece (every native
/// string does), none when they are one string: the engine compares every element it
/// renders before and after a change, and walking `utf8` a byte at a time was 6% of its
/// work for a send.
@inlinable
public func sameBytes(_ a: String, _ b: String) -> Bool {
    guard a.utf8.count == b.utf8.count else { return false }
    let compared = a.utf8.withContiguousStorageIfAvailable { x in
        b.utf8.withContiguousStorageIfAvailable { y in
            x.isEmpty || x.baseAddress == y.baseAddress || memcmp(x.baseAddress!, y.baseAddress!, x.count) == 0
        }
    }
    return (compared ?? nil) ?? a.utf8.elementsEqual(b.utf8)
}

@inlinable
public func sameBytes(_ a: String?, _ b: String?) -> Bool {
    switch (a, b) {
    case (nil, nil): true
    case (let a?, let b?): sameBytes(a, b)
    default: false
    }
}

func sameBytes(_ a: [String], _ b: [String]) -> Bool {
    a.count == b.count && zip(a, b).allSatisfy { sameBytes($0, $1) }
}

func sameBytes(_ a: [String]?, _ b: [String]?) -> Bool {
    switch (a, b) {
    case (nil, nil): true
    case (let a?, let b?): sameBytes(a, b)
    default: false
    }
}

func sameBytes(_ a: Nullable<String>?, _ b: Nullable<String>?) -> Bool {
    switch (a, b) {
    case (nil, nil), (.null?, .null?): true
    case (.value(let a)?, .value(let b)?): sameBytes(a, b)
    default: false
    }
}
