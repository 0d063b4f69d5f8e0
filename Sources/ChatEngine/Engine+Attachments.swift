import Attachments
import ChatProtocol
import Dispatch
import Storage
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// The files a message's attachments are copied from, while they are being stored.
struct SourcesInFlight {
    var thumb: AttachmentStore.Source?
    var file: AttachmentStore.Source?
    var removeThumb: Bool
    var removeFile: Bool

    func close() {
        thumb?.close()
        file?.close()
    }

    /// The Move and Delete policies' removals, then closes: once the message's link to
    /// its copies is durable, so that a failed commit never loses both.
    func removeByPolicy(_ attachments: AttachmentStore) {
        if let thumb, removeThumb { attachments.removeSource(thumb) }
        if let file, removeFile { attachments.removeSource(file) }
        close()
    }
}

/// Attachments (§7): which files a session may name, storing them off the
/// engine thread, downloads and detaching, and releasing stored contents.
extension Engine {
    static let maxThumbBytes: Int64 = 56_320
    static let maxFileBytes: Int64 = 134_217_728

    /// The attachments of a send, opened and checked (sizes included) before anything is
    /// posted. On a throw nothing stays open.
    func admitAttachments(_ request: ChatMessageSend, session: EngineSession) throws -> (thumb: AttachmentStore.Source?, file: AttachmentStore.Source?) {
        guard request.thumb != nil || request.file != nil else { return (nil, nil) }
        guard attachmentWork.store != nil else {
            throw ProtocolError.notPermitted("this service keeps no attachments")
        }
        let allowed: String?
        if session.transport == .stdio {
            allowed = nil
        } else if let root = attachmentWork.allowedDirectory, let user = session.user.flatMap({ directory.users[$0] }) {
            // A socket session attaches only its own user's files: the directory the
            // application fills for that user.
            allowed = root + "/" + AttachmentStore.userDirectory(user.userId)
        } else {
            throw ProtocolError.notPermitted("sessions over sockets may not attach files: the service was started without --attachments-dir")
        }
        func open(_ path: String?, field: String, limit: Int64) throws -> AttachmentStore.Source? {
            guard let path else { return nil }
            let source: AttachmentStore.Source
            do {
                source = try AttachmentStore.open(path, field: field, allowed: allowed)
            } catch {
                switch error {
                case .notPermitted(let reason): throw ProtocolError.notPermitted(reason)
                case .unusable(let reason): throw ProtocolError.invalid(reason)
                }
            }
            if source.size > limit {
                source.close()
                throw ProtocolError(.tooLarge, "'\(field)' is \(source.size) bytes, over the limit of \(limit)")
            }
            return source
        }
        let thumb = try open(request.thumb, field: "thumb", limit: Engine.maxThumbBytes)
        do {
            let file = try open(request.file, field: "file", limit: Engine.maxFileBytes)
            return (thumb, file)
        } catch {
            thumb?.close()
            throw error
        }
    }

    /// Stores the attachments of a posted message on a worker thread once the message is
    /// durable (a message whose commit fails never has its sources moved or deleted);
    /// the outcome comes back to the engine thread as work (`attachmentsStored`).
    func storeAttachments(
        of message: MessageRecord, in chat: ChatRecord, thumb: AttachmentStore.Source?, file: AttachmentStore.Source?,
        request: ChatMessageSend, session: EngineSession, batch: Batch
    ) {
        guard let attachments = attachmentWork.store else { return }
        let chatNumber = chat.number
        let id = message.id
        let sources = SourcesInFlight(
            thumb: thumb, file: file, removeThumb: (request.thumbPolicy ?? .copy) != .copy,
            removeFile: (request.filePolicy ?? .copy) != .copy)
        batch.ifNotCommitted { [self] in
            // Never posted: nothing is pending for anyone.
            sources.close()
            directory.chats[chatNumber]?.pendingSends[id] = nil
        }
        batch.whenCommitted { [self] in
            attachmentWork.inFlight[Batch.RowKey(chat: chatNumber, item: id)] = sources
            attachmentWork.jobs.add(1, ordering: .relaxed)
            DispatchQueue.global(qos: .utility).async { [self] in
                var thumbBlob: String?
                var fileBlob: String?
                var failure: String?
                do {
                    // Each stored blob is pinned: it cannot be deleted until the engine
                    // has counted this message's use of it (`attachmentsStored`).
                    if let thumb { thumbBlob = try attachments.store(thumb, maxBytes: Engine.maxThumbBytes) }
                    if let file { fileBlob = try attachments.store(file, maxBytes: Engine.maxFileBytes) }
                } catch {
                    failure = "\(error)"
                }
                // The sources stay open: the engine removes (Move, Delete) and closes them.
                attachmentsFinished(chat: chatNumber, id: id, thumb: thumbBlob, file: fileBlob, error: failure)
                _attachmentWork.jobs.subtract(1, ordering: .releasing)
                life.settle()
            }
        }
    }

