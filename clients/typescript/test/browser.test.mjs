// The browser client (browser.js) against the real binary's WebSocket listener, in Node with
// its WebSocket (browsers run the same file: Examples/web). Nothing on its path may need Node.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Client, ChatcoreError, chatStart, chatMessageSend, chatMessageRead, chatTyping, requestListAll, identitiesGet } from "../browser.js";
import { Client as NodeClient, findBinary } from "../client.js";

const here = dirname(fileURLToPath(import.meta.url));

/** chatcore with a WebSocket listener and a Unix socket; { url, socket, stop }. */
async function serve() {
  const dir = mkdtempSync(join(tmpdir(), "chatcore-ws-"));
  const socket = join(dir, "s");
  const child = spawn(findBinary(), ["serve", "--data-dir", join(dir, "data"), "--listen", "ws://127.0.0.1:0/chat", "--listen", `unix:${socket}`,
    "--insecure-no-auth"], { stdio: ["ignore", "ignore", "pipe"] });
  let log = "";
  const url = await new Promise((resolveUrl, reject) => {
    child.stderr.setEncoding("utf8");
    child.stderr.on("data", (text) => {
      log += text;
      const port = /address=ws:\/\/\S+ .*?port=(\d+)/.exec(log);
      if (port && log.includes(`unix:${socket}`)) resolveUrl(`ws://127.0.0.1:${port[1]}/chat`);
    });
    child.once("exit", (code) => reject(new Error(`chatcore exited ${code}: ${log}`)));
  });
  return {
    url, socket: `unix:${socket}`,
    async stop() {
      child.kill("SIGTERM");
      await new Promise((r) => child.once("exit", r));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

test("browser.js and core.js import nothing of Node's", () => {
  for (const file of ["browser.js", "core.js", "protocol.js"]) {
    const text = readFileSync(join(here, "..", file), "utf8");
    assert.doesNotMatch(text, /from\s+["']node:|require\(/, `${file} must run in a browser`);
  }
});

test("the same Client over a WebSocket: answers, failures, events, delivery and read states", async () => {
  const server = await serve();
  try {
    const alice = await Client.connect(server.url);
    const globals = await alice.authenticate("alice");
    assert.equal(globals.setupState.state, "Success");
    const bob = await NodeClient.connect(server.socket);
    await bob.authenticate("bob");
    // Every event from here on: the ones waited for below may come with the answers before them.
    const events = alice.events();
    const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "from a browser" }));
    const sent = await alice.request(chatMessageSend({ chatId: chat.chatId, tag: "Text", content: "hi bob" }));
    assert.equal(sent.state, "Sent");
    await alice.waitFor("listChange", (f) => f.type === "chatMessage" && f.elements.some((e) => e.messageId === sent.messageId && e.state === "Delivered"), { events });
    await bob.request(chatTyping({ chatId: chat.chatId }));
    await alice.waitFor("listAdd", (f) => f.type === "typing", { events });
    await bob.request(chatMessageRead({ chatId: chat.chatId, messageId: sent.messageId }));
    await alice.waitFor("listChange", (f) => f.type === "chatMessage" && f.elements.some((e) => e.messageId === sent.messageId && e.state === "Read"), { events });
    await events.return();
    const chats = await alice.request(requestListAll({ type: "chat" }));
    assert.deepEqual(chats.elements.map((c) => c.chatId), [chat.chatId]);
    await assert.rejects(alice.request(chatMessageSend({ chatId: "99", tag: "Text", content: "x" })), (error) => {
      assert.ok(error instanceof ChatcoreError);
      assert.equal(error.error, "NotFound");
      return true;
    });
    const who = await alice.request(identitiesGet({ appUserIds: ["bob"] }));
    assert.equal(who.info[0].appUserId, "bob");
    await alice.close();
    await bob.close();
  } finally {
    await server.stop();
  }
});
