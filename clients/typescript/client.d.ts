// Types of chatcore's Node client (client.js). The protocol's types and request builders
// are generated from Schemas/: protocol.d.ts.
import type { Answered, Events } from "./protocol.js";

export * from "./protocol.js";

/** A request was refused: `error` is the protocol's code, `event` what said so. */
export class ChatcoreError extends Error {
  readonly event: "requestFailed" | "chatStartFailed" | "setupError" | "timeout" | "closed" | "events";
  readonly error: string;
  readonly reason: string;
  readonly body: Record<string, unknown>;
}
export class ChatcoreTimeout extends ChatcoreError {}
export class ConnectionClosed extends ChatcoreError {}
/** An `events()` iterator fell more than its `maxBuffered` events behind: later events were
 * dropped for it alone. It hands over those it kept, then throws this and ends. */
export class EventsLost extends ChatcoreError {
  readonly kept: number;
}
/** How many unread events one `events()` iterator keeps by default (10,000). */
export const MAX_BUFFERED_EVENTS: number;

// `await using` (TypeScript 5.2+) closes a client and stops a server; older compilers learn
// the symbol here (the same declaration as newer libraries make, so the two merge).
declare global {
  interface SymbolConstructor {
    readonly asyncDispose: unique symbol;
  }
}

/** How long to wait for an outcome (ms), and a signal that stops waiting (rejecting with its reason). */
export interface WaitOptions {
  timeout?: number;
  signal?: AbortSignal;
}

/** One event as the client hands it over: [name, fields]. */
export type EventEntry = { [Name in keyof Events]: [Name, Events[Name]] }[keyof Events];

export interface EventStream extends AsyncIterableIterator<EventEntry> {}

export function findBinary(binary?: string): string;

export class Client {
  /** The `global` values received (authTokenState, setupState, localUri, ...). */
  globals: Record<string, unknown>;
  /** `chatcore serve --user USER` as a child process, over its standard input/output. */
  static spawn(user: string, options?: { dataDir?: string; binary?: string; args?: string[] }): Client;
  /** Connects to a serving chatcore: "unix:/path", "host:port", "tcp://host:port" or "[::1]:port". */
  static connect(address: string): Promise<Client>;
  authenticate(userId: string, token?: string, options?: { timeout?: number }): Promise<Record<string, unknown>>;
  /** Writes one request without waiting; returns its line number. */
  send(message: object): number;
  /**
   * Sends a request built with the protocol's builders and resolves with its outcome, typed by
   * the builder: a list answer (`ListAnswer` of the list's elements), the new chat for
   * chatStart, the sent message for chatMessageSend, the globals for authToken, the answer's
   * fields for an answered request, undefined for one answered only when it fails.
   */
  request<Answer>(message: Answered<Answer>, options?: WaitOptions): Promise<Answer>;
  /** A request written by hand (`{ name: { fields } }`): its outcome is not typed. */
  request(message: object, options?: WaitOptions): Promise<unknown>;
  /** Every event from now on, answers included; ends when the connection closes. Past
   * `maxBuffered` unread events it throws EventsLost once those it kept are read. */
  events(options?: { maxBuffered?: number }): EventStream;
  /** The first event named `name` (from `events`, or from the moment of this call) for which the predicate holds. */
  waitFor<Name extends keyof Events>(name: Name, predicate?: (fields: Events[Name]) => boolean, options?: WaitOptions & { events?: EventStream }): Promise<[Name, Events[Name]]>;
  waitFor<Name extends keyof Events>(name: Name, options?: WaitOptions & { events?: EventStream }): Promise<[Name, Events[Name]]>;
  /** The first event (from `events`, or from the moment of this call) for which the predicate holds. */
  waitFor(predicate: (name: keyof Events, fields: any) => boolean, options?: WaitOptions & { events?: EventStream }): Promise<EventEntry>;
  /** Event iterators open now (`events()` not yet ended or returned): for diagnostics. */
  readonly openEventIterators: number;
  /** Ends the session once the service has answered everything sent. */
  close(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}

/** A chatcore serving a Unix socket of its own (any token accepted unless `args` say otherwise). */
export class Server {
  readonly address: string;
  static start(options?: { dataDir?: string; binary?: string; args?: string[]; timeout?: number }): Promise<Server>;
  connect(user?: string, token?: string): Promise<Client>;
  stop(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}
