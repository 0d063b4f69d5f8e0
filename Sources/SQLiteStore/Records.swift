import GRDB
import Store

// Each row the store keeps maps to its table here, once: read by `init(row:)`, written by
// `encode(to:)`; narrow changes write only the columns they name (`update(_:columns:)`).

extension UserRecord: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "user"

    public init(row: Row) throws {
        self.init(number: row["number"], userId: row["userId"], regId: row["regId"])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["number"] = number
        container["userId"] = userId
        container["regId"] = regId
    }
}

extension EndpointRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "endpoint"

    public init(row: Row) throws {
        self.init(id: row["id"], user: row["user"], description: row["description"], nickname: row["nickname"],
                  isLegacyDelegate: row["isLegacyDelegate"], ordinal: row["ordinal"])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["id"] = id
        container["user"] = user
        container["description"] = description
        container["nickname"] = nickname
        container["isLegacyDelegate"] = isLegacyDelegate
        container["ordinal"] = ordinal
    }
}

extension ChatRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "chat"

    public init(row: Row) throws {
        self.init(number: row["number"], subject: row["subject"], isOneToOne: row["isOneToOne"], invitePolicy: row["invitePolicy"],
                  isDefunct: row["isDefunct"], data: row["data"], lastMessage: row["lastMessage"], lastActivity: row["lastActivity"])
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
    }
}

extension MemberRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "member"

    public init(row: Row) throws {
        self.init(chat: row["chat"], user: row["user"], isActive: row["isActive"], isAdmin: row["isAdmin"], joinedAt: row["joinedAt"],
                  leftAt: row["leftAt"], isHidden: row["isHidden"], localData: row["localData"], privateData: row["privateData"],
                  deliveredUpTo: row["deliveredUpTo"], readUpTo: row["readUpTo"], numUnread: row["numUnread"])
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
    }
}

extension MessageRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "message"

    /// The message's own columns (references, counts and private states are rows of
    /// their own tables, read beside it).
    public init(row: Row) throws {
        self.init(chat: row["chat"], id: row["id"], sender: row["sender"], tag: row["tag"], content: row["content"], data: row["data"], refs: [],
                  timestamp: row["timestamp"], isControl: row["isControl"], neverCountsUnread: row["neverCountsUnread"],
                  isRecalled: row["isRecalled"], changeSeq: row["changeSeq"], searchRow: row["searchRow"])
        thumbName = row["thumbName"]
        thumbBlob = row["thumbBlob"]
        fileName = row["fileName"]
        fileBlob = row["fileBlob"]
        fileSize = row["fileSize"]
        attachment = row["attachment"]
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["id"] = id
        container["sender"] = sender
        container["tag"] = tag
        container["content"] = content
        container["data"] = data
        container["timestamp"] = timestamp
        container["isControl"] = isControl
        container["neverCountsUnread"] = neverCountsUnread
        container["isRecalled"] = isRecalled
        container["changeSeq"] = changeSeq
        container["searchRow"] = searchRow
        container["thumbName"] = thumbName
        container["thumbBlob"] = thumbBlob
        container["fileName"] = fileName
        container["fileBlob"] = fileBlob
        container["fileSize"] = fileSize
        container["attachment"] = attachment
    }
}

extension RefCountRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "ref_count"

    public init(row: Row) throws {
        self.init(chat: row["chat"], target: row["target"], tag: row["tag"], count: row["count"], newest: row["newest"])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["target"] = target
        container["tag"] = tag
        container["count"] = count
        container["newest"] = newest
    }
}

extension MessageUserRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "message_user"

    public init(row: Row) throws {
        self.init(chat: row["chat"], id: row["id"], user: row["user"], localData: row["localData"], isDeleted: row["isDeleted"])
        thumbDetached = row["thumbDetached"]
        fileDownloaded = row["fileDownloaded"]
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["id"] = id
        container["user"] = user
        container["localData"] = localData
        container["isDeleted"] = isDeleted
        container["thumbDetached"] = thumbDetached
        container["fileDownloaded"] = fileDownloaded
    }
}

extension RangeChangeRow: FetchableRecord, PersistableRecord {
    public static let databaseTableName = "range_change"

    public init(row: Row) throws {
        self.init(chat: row["chat"], firstSeq: row["firstSeq"], firstId: row["firstId"], lastId: row["lastId"])
    }

    public func encode(to container: inout PersistenceContainer) throws {
        container["chat"] = chat
        container["lastSeq"] = lastSeq
        container["firstSeq"] = firstSeq
        container["firstId"] = firstId
        container["lastId"] = lastId
    }
}
