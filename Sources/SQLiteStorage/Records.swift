import GRDB
import Storage

// Each row the store keeps maps to its table here, once: a `Field` enumeration names the
// table's columns in the order they are selected (`databaseSelection`), `init(row:)` reads
// them by that position (no look-up of names per value: start-up reads every chat and
// membership, a window a hundred messages), `encode(to:)` writes them, and a narrow
// change writes only the columns it names (`update(_:columns:)`).

/// A record whose columns are selected in the order of its `Field`s.
protocol SelectedInOrder: FetchableRecord, TableRecord {
    associatedtype Field: RawRepresentable & CaseIterable where Field.RawValue == Int
}

extension SelectedInOrder {
    static var columnNames: [String] { Field.allCases.map { "\($0)" } }
    /// `"a", "b", ...` for a SELECT of exactly these columns, in order.
    static var selectionSQL: String { columnNames.map { "\"\($0)\"" }.joined(separator: ", ") }
    public static var databaseSelection: [any SQLSelectable] { columnNames.map { Column($0) } }
}

extension UserRecord: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "user"
    enum Field: Int, CaseIterable { case number, userId, regId }

    public init(row: Row) throws {
        self.init(number: row[Field.number.rawValue], userId: row[Field.userId.rawValue], regId: row[Field.regId.rawValue])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["number"] = number
        container["userId"] = userId
        container["regId"] = regId
    }
}

extension EndpointRow: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "endpoint"
    enum Field: Int, CaseIterable { case id, user, description, nickname, isLegacyDelegate, ordinal, pushToken }

    public init(row: Row) throws {
        self.init(
            id: row[Field.id.rawValue], user: row[Field.user.rawValue], description: row[Field.description.rawValue], nickname: row[Field.nickname.rawValue],
            isLegacyDelegate: row[Field.isLegacyDelegate.rawValue], ordinal: row[Field.ordinal.rawValue])
        pushToken = row[Field.pushToken.rawValue]
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["id"] = id
        container["user"] = user
        container["description"] = description
        container["nickname"] = nickname
        container["isLegacyDelegate"] = isLegacyDelegate
        container["ordinal"] = ordinal
        container["pushToken"] = pushToken
    }
}

extension ChatRow: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "chat"
    enum Field: Int, CaseIterable { case number, subject, isOneToOne, invitePolicy, isDefunct, data, lastMessage, lastActivity, pinPolicy, pins }

    public init(row: Row) throws {
        self.init(
            number: row[Field.number.rawValue], subject: row[Field.subject.rawValue], isOneToOne: row[Field.isOneToOne.rawValue],
            invitePolicy: row[Field.invitePolicy.rawValue], isDefunct: row[Field.isDefunct.rawValue], data: row[Field.data.rawValue],
            lastMessage: row[Field.lastMessage.rawValue], lastActivity: row[Field.lastActivity.rawValue])
        pinPolicy = row[Field.pinPolicy.rawValue]
        pins = row[Field.pins.rawValue]
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["number"] = number
        container["subject"] = subject
        container["isOneToOne"] = isOneToOne
        container["invitePolicy"] = invitePolicy
        container["isDefunct"] = isDefunct
        container["data"] = data
        container["lastMessage"] = lastMessage
        container["lastActivity"] = lastActivity
        container["pinPolicy"] = pinPolicy
        container["pins"] = pins
    }
}

extension MemberRow: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "member"
    enum Field: Int, CaseIterable {
        case chat, user, isActive, isAdmin, joinedAt, leftAt, isHidden, localData, privateData, deliveredUpTo, readUpTo, numUnread, numUnreadMentions,
            mutedUntil, isBanned
    }

    public init(row: Row) throws {
        self.init(
            chat: row[Field.chat.rawValue], user: row[Field.user.rawValue], isActive: row[Field.isActive.rawValue], isAdmin: row[Field.isAdmin.rawValue],
            joinedAt: row[Field.joinedAt.rawValue], leftAt: row[Field.leftAt.rawValue], isHidden: row[Field.isHidden.rawValue],
            localData: row[Field.localData.rawValue],
            privateData: row[Field.privateData.rawValue], deliveredUpTo: row[Field.deliveredUpTo.rawValue], readUpTo: row[Field.readUpTo.rawValue],
            numUnread: row[Field.numUnread.rawValue])
        numUnreadMentions = row[Field.numUnreadMentions.rawValue]
        mutedUntil = row[Field.mutedUntil.rawValue]
        isBanned = row[Field.isBanned.rawValue]
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["user"] = user
        container["isActive"] = isActive
        container["isAdmin"] = isAdmin
        container["joinedAt"] = joinedAt
        container["leftAt"] = leftAt
        container["isHidden"] = isHidden
        container["localData"] = localData
        container["privateData"] = privateData
        container["deliveredUpTo"] = deliveredUpTo
        container["readUpTo"] = readUpTo
        container["numUnread"] = numUnread
        container["numUnreadMentions"] = numUnreadMentions
        container["mutedUntil"] = mutedUntil
        container["isBanned"] = isBanned
    }
}

