// Types of chatcore's Node client (client.js). The protocol's types and request builders
// are generated from Schemas/: protocol.d.ts.
import type { Events, Requests } from "./protocol.js";

export * from "./protocol.js";

/** A request was refused: `error` is the protocol's code, `event` what said so. */
export class ChatcoreError extends Error {
  readonly event: "requestFailed" | "chatStartFailed" | "setupError" | "timeout" | "closed";
  readonly error: string;
  readonly reason: string;
  readonly body: Record<string, unknown>;
}
export class ChatcoreTimeout extends ChatcoreError {}
export class ConnectionClosed extends ChatcoreError {}

/** One event as the client hands it over: [name, fields]. */
export type EventEntry = { [Name in keyof Events]: [Name, Events[Name]] }[keyof Events];

/** What `request` resolves with, by request. */
export type Outcome<Name extends keyof Requests> =
  Name extends "requestListAll" ? { header: Events["listAll"]; elements: unknown[] } :
  Name extends "requestListElements" ? { header: Events["listElements"]; elements: unknown[] } :
  Name extends "requestListMatching" ? { header: Events["listMatching"]; elements: unknown[] } :
  Name extends "chatStart" ? import("./protocol.js").Chat :
  Name extends "chatMessageSend" ? import("./protocol.js").ChatMessage :
  Name extends "authToken" ? Record<string, unknown> :
  Name extends "identitiesGet" ? Events["identities"] :
  Name extends "search" ? Events["searchResult"] :
  Name extends "chatMessageStateGet" ? Events["chatMessageState"] :
  Name extends "requestListChanges" ? Events["listChanges"] :
  Name extends "endpointUpdate" ? Events["endpointUpdateResult"] :
  Name extends "endpointsGet" ? Events["endpoints"] :
  Name extends "endpointDeregister" ? Events["endpointDeregisterResult"] :
  undefined;

export interface EventStream extends AsyncIterableIterator<EventEntry> {}

export function findBinary(binary?: string): string;

export class Client {
  /** The `global` values received (authTokenState, setupState, localUri, ...). */
  globals: Record<string, unknown>;
  /** `chatcore serve --user USER` as a child process, over its standard input/output. */
  static spawn(user: string, options?: { dataDir?: string; binary?: string; args?: string[] }): Client;
  /** Connects to a serving chatcore: "unix:/path", "tcp://host:port" or "host:port". */
  static connect(address: string): Promise<Client>;
  authenticate(userId: string, token?: string, options?: { timeout?: number }): Promise<Record<string, unknown>>;
  /** Writes one request without waiting; returns its line number. */
  send(message: object): number;
  /** Sends a request (built with the protocol's builders) and resolves with its outcome. */
  request<Name extends keyof Requests>(message: { [K in Name]: Partial<Requests[K]> }, options?: { timeout?: number }): Promise<Outcome<Name>>;
  /** Every event from now on, answers included; ends when the connection closes. */
  events(): EventStream;
  /** The first event (from `events`, or from now on) for which the predicate holds. */
  waitFor(predicate: (name: keyof Events, fields: any) => boolean, options?: { timeout?: number; events?: EventStream }): Promise<EventEntry>;
  /** Event iterators open now (`events()` not yet ended or returned): for diagnostics. */
  readonly openEventIterators: number;
  /** Ends the session once the service has answered everything sent. */
  close(): Promise<void>;
}

/** A chatcore serving a Unix socket of its own (any token accepted unless `args` say otherwise). */
export class Server {
  readonly address: string;
  static start(options?: { dataDir?: string; binary?: string; args?: string[]; timeout?: number }): Promise<Server>;
  connect(user?: string, token?: string): Promise<Client>;
  stop(): Promise<void>;
}
