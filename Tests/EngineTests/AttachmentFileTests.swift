import Attachments
import Foundation
import GRDB
import SQLiteStorage
import Testing

/// Files of attachments follow the commits (issue 11): a recall whose commit fails keeps
/// every file, and a blob a copy is handing over is never deleted under it.
@Suite(.serialized) final class AttachmentFileTests {
    private var directory: URL!

    init() throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("attachment-tests-\(UUID())")
        // Socket sessions attach from their user's directory under it.
        try FileManager.default.createDirectory(at: directory.appendingPathComponent("uploads/alice"), withIntermediateDirectories: true)
    }

    deinit {
        try? FileManager.default.removeItem(at: directory)
    }

    private func blobs() throws -> [String] {
        try FileManager.default.contentsOfDirectory(atPath: directory.appendingPathComponent("attachments/blobs").path)
    }

    @Test func aRecallWhoseCommitFailsKeepsItsFiles() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let uploads = directory.appendingPathComponent("uploads").path
        let h = try EngineHarness(store: store, attachments: try AttachmentStore(directory: directory), attachmentsDirectory: uploads)
        h.connect("a", as: "alice")
        h.connect("b", as: "bob")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        try Data("the same bytes".utf8).write(to: URL(fileURLWithPath: uploads + "/alice/one.txt"))
        h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"File","file":"one.txt"}}"#)
        #expect((try blobs().count) == 1)
        let link = directory.appendingPathComponent("attachments/messages/1-2/file/one.txt").path
        #expect(FileManager.default.fileExists(atPath: link))

        store.failing.store(true, ordering: .relaxed)
        let refused = h.send("a", #"{"chatMessageDestroy":{"chatId":"1","messageId":"2","cookie":"r"}}"#)
        #expect(refused.joined().contains("Internal"), "\(refused)")
        #expect((try blobs().count) == 1, "a recall that was not committed deleted the blob")
        #expect(FileManager.default.fileExists(atPath: link), "a recall that was not committed deleted the message's file")

        store.failing.store(false, ordering: .relaxed)
        h.send("a", #"{"chatMessageDestroy":{"chatId":"1","messageId":"2","cookie":"r"}}"#)
        #expect((try blobs()) == [], "the committed recall kept the blob")
        #expect(!FileManager.default.fileExists(atPath: link))
    }

    /// `filePolicy: Move` removed the source as soon as its copy was stored, before the
    /// message's link to the copy was committed: a failed commit then lost both.
    @Test func aSourceIsMovedOnlyOnceTheMessagesLinkToItsCopyIsCommitted() throws {
        let store = FailingStore(try SQLiteStore(writer: DatabaseQueue()))
        let uploads = directory.appendingPathComponent("uploads").path
        let h = try EngineHarness(store: store, attachments: try AttachmentStore(directory: directory), attachmentsDirectory: uploads)
        h.connect("a", as: "alice")
        h.send("a", #"{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"f"}}"#)
        let source = uploads + "/alice/moved.txt"
        try Data("moved bytes".utf8).write(to: URL(fileURLWithPath: source))
        // The send's commit succeeds; the one that links the stored copy fails.
        store.successesFirst.store(1, ordering: .relaxed)
        store.failing.store(true, ordering: .relaxed)
        h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"File","file":"moved.txt","filePolicy":"Move"}}"#)
        store.failing.store(false, ordering: .relaxed)
        #expect(store.failedCommits.load(ordering: .relaxed) > 0, "no commit failed")
        #expect(FileManager.default.fileExists(atPath: source), "the source was moved while its copy's link was not committed")

        // When the link is committed, the source goes.
        try Data("moved again".utf8).write(to: URL(fileURLWithPath: uploads + "/alice/again.txt"))
        h.send("a", #"{"chatMessageSend":{"chatId":"1","tag":"File","file":"again.txt","filePolicy":"Move"}}"#)
        #expect(!(FileManager.default.fileExists(atPath: uploads + "/alice/again.txt")))
    }

    @Test func aBlobBeingHandedOverIsNotDeleted() throws {
        let attachments = try AttachmentStore(directory: directory)
        let path = directory.appendingPathComponent("uploads/two.txt").path
        try Data("shared content".utf8).write(to: URL(fileURLWithPath: path))
        let source = try AttachmentStore.open(path, field: "file", allowed: nil)
        defer { source.close() }
        // A copy finds the content stored already (another message has it)...
        let blob = try attachments.store(source, maxBytes: 1 << 20)
        // ...and before the engine counts the new message, the old one lets go of it.
        attachments.removeBlob(blob)
        #expect(FileManager.default.fileExists(atPath: attachments.blobPath(blob)), "a pinned blob was deleted")
        attachments.unpin(blob)
        attachments.removeBlob(blob)
        #expect(!FileManager.default.fileExists(atPath: attachments.blobPath(blob)))
    }

    /// File names are bytes: a directory spelled like the attachments directory with
    /// other code points (e and a combining accent for é) is another directory, and a
    /// file in it is outside.
    @Test func aLookAlikeDirectoryIsOutsideTheAttachmentsDirectory() throws {
        let allowed = directory.appendingPathComponent("caf\u{E9}")
        let lookAlike = directory.appendingPathComponent("cafe\u{301}")
        for folder in [allowed, lookAlike] {
            try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        }
        let secret = lookAlike.appendingPathComponent("secret.txt").path
        let inside = allowed.appendingPathComponent("inside.txt").path
        #expect(FileManager.default.createFile(atPath: secret, contents: Data("secret".utf8)))
        #expect(FileManager.default.createFile(atPath: inside, contents: Data("inside".utf8)))
        let resolved = try #require(AttachmentStore.realPath(allowed.path))
        #expect(Array(resolved.utf8) != Array(try #require(AttachmentStore.realPath(lookAlike.path)).utf8))

        let source = try AttachmentStore.open(inside, field: "file", allowed: resolved)
        source.close()
        do {
            _ = try AttachmentStore.open(secret, field: "file", allowed: resolved)
            Issue.record("expected an error")
        } catch {
            guard case AttachmentStore.AdmitError.notPermitted = error else {
                Issue.record("\(error)")
                return
            }
        }
    }
}
