// The message table, described once: its columns in the order the stores keep them, how a
// row's value of each is read and written, and which of them a change may write. Both
// stores build their SQL, their inserts, their updates and their reads of a message from
// `MessageColumn.all` and `MessageRow[column]`, so a new column is a case and its
// value here, plus a migration in each store.

/// A column of the message table, in the order the stores keep them.
public enum MessageColumn: String, Sendable, CaseIterable {
    case chat, id, sender, tag, content, data, timestamp, isControl, neverCountsUnread, isRecalled, changeSeq, searchRow
    case thumbName, thumbBlob, fileName, fileBlob, fileSize, attachment
    case externalId, mentions, mentionsAll

    /// The kinds of value a column holds.
    public enum Kind: Sendable {
        case int, optionalInt, text, optionalText, bool
    }

    public var kind: Kind {
        switch self {
        case .chat, .id, .sender, .timestamp, .changeSeq, .searchRow: .int
        case .fileSize: .optionalInt
        case .tag: .text
        case .content, .data, .thumbName, .thumbBlob, .fileName, .fileBlob, .attachment, .externalId, .mentions: .optionalText
        case .isControl, .neverCountsUnread, .isRecalled, .mentionsAll: .bool
        }
    }

    /// Every column, in order (`allCases`, made once: the synthesized one is a new array
    /// at each use, on the hot path of every write and read of a message).
    public static let all: [MessageColumn] = allCases
    /// What a change of a stored message may write: not its key, nor what it was sent
    /// with.
    public static let changeable: [MessageColumn] = allCases.filter { !fixed.contains($0) }
    private static let fixed: Set<MessageColumn> = [
        .chat, .id, .sender, .tag, .timestamp, .isControl, .neverCountsUnread, .externalId, .mentions, .mentionsAll
    ]
}

/// A message as everyone sees it, with what refers to it and what each user changed of
/// it for themselves.
public struct MessageRow: Sendable, Equatable {
    public var chat: Int64
    public var id: Int64
    public var sender: Int64
    public var tag: String
    public var content: String?
    public var data: String?
    public var refs: [RefRow]
    public var timestamp: Int64
    public var isControl: Bool
    public var neverCountsUnread: Bool
    public var isRecalled: Bool
    /// The change feed position of the message's latest change of its own (docs/protocol.md
    /// §4; marks moving over many messages are `RangeChangeRow`s).
    public var changeSeq: Int64
    /// Its row in the search index, 0 when its text is not indexed.
    public var searchRow: Int64
    public var attachments = AttachmentColumns()
    /// The sender's own identifier of the message (`chatMessageSend`'s `externalId`).
    public var externalId: String?
    /// The users it mentions by name, as their numbers in ascending order, separated by
    /// spaces (nil: none).
    public var mentions: String?
    /// It mentions every member.
    public var mentionsAll = false
    /// Written with a new message, never read back: every user it mentions (by name, or
    /// each member with `mentionsAll`), one `message_mention` row each, which lists a
    /// user's mentions across chats.
    public var mentionedUsers: [Int64] = []
    /// Read with the message: the messages referring to it, per tag.
    public var refCounts: [RefCountRow] = []
    /// Read with the message: every user's private state of it.
    public var privateStates: [MessageUserRow] = []

    public init(
        chat: Int64, id: Int64, sender: Int64, tag: String, content: String?, data: String?, refs: [RefRow], timestamp: Int64,
        isControl: Bool, neverCountsUnread: Bool, isRecalled: Bool, changeSeq: Int64, searchRow: Int64
    ) {
        self.chat = chat
        self.id = id
        self.sender = sender
        self.tag = tag
        self.content = content
        self.data = data
        self.refs = refs
        self.timestamp = timestamp
        self.isControl = isControl
        self.neverCountsUnread = neverCountsUnread
        self.isRecalled = isRecalled
        self.changeSeq = changeSeq
        self.searchRow = searchRow
    }

    /// A row of the table's columns only (references, counts and private states are rows
    /// of their own tables), made from the value of each.
    public init(values: (MessageColumn) throws -> StoredValue) rethrows {
        self.init(
            chat: 0, id: 0, sender: 0, tag: "", content: nil, data: nil, refs: [], timestamp: 0, isControl: false, neverCountsUnread: false, isRecalled: false,
            changeSeq: 0, searchRow: 0)
        for column in MessageColumn.all { self[column] = try values(column) }
    }