extension UserSettingsRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "user_settings"

    public init(row: Row) throws {
        self.init(
            user: row["user"], presenceHidden: row["presenceHidden"], lastActive: row["lastActive"],
            blocked: UserSettingsRow.blocked(stored: row["blocked"] ?? ""))
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["user"] = user
        container["presenceHidden"] = presenceHidden
        container["lastActive"] = lastActive
        container["blocked"] = storedBlocked
    }
}

extension MessageRow: FetchableRecord, TableRecord, PersistableRecord {
    public static let databaseTableName = "message"
    /// `"a", "b", ...`: the table's columns (`MessageColumn`), in order.
    static let selectionSQL = MessageColumn.allCases.map { "\"\($0.rawValue)\"" }.joined(separator: ", ")
    public static var databaseSelection: [any SQLSelectable] { MessageColumn.allCases.map { Column($0.rawValue) } }

    /// The message's own columns (references, counts and private states are rows of
    /// their own tables, read beside it).
    public init(row: Row) throws {
        var index = 0
        self.init { column in
            defer { index += 1 }
            return switch column.kind {
            case .int: .int(row[index] as Int64)
            case .optionalInt: .int(row[index] as Int64?)
            case .text: .text(row[index] as String)
            case .optionalText: .text(row[index] as String?)
            case .bool: .bool(row[index] as Bool)
            }
        }
    }

    /// One prepared INSERT of every column, bound by position: the hot write path (a
    /// record's `insert` builds its statement's SQL and a container per row, a third of a
    /// send's store time).
    static let insertSQL = "INSERT INTO message (\(selectionSQL)) VALUES (\(MessageColumn.allCases.map { _ in "?" }.joined(separator: ", ")))"

    /// The values of the columns, in order.
    var insertArguments: StatementArguments {
        StatementArguments(MessageColumn.all.map { self[$0].convertible })
    }

    public func encode(to container: inout PersistenceContainer) throws {
        for column in MessageColumn.all { container[column.rawValue] = self[column].databaseValue }
    }
}

extension StoredValue {
    /// As GRDB binds a value of its own type (a `DatabaseValue` made here and bound cost
    /// a sixth of the durable sends per second).
    var convertible: (any DatabaseValueConvertible)? {
        switch self {
        case .int(let value): value
        case .text(let value): value
        case .bool(let value): value
        }
    }

    var databaseValue: DatabaseValue {
        switch self {
        case .int(let value): value.databaseValue
        case .text(let value): value.databaseValue
        case .bool(let value): value.databaseValue
        }
    }
}

extension RefCountRow: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "ref_count"
    enum Field: Int, CaseIterable { case chat, target, tag, count, newest }

    public init(row: Row) throws {
        self.init(
            chat: row[Field.chat.rawValue], target: row[Field.target.rawValue], tag: row[Field.tag.rawValue], count: row[Field.count.rawValue],
            newest: row[Field.newest.rawValue])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["target"] = target
        container["tag"] = tag
        container["count"] = count
        container["newest"] = newest
    }
}

extension MessageUserRow: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "message_user"
    enum Field: Int, CaseIterable { case chat, id, user, localData, isDeleted, thumbDetached, fileDownloaded, reactions }

    public init(row: Row) throws {
        self.init(
            chat: row[Field.chat.rawValue], id: row[Field.id.rawValue], user: row[Field.user.rawValue], localData: row[Field.localData.rawValue],
            isDeleted: row[Field.isDeleted.rawValue])
        thumbDetached = row[Field.thumbDetached.rawValue]
        fileDownloaded = row[Field.fileDownloaded.rawValue]
        reactions = row[Field.reactions.rawValue]
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["id"] = id
        container["user"] = user
        container["localData"] = localData
        container["isDeleted"] = isDeleted
        container["thumbDetached"] = thumbDetached
        container["fileDownloaded"] = fileDownloaded
        container["reactions"] = reactions
    }
}

