// A minimal chatcore client in Node.js: spawns `chatcore serve --user alice`, sends
// requests as JSON lines on its standard input, and reads events from its standard output.
//
//     CHATCORE_BINARY=.build/debug/chatcore node Examples/node/client.mjs
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

const binary = process.env.CHATCORE_BINARY ?? "chatcore";
const dataDir = mkdtempSync(join(tmpdir(), "chatcore-node-"));
const child = spawn(binary, ["serve", "--user", "alice", "--data-dir", dataDir], { stdio: ["pipe", "pipe", "inherit"] });

// Events carrying a cookie resolve the request that sent it.
const waiting = new Map();
let nextCookie = 1;
createInterface({ input: child.stdout }).on("line", (line) => {
  const event = JSON.parse(line);
  const [name, body] = Object.entries(event)[0];
  const resolve = waiting.get(body?.cookie);
  if (resolve) {
    waiting.delete(body.cookie);
    resolve(event);
  } else {
    console.log("event:", name, JSON.stringify(body));
  }
});

function request(name, fields) {
  const cookie = `node${nextCookie++}`;
  child.stdin.write(JSON.stringify({ [name]: { ...fields, cookie } }) + "\n");
  return new Promise((resolve) => waiting.set(cookie, resolve));
}

const identities = await request("identitiesGet", { appUserIds: ["alice"] });
console.log("identities:", JSON.stringify(identities.identities.info));
const failed = await request("chatMessageSend", { chatId: "1", tag: "Text", misspelled: true });
console.log("requestFailed:", failed.requestFailed.reason);

child.stdin.end();
child.on("exit", (code) => {
  rmSync(dataDir, { recursive: true, force: true });
  console.log("exit code", code);
  process.exit(code ?? 1);
});
