// Drives chatcore the way an app written for bbmcore does (BlackBerry's Cordova plugin:
// its native proxies, its observable cache and its list adapters), to check the facts such
// an app depends on, written here in our own code:
//
// - element observers match elements by key with string equality: message ids, chat ids
//   and uris must be strings;
// - a whole-list adapter applies chunks only after their header (listAll or listElements)
//   and throws when a chunk comes first; it applies what it gathered on `last: true`;
// - the message list adapter does arithmetic on `chat.lastMessage` (numbers) to know which
//   message ids to observe, and marks read up to `String(chat.lastMessage)`;
// - a started chat is recognised by the cookie on its `listAdd`;
// - globals come before a token: authToken on `Needed`, endpointUpdate on `NotRequested`.
//
// Each scenario runs over a Unix socket and over a WebSocket (one message per frame, as a web
// app would speak). Run by `make test` (node --test Tests/node) against $CHATCORE_BINARY.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { connect } from "node:net";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const binary = process.env.CHATCORE_BINARY ?? join(root, ".build", "debug", "chatcore");

function accepts(path) {
  return new Promise((resolve) => {
    const probe = connect(path);
    probe.once("connect", () => { probe.destroy(); resolve(true); });
    probe.once("error", () => { probe.destroy(); resolve(false); });
  });
}

