import NIOCore
import PostgresNIO
import Storage

/// A statement, or a piece of one, written with string interpolation the way
/// postgres-nio's `PostgresQuery` is: every interpolated value is a bound parameter, never
/// text in the statement; `\(unescaped:)` puts SQL text in (names and fixed fragments
/// only); `\(sql)` puts in another piece with its values. Pieces compose in any order and
/// are numbered when the statement is made (`query`), through `PostgresQuery`'s own
/// interpolation: the store never numbers a parameter itself.
struct SQL: ExpressibleByStringInterpolation, Sendable {
    fileprivate enum Piece: Sendable {
        case text(String)
        case value(@Sendable (inout PostgresQuery.StringInterpolation) -> Void)
    }

    fileprivate var pieces: [Piece] = []

    init(stringLiteral value: String) {
        pieces = [.text(value)]
    }

    init(stringInterpolation: StringInterpolation) {
        pieces = stringInterpolation.pieces
    }

    /// `pieces` with `separator` between them.
    init(joining pieces: [SQL], separator: String) {
        for (index, piece) in pieces.enumerated() {
            if index > 0 { self.pieces.append(.text(separator)) }
            self.pieces += piece.pieces
        }
    }

    static func + (left: SQL, right: SQL) -> SQL {
        var joined = left
        joined.pieces += right.pieces
        return joined
    }

    var isEmpty: Bool {
        pieces.allSatisfy { if case .text(let text) = $0 { text.isEmpty } else { false } }
    }

    /// The statement for postgres-nio.
    var query: PostgresQuery {
        var query = PostgresQuery.StringInterpolation(literalCapacity: 0, interpolationCount: pieces.count)
        for piece in pieces {
            switch piece {
            case .text(let text): query.appendLiteral(text)
            case .value(let append): append(&query)
            }
        }
        return PostgresQuery(stringInterpolation: query)
    }

    struct StringInterpolation: StringInterpolationProtocol {
        fileprivate var pieces: [Piece] = []

        init(literalCapacity: Int, interpolationCount: Int) {
            pieces.reserveCapacity(2 * interpolationCount + 1)
        }

        mutating func appendLiteral(_ literal: String) {
            if !literal.isEmpty { pieces.append(.text(literal)) }
        }

        /// A value, bound.
        mutating func appendInterpolation<Value: PostgresDynamicTypeEncodable & Sendable>(_ value: Value) {
            pieces.append(.value { $0.appendInterpolation(value) })
        }

        /// A value or NULL, bound.
        mutating func appendInterpolation<Value: PostgresDynamicTypeEncodable & Sendable>(_ value: Value?) {
            pieces.append(.value { $0.appendInterpolation(value) })
        }

        /// A piece with its own values.
        mutating func appendInterpolation(_ sql: SQL) {
            pieces += sql.pieces
        }

        /// SQL text: a name or a fixed fragment, never a value from outside.
        mutating func appendInterpolation(unescaped text: String) {
            pieces.append(.text(text))
        }

        /// One column of rows (values of one type, as the first one is) as one array
        /// parameter, cast to its SQL array type.
        mutating func appendInterpolation(column values: [StoredValue]) {
            switch values.first {
            case .int?, nil:
                appendInterpolation(NullableArray(values.map { if case .int(let number) = $0 { number } else { nil } }))
                appendLiteral("::bigint[]")
            case .text?:
                appendInterpolation(NullableArray(values.map { if case .text(let text) = $0 { text } else { nil } }))
                appendLiteral("::text[]")
            case .bool?:
                appendInterpolation(NullableArray(values.map { if case .bool(let flag) = $0 { flag } else { nil } }))
                appendLiteral("::boolean[]")
            }
        }
    }
}

/// An array parameter whose elements may be NULL (postgres-nio's arrays cannot hold
/// NULL), in PostgreSQL's binary array format: dimensions, whether a NULL is in it, the
/// element type, length and lower bound, then each element (length -1 for NULL).
struct NullableArray<Element: PostgresArrayEncodable & PostgresNonThrowingEncodable & Sendable>: PostgresNonThrowingEncodable, Sendable {
    let elements: [Element?]

    init(_ elements: [Element?]) {
        self.elements = elements
    }

    static var psqlType: PostgresDataType { Element.psqlArrayType }
    static var psqlFormat: PostgresFormat { .binary }

    func encode<JSONEncoder: PostgresJSONEncoder>(into buffer: inout ByteBuffer, context: PostgresEncodingContext<JSONEncoder>) {
        buffer.writeInteger(elements.isEmpty ? 0 : 1, as: Int32.self)
        buffer.writeInteger(elements.contains { $0 == nil } ? 1 : 0, as: Int32.self)
        buffer.writeInteger(Element.psqlType.rawValue)
        guard !elements.isEmpty else { return }
        buffer.writeInteger(Int32(elements.count))
        buffer.writeInteger(1, as: Int32.self)
        for element in elements {
            guard let element else {
                buffer.writeInteger(-1, as: Int32.self)
                continue
            }
            let lengthAt = buffer.writerIndex
            buffer.writeInteger(0, as: Int32.self)
            let start = buffer.writerIndex
            element.encode(into: &buffer, context: context)
            buffer.setInteger(Int32(buffer.writerIndex - start), at: lengthAt)
        }
    }
}
