import Crypto

/// A user's regId: a positive 63-bit number derived from the user id alone, so the same
/// user has the same regId in every store (§3): the first eight bytes of
/// SHA-256 of the UTF-8 user id, big-endian, top bit cleared (never 0).
public enum RegId {
    public static func derive(_ userId: String) -> Int64 {
        let digest = SHA256.hash(data: Array(userId.utf8))
        var value: UInt64 = 0
        for byte in digest.prefix(8) { value = value << 8 | UInt64(byte) }
        let regId = Int64(bitPattern: value & 0x7FFF_FFFF_FFFF_FFFF)
        return regId == 0 ? 1 : regId
    }
}
