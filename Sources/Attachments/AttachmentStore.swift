import Crypto
import Foundation
import Threads

#if canImport(Glibc)
    import Glibc
#endif

/// The service's own copies of attached files (§7), under the data directory:
///
///     attachments/blobs/<sha256>                    each distinct content once
///     attachments/messages/<chat>-<id>/<kind>/<name> a message's thumb or file (hard link)
///     attachments/downloads/<user>/<chat>-<id>/<name> a recipient's downloaded file (hard link)
///     attachments/tmp/                              copies in progress
///
/// Storing reads an already opened descriptor (so the file that was checked is the file
/// that is read), hashes while copying, syncs, and renames into place: a blob is either
/// complete or absent.
public final class AttachmentStore: Sendable {
    public let root: URL
    private let blobs: URL
    private let messages: URL
    private let downloads: URL
    private let temporary: URL
    /// Blobs returned by `store` whose use the engine has not counted yet.
    private let pins = Locked<[String: Int]>([:])

    public init(directory: URL) throws {
        root = directory.appendingPathComponent("attachments", isDirectory: true)
        blobs = root.appendingPathComponent("blobs", isDirectory: true)
        messages = root.appendingPathComponent("messages", isDirectory: true)
        downloads = root.appendingPathComponent("downloads", isDirectory: true)
        temporary = root.appendingPathComponent("tmp", isDirectory: true)
        for directory in [blobs, messages, downloads, temporary] {
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        }
        // Copies that were in progress when the process stopped are garbage.
        for leftover in (try? FileManager.default.contentsOfDirectory(atPath: temporary.path)) ?? [] {
            unlink(temporary.appendingPathComponent(leftover).path)
        }
    }

    // MARK: names

    /// The base name kept of a path (§7): no directory parts, no control
    /// characters, no leading dots, `/ \ : * ? " < > |` replaced by `_`, at most 255 bytes.
    public static func sanitize(_ path: String) -> String {
        let base = path.split(separator: "/", omittingEmptySubsequences: true).last.map(String.init) ?? ""
        var name = ""
        for scalar in base.unicodeScalars {
            if scalar.value < 0x20 || scalar.value == 0x7F || (0x80...0x9F).contains(scalar.value) { continue }
            if "\\:*?\"<>|".unicodeScalars.contains(scalar) {
                name.unicodeScalars.append("_")
            } else {
                name.unicodeScalars.append(scalar)
            }
        }
        while name.hasPrefix(".") { name.removeFirst() }
        while name.utf8.count > 255 { name.removeLast() }
        return name.isEmpty ? "file" : name
    }

    // MARK: admitting a source

    /// A file a request named, opened for reading, and the directory that holds it
    /// (through which it is removed, for the Move and Delete policies).
    public struct Source: Sendable {
        public let descriptor: Int32
        /// The resolved path (no symbolic links).
        public let path: String
        public let size: Int64
        /// The sanitized base name of the path as the request gave it.
        public let name: String
        /// The directory holding it, opened when it was, and its name there.
        let directory: Int32
        let entry: String
        /// Which file it is: it is removed only while its name there still names it.
        let device: UInt64
        let inode: UInt64

        /// Closes the file and its directory.
        public func close() {
            Glibc.close(descriptor)
            Glibc.close(directory)
        }
    }

    public enum AdmitError: Error, Sendable {
        /// The session may not name this file.
        case notPermitted(String)
        /// It cannot be used (missing, not a regular file, unreadable).
        case unusable(String)
    }

    /// The directory of `userId` under the attachments directory: its files are the only
    /// ones its socket sessions may attach (and move or delete). The user id, with `%`, `/`,
    /// control characters and a leading `.` written as `%XX` (so that no id names another
    /// directory, `..` included).
    public static func userDirectory(_ userId: String) -> String {
        var name: [UInt8] = []
        for (index, byte) in userId.utf8.enumerated() {
            if byte == UInt8(ascii: "%") || byte == UInt8(ascii: "/") || byte < 0x20 || byte == 0x7F || (index == 0 && byte == UInt8(ascii: ".")) {
                name += Array(String(format: "%%%02X", byte).utf8)
            } else {
                name.append(byte)
            }
        }
        return String(decoding: name, as: UTF8.self)
    }