    /// The value of a column (a value of another kind than the column's is not written).
    /// Inlinable: the stores read every column of every message they write through it.
    @inlinable
    public subscript(column: MessageColumn) -> StoredValue {
        get {
            switch column {
            case .chat: .int(chat)
            case .id: .int(id)
            case .sender: .int(sender)
            case .tag: .text(tag)
            case .content: .text(content)
            case .data: .text(data)
            case .timestamp: .int(timestamp)
            case .isControl: .bool(isControl)
            case .neverCountsUnread: .bool(neverCountsUnread)
            case .isRecalled: .bool(isRecalled)
            case .changeSeq: .int(changeSeq)
            case .searchRow: .int(searchRow)
            case .thumbName, .thumbBlob, .fileName, .fileBlob, .fileSize, .attachment: attachments[column]
            case .externalId: .text(externalId)
            case .mentions: .text(mentions)
            case .mentionsAll: .bool(mentionsAll)
            }
        }
        set {
            switch (column, newValue) {
            case (.chat, .int(let value?)): chat = value
            case (.id, .int(let value?)): id = value
            case (.sender, .int(let value?)): sender = value
            case (.tag, .text(let value?)): tag = value
            case (.content, .text(let value)): content = value
            case (.data, .text(let value)): data = value
            case (.timestamp, .int(let value?)): timestamp = value
            case (.isControl, .bool(let value)): isControl = value
            case (.neverCountsUnread, .bool(let value)): neverCountsUnread = value
            case (.isRecalled, .bool(let value)): isRecalled = value
            case (.changeSeq, .int(let value?)): changeSeq = value
            case (.searchRow, .int(let value?)): searchRow = value
            case (.thumbName, _), (.thumbBlob, _), (.fileName, _), (.fileBlob, _), (.fileSize, _), (.attachment, _): attachments[column] = newValue
            case (.externalId, .text(let value)): externalId = value
            case (.mentions, .text(let value)): mentions = value
            case (.mentionsAll, .bool(let value)): mentionsAll = value
            default: break
            }
        }
    }

    /// The message's changeable columns whose values differ from `old` (references are
    /// rows of their own: they only ever go, with a recall).
    public func columns(changedFrom old: MessageColumns) -> Set<MessageColumn> {
        Set(MessageColumn.changeable.filter { self[$0] != old[$0] })
    }
}

/// A message's attachments: sanitized base names, stored contents (SHA-256 hex, nil until
/// stored), and `Sending`, `Stored` or `Failed` (all nil without attachments).
public struct AttachmentColumns: Sendable, Equatable {
    public var thumbName: String?
    public var thumbBlob: String?
    public var fileName: String?
    public var fileBlob: String?
    public var fileSize: Int64?
    public var attachment: String?

    public init() {}

    public var isEmpty: Bool { self == AttachmentColumns() }

    /// The value of one of the attachment columns (`.text(nil)` for any other).
    @inlinable
    public subscript(column: MessageColumn) -> StoredValue {
        get {
            switch column {
            case .thumbName: .text(thumbName)
            case .thumbBlob: .text(thumbBlob)
            case .fileName: .text(fileName)
            case .fileBlob: .text(fileBlob)
            case .fileSize: .int(fileSize)
            case .attachment: .text(attachment)
            default: .text(nil)
            }
        }
        set {
            switch (column, newValue) {
            case (.thumbName, .text(let value)): thumbName = value
            case (.thumbBlob, .text(let value)): thumbBlob = value
            case (.fileName, .text(let value)): fileName = value
            case (.fileBlob, .text(let value)): fileBlob = value
            case (.fileSize, .int(let value)): fileSize = value
            case (.attachment, .text(let value)): attachment = value
            default: break
            }
        }
    }
}

/// What a message's row holds in the columns a change may write (and whether it has
/// references): what the engine keeps of a message as the store has it, to write only
/// what a change changed. Compact, since every cached message carries one: the attachment
/// columns, nil for most messages, take room only when one is not.
public struct MessageColumns: Sendable {
    public var content: String?
    public var data: String?
    public var isRecalled: Bool
    public var hasReferences: Bool
    public var changeSeq: Int64
    public var searchRow: Int64
    public var attachments: Attachments?

    public final class Attachments: Sendable {
        public let columns: AttachmentColumns

        init(_ columns: AttachmentColumns) {
            self.columns = columns
        }
    }

    public init(_ row: MessageRow) {
        content = row.content
        data = row.data
        isRecalled = row.isRecalled
        hasReferences = !row.refs.isEmpty
        changeSeq = row.changeSeq
        searchRow = row.searchRow
        attachments = row.attachments.isEmpty ? nil : Attachments(row.attachments)
    }

    /// The value of a changeable column.
    public subscript(column: MessageColumn) -> StoredValue {
        switch column {
        case .content: .text(content)
        case .data: .text(data)
        case .isRecalled: .bool(isRecalled)
        case .changeSeq: .int(changeSeq)
        case .searchRow: .int(searchRow)
        default: (attachments?.columns ?? AttachmentColumns())[column]
        }
    }
}
