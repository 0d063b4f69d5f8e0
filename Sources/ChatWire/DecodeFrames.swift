import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// MARK: - State

/// An open object, array or skipped/captured value.
struct Frame {
    enum Kind: UInt8 {
        /// The line's outer object `{"<request>": ...}`.
        case envelope
        case object
        case array
        /// A free-form value or a union, kept as bytes.
        case capture
        /// A union before its first member: if that is the discriminator, the frame becomes
        /// the chosen variant's object; otherwise it becomes a capture.
        case union
        case skip
    }

    var kind: Kind
    /// capture/skip: nesting depth inside the value.
    var depth = 1
    /// capture: where the value's bytes start.
    var start = 0
    /// envelope: members seen.
    var members = 0
    /// array: index of the next element.
    var index = 0
    var object = Object()
    /// envelope: the type of the request value; capture: the captured type; array: element type.
    var type: WireType?
    var maxItems = 0
    var minItems = 0
    var values: [WireValue] = []
    /// union: its type, and whether the discriminator's value comes next.
    var unionType: (any WireUnionDecodable.Type)?
    var awaitingDiscriminator = false

    init(kind: Kind) {
        self.kind = kind
    }

    /// What an object frame knows of its object.
    struct Object {
        /// The member whose value comes next (-1: skip it).
        var pending = -1
        /// First of its slots in the arena.
        var slotBase = 0
        /// The request itself (its `cookie` is echoed in failures).
        var isRequest = false
        /// Its schema (schemas are static: they outlive every decoder, so no reference is
        /// counted for them).
        var schemaReference: Unmanaged<WireSchema>?
        /// The index of its `cookie` member (-1 when none).
        var cookieIndex = -1
        /// The schema's member types, read without reference counting.
        var types: UnsafePointer<WireType>?
        var objectType: (any WireDecodable.Type)?
    }
}

/// The open frames, in memory of their own: a field of a frame is read and written in
/// place (an array subscript would copy the whole frame to read one field).
struct FrameStack {
    private(set) var base: UnsafeMutablePointer<Frame>
    private(set) var count = 0
    var capacity: Int

    init() {
        capacity = 16
        base = .allocate(capacity: capacity)
    }

    var isEmpty: Bool { count == 0 }

    /// A new top frame of this kind, made in place; returns where it is.
    @discardableResult
    mutating func push(_ kind: Frame.Kind) -> UnsafeMutablePointer<Frame> {
        grow()
        let slot = base + count
        slot.initialize(to: Frame(kind: kind))
        count += 1
        return slot
    }

    mutating func append(_ frame: Frame) {
        grow()
        (base + count).initialize(to: frame)
        count += 1
    }

    mutating func grow() {
        if count == capacity {
            let larger = UnsafeMutablePointer<Frame>.allocate(capacity: capacity * 2)
            larger.moveInitialize(from: base, count: count)
            base.deallocate()
            base = larger
            capacity *= 2
        }
    }

    /// Drops the top frame in place.
    mutating func removeLast() {
        count -= 1
        (base + count).deinitialize(count: 1)
    }

    /// Takes the top frame out (when its contents are needed afterwards).
    mutating func popLast() -> Frame {
        count -= 1
        return (base + count).move()
    }

    mutating func removeAll() {
        base.deinitialize(count: count)
        count = 0
    }

    func release() {
        base.deinitialize(count: count)
        base.deallocate()
    }

    subscript(index: Int) -> UnsafeMutablePointer<Frame> { base + index }
}

enum Scalar {
    case null
    case bool(Bool)
    case number(UnsafeRawBufferPointer)
    case string(UnsafeRawBufferPointer)
}
