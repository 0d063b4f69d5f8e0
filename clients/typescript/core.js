// chatcore's client, whatever carries its lines: a child's standard input/output or a socket
// (client.js, for Node) or a WebSocket (browser.js, for browsers). No Node built-in is used
// here. Types: client.d.ts; the request builders and protocol types are generated from
// Schemas/ (protocol.js, protocol.d.ts).
//
// Every request's outcome is found the same way (docs/protocol.md, "Reference"): a failure is
// the requestFailed whose `line` is the request's line (the client counts the lines it
// writes), or chatStartFailed / setupError; an answer is the event carrying the request's
// cookie (list answers: the header and every chunk up to `last: true`; a started chat or a
// sent message: the listAdd carrying the cookie); a request not answered when it succeeds is
// followed by a small list request, and since answers keep the order of requests, once that
// is answered with no failure before it, the request succeeded.
import { ANSWERS, TAKES_COOKIE, requestListElementsGlobal } from "./protocol.js";

export * from "./protocol.js";

const LIST_HEADERS = new Set(["listAll", "listElements", "listMatching"]);

export class ChatcoreError extends Error {
  constructor(event, error, reason, body = {}) {
    super(`${event}: ${error}: ${reason}`);
    this.name = "ChatcoreError";
    this.event = event;
    this.error = error;
    this.reason = reason;
    this.body = body;
  }
}

export class ChatcoreTimeout extends ChatcoreError {
  constructor(request, ms) {
    super("timeout", "Timeout", `no outcome for ${request} within ${ms} ms`);
    this.name = "ChatcoreTimeout";
  }
}

export class ConnectionClosed extends ChatcoreError {
  constructor(reason = "the connection to chatcore closed") {
    super("closed", "Closed", reason);
    this.name = "ConnectionClosed";
  }
}

/** An `events()` iterator fell more than its `maxBuffered` events behind: later events were
 * dropped for it alone. It hands over those it kept, then throws this and ends. */
export class EventsLost extends ChatcoreError {
  constructor(kept) {
    super("events", "EventsLost", `more than ${kept} events waited in this iterator unread; later ones were dropped`);
    this.name = "EventsLost";
    this.kept = kept;
  }
}

/** How many unread events one `events()` iterator keeps by default. */
export const MAX_BUFFERED_EVENTS = 10000;

/** The error a request or wait rejects with when its signal is aborted: the signal's reason. */
function aborted(signal) {
  return signal.reason ?? Object.assign(new Error("This operation was aborted"), { name: "AbortError" });
}

export class Client {
  #transport;
  #lines = 0;
  #cookies = 0;
  #byLine = new Map();
  #byCookie = new Map();
  #auth = null;
  #subscribers = new Set();
  #closed = null;
  #buffer = "";
  #ended;
  /** The `global` values received (authTokenState, setupState, localUri, ...). */
  globals = {};

