import Storage

/// Every user of the store, by each of their ids (engine thread only).
struct UserDirectory {
    private(set) var byNumber: [Int64: UserRecord] = [:]
    /// By id byte for byte: Swift's `==` on strings is canonical equivalence ("jos\u{E9}"
    /// and "jose\u{301}" are equal), while the store and identity providers tell such ids
    /// apart; one must not be let in as the other.
    private var byUserId: [ExactText: Int64] = [:]
    private var byRegId: [Int64: Int64] = [:]
    private var lastNumber: Int64 = 0

    init(_ users: [UserRecord] = []) {
        for user in users { insert(user) }
    }

    private mutating func insert(_ user: UserRecord) {
        byNumber[user.number] = user
        byUserId[ExactText(user.userId)] = user.number
        byRegId[user.regId] = user.number
        lastNumber = max(lastNumber, user.number)
    }

    subscript(number: Int64) -> UserRecord? { byNumber[number] }

    /// A user another deciding process made (known already: nothing changes).
    mutating func learn(_ user: UserRecord) {
        if byNumber[user.number] == nil { insert(user) }
    }

    func find(userId: String) -> UserRecord? { byUserId[ExactText(userId)].flatMap { byNumber[$0] } }
    func find(regId: Int64) -> UserRecord? { byRegId[regId].flatMap { byNumber[$0] } }
    func find(uri: String) -> UserRecord? { UserRecord.number(fromURI: uri).flatMap { byNumber[$0] } }

    /// The user with this id, created (and added to the batch) when new, with the number
    /// `number` gives after the highest one known.
    mutating func ensure(userId: String, batch: inout StoreBatch, number: (_ after: Int64) -> Int64) -> UserRecord {
        if let existing = find(userId: userId) { return existing }
        let user = UserRecord(number: number(lastNumber), userId: userId, regId: RegId.derive(userId))
        insert(user)
        batch.directory.newUsers.append(user)
        return user
    }
}
