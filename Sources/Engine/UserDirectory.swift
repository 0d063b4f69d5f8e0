import Store

/// Every user of the store, by each of their ids (engine thread only).
struct UserDirectory {
    private(set) var byNumber: [Int64: UserRecord] = [:]
    private var byUserId: [String: Int64] = [:]
    private var byRegId: [Int64: Int64] = [:]
    private var lastNumber: Int64 = 0

    init(_ users: [UserRecord] = []) {
        for user in users { insert(user) }
    }

    private mutating func insert(_ user: UserRecord) {
        byNumber[user.number] = user
        byUserId[user.userId] = user.number
        byRegId[user.regId] = user.number
        lastNumber = max(lastNumber, user.number)
    }

    subscript(number: Int64) -> UserRecord? { byNumber[number] }

    func find(userId: String) -> UserRecord? { byUserId[userId].flatMap { byNumber[$0] } }
    func find(regId: Int64) -> UserRecord? { byRegId[regId].flatMap { byNumber[$0] } }
    func find(uri: String) -> UserRecord? { UserRecord.number(fromURI: uri).flatMap { byNumber[$0] } }

    /// The user with this id, created (and added to the batch) when new.
    mutating func ensure(userId: String, batch: inout StoreBatch) -> UserRecord {
        if let existing = find(userId: userId) { return existing }
        let user = UserRecord(number: lastNumber + 1, userId: userId, regId: RegId.derive(userId))
        insert(user)
        batch.newUsers.append(user)
        return user
    }
}