    /// The worker is done with a message's attachments. Stored: its sender sees it `Sent`,
    /// and the others see it for the first time, as a new message (counted unread, found
    /// by search). Not stored: its sender sees it `Failed`, the others a `Gap` in its place,
    /// so that every viewer's ids stay consecutive (docs/protocol.md, "Attachments").
    func attachmentsStored(chat number: Int64, id: Int64, thumb: String?, file: String?, error: String?, batch: Batch) {
        // Read while it still counts as being stored (read from the store, it would
        // otherwise be taken for one whose storing failed).
        let message = directory.chats[number].flatMap { try? loadMessage(id, in: $0) }
        let sources = attachmentWork.inFlight.removeValue(forKey: Batch.RowKey(chat: number, item: id))
        let stored = [thumb, file].compactMap { $0 }
        // The worker's pins end with this item, once its outcome is durable (or not).
        defer {
            if let attachments = attachmentWork.store {
                let release = { [self] in
                    for blob in stored { attachments.unpin(blob) }
                    releaseUnused(stored)
                }
                batch.whenCommitted(release)
                batch.ifNotCommitted(release)
            }
        }
        guard let attachments = attachmentWork.store, let chat = directory.chats[number], let message, message.isPending else {
            // Recalled while being stored: nothing holds on to what was stored.
            sources?.close()
            return
        }
        let changes = PendingChanges()
        willChange(chat, changes)
        willChange(message, in: chat, changes)
        chat.pendingSends[id] = nil
        var failure = error
        if failure == nil {
            do {
                if let thumb, let name = message.attached.thumb?.name {
                    try attachments.link(blob: thumb, at: attachments.messagePath(chat: chat.number, id: id, kind: "thumb", name: name))
                }
                if let file, let name = message.attached.file?.name {
                    try attachments.link(blob: file, at: attachments.messagePath(chat: chat.number, id: id, kind: "file", name: name))
                }
            } catch {
                failure = "\(error)"
            }
        }
        if let failure {
            logger.warning("an attachment could not be stored", metadata: ["chat": "\(number)", "message": "\(id)", "error": "\(failure)"])
            message.attached.attachment = .failed
            sources?.close()
            batch.whenCommitted { attachments.removeMessageLinks(chat: number, id: id) }
        } else {
            message.attached.thumb?.blob = thumb
            message.attached.file?.blob = file
            message.attached.attachment = .stored
            for blob in message.blobs { batch.uses(blob, +1) }
            batch.whenCommitted { sources?.removeByPolicy(attachments) }
            batch.ifNotCommitted { sources?.close() }
            index(message, in: chat, batch: batch)
            if !message.neverCountsUnread { chat.lastActivity = max(chat.lastActivity, message.timestamp) }
            // A member who read past it while it was being stored got it read.
            for member in chat.members.values where member.isActive && member.hasUnread(message) {
                countNewUnread(message, for: member, in: chat, batch: batch)
            }
        }
        batch.changed(message)
        do {
            try announceNew([message], in: chat, except: message.sender, batch: batch, changes: changes)
        } catch {
            logger.warning("deliveries were not marked: the store could not be read", metadata: ["error": "\(error)"])
        }
        publish(changes, batch: batch)
    }

    /// Finds and removes, in the background, the stored contents no message uses: a
    /// crash between storing a message's attachments and committing its link to them
    /// leaves them. The store's counts decide, a few hundred at a time on the engine
    /// thread between other work; a content stored since is pinned until its use is
    /// counted, so it is never taken for unused.
    public func sweepUnusedBlobs() {
        guard let attachments = _attachmentWork.store else { return }  // immutable: any thread
        DispatchQueue.global(qos: .utility).async { [self] in
            let candidates = attachments.storedBlobs()
            let removed = Atomic<Int>(0)
            for (index, chunk) in candidates.chunked(256).enumerated() {
                barrier { [self] in
                    for blob in chunk where (try? store.blobUses(blob)) == 0 {
                        attachments.removeBlob(blob)
                        removed.add(1, ordering: .relaxed)
                    }
                    if index == (candidates.count - 1) / 256, removed.load(ordering: .relaxed) > 0 {
                        logger.notice(
                            "removed stored attachments no message uses (left by a crash)", metadata: ["count": "\(removed.load(ordering: .relaxed))"])
                    }
                }
            }
        }
    }

