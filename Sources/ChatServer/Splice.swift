import NIOCore

/// Two connections joined byte for byte, both ways: a relayed client and its connection to
/// the writer (`FollowerProxy`), or a relayed standard input/output session's end of a
/// socket pair and its TLS connection to the writer (`StdioRelay`).
enum Splice {
    /// Joins `client` (its reading not started yet) to `upstream`, then starts reading
    /// `client`. Called on `client`'s event loop. When they cannot be joined (either went
    /// away meanwhile, or `stillWanted` says no), both are closed and the future fails.
    static func join(_ client: Channel, to upstream: Channel, stillWanted: () -> Bool = { true }) -> EventLoopFuture<Void> {
        let toWriter = Relay(partner: upstream)
        let toClient = Relay(partner: client)
        do {
            // On the client's event loop: a client that went away while the upstream
            // connected does not leave the upstream open.
            try client.pipeline.syncOperations.addHandler(toWriter)
            guard stillWanted() else { throw ChannelError.ioOnClosedChannel }
        } catch {
            client.close(promise: nil)
            upstream.close(promise: nil)
            return client.eventLoop.makeFailedFuture(error)
        }
        return upstream.pipeline.addHandler(toClient).hop(to: client.eventLoop).map {
            // What the client sent (and its end) before the relay was up, then the rest.
            HeldInput.release(client)
        }.flatMapError { error in
            client.close(promise: nil)
            upstream.close(promise: nil)
            return client.eventLoop.makeFailedFuture(error)
        }.flatMap {
            client.setOption(.autoRead, value: true)
        }
    }
}

/// Passes what one channel reads to its partner; reading pauses while the partner cannot
/// take more (its write buffer is above its high water mark); a half-close and a close
/// pass through, after what was read before them has been written.
final class Relay: ChannelDuplexHandler, Sendable {
    typealias InboundIn = ByteBuffer
    typealias OutboundIn = ByteBuffer

    let partner: Channel

    /// How long what was read before a close may take to be written to a partner that
    /// does not take it in: then the partner is closed regardless.
    static let drainTimeout: TimeAmount = .seconds(10)

    init(partner: Channel) {
        self.partner = partner
    }

    func handlerAdded(context: ChannelHandlerContext) {
        // When the partner can take more again, this side reads again.
        let ownChannel = context.channel
        partner.pipeline.addHandler(WritabilityWatcher(resume: ownChannel)).whenComplete { _ in }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        partner.write(unwrapInboundIn(data), promise: nil)
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        partner.flush()
        if !partner.isWritable {
            context.channel.setOption(.autoRead, value: false).whenComplete { _ in }
        }
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if case ChannelEvent.inputClosed = event {
            afterWritten { $0.close(mode: .output, promise: nil) }
        }
        context.fireUserInboundEventTriggered(event)
    }

    func channelInactive(context: ChannelHandlerContext) {
        afterWritten { $0.close(promise: nil) }
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: Error) {
        context.close(promise: nil)
    }

    /// Does `then` to the partner once what was written to it before is written (a close
    /// at once would drop it: the last answers of a session the writer ended), or after
    /// `drainTimeout`.
    private func afterWritten(_ then: @escaping @Sendable (Channel) -> Void) {
        let partner = self.partner
        let late = partner.eventLoop.scheduleTask(in: Relay.drainTimeout) { partner.close(promise: nil) }
        partner.writeAndFlush(ByteBuffer()).whenComplete { _ in
            late.cancel()
            then(partner)
        }
    }
}

/// Resumes reading on `resume` when the channel it watches becomes writable again.
private final class WritabilityWatcher: ChannelInboundHandler, Sendable {
    typealias InboundIn = ByteBuffer

    let resume: Channel

    init(resume: Channel) {
        self.resume = resume
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable {
            resume.setOption(.autoRead, value: true).whenComplete { _ in }
        }
        context.fireChannelWritabilityChanged()
    }
}

/// Holds what a connection gives up before anything is there to take it: a relayed client
/// while its relay to the writer is made, a connection accepted while a node takes over.
/// Their reading is off (`autoRead`), but a client that ends its input makes NIO read what
/// is left at once (to tell the end from the data), and without this it went to the end
/// of the pipeline and was dropped: a client that sent its requests and half-closed before
/// its relay was up lost them all. The first handler of the pipeline; `release` passes on
/// what it holds, in order, then steps out.
final class HeldInput: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer

    private var held: [ByteBuffer] = []
    private var inputClosed = false
    /// Passing everything on (`release` was called).
    private var released = false
    private var context: ChannelHandlerContext?

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        if released { return context.fireChannelRead(data) }
        held.append(unwrapInboundIn(data))
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        if released { context.fireChannelReadComplete() }
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if !released, case ChannelEvent.inputClosed = event {
            inputClosed = true
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    /// Passes what `channel`'s `HeldInput` holds to the handlers after it, then removes it
    /// (a channel without one, or whose pipeline is gone with it, is left as it is). On the
    /// channel's event loop.
    static func release(_ channel: Channel) {
        guard let handler = try? channel.pipeline.syncOperations.handler(type: HeldInput.self), let context = handler.context, !handler.released
        else { return }
        handler.released = true
        let held = handler.held
        handler.held = []
        for buffer in held { context.fireChannelRead(NIOAny(buffer)) }
        if !held.isEmpty { context.fireChannelReadComplete() }
        if handler.inputClosed { context.fireUserInboundEventTriggered(ChannelEvent.inputClosed) }
        context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
    }
}
