// Every request builder of the protocol, sent through `Client.request`, each outcome in a
// variable of the type it must have: `tsc --strict` checks the types (checkJs; see
// tsconfig.json), and running it checks that the service answers each as the types say.
//
//     node clients/typescript/test/every_builder.mjs
// @ts-check
import {
  ChatcoreError, Client, Server,
  authToken, identitiesGet, chatStart, chatMessageSend, requestListAll, requestListElementsGlobal, requestListElementsUser,
  requestListElementsChat, requestListElementsChatParticipant, requestListElementsChatMessage, requestListElementsTyping,
  requestListMatchingChatMessage, requestListMatchingChatParticipant, requestListMatchingChat, requestListMatchingUser,
  requestListChangeChat, requestListChangeChatMessage, requestListChanges, chatInvite, participantPromote, participantDemote,
  participantRemove, chatMessageRead, chatMessageStateGet, chatTyping, chatEventSend, search, chatMessageFileDownload,
  chatMessageDetach, chatMessageDelete, chatMessageDestroy, chatMessageReact, chatMessageReactionsGet, chatMessageMentionsGet, chatMessagePin, participantMute, participantBan, userBlock, presenceSet, syncStart, setupRetry, retryServerRequests, chatHide, chatLeave,
  endpointUpdate, endpointsGet, endpointDeregister,
} from "chatcore-client";

/** @typedef {import("chatcore-client").Chat} Chat */
/** @typedef {import("chatcore-client").ChatMessage} ChatMessage */
/** @template E @typedef {import("chatcore-client").ListAnswer<E>} ListAnswer */

/**
 * The error code of a request expected to be refused.
 * @param {Client} client
 * @param {object} message
 */
async function refused(client, message) {
  try {
    await client.request(message);
  } catch (error) {
    if (error instanceof ChatcoreError) return error.error;
    throw error;
  }
  throw new Error(`${JSON.stringify(message)} was not refused`);
}

/**
 * @param {boolean} condition
 * @param {unknown} [detail]
 */
function check(condition, detail) {
  if (!condition) throw new Error(`check failed: ${JSON.stringify(detail)}`);
}