async function startService() {
  const dir = mkdtempSync(join(tmpdir(), "chatcore-node-adapters-"));
  const socket = join(dir, "s");
  const child = spawn(binary, ["serve", "--data-dir", join(dir, "data"), "--listen", "ws://127.0.0.1:0/bbmds", "--listen", `unix:${socket}`,
    "--insecure-no-auth"], { stdio: ["ignore", "ignore", "pipe"] });
  let log = "";
  child.stderr.setEncoding("utf8");
  child.stderr.on("data", (text) => { log += text; });
  // The socket file appears when chatcore binds it, a moment before it listens.
  for (let tries = 0; !(await accepts(socket)); tries++) {
    if (tries > 600) throw new Error("chatcore did not listen");
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  const port = /address=ws:\/\/\S+ .*?port=(\d+)/.exec(log)[1];
  return {
    socket,
    webSocket: `ws://127.0.0.1:${port}/bbmds`,
    stop: async () => {
      child.kill("SIGTERM");
      await new Promise((resolve) => child.on("exit", resolve));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

const primaryKeys = {
  global: ["name"], user: ["uri"], chat: ["chatId"], chatParticipant: ["chatId", "userUri"],
  chatMessage: ["chatId", "messageId"], typing: ["userUri", "chatId"],
};

function sameKey(type, a, b) {
  // Strict equality, as the proxies compare: "2" is not 2.
  return primaryKeys[type].every((part) => a[part] === b[part]);
}

/// A whole-list adapter: the list as the app shows it.
class ListAdapter {
  constructor(type) {
    this.type = type;
    this.items = [];
    this.pending = undefined;
    this.replaceAll = false;
    this.errors = [];
  }

  apply(name, body) {
    switch (name) {
      case "listAll":
      case "listElements":
        this.pending = [];
        this.replaceAll = name === "listAll";
        break;
      case "listChunk":
        if (this.pending === undefined) throw new Error(`a ${this.type} listChunk came before its header`);
        this.pending.push(...body.elements);
        if (body.last) {
          if (this.replaceAll) {
            this.items = this.pending;
          } else {
            for (const element of this.pending) {
              const index = this.items.findIndex((item) => sameKey(this.type, item, element));
              if (index >= 0) this.items[index] = element; else this.items.push(element);
            }
          }
          this.pending = undefined;
        }
        break;
      case "listAdd":
        this.items.push(...body.elements);
        break;
      case "listChange":
        for (const change of body.elements) {
          const index = this.items.findIndex((item) => sameKey(this.type, item, change));
          if (index < 0) this.errors.push(`changed ${JSON.stringify(change)} is not in the list`);
          else this.items[index] = { ...this.items[index], ...change };
        }
        break;
      case "listRemove":
        for (const key of body.elements) {
          const index = this.items.findIndex((item) => sameKey(this.type, item, key));
          if (index < 0) this.errors.push(`removed ${JSON.stringify(key)} is not in the list`);
          else this.items.splice(index, 1);
        }
        break;
      case "listResync":
        throw new Error(`listResync of ${this.type} cannot be applied`);
    }
  }
}

/// A WebSocket that looks like the socket the app writes lines to: each line it writes is
/// one text frame, each frame it receives a line.
async function webSocketLines(url) {
  const socket = new WebSocket(url);
  await new Promise((resolve, reject) => {
    socket.addEventListener("open", resolve, { once: true });
    socket.addEventListener("error", reject, { once: true });
  });
  return {
    write(text) {
      for (const line of text.split("\n")) if (line) socket.send(line);
    },
    on(event, handler) {
      if (event === "data") socket.addEventListener("message", (message) => handler(message.data + "\n"));
    },
    destroy() {
      socket.close();
    },
  };
}

/// One endpoint of an app: a socket to chatcore, the proxy's routing and the cache of
/// observed elements and lists.
class App {
  constructor(name) {
    this.name = name;
    this.lists = new Map();      // type -> ListAdapter, for lists observed whole
    this.observed = new Map();   // "type:key json" -> { type, key, value, handlers }
    this.messages = [];          // every event, for assertions
    this.waiters = [];
    this.nextCookie = 1;
  }

  async connect(path) {
    this.sock = path.startsWith("ws://") ? await webSocketLines(path) : connect(path);
    if (!path.startsWith("ws://")) await new Promise((resolve, reject) => { this.sock.once("connect", resolve); this.sock.once("error", reject); });
    let buffer = "";
    this.sock.on("data", (data) => {
      buffer += data.toString("utf8");
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        this.receive(JSON.parse(line));
      }
    });
  }

  send(name, fields) {
    this.sock.write(JSON.stringify({ [name]: fields }) + "\n");
  }

  cookie() {
    return `${this.name}-${this.nextCookie++}`;
  }

  /// The proxy's routing of one event.
  receive(event) {
    const [name, body] = Object.entries(event)[0];
    this.messages.push(event);
    if (name.startsWith("list") && body.type) {
      this.lists.get(body.type)?.apply(name, body);
      for (const entry of this.observed.values()) {
        if (entry.type !== body.type || !body.elements) continue;
        for (const element of body.elements) {
          if (!Object.entries(entry.key).every(([field, value]) => element[field] === value)) continue;
          const value = entry.type === "global" ? element.value : element;
          entry.value = name === "listRemove" ? null
            : name === "listChange" && typeof entry.value === "object" && entry.value !== null && typeof value === "object" ? { ...entry.value, ...value }
            : value;
          for (const handler of entry.handlers) handler(entry.value);
        }
      }
    }
    for (const waiter of [...this.waiters]) {
      if (waiter.match(event)) {
        this.waiters.splice(this.waiters.indexOf(waiter), 1);
        waiter.resolve(event);
      }
    }
  }

  /// Observes a whole list (requestListAll, no cookie, as the Android proxy sends it).
  observeList(type) {
    const adapter = new ListAdapter(type);
    this.lists.set(type, adapter);
    this.send("requestListAll", { type });
    return adapter;
  }

  /// Observes one element by key (requestListElements with a random cookie).
  observe(type, key, handler) {
    const id = `${type}:${JSON.stringify(key)}`;
    let entry = this.observed.get(id);
    if (!entry) {
      entry = { type, key, value: undefined, handlers: [] };
      this.observed.set(id, entry);
      this.send("requestListElements", { type, elements: [key], cookie: `uuid-${Math.random().toString(16).slice(2)}` });
    }
    if (handler) {
      entry.handlers.push(handler);
      if (entry.value !== undefined) handler(entry.value);
    }
    return entry;
  }

  waitFor(match, what, timeout = 10000) {
    const found = this.messages.find(match);
    if (found) return Promise.resolve(found);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`${this.name}: no ${what} within ${timeout} ms`)), timeout);
      this.waiters.push({ match, resolve: (event) => { clearTimeout(timer); resolve(event); } });
    });
  }

  async until(predicate, what, timeout = 10000) {
    const deadline = Date.now() + timeout;
    while (!predicate()) {
      if (Date.now() > deadline) throw new Error(`${this.name}: ${what} did not happen within ${timeout} ms`);
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
  }

  /// The setup flow of the plugin's sample app: globals first; endpointUpdate on
  /// NotRequested, authToken on Needed; done on Success.
  async setUp(userId) {
    const chats = this.observeList("chat");
    this.observeList("typing");
    let state;
    this.observe("global", { name: "setupState" }, (value) => {
      state = value.state;
      if (value.state === "NotRequested") {
        this.send("endpointUpdate", { description: `${this.name} (node)`, nickname: this.name, isLegacyDelegate: true, cookie: this.cookie() });
      }
    });
    this.observe("global", { name: "authTokenState" }, (value) => {
      if (value === "Needed") this.send("authToken", { userId, authToken: "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0." });
    });
    this.observe("global", { name: "localUri" }, (uri) => {
      this.observe("user", { uri }, (user) => { this.regId = user.regId; });
    });
    await this.until(() => state === "Success" && this.regId !== undefined, "setup");
    return chats;
  }
}

