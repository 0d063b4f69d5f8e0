// A chatcore session from Node.js, with the client in clients/typescript as this
// directory's package.json names it:
//
//     cd Examples/node && npm install && node client.mjs
//
// It spawns `chatcore serve --user alice` on a fresh data directory, starts a chat with bob,
// sends a message, reads the chat back, and shows a refused request. The binary is found
// through CHATCORE_BINARY, PATH, or a build of this repository (`make build`).
// @ts-check
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ChatcoreError, Client, chatStart, chatMessageSend, identitiesGet, requestListMatchingChatMessage } from "chatcore-client";

const dataDir = mkdtempSync(join(tmpdir(), "chatcore-node-"));
let alice;
try {
  alice = Client.spawn("alice", { dataDir });
} catch (error) {
  console.error(error instanceof Error ? error.message : error);
  process.exit(1);
}
const me = await alice.request(identitiesGet({ appUserIds: ["alice"] }));
console.log("alice is", me.info[0].uri);
const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "Lunch" }));
console.log("started chat", chat.chatId, JSON.stringify(chat.subject));
const sent = await alice.request(chatMessageSend({ chatId: chat.chatId, tag: "Text", content: "Noon?" }));
console.log("sent message", sent.messageId, sent.state);
const window = await alice.request(requestListMatchingChatMessage({ criteria: { chatId: chat.chatId }, window: { messageId: sent.messageId, before: 10 } }));
for (const message of window.elements) console.log(" ", message.messageId, message.tag, message.content ?? "");
try {
  await alice.request({ chatMessageSend: { chatId: chat.chatId, tag: "Text", misspelled: true } });
} catch (refused) {
  if (!(refused instanceof ChatcoreError)) throw refused;
  console.log("refused:", refused.error, refused.reason);
}
await alice.close();
rmSync(dataDir, { recursive: true, force: true });