extension RangeChangeRow: SelectedInOrder, PersistableRecord {
    public static let databaseTableName = "range_change"
    enum Field: Int, CaseIterable { case chat, firstSeq, firstId, lastId }

    public init(row: Row) throws {
        self.init(
            chat: row[Field.chat.rawValue], firstSeq: row[Field.firstSeq.rawValue], firstId: row[Field.firstId.rawValue], lastId: row[Field.lastId.rawValue])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["lastSeq"] = lastSeq
        container["firstSeq"] = firstSeq
        container["firstId"] = firstId
        container["lastId"] = lastId
    }
}

// MARK: Updates of some columns

/// A row a commit changes some columns of, by one prepared `UPDATE` per set of columns.
/// A record's `update(_:columns:)` builds its statement's SQL and a container of every
/// column for each row: it was most of a commit's time when a send moves each member of
/// a big chat, or a sign-in marks a user's messages in 2,000 chats delivered.
protocol UpdatedInPlace: TableRecord {
    associatedtype UpdatedColumn: RawRepresentable<String> & CaseIterable & Hashable
    /// The primary key's columns and this row's values of them.
    var key: [(column: String, value: any DatabaseValueConvertible)] { get }
    func value(of column: UpdatedColumn) -> (any DatabaseValueConvertible)?
}

extension UpdatedInPlace {
    /// Writes `columns` of this row, which must exist (as `update(_:columns:)`, it throws
    /// `RecordError.recordNotFound` when no row has the key).
    func update(_ db: Database, changing columns: Set<UpdatedColumn>) throws {
        guard !columns.isEmpty else { return }
        let written = UpdatedColumn.allCases.filter(columns.contains)
        let key = self.key
        let sql =
            "UPDATE \"\(Self.databaseTableName)\" SET "
            + written.map { "\"\($0.rawValue)\" = ?" }.joined(separator: ", ")
            + " WHERE " + key.map { "\"\($0.column)\" = ?" }.joined(separator: " AND ")
        let statement = try db.cachedStatement(sql: sql)
        try statement.execute(arguments: StatementArguments(written.map(value(of:)) + key.map(\.value)))
        if db.changesCount == 0 {
            throw RecordError.recordNotFound(
                databaseTableName: Self.databaseTableName,
                key: Dictionary(uniqueKeysWithValues: key.map { ($0.column, $0.value.databaseValue) }))
        }
    }
}

extension MessageRow: UpdatedInPlace {
    var key: [(column: String, value: any DatabaseValueConvertible)] { [("chat", chat), ("id", id)] }
    func value(of column: MessageColumn) -> (any DatabaseValueConvertible)? { self[column].convertible }
}

extension ChatRow: UpdatedInPlace {
    var key: [(column: String, value: any DatabaseValueConvertible)] { [("number", number)] }
    func value(of column: ChatColumn) -> (any DatabaseValueConvertible)? {
        switch column {
        case .subject: subject
        case .isDefunct: isDefunct
        case .data: data
        case .lastMessage: lastMessage
        case .lastActivity: lastActivity
        case .pins: pins
        }
    }
}

extension MemberRow: UpdatedInPlace {
    var key: [(column: String, value: any DatabaseValueConvertible)] { [("chat", chat), ("user", user)] }
    func value(of column: MemberColumn) -> (any DatabaseValueConvertible)? {
        switch column {
        case .isActive: isActive
        case .isAdmin: isAdmin
        case .joinedAt: joinedAt
        case .leftAt: leftAt
        case .isHidden: isHidden
        case .localData: localData
        case .privateData: privateData
        case .deliveredUpTo: deliveredUpTo
        case .readUpTo: readUpTo
        case .numUnread: numUnread
        case .numUnreadMentions: numUnreadMentions
        case .mutedUntil: mutedUntil
        case .isBanned: isBanned
        }
    }
}