const server = await Server.start();
const alice = await Client.connect(server.address);
const bob = await server.connect("bob");
try {
  /** @type {Record<string, unknown>} */
  const globals = await alice.request(authToken({ userId: "alice", authToken: "any" }));
  const me = globals.localUri;
  /** @type {import("chatcore-client").Identities} */
  const identities = await alice.request(identitiesGet({ appUserIds: ["bob"] }));
  const bobUri = identities.info[0].uri; // as alice sees bob: uris are each viewer's own

  /** @type {Chat} */
  const chat = await alice.request(chatStart({ invitees: [{ userId: "bob" }], subject: "Plans" }));
  const chatId = chat.chatId;
  /** @type {ChatMessage} */
  const sent = await alice.request(chatMessageSend({ chatId, tag: "Text", content: "hello" }));
  /** @type {string} */
  const messageId = sent.messageId;

  /** @type {ListAnswer<Chat>} */
  const chats = await alice.request(requestListAll({ type: "chat" }));
  check(chats.elements.map((c) => c.subject).join() === "Plans", chats);
  /** @type {ListAnswer<import("chatcore-client").User>} */
  const users = await alice.request(requestListAll({ type: "user" }));
  check(users.elements.some((u) => u.uri === me), users);
  /** @type {ListAnswer<import("chatcore-client").Global>} */
  const everyGlobal = await alice.request(requestListAll({ type: "global" }));
  /** @type {ListAnswer<import("chatcore-client").ChatParticipant>} */
  const everyParticipant = await alice.request(requestListAll({ type: "chatParticipant" }));
  /** @type {ListAnswer<import("chatcore-client").Typing>} */
  const everyTyping = await alice.request(requestListAll({ type: "typing" }));
  check(everyGlobal.elements.length > 0 && everyParticipant.elements.length > 0 && everyTyping.elements.length === 0);
  check(await refused(alice, requestListAll({ type: "chatMessage" })) === "InvalidParameter");

  /** @type {ListAnswer<import("chatcore-client").Global>} */
  const localUri = await alice.request(requestListElementsGlobal({ elements: [{ name: "localUri" }] }));
  check(localUri.elements[0].value === me);
  /** @type {ListAnswer<import("chatcore-client").User>} */
  const bobUser = await alice.request(requestListElementsUser({ elements: [{ uri: bobUri }] }));
  check(bobUser.elements[0].uri === bobUri);
  /** @type {ListAnswer<Chat>} */
  const oneChat = await alice.request(requestListElementsChat({ elements: [{ chatId }] }));
  check(oneChat.elements[0].chatId === chatId);
  /** @type {ListAnswer<import("chatcore-client").ChatParticipant>} */
  const participant = await alice.request(requestListElementsChatParticipant({ elements: [{ chatId, userUri: bobUri }] }));
  check(participant.elements[0].state === "Joined", participant);
  /** @type {ListAnswer<ChatMessage>} */
  const messages = await alice.request(requestListElementsChatMessage({ elements: [{ chatId, messageId }] }));
  check(messages.elements[0].content === "hello");
  /** @type {ListAnswer<import("chatcore-client").Typing>} */
  const typing = await alice.request(requestListElementsTyping({ elements: [{ chatId, userUri: bobUri }] }));
  check(Array.isArray(typing.elements));

  /** @type {ListAnswer<ChatMessage>} */
  const window = await alice.request(requestListMatchingChatMessage({ criteria: { chatId }, window: { messageId, before: 5 } }));
  check(window.elements[window.elements.length - 1].messageId === messageId);
  /** @type {ListAnswer<import("chatcore-client").ChatParticipant>} */
  const participants = await alice.request(requestListMatchingChatParticipant({ criteria: { chatId } }));
  check(participants.elements.some((p) => p.userUri === bobUri), participants);
  /** @type {ListAnswer<Chat>} */
  const synced = await alice.request(requestListMatchingChat({ criteria: { keyState: "Synced" } }));
  /** @type {ListAnswer<import("chatcore-client").User>} */
  const syncedUsers = await alice.request(requestListMatchingUser({ criteria: { keyState: "Synced" } }));
  check(Array.isArray(synced.elements) && Array.isArray(syncedUsers.elements));

  /** @type {undefined} */
  const changed = await alice.request(requestListChangeChat({ elements: [{ chatId, localData: { pinned: true } }] }));
  /** @type {undefined} */
  const changedMessage = await alice.request(requestListChangeChatMessage({ elements: [{ chatId, messageId, localData: { starred: true } }] }));
  check(changed === undefined && changedMessage === undefined);
  /** @type {import("chatcore-client").ListChanges} */
  const changes = await alice.request(requestListChanges({ type: "chatMessage", chatId }));
  check(typeof changes.token === "string" && Array.isArray(changes.changed));

  /** @type {undefined} */
  const invited = await alice.request(chatInvite({ chatId, invitees: [{ userId: "carol" }] }));
  check(invited === undefined);
  const carol = (await alice.request(identitiesGet({ appUserIds: ["carol"] }))).info[0].uri;
  await alice.request(participantPromote({ chatId, userUri: bobUri }));
  await alice.request(participantDemote({ chatId, userUri: bobUri }));
  await alice.request(participantRemove({ chatId, userUri: carol }));
  await alice.request(participantMute({ chatId, userUri: bobUri, until: 4102444800 }));
  await alice.request(participantMute({ chatId, userUri: bobUri, unmute: true }));
  await alice.request(participantBan({ chatId, userUri: carol }));
  await alice.request(userBlock({ userUri: carol }));
  await alice.request(userBlock({ userUri: carol, unblock: true }));
  await alice.request(presenceSet({ watch: true, hidden: false }));

  await bob.request(chatMessageRead({ chatId, messageId }));
  /** @type {import("chatcore-client").ChatMessageStateEvent} */
  const state = await alice.request(chatMessageStateGet({ chatId, messageId }));
  check(["Delivered", "Read"].includes(state.states[0].state), state);
  await alice.request(chatTyping({ chatId }));
  await alice.request(chatEventSend({ chatId, tag: "Nudge" }));
  /** @type {import("chatcore-client").SearchResult} */
  const found = await alice.request(search({ text: "hello" }));
  check(found.messages.map((m) => m.messageId).join() === messageId, found);

  check(await refused(alice, chatMessageFileDownload({ chatId, messageId })) === "InvalidParameter");
  await alice.request(chatMessageDetach({ chatId, messageId, detachFile: true }));
  await bob.request(chatMessageReact({ chatId, messageId, reaction: "👍" }));
  /** @type {import("chatcore-client").ChatMessageReactionsEvent} */
  const reactions = await alice.request(chatMessageReactionsGet({ chatId, messageId }));
  check(reactions.reactions.map((r) => r.reaction).join() === "👍", reactions);
  /** @type {import("chatcore-client").ChatMessageMentionsEvent} */
  const mentions = await bob.request(chatMessageMentionsGet({ limit: 10 }));
  check(mentions.messages.length === 0, mentions);
  await alice.request(chatMessagePin({ chatId, messageId }));
  await alice.request(chatMessageDelete({ chatId, id: messageId }));
  const again = await alice.request(chatMessageSend({ chatId, tag: "Text", content: "again" }));
  await alice.request(chatMessageDestroy({ chatId, messageId: again.messageId }));

  await alice.request(syncStart({ passcode: "123456" }));
  await alice.request(setupRetry());
  await alice.request(retryServerRequests());
  await alice.request(chatHide({ chatIds: [chatId] }));
  await alice.request(chatLeave({ chatIds: [chatId] }));

  // Another session of alice's registers an endpoint and leaves; this one lists and deregisters it.
  const phone = await server.connect("alice");
  /** @type {import("chatcore-client").EndpointUpdateResult} */
  const updated = await phone.request(endpointUpdate({ description: "a phone" }));
  check(updated.result === "Success");
  await phone.close();
  /** @type {import("chatcore-client").Endpoints} */
  const endpoints = await alice.request(endpointsGet());
  const phoneEndpoint = endpoints.registeredEndpoints.find((e) => e.description === "a phone");
  check(phoneEndpoint !== undefined, endpoints);
  /** @type {import("chatcore-client").EndpointDeregisterResult} */
  const deregistered = await alice.request(endpointDeregister({ endpointId: phoneEndpoint?.endpointId ?? "" }));
  check(deregistered.result === "Success", deregistered);
  console.log("every builder answered as typed");
} finally {
  await alice.close();
  await bob.close();
  await server.stop();
}
