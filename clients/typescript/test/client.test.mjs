// The Node client against the real binary ($CHATCORE_BINARY, or a build found from here):
// every kind of outcome, two users, a refused token, a missing binary, installing it.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { cpSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { createServer } from "node:net";
import {
  ChatcoreError, ChatcoreTimeout, Client, ConnectionClosed, EventsLost, Server, findBinary,
  chatStart, chatMessageSend, chatMessageRead, chatLeave, requestListAll, requestListMatchingChatMessage, search, identitiesGet,
} from "../client.js";

const here = dirname(fileURLToPath(import.meta.url));

function scratch() {
  return mkdtempSync(join(tmpdir(), "chatcore-js-"));
}

test("every kind of outcome over standard input/output", async () => {
  const dir = scratch();
  const alice = Client.spawn("alice", { dataDir: join(dir, "data") });
  try {
    const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "Plans" }));
    assert.equal(chat.chatId, "1");
    const one = await alice.request(chatStart({ invitees: [{ userId: "carol" }], isOneToOne: true }));
    await assert.rejects(alice.request(chatStart({ invitees: [{ userId: "carol" }], isOneToOne: true })), (error) => {
      assert.equal(error.event, "chatStartFailed");
      assert.equal(error.error, "AlreadyExists");
      assert.equal(error.body.chatId, one.chatId);
      return true;
    });
    const sent = await alice.request(chatMessageSend({ chatId: "1", tag: "Text", content: "hello" }));
    assert.deepEqual([sent.messageId, sent.content, sent.state], ["2", "hello", "Sent"]);
    const chats = await alice.request(requestListAll({ type: "chat" }));
    assert.equal(chats.header.type, "chat");
    assert.deepEqual(chats.elements.map((c) => c.chatId).sort(), ["1", "2"]);
    const window = await alice.request(requestListMatchingChatMessage({ criteria: { chatId: "1" }, window: { messageId: "2", before: 5 } }));
    assert.deepEqual(window.elements.map((m) => m.messageId), ["1", "2"]);
    assert.equal(window.header.hasMoreBefore, false);
    const found = await alice.request(search({ text: "hell" }));
    assert.deepEqual(found.messages.map((m) => m.messageId), ["2"]);
    const identities = await alice.request(identitiesGet({ appUserIds: ["alice"] }));
    assert.equal(identities.info[0].appUserId, "alice");
    // Answered only when they fail: undefined on success, the failure found by its line.
    assert.equal(await alice.request(chatMessageRead({ chatId: "1", messageId: "2" })), undefined);
    await assert.rejects(alice.request(chatLeave({ chatIds: ["99"] })), (error) => error.error === "NotFound" && error.body.request === "chatLeave");
    await assert.rejects(alice.request({ requestListChange: { type: "chat", elements: [{ chatId: "1", numUnread: 3 }] } }),
      (error) => error.error === "InvalidParameter" && error.reason.includes("read-only"));
    await assert.rejects(alice.request({ chatMessageSend: { chatId: "1", tag: "Text", bogus: 1 } }), (error) => error.error === "InvalidParameter");
    const again = await alice.request(chatMessageSend({ chatId: "1", tag: "Text", content: "again" }));
    assert.equal(again.messageId, "3");
  } finally {
    await alice.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test("two users see Delivered and Read", async () => {
  const server = await Server.start();
  try {
    const alice = await server.connect("alice");
    assert.deepEqual(alice.globals.setupState, { state: "Success" });
    const bob = await server.connect("bob");
    const bobEvents = bob.events();
    const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "Lunch" }));
    const aliceEvents = alice.events();
    const sent = await alice.request(chatMessageSend({ chatId: chat.chatId, tag: "Text", content: "Noon?" }));
    const [, added] = await bob.waitFor((name, body) => name === "listAdd" && body.type === "chatMessage"
      && body.elements[0].content === "Noon?", { events: bobEvents });
    assert.equal(added.elements[0].flags, "I");
    await bob.request(chatMessageRead({ chatId: chat.chatId, messageId: added.elements[0].messageId }));
    const seen = [];
    for await (const [name, body] of aliceEvents) {
      if (name === "listChange" && body.type === "chatMessage") {
        seen.push(...body.elements.filter((e) => e.messageId === sent.messageId && e.state).map((e) => e.state));
      }
      if (seen.includes("Read")) break;
    }
    assert.deepEqual(seen, ["Delivered", "Read"]);
    await alice.close();
    await bob.close();
  } finally {
    await server.stop();
  }
});