    /// Deletes the stored contents no message uses (and no worker has pinned). Engine
    /// thread, after the commit that let go of them: the store counts the uses.
    func releaseUnused(_ blobs: [String]) {
        guard let attachments = attachmentWork.store else { return }
        for blob in Set(blobs) {
            guard let uses = try? store.blobUses(blob) else {
                logger.warning("the uses of a stored attachment could not be read: it is kept", metadata: ["blob": "\(blob)"])
                continue
            }
            if uses == 0 { attachments.removeBlob(blob) }
        }
    }

    /// A recalled message lets go of its stored contents, links and downloads; the files
    /// go once the recall is durable.
    func releaseAttachments(of message: MessageRecord, in chat: ChatRecord, batch: Batch) {
        guard let attachments = attachmentWork.store, message.attached.thumb != nil || message.attached.file != nil else { return }
        let number = chat.number
        let id = message.id
        var links: [String] = []
        if let name = message.attached.file?.name {
            for (user, state) in message.privateStates where state.fileState == .done {
                links.append(attachments.downloadPath(user: user, chat: number, id: id, name: name))
            }
        }
        var released: [String] = []
        if message.attached.attachment == .stored {
            for blob in message.blobs {
                batch.uses(blob, -1)
                released.append(blob)
            }
        }
        batch.whenCommitted { [self] in
            for link in links { attachments.removeLink(link) }
            attachments.removeMessageLinks(chat: number, id: id)
            releaseUnused(released)
        }
        message.attached.thumb = nil
        message.attached.file = nil
        message.attached.attachment = nil
    }

    /// A user deleted a message for themselves: their downloaded copy goes (once durable).
    func releaseDownload(of message: MessageRecord, in chat: ChatRecord, for user: Int64, batch: Batch) {
        guard let attachments = attachmentWork.store, let name = message.attached.file?.name, message.privateStates[user]?.fileState == .done else { return }
        let path = attachments.downloadPath(user: user, chat: chat.number, id: message.id, name: name)
        batch.whenCommitted { attachments.removeLink(path) }
    }

    // MARK: requests

    func download(_ request: ChatMessageFileDownload, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        let message = try message(request.messageId, in: chat, seenBy: member)
        guard let attachments = attachmentWork.store, let file = message.attached.file, let blob = file.blob, !message.isRecalled,
            message.privateStates[user]?.isDeleted != true
        else {
            throw ProtocolError.invalid("message \(message.id) has no stored file to download")
        }
        guard message.sender != user, message.privateStates[user]?.fileState != .done else { return }
        // Another try after a failed one starts over (Failed, FailedAvailable).
        let transferring = PendingChanges()
        willChange(message, in: chat, transferring)
        message.privateStates[user, default: PrivateState()].fileState = .transferring
        publish(transferring, batch: batch)

        let done = PendingChanges()
        willChange(message, in: chat, done)
        if access(attachments.blobPath(blob), F_OK) != 0 {
            // The stored content is gone (removed by hand, or a damaged disk): nothing to
            // download, now or later.
            message.privateStates[user, default: PrivateState()].fileState = .failed
            logger.error("a download found no stored content", metadata: ["chat": "\(chat.number)", "message": "\(message.id)", "blob": "\(blob)"])
        } else {
            do {
                try attachments.link(blob: blob, at: attachments.downloadPath(user: user, chat: chat.number, id: message.id, name: file.name))
                message.privateStates[user, default: PrivateState()].fileState = .done
            } catch {
                message.privateStates[user, default: PrivateState()].fileState = .failedAvailable
                logger.error("a download could not be made: it can be tried again", metadata: ["error": "\(error)"])
            }
        }
        batch.changedPrivately(message, for: user)
        publish(done, batch: batch)
    }

    func detach(_ request: ChatMessageDetach, user: Int64, batch: Batch) throws {
        let (chat, member) = try chat(request.chatId, of: user)
        let message = try message(request.messageId, in: chat, seenBy: member)
        let changes = PendingChanges()
        willChange(message, in: chat, changes)
        if request.detachThumb ?? false, message.attached.thumb != nil {
            message.privateStates[user, default: PrivateState()].thumbDetached = true
        }
        if request.detachFile ?? false {
            releaseDownload(of: message, in: chat, for: user, batch: batch)
            message.privateStates[user]?.fileState = nil
        }
        batch.changedPrivately(message, for: user)
        publish(changes, batch: batch)
    }
}