  /**
   * A session over `transport`, which writes a line (`write(text)`, the newline its own
   * business), ends the input (`end()`), lets go of what is left once the session ended
   * (`dispose()`, optional), and hands over what arrives: `start({ data(text), end(error) })`,
   * where `data` gets text in which every event ends with a newline.
   */
  constructor(transport) {
    this.#transport = transport;
    this.#ended = new Promise((resolveEnded) => {
      let ended = false;
      const end = (error) => {
        if (ended) return;
        ended = true;
        if (!this.#closed) this.#closed = new ConnectionClosed(error ? `the connection to chatcore failed: ${error.message}` : undefined);
        for (const pending of new Set([...this.#byLine.values(), ...this.#byCookie.values()])) this.#settle(pending, undefined, this.#closed);
        for (const subscriber of this.#subscribers) subscriber.push(null);
        resolveEnded();
      };
      transport.start({ data: (text) => this.#receive(text), end });
    });
  }

  /** Sends authToken; resolves with the global values once setup says Success (or Full). */
  async authenticate(userId, token = "any", { timeout = 10000 } = {}) {
    await this.request({ authToken: { userId, authToken: token } }, { timeout });
    return { ...this.globals };
  }

  /** Writes one request without waiting; returns its line number. */
  send(message) {
    if (this.#closed) throw this.#closed;
    this.#transport.write(JSON.stringify(message));
    return ++this.#lines;
  }

  /**
   * Sends a request and resolves with its outcome: a list answer as { header, elements }, the
   * new chat element for chatStart, the sent message element for chatMessageSend, the globals
   * for authToken, the answer's fields for an answered request, undefined for a request
   * answered only when it fails. Rejects with ChatcoreError or ChatcoreTimeout, or with the
   * signal's reason once `signal` is aborted (the request may still have been carried out:
   * only waiting for its outcome stops).
   */
  request(message, { timeout = 10000, signal } = {}) {
    const [name, fields] = Object.entries(message)[0];
    const body = { ...fields };
    if (TAKES_COOKIE.has(name) && body.cookie === undefined) body.cookie = `js${++this.#cookies}`;
    if (signal?.aborted) return Promise.reject(aborted(signal));
    return new Promise((resolvePromise, reject) => {
      const pending = { name, cookie: body.cookie, resolve: resolvePromise, reject, header: null, elements: [], done: false };
      if (pending.cookie !== undefined) {
        if (this.#byCookie.has(pending.cookie)) throw new Error(`cookie ${pending.cookie} is already waiting for an answer`);
        this.#byCookie.set(pending.cookie, pending);
      }
      if (name === "authToken") this.#auth = pending;
      const timer = setTimeout(() => this.#settle(pending, undefined, new ChatcoreTimeout(name, timeout)), timeout);
      const onAbort = () => this.#settle(pending, undefined, aborted(signal));
      signal?.addEventListener("abort", onAbort, { once: true });
      pending.cleanup = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        for (const table of [this.#byLine, this.#byCookie]) {
          for (const [key, value] of table) if (value === pending || value.barrierFor === pending) table.delete(key);
        }
        if (this.#auth === pending) this.#auth = null;
      };
      try {
        this.#byLine.set(this.send({ [name]: body }), pending);
        if ((ANSWERS[name] ?? []).length === 0 && name !== "authToken") {
          const barrier = { name: "requestListElements", cookie: `js${++this.#cookies}`, barrierFor: pending, elements: [] };
          this.#byCookie.set(barrier.cookie, barrier);
          this.#byLine.set(this.send(requestListElementsGlobal({ elements: [{ name: "authTokenState" }], cookie: barrier.cookie })), barrier);
        }
      } catch (error) {
        this.#settle(pending, undefined, error);
      }
    });
  }

  /**
   * Every event from now on, as [name, fields], answers included; ends when the connection
   * closes. Events wait in the iterator until read: past `maxBuffered` unread ones, later
   * events are dropped for this iterator alone, and once it has handed over those it kept it
   * throws EventsLost and ends. Return an iterator you stop reading (`break` does).
   */
  events({ maxBuffered = MAX_BUFFERED_EVENTS } = {}) {
    const queue = [];
    let wake = null;
    let lost = false;
    const subscriber = {
      push: (item) => {
        if (lost) return;
        if (item !== null && queue.length >= maxBuffered) {
          lost = true;
          item = null;
        }
        queue.push(item);
        if (wake) { wake(); wake = null; }
      },
    };
    this.#subscribers.add(subscriber);
    const subscribers = this.#subscribers;
    return {
      async next() {
        while (queue.length === 0) await new Promise((resolveWake) => { wake = resolveWake; });
        const item = queue.shift();
        if (item === null) {
          subscribers.delete(subscriber);
          if (lost) throw new EventsLost(maxBuffered);
          return { done: true, value: undefined };
        }
        return { done: false, value: item };
      },
      async return() {
        subscribers.delete(subscriber);
        return { done: true, value: undefined };
      },
      [Symbol.asyncIterator]() { return this; },
    };
  }

  /**
   * The first event (from `events`, or from the moment of this call) for which
   * predicate(name, fields) holds; rejects with ChatcoreTimeout, or the signal's reason.
   * `waitFor(name, predicate?, options?)` waits for an event of that name (predicate(fields)).
   */
  async waitFor(...given) {
    if (typeof given[0] === "string") {
      const [wanted, test, options] = given;
      const predicate = (name, fields) => name === wanted && (typeof test !== "function" || test(fields));
      return this.waitFor(predicate, (typeof test === "function" ? options : test) ?? {});
    }
    const [predicate, { timeout = 10000, events, signal } = {}] = given;
    const source = events ?? this.events();
    let timer;
    let onAbort;
    const expired = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new ChatcoreTimeout("an event", timeout)), timeout);
      onAbort = () => reject(aborted(signal));
      if (signal?.aborted) onAbort();
      signal?.addEventListener("abort", onAbort, { once: true });
    });
    try {
      return await Promise.race([expired, (async () => {
        for (;;) {
          const { done, value } = await source.next();
          if (done) throw this.#closed ?? new ConnectionClosed();
          if (predicate(value[0], value[1])) return value;
        }
      })()]);
    } finally {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
      // An iterator it opened itself is closed: it would otherwise buffer every later event.
      if (!events) await source.return();
    }
  }

  /** Event iterators open now (`events()` not yet ended or returned): for diagnostics. */
  get openEventIterators() {
    return this.#subscribers.size;
  }

  /** Ends the session: no more input; resolves once the service has answered everything. */
  async close() {
    this.#transport.end();
    let timer;
    await Promise.race([this.#ended, new Promise((r) => { timer = setTimeout(r, 10000); })]);
    clearTimeout(timer);
    await this.#transport.dispose?.();
  }

  /** `await using client = ...` closes it at the end of the scope. */
  [Symbol.asyncDispose ?? Symbol.for("Symbol.asyncDispose")]() {
    return this.close();
  }

  #receive(text) {
    this.#buffer += text;
    let newline;
    while ((newline = this.#buffer.indexOf("\n")) >= 0) {
      const line = this.#buffer.slice(0, newline);
      this.#buffer = this.#buffer.slice(newline + 1);
      if (!line) continue;
      const event = JSON.parse(line);
      const [name, fields] = Object.entries(event)[0];
      this.#dispatch(name, fields);
      for (const subscriber of this.#subscribers) subscriber.push([name, fields]);
    }
  }

  #settle(pending, value, error) {
    const target = pending.barrierFor ?? pending;
    if (target.done) return;
    target.done = true;
    target.cleanup?.();
    if (error) target.reject(error);
    else target.resolve(pending.barrierFor ? undefined : value);
  }

  #dispatch(name, body) {
    if (name === "requestFailed") {
      const pending = this.#byLine.get(body.line);
      if (pending) this.#settle(pending, undefined, new ChatcoreError(name, body.error, body.reason, body));
      return;
    }
    if (name === "listChange" && body.type === "global") {
      for (const element of body.elements ?? []) this.globals[element.name] = element.value;
      const state = this.globals.setupState?.state;
      if (this.#auth && this.globals.authTokenState === "Ok" && (state === "Success" || state === "Full")) {
        this.#settle(this.#auth, { ...this.globals });
      }
      return;
    }
    if (name === "setupError" && this.#auth) {
      this.#settle(this.#auth, undefined, new ChatcoreError(name, body.error, body.error, body));
      return;
    }
    const pending = body.cookie === undefined ? undefined : this.#byCookie.get(body.cookie);
    if (!pending) return;
    if (LIST_HEADERS.has(name)) {
      pending.header = body;
    } else if (name === "listChunk") {
      pending.elements.push(...(body.elements ?? []));
      if (body.last) this.#settle(pending, { header: pending.header, elements: pending.elements });
    } else if (name === "listAdd") {
      this.#settle(pending, body.elements?.[0]);
    } else if (name === "chatStartFailed") {
      this.#settle(pending, undefined, new ChatcoreError(name, body.reason, body.detail ?? "", body));
    } else if ((ANSWERS[pending.name] ?? []).includes(name)) {
      this.#settle(pending, body);
    }
  }
}

