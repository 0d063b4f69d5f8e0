// The web Simple Chat: chatcore's TypeScript client in a page, nothing else. Sign in, the
// chat list with unread counts, a chat's messages (older ones as you scroll up), send,
// Sent / Delivered / Read, typing. Every list is kept up to date from the service's events.
import {
  Client, chatMessageRead, chatMessageSend, chatStart, chatTyping, requestListAll, requestListElementsUser, requestListMatchingChatMessage,
} from "/client/browser.js";

const $ = (id) => document.getElementById(id);
const PAGE = 30;

let client = null;
let me = "";
const chats = new Map(); // chatId → chat element
const participants = new Map(); // chatId → Set of other members' uris
const names = new Map(); // uri → user id, as the user list says
let open = null; // { chatId, messages: Map(id → element), first, hasMoreBefore, loading }
const typing = new Map(); // `${chatId} ${uri}` → true
let lastTyping = 0;

function showError(where, error) {
  $(where).textContent = error ? `${error.error ?? ""} ${error.reason ?? error.message ?? error}`.trim() : "";
}

async function nameOf(uri) {
  if (uri === "bbmpim://user/id/0") return me;
  if (!names.has(uri)) {
    const found = await client.request(requestListElementsUser({ elements: [{ uri }] }));
    names.set(uri, found.elements[0]?.userId ?? uri);
  }
  return names.get(uri);
}

// Sign in: a token from the page's server (its development endpoint), or one pasted.
$("sign-in").addEventListener("submit", async (event) => {
  event.preventDefault();
  showError("sign-in-error", null);
  try {
    await signIn($("user").value.trim(), $("token").value.trim());
  } catch (error) {
    showError("sign-in-error", error);
  }
});

async function signIn(user, pasted) {
  const answer = await (await fetch(`/token?user=${encodeURIComponent(user)}`)).json();
  client = await Client.connect(answer.url);
  await client.authenticate(user, pasted || answer.token);
  me = user;
  sessionStorage.setItem("simple-chat-user", user);
  $("me").textContent = user;
  $("sign-in").hidden = true;
  $("app").hidden = false;
  listen();
  const listed = await client.request(requestListAll({ type: "chat" }));
  for (const chat of listed.elements) chats.set(chat.chatId, chat);
  const members = await client.request(requestListAll({ type: "chatParticipant" }));
  for (const member of members.elements) addParticipant(member);
  await renderChats();
}

function addParticipant(member) {
  if (!participants.has(member.chatId)) participants.set(member.chatId, new Set());
  participants.get(member.chatId).add(member.userUri);
}

async function titleOf(chat) {
  if (chat.subject) return chat.subject;
  const others = await Promise.all([...(participants.get(chat.chatId) ?? [])].map(nameOf));
  return others.join(", ") || "(just you)";
}

async function renderChats() {
  const list = $("chats");
  const sorted = [...chats.values()].sort((a, b) => (b.lastActivity ?? 0) - (a.lastActivity ?? 0) || Number(b.chatId) - Number(a.chatId));
  const items = await Promise.all(sorted.map(async (chat) => {
    const item = document.createElement("li");
    item.dataset.chatId = chat.chatId;
    item.className = open?.chatId === chat.chatId ? "open" : "";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = await titleOf(chat);
    item.append(title);
    if (chat.numUnread > 0) {
      const unread = document.createElement("span");
      unread.className = "unread";
      unread.textContent = String(chat.numUnread);
      item.append(unread);
    }
    item.addEventListener("click", () => openChat(chat.chatId).catch((error) => showError("error", error)));
    return item;
  }));
  list.replaceChildren(...items);
}

// Events: every change to the lists this page shows.
async function listen() {
  for await (const [name, fields] of client.events()) {
    try {
      await handle(name, fields);
    } catch (error) {
      showError("error", error);
    }
  }
  showError("error", { message: "the connection to chatcore closed: reload the page" });
}

async function handle(name, fields) {
  // Answers to this page's own list requests are taken where they were asked.
  if (name !== "listAdd" && name !== "listChange" && name !== "listRemove") return;
  const type = fields.type;
  if (type === "chat") {
    if (name === "listAdd") for (const chat of fields.elements) chats.set(chat.chatId, chat);
    if (name === "listChange") for (const change of fields.elements) chats.set(change.chatId, { ...chats.get(change.chatId), ...change });
    if (name === "listRemove") for (const key of fields.elements) chats.delete(key.chatId);
    await renderChats();
  } else if (type === "chatParticipant" && name === "listAdd") {
    for (const member of fields.elements) addParticipant(member);
    await renderChats();
  } else if (type === "chatMessage" && open) {
    for (const element of fields.elements) {
      if (element.chatId !== open.chatId) continue;
      const known = open.messages.get(element.messageId);
      if (name === "listAdd" || known) open.messages.set(element.messageId, { ...known, ...element });
    }
    await renderMessages({ stickToBottom: true });
    if (name === "listAdd") await markRead();
  } else if (type === "typing") {
    for (const element of fields.elements) {
      const key = `${element.chatId} ${element.userUri}`;
      if (name === "listAdd") typing.set(key, true);
      if (name === "listRemove") typing.delete(key);
    }
    await renderTyping();
  }
}

