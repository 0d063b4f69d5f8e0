// Types of chatcore's client for browsers (browser.js): the Node client's Client (client.d.ts)
// without what needs Node, and connect() to a WebSocket listener.
import type { Client as NodeClient } from "./client.js";

export * from "./protocol.js";
export { ChatcoreError, ChatcoreTimeout, ConnectionClosed, EventsLost, MAX_BUFFERED_EVENTS, WaitOptions, EventEntry, EventStream } from "./client.js";

export interface Client extends Omit<NodeClient, never> {}
export class Client {
  /** Connects to a chatcore WebSocket listener ("ws://host:port/path" or "wss://…"); resolves once it is open. */
  static connect(url: string, options?: { WebSocket?: typeof WebSocket }): Promise<Client>;
}