test("a refused token rejects, and no outcome in time is a timeout", async () => {
  const dir = scratch();
  writeFileSync(join(dir, "secret"), "s".repeat(32));
  const server = await Server.start({ args: ["--auth-secret-file", join(dir, "secret"), "--log-level", "warning"] });
  try {
    const client = await server.connect();
    await assert.rejects(client.authenticate("alice", "not-a-jwt"), (error) => error instanceof ChatcoreError
      && error.event === "setupError" && error.error === "InvalidToken");
    await assert.rejects(client.request(chatMessageSend({ chatId: "1", tag: "Text", content: "x" })), (error) => error.error === "NotAuthenticated");
    // A service that does not answer (stopped) leaves the request without an outcome.
    server.child.kill("SIGSTOP");
    await stopped(server.child.pid);
    try {
      await assert.rejects(client.request({ chatTyping: { chatId: "1" } }, { timeout: 300 }), (error) => error instanceof ChatcoreTimeout);
    } finally {
      server.child.kill("SIGCONT");
    }
    await client.close();
  } finally {
    await server.stop();
    rmSync(dir, { recursive: true, force: true });
  }
});

// Resolves once every thread of `pid` is stopped: a signal's stop is not immediate, and a
// thread still running could answer what is sent after the signal.
async function stopped(pid, timeout = 10000) {
  const deadline = Date.now() + timeout;
  for (;;) {
    const states = [];
    for (const task of readdirSync(`/proc/${pid}/task`)) {
      try {
        const stat = readFileSync(`/proc/${pid}/task/${task}/stat`, "utf8");
        states.push(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[0]);
      } catch {
        // the thread ended
      }
    }
    if (states.length > 0 && states.every((state) => state === "T")) return;
    assert.ok(Date.now() < deadline, `not stopped: ${states}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

test("waitFor closes the event iterator it opened", async () => {
  const alice = Client.spawn("alice", { dataDir: join(scratch(), "data") });
  try {
    for (let n = 0; n < 8; n++) {
      const waiting = alice.waitFor((name, fields) => name === "identities" && fields.cookie === `w${n}`);
      alice.send(identitiesGet({ cookie: `w${n}`, appUserIds: ["alice"] }));
      await waiting;
    }
    assert.equal(alice.openEventIterators, 0, "each waitFor left its iterator subscribed, buffering every later event");
  } finally {
    await alice.close();
  }
});

test("a binary that cannot be started fails the requests, not the process", async () => {
  assert.throws(() => findBinary(join(scratch(), "nothing-here")), /binary is .*nothing-here, which is not an executable file/);
  // A directory passes the executable check but cannot be run: spawning it fails.
  const client = Client.spawn("alice", { binary: scratch() });
  await assert.rejects(client.request(chatStart({ invitees: [{ userId: "bob" }], subject: "never" })), ConnectionClosed);
});

test("without a binary the error says how to point at one", async () => {
  const saved = { binary: process.env.CHATCORE_BINARY, path: process.env.PATH, cwd: process.cwd() };
  const dir = scratch();
  try {
    delete process.env.CHATCORE_BINARY;
    process.env.PATH = dir;
    process.chdir(dir);
    // The package's own directory is searched too: copy it somewhere without a build.
    cpSync(join(here, ".."), join(dir, "client"), { recursive: true });
    const copy = await import(join(dir, "client", "client.js"));
    assert.throws(() => copy.findBinary(), /CHATCORE_BINARY/);
  } finally {
    if (saved.binary !== undefined) process.env.CHATCORE_BINARY = saved.binary;
    process.env.PATH = saved.path;
    process.chdir(saved.cwd);
  }
});

test("the package installs into a fresh project and its example runs", () => {
  const dir = scratch();
  try {
    writeFileSync(join(dir, "package.json"), JSON.stringify({ name: "app", version: "1.0.0", type: "module", private: true }));
    execFileSync("npm", ["install", "--no-audit", "--no-fund", "--offline", join(here, "..")], { cwd: dir, stdio: "ignore", timeout: 120000 });
    cpSync(join(here, "..", "example.mjs"), join(dir, "example.mjs"));
    const out = execFileSync("node", ["example.mjs"], { cwd: dir, env: { ...process.env, CHATCORE_BINARY: findBinary() }, timeout: 120000 }).toString();
    assert.deepEqual(out.trim().split("\n").slice(-2), ["alice sees Delivered", "alice sees Read"]);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("an aborted signal stops waiting for an outcome, and the session goes on", async () => {
  const server = await Server.start();
  try {
    const alice = await server.connect("alice");
    const before = new AbortController();
    before.abort(new Error("not wanted any more"));
    await assert.rejects(alice.request(identitiesGet({ appUserIds: ["alice"] }), { signal: before.signal }), /not wanted any more/);
    // Aborted while waiting: the service stopped (SIGSTOP) answers nothing until the abort.
    server.child.kill("SIGSTOP");
    await stopped(server.child.pid);
    const during = new AbortController();
    const waiting = alice.request(identitiesGet({ appUserIds: ["alice"] }), { signal: during.signal, timeout: 60000 });
    setTimeout(() => during.abort(), 50);
    await assert.rejects(waiting, (error) => error.name === "AbortError");
    const watching = new AbortController();
    const event = alice.waitFor("identities", { signal: watching.signal });
    watching.abort();
    await assert.rejects(event, (error) => error.name === "AbortError");
    server.child.kill("SIGCONT");
    assert.equal((await alice.request(identitiesGet({ appUserIds: ["alice"] }))).info[0].appUserId, "alice");
    assert.equal(alice.openEventIterators, 0);
    await alice.close();
  } finally {
    server.child.kill("SIGCONT");
    await server.stop();
  }
});

test("Symbol.asyncDispose closes a client and stops a server", async () => {
  const server = await Server.start();
  const alice = await server.connect("alice");
  await alice[Symbol.asyncDispose]();
  await assert.rejects(alice.request(identitiesGet({ appUserIds: ["alice"] })), ConnectionClosed);
  await server[Symbol.asyncDispose]();
  assert.notEqual(server.child.exitCode ?? server.child.signalCode, null, "the server still runs");
});

test("a TCP listener on IPv6 loopback is reached by its bracketed address", async () => {
  const probe = createServer();
  await new Promise((done) => probe.listen(0, "::1", done));
  const port = probe.address().port;
  await new Promise((done) => probe.close(done));
  const server = await Server.start({ args: ["--insecure-no-auth", "--log-level", "warning", "--listen", `[::1]:${port}`] });
  try {
    const client = await Client.connect(`[::1]:${port}`);
    await client.authenticate("alice");
    assert.equal(client.globals.authTokenState, "Ok");
    await client.close();
    await assert.rejects(Client.connect("::1"), TypeError);
  } finally {
    await server.stop();
  }
});

test("an iterator left unread keeps its bound, then says events were lost", async () => {
  const alice = Client.spawn("alice", { dataDir: join(scratch(), "data") });
  try {
    const lagging = alice.events({ maxBuffered: 5 });
    const following = alice.events();
    for (let n = 0; n < 8; n++) await alice.request(identitiesGet({ appUserIds: ["alice"] }));
    const received = [];
    await assert.rejects((async () => { for await (const [name] of lagging) received.push(name); })(), EventsLost);
    assert.equal(received.length, 5);
    assert.equal(alice.openEventIterators, 1);
    const names = [];
    for (let n = 0; n < 8; n++) names.push((await following.next()).value[0]);
    assert.deepEqual(names, Array(8).fill("identities"));
    const [name, fields] = await Promise.all([alice.waitFor("identities", (f) => f.cookie === "late"),
      alice.request(identitiesGet({ cookie: "late", appUserIds: ["alice"] }))]).then(([entry]) => entry);
    assert.equal(name, "identities");
    assert.equal(fields.cookie, "late");
  } finally {
    await alice.close();
  }
});
