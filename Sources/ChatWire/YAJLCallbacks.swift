import CYAJL

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

@inline(__always)
private func state(_ context: UnsafeMutableRawPointer?) -> UnsafeMutablePointer<DecodeState> {
    context!.assumingMemoryBound(to: DecodeState.self)
}

@inline(__always)
private func bytes(_ pointer: UnsafePointer<UInt8>?, _ count: Int) -> UnsafeRawBufferPointer {
    UnsafeRawBufferPointer(start: pointer, count: count)
}

/// YAJL keeps a pointer to its callbacks for the life of a handle, and handles live from
/// line to line: the table has storage of its own that is never freed.
nonisolated(unsafe) let decodeCallbacks: UnsafePointer<yajl_callbacks> = {  // written once, before any handle reads it
    let table = UnsafeMutablePointer<yajl_callbacks>.allocate(capacity: 1)
    table.initialize(to: decodeCallbackTable)
    return UnsafePointer(table)
}()

private let decodeCallbackTable = yajl_callbacks(
    yajl_null: { context in
        state(context).pointee.scalar(.null)
        return 1
    },
    yajl_boolean: { context, value in
        state(context).pointee.scalar(.bool(value != 0))
        return 1
    },
    yajl_integer: nil,
    yajl_double: nil,
    yajl_number: { context, pointer, count in
        state(context).pointee.scalar(.number(UnsafeRawBufferPointer(start: pointer, count: count)))
        return 1
    },
    yajl_string: { context, pointer, count in
        state(context).pointee.scalar(.string(bytes(pointer, count)))
        return 1
    },
    yajl_start_map: { context in
        let state = state(context)
        guard state.pointee.enter() else { return 0 }
        state.pointee.startMap()
        return 1
    },
    yajl_map_key: { context, pointer, count in
        state(context).pointee.mapKey(bytes(pointer, count))
        return 1
    },
    yajl_end_map: { context in
        state(context).pointee.depth.nesting -= 1
        state(context).pointee.endMap()
        return 1
    },
    yajl_start_array: { context in
        let state = state(context)
        guard state.pointee.enter() else { return 0 }
        state.pointee.startArray()
        return 1
    },
    yajl_end_array: { context in
        state(context).pointee.depth.nesting -= 1
        state(context).pointee.endArray()
        return 1
    }
)
