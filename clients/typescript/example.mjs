// Two users chat: alice starts a chat with bob, bob reads the message, alice sees it
// Delivered and then Read. Run: node example.mjs (with chatcore built, or CHATCORE_BINARY set).
import { Server, chatStart, chatMessageSend, chatMessageRead } from "chatcore-client";

const server = await Server.start();
const alice = await server.connect("alice");
const bob = await server.connect("bob");
const bobEvents = bob.events();

const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "Lunch" }));
console.log("alice started chat", chat.chatId);
const aliceEvents = alice.events();
const sent = await alice.request(chatMessageSend({ chatId: chat.chatId, tag: "Text", content: "Noon?" }));
console.log("alice sent message", sent.messageId, sent.state);

const [, added] = await bob.waitFor("listAdd", (body) => body.type === "chatMessage" && body.elements[0].content === "Noon?",
  { events: bobEvents });
if (added.type !== "chatMessage") throw new Error("a message was expected");
const message = added.elements[0];
console.log("bob received:", message.content);
await bob.request(chatMessageRead({ chatId: message.chatId, messageId: message.messageId }));

for await (const [name, body] of aliceEvents) {
  if (name !== "listChange" || body.type !== "chatMessage") continue;
  const states = body.elements.filter((e) => e.messageId === sent.messageId && e.state).map((e) => e.state);
  for (const state of states) console.log("alice sees", state);
  if (states.includes("Read")) break;
}
await alice.close();
await bob.close();
await server.stop();