    /// Opens the file at `path` for a session. With `allowed` (a resolved directory), only
    /// files inside it, after resolving symbolic links and `..`, may be opened; nothing
    /// outside is opened at all, and a file with other names (hard links, which may lead
    /// anywhere on the file system) is refused.
    public static func open(_ path: String, field: String, allowed: String?) throws(AdmitError) -> Source {
        var candidate = path
        if let allowed, path.utf8.first != UInt8(ascii: "/") { candidate = allowed + "/" + path }
        guard let resolved = realPath(candidate) else {
            let reason = String(cString: strerror(errno))
            if let allowed, !isInside(lexicallyNormalized(candidate), allowed) {
                throw .notPermitted("'\(field)' is outside the attachments directory")
            }
            throw .unusable("'\(field)' \(path) cannot be read: \(reason)")
        }
        if let allowed, !isInside(resolved, allowed) {
            throw .notPermitted("'\(field)' is outside the attachments directory")
        }
        let descriptor = Glibc.open(resolved, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
        guard descriptor >= 0 else {
            throw .unusable("'\(field)' \(path) cannot be read: \(String(cString: strerror(errno)))")
        }
        var status = stat()
        guard fstat(descriptor, &status) == 0, (status.st_mode & S_IFMT) == S_IFREG else {
            close(descriptor)
            throw .unusable("'\(field)' \(path) is not a regular file")
        }
        // What was opened, not what the path says now: a swapped link cannot lead out.
        if let allowed {
            guard let opened = realPath("/proc/self/fd/\(descriptor)"), isInside(opened, allowed) else {
                close(descriptor)
                throw .notPermitted("'\(field)' is outside the attachments directory")
            }
            // A hard link made in the directory to a file elsewhere (the service's own
            // secrets, say) resolves inside it: a file must have one name.
            guard status.st_nlink == 1 else {
                close(descriptor)
                throw .notPermitted("'\(field)' has other names (hard links): only a file of its own may be attached")
            }
        }
        let parent = (resolved as NSString).deletingLastPathComponent
        let directory = Glibc.open(parent, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        var named = stat()
        guard directory >= 0, fstatat(directory, (resolved as NSString).lastPathComponent, &named, AT_SYMLINK_NOFOLLOW) == 0,
            named.st_dev == status.st_dev, named.st_ino == status.st_ino
        else {
            if directory >= 0 { close(directory) }
            close(descriptor)
            throw .unusable("'\(field)' \(path) changed while it was being opened")
        }
        return Source(
            descriptor: descriptor, path: resolved, size: Int64(status.st_size), name: sanitize(path), directory: directory,
            entry: (resolved as NSString).lastPathComponent, device: UInt64(status.st_dev), inode: UInt64(status.st_ino))
    }

    public static func realPath(_ path: String) -> String? {
        guard let resolved = realpath(path, nil) else { return nil }
        defer { free(resolved) }
        return String(cString: resolved)
    }

    /// Byte for byte, as the file system names files: Swift's `hasPrefix` compares by
    /// canonical equivalence, so "cafe\u{301}/" would pass for "caf\u{E9}/", another
    /// directory.
    public static func isInside(_ path: String, _ directory: String) -> Bool {
        let prefix = directory.utf8.last == UInt8(ascii: "/") ? directory : directory + "/"
        return path.utf8.starts(with: prefix.utf8)
    }

    static func lexicallyNormalized(_ path: String) -> String {
        var parts: [Substring] = []
        for part in path.split(separator: "/") {
            if part == "." { continue }
            if part == ".." { _ = parts.popLast() } else { parts.append(part) }
        }
        return "/" + parts.joined(separator: "/")
    }

    // MARK: storing

    public struct StoreError: Error, CustomStringConvertible, Sendable {
        public let description: String
    }

    /// Copies the source into the blob store and returns its content's SHA-256 (hex).
    /// Blocking: call it off the engine and event loops. The source must still have the
    /// size it had when it was opened, and at most `maxBytes`.
    public func store(_ source: Source, maxBytes: Int64) throws -> String {
        var template = Array(temporary.appendingPathComponent("copy-XXXXXX").path.utf8CString)
        let output = template.withUnsafeMutableBufferPointer { mkstemp($0.baseAddress!) }
        guard output >= 0 else { throw StoreError(description: "cannot create a copy: \(String(cString: strerror(errno)))") }
        let temporaryPath = String(decoding: template.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        var keep = false
        defer {
            close(output)
            if !keep { unlink(temporaryPath) }
        }
        var hasher = SHA256()
        let chunk = 1 << 20
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: chunk, alignment: 16)
        defer { buffer.deallocate() }
        var total: Int64 = 0
        while true {
            let count = pread(source.descriptor, buffer.baseAddress, chunk, off_t(total))
            if count < 0 {
                if errno == EINTR || errno == EAGAIN { continue }
                throw StoreError(description: "reading \(source.name) failed: \(String(cString: strerror(errno)))")
            }
            if count == 0 { break }
            total += Int64(count)
            guard total <= maxBytes else { throw StoreError(description: "\(source.name) grew over \(maxBytes) bytes") }
            let bytes = UnsafeRawBufferPointer(rebasing: buffer[0..<count])
            hasher.update(bufferPointer: bytes)
            var written = 0
            while written < count {
                let result = write(output, bytes.baseAddress! + written, count - written)
                if result < 0 {
                    if errno == EINTR { continue }
                    throw StoreError(description: "writing the copy of \(source.name) failed: \(String(cString: strerror(errno)))")
                }
                written += result
            }
        }
        guard total == source.size else {
            throw StoreError(description: "\(source.name) changed while it was being stored (\(source.size) bytes, then \(total))")
        }
        guard fsync(output) == 0 else { throw StoreError(description: "cannot sync the copy of \(source.name)") }
        let hex = hasher.finalize().map { String(format: "%02x", $0) }.joined()
        let destination = blobPath(hex)
        // Pinned under the same lock that deletion takes: a blob found here (the same
        // content stored already) cannot be deleted before its new user is counted.
        try pins.withLock { pins in
            if access(destination, F_OK) != 0 {
                guard rename(temporaryPath, destination) == 0 else {
                    throw StoreError(description: "cannot store \(source.name): \(String(cString: strerror(errno)))")
                }
                keep = true
            }
            pins[hex, default: 0] += 1
        }
        if keep { syncDirectory(blobs.path) }
        return hex
    }

    /// Removes the source once the message's link to its copy is durable (`Move`,
    /// `Delete` policies): through the directory it was opened in (a directory renamed
    /// or swapped for a link since cannot lead elsewhere), and only while its name there
    /// still names the file that was stored.
    public func removeSource(_ source: Source) {
        var now = stat()
        guard fstatat(source.directory, source.entry, &now, AT_SYMLINK_NOFOLLOW) == 0,
            UInt64(now.st_dev) == source.device, UInt64(now.st_ino) == source.inode
        else { return }
        unlinkat(source.directory, source.entry, 0)
    }

    // MARK: paths and links

    /// The contents stored, by name (a SHA-256 in hex).
    public func storedBlobs() -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: blobs.path)) ?? []).filter { name in
            name.utf8.count == 64 && name.utf8.allSatisfy { (0x30...0x39).contains($0) || (0x61...0x66).contains($0) }
        }
    }

    public func blobPath(_ blob: String) -> String {
        blobs.appendingPathComponent(blob).path
    }

    public func messagePath(chat: Int64, id: Int64, kind: String, name: String) -> String {
        messages.appendingPathComponent("\(chat)-\(id)/\(kind)/\(name)").path
    }

    public func downloadPath(user: Int64, chat: Int64, id: Int64, name: String) -> String {
        downloads.appendingPathComponent("\(user)/\(chat)-\(id)/\(name)").path
    }

    /// Makes `path` name the blob (a hard link, so no bytes are copied).
    public func link(blob: String, at path: String) throws {
        let directory = (path as NSString).deletingLastPathComponent
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        if access(path, F_OK) == 0 { return }
        guard Glibc.link(blobPath(blob), path) == 0 else {
            throw StoreError(description: "cannot link \(path): \(String(cString: strerror(errno)))")
        }
    }

    public func removeLink(_ path: String) {
        unlink(path)
        rmdir((path as NSString).deletingLastPathComponent)
    }

    public func removeMessageLinks(chat: Int64, id: Int64) {
        try? FileManager.default.removeItem(at: messages.appendingPathComponent("\(chat)-\(id)"))
    }

    /// Deletes a stored content, unless a copy still being handed over has pinned it.
    public func removeBlob(_ blob: String) {
        pins.withLock { pins in
            if pins[blob] == nil { unlink(blobPath(blob)) }
        }
    }

    /// The engine has counted the use of a blob that `store` returned.
    public func unpin(_ blob: String) {
        pins.withLock { pins in
            let count = pins[blob, default: 1] - 1
            pins[blob] = count > 0 ? count : nil
        }
    }

    private func syncDirectory(_ path: String) {
        let descriptor = Glibc.open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard descriptor >= 0 else { return }
        fsync(descriptor)
        close(descriptor)
    }
}