async function openChat(chatId) {
  const chat = chats.get(chatId);
  open = { chatId, messages: new Map(), first: null, hasMoreBefore: false, loading: false };
  $("chat-title").textContent = await titleOf(chat);
  $("composer").hidden = false;
  await renderChats();
  await loadOlder(chat.lastMessage);
  await markRead();
  await renderTyping();
  $("text").focus();
}

// A window of up to PAGE messages ending at `anchor` (the newest first, then older ones).
async function loadOlder(anchor) {
  if (!open || open.loading || Number(anchor) < 1) return;
  open.loading = true;
  const chatId = open.chatId;
  try {
    const found = await client.request(requestListMatchingChatMessage({ criteria: { chatId }, window: { messageId: String(anchor), before: PAGE - 1, after: 0 } }));
    if (open?.chatId !== chatId) return;
    for (const element of found.elements) open.messages.set(element.messageId, element);
    open.hasMoreBefore = found.header.hasMoreBefore ?? false;
    const list = $("messages");
    const fromBottom = list.scrollHeight - list.scrollTop;
    await renderMessages({ stickToBottom: open.first === null });
    if (open.first !== null) list.scrollTop = list.scrollHeight - fromBottom;
    open.first = Math.min(...[...open.messages.keys()].map(Number));
  } finally {
    if (open) open.loading = false;
  }
}

$("messages").addEventListener("scroll", () => {
  if (open && $("messages").scrollTop < 40 && open.hasMoreBefore) loadOlder(open.first - 1).catch((error) => showError("error", error));
});

async function renderMessages({ stickToBottom }) {
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  const sorted = [...open.messages.values()].sort((a, b) => Number(a.messageId) - Number(b.messageId));
  const items = await Promise.all(sorted.map(async (message) => {
    const item = document.createElement("li");
    item.dataset.messageId = message.messageId;
    const mine = !message.flags.includes("I");
    if (message.tag !== "Text") {
      item.className = "system";
      item.textContent = `${await nameOf(message.senderUri)}: ${message.tag}`;
      return item;
    }
    item.className = mine ? "mine" : "theirs";
    const text = document.createElement("span");
    text.className = "content";
    text.textContent = message.recall ? "(recalled)" : message.content ?? "";
    item.append(mine ? "" : `${await nameOf(message.senderUri)}: `, text);
    if (mine) {
      const state = document.createElement("span");
      state.className = "state";
      state.textContent = message.state;
      item.append(state);
    }
    return item;
  }));
  list.replaceChildren(...items);
  if (stickToBottom && (atBottom || items.length <= PAGE)) list.scrollTop = list.scrollHeight;
}

// What is open is read: up to the newest message of someone else's.
async function markRead() {
  if (!open || document.hidden) return;
  const incoming = [...open.messages.values()].filter((m) => m.flags.includes("I") && m.state !== "Read").map((m) => Number(m.messageId));
  if (incoming.length === 0) return;
  await client.request(chatMessageRead({ chatId: open.chatId, messageId: String(Math.max(...incoming)) }));
}
document.addEventListener("visibilitychange", () => markRead().catch(() => {}));

async function renderTyping() {
  const who = [];
  for (const key of typing.keys()) {
    const [chatId, uri] = key.split(" ");
    if (open?.chatId === chatId) who.push(await nameOf(uri));
  }
  $("typing").textContent = who.length ? `${who.join(", ")} ${who.length === 1 ? "is" : "are"} typing…` : "";
}

$("composer").addEventListener("submit", async (event) => {
  event.preventDefault();
  const content = $("text").value;
  if (!content.trim() || !open) return;
  $("text").value = "";
  showError("error", null);
  try {
    const sent = await client.request(chatMessageSend({ chatId: open.chatId, tag: "Text", content }));
    open.messages.set(sent.messageId, { ...open.messages.get(sent.messageId), ...sent });
    await renderMessages({ stickToBottom: true });
  } catch (error) {
    showError("error", error);
  }
});

$("text").addEventListener("input", () => {
  // chatcore keeps an indication 5 s: saying it again every 3 s keeps it while typing goes on.
  if (!open || Date.now() - lastTyping < 3000) return;
  lastTyping = Date.now();
  client.request(chatTyping({ chatId: open.chatId })).catch(() => {});
});

$("new-chat").addEventListener("submit", async (event) => {
  event.preventDefault();
  const invitee = $("invitee").value.trim();
  showError("error", null);
  try {
    let chatId;
    try {
      const started = await client.request(chatStart({ invitees: [{ userId: invitee }], isOneToOne: true }));
      chatId = started.chatId;
      chats.set(chatId, { ...started, ...chats.get(chatId) });
    } catch (error) {
      // Starting it again opens the one-to-one chat there is.
      if (error.error !== "AlreadyExists") throw error;
      chatId = error.body.chatId;
    }
    $("invitee").value = "";
    await openChat(chatId);
  } catch (error) {
    showError("error", error);
  }
});

// A reload signs in again as the same user: the history is the service's.
const remembered = sessionStorage.getItem("simple-chat-user");
if (remembered) {
  $("user").value = remembered;
  signIn(remembered, "").catch((error) => showError("sign-in-error", error));
}