/// The message list adapter: observes the last `size` messages of a chat by id, growing
/// as `lastMessage` grows; the ids are computed with arithmetic on the counters.
class MessageWindow {
  constructor(app, chatId, size) {
    this.app = app;
    this.chatId = chatId;
    this.size = size;
    this.messages = new Map(); // messageId (string) -> element
    this.end = undefined;
    app.observe("chat", { chatId }, (chat) => this.chatChanged(chat));
  }

  chatChanged(chat) {
    if (chat === null) return; // the chat was removed (left)
    assert.equal(typeof chat.lastMessage, "number", "lastMessage must be a number");
    assert.equal(typeof chat.numMessages, "number", "numMessages must be a number");
    if (this.end === chat.lastMessage) return;
    const start = this.end === undefined ? Math.max(chat.lastMessage - this.size, 0) : this.end;
    for (let index = start; index < chat.lastMessage; index++) {
      const messageId = String(index + 1);
      this.app.observe("chatMessage", { chatId: this.chatId, messageId }, (message) => this.messages.set(messageId, message));
    }
    this.end = chat.lastMessage;
  }

  list() {
    return [...this.messages.values()].sort((a, b) => Number(a.messageId) - Number(b.messageId));
  }
}

for (const transport of ["socket", "webSocket"]) {
test(`an app written for bbmcore sets up, starts a chat by cookie, and sees messages, states and counters (${transport})`, async () => {
  const service = await startService();
  const alice = new App("alice");
  const bob = new App("bob");
  try {
    await alice.connect(service[transport]);
    await bob.connect(service[transport]);
    const aliceChats = await alice.setUp("alice");
    const bobChats = await bob.setUp("bob");
    assert.match(alice.regId, /^[0-9]+$/, "regId is a decimal string");

    // Start a chat with bob's regId: the app passes it as a string and the native layer
    // writes it as a JSON integer (a 63-bit one, more than a JavaScript number holds).
    const start = alice.cookie();
    alice.sock.write(`{"chatStart":{"invitees":[{"regId":${bob.regId}}],"subject":"Node test","cookie":"${start}"}}\n`);
    const added = await alice.waitFor((e) => e.listAdd?.type === "chat" && e.listAdd.cookie === start, "the chat's listAdd with the cookie");
    const chatId = added.listAdd.elements[0].chatId;
    assert.equal(typeof chatId, "string");
    const aliceWindow = new MessageWindow(alice, chatId, 100);
    await bob.until(() => bobChats.items.some((chat) => chat.chatId === chatId), "bob's chat list has the chat");
    const bobWindow = new MessageWindow(bob, chatId, 100);

    // Text both ways, each send answered by the sender's listAdd with its cookie.
    for (const [from, text] of [[alice, "Hello bob"], [bob, "Hi alice"], [alice, "How are you?"]]) {
      const cookie = from.cookie();
      from.send("chatMessageSend", { chatId, tag: "Text", content: text, cookie });
      const answer = await from.waitFor((e) => e.listAdd?.type === "chatMessage" && e.listAdd.cookie === cookie, "the send's listAdd");
      assert.equal(typeof answer.listAdd.elements[0].messageId, "string");
    }
    await alice.until(() => aliceWindow.list().length === 4, "alice's window holds 4 messages");
    await bob.until(() => bobWindow.list().length === 4, "bob's window holds 4 messages");
    assert.deepEqual(bobWindow.list().map((m) => m.messageId), ["1", "2", "3", "4"]);
    assert.deepEqual(bobWindow.list().map((m) => m.tag), ["Join", "Text", "Text", "Text"]);
    assert.equal(bobWindow.list()[1].content, "Hello bob");
    assert.ok(bobWindow.list()[1].flags.includes("I"));

    // Alice's messages are Delivered; bob reads up to String(chat.lastMessage): Read.
    await alice.until(() => aliceWindow.messages.get("4")?.state === "Delivered", "message 4 Delivered for alice");
    const bobChat = bob.observe("chat", { chatId }).value;
    assert.equal(bobChat.numUnread, 2);
    bob.send("chatMessageRead", { chatId, messageId: String(bobChat.lastMessage) });
    await alice.until(() => aliceWindow.messages.get("4")?.state === "Read" && aliceWindow.messages.get("2")?.state === "Read",
      "alice's messages Read");
    await bob.until(() => bob.observe("chat", { chatId }).value.numUnread === 0, "bob's numUnread 0");

    // The lists as the adapters hold them: counters are numbers, nothing was lost.
    const aliceChat = aliceChats.items.find((chat) => chat.chatId === chatId);
    assert.equal(aliceChat.lastMessage, 4);
    assert.equal(aliceChat.numMessages, 4);
    assert.deepEqual(aliceChats.errors, []);
    assert.deepEqual(bobChats.errors, []);

    // What other chat SDKs add (reactions, mentions, pins), done by another client: the
    // app's adapters take the new fields in their stride and what it shows stays right.
    const mentionAll = alice.cookie();
    alice.send("chatMessageSend", { chatId, tag: "Text", content: "@all lunch", mentionsAll: true, cookie: mentionAll });
    await alice.waitFor((e) => e.listAdd?.type === "chatMessage" && e.listAdd.cookie === mentionAll, "the mention's listAdd");
    bob.send("chatMessageReact", { chatId, messageId: "2", reaction: "👍" });
    alice.send("chatMessagePin", { chatId, messageId: "2" });
    await bob.until(() => bobWindow.messages.get("2")?.pinned !== undefined && bobWindow.messages.get("2")?.reactions?.length === 1,
      "bob's window has message 2 reacted to and pinned");
    await bob.until(() => bobWindow.list().length === 5, "bob's window holds the mention");
    assert.equal(bobWindow.messages.get("2").content, "Hello bob");
    assert.equal(bobWindow.messages.get("2").state, "Read");
    assert.equal(bobWindow.messages.get("5").mentioned, true);
    assert.equal(bob.observe("chat", { chatId }).value.numUnread, 1);
    assert.deepEqual(bobChats.errors, []);
    assert.deepEqual(aliceChats.errors, []);

    // Typing comes and goes in the typing list.
    const bobTyping = bob.lists.get("typing");
    alice.send("chatTyping", { chatId });
    await bob.until(() => bobTyping.items.length === 1, "bob sees alice typing");
    alice.send("chatMessageSend", { chatId, tag: "Text", content: "bye", cookie: alice.cookie() });
    await bob.until(() => bobTyping.items.length === 0, "the typing ends with the message");

    // bob leaves: the chat goes from his list, alice's participant list loses him.
    bob.send("chatLeave", { chatIds: [chatId] });
    await bob.until(() => !bobChats.items.some((chat) => chat.chatId === chatId), "the chat leaves bob's list");

    // A second endpoint of alice's gets her existing chat when it is set up.
    const alice2 = new App("alice2");
    await alice2.connect(service[transport]);
    const alice2Chats = await alice2.setUp("alice");
    await alice2.until(() => alice2Chats.items.some((chat) => chat.chatId === chatId && chat.lastMessage === 7), "alice2 has the chat");
    alice2.sock.destroy();
  } finally {
    alice.sock?.destroy();
    bob.sock?.destroy();
    await service.stop();
  }
});

test(`a chunk never comes before its header, even for lists asked for before setup (${transport})`, async () => {
  const service = await startService();
  const app = new App("early");
  try {
    await app.connect(service[transport]);
    // Every list type, whole and by element, before and after the token.
    const lists = ["global", "user", "chat", "chatParticipant", "typing"].map((type) => app.observeList(type));
    app.observe("chatMessage", { chatId: "1", messageId: "1" });
    app.send("authToken", { userId: "early", authToken: "x" });
    for (const type of ["global", "user", "chat", "chatParticipant", "typing"]) app.observeList(type);
    app.send("identitiesGet", { cookie: "sync", appUserIds: ["early"] });
    await app.waitFor((e) => e.identities?.cookie === "sync", "the identities answer");
    for (const list of lists) assert.deepEqual(list.errors, []);
    // Every header was followed by chunks that ended with last: true.
    let open = 0;
    for (const event of app.messages) {
      const [name, body] = Object.entries(event)[0];
      if (["listAll", "listElements"].includes(name)) open++;
      if (name === "listChunk") {
        assert.ok(open > 0, "a chunk came before its header");
        if (body.last) open--;
      }
    }
    assert.equal(open, 0);
  } finally {
    app.sock?.destroy();
    await service.stop();
  }
});
}
