"""Reactions, mentions and pins driven over the wire by three users, a late joiner and a
second endpoint of one user, against a brute-force model of what each of them must see:
after every step, each session's view (built only from the events it was sent) and what
each user is answered when they ask must equal the model; and so after SIGKILL and a
restart. A seeded random walk, so a failure names the step that broke it."""
import os
import random
import signal
import subprocess
import tempfile
import time

import pytest

from chatcore_harness import Client, auth, start_socket_server

REACTIONS = ["👍", "🎉", "yum", "❤️", "e\u0301"]


class Session:
    """One socket session and the messages and chats as its events made them."""

    def __init__(self, path, user):
        self.user = user
        self.client = Client(path)
        auth(self.client, user)
        self.messages = {}
        self.chats = {}
        self.markers = 0

    def sync(self):
        """Everything the service sent before the answer to a request made now is applied."""
        self.markers += 1
        cookie = f"sync-{self.markers}"
        for event in self.client.request({"identitiesGet": {"cookie": cookie, "appUserIds": [self.user]}})[:-1]:
            self.apply(event)

    def apply(self, event):
        name, value = next(iter(event.items()))
        if name not in ("listAdd", "listChange") or value["type"] not in ("chatMessage", "chat"):
            return
        for element in value["elements"]:
            if value["type"] == "chat":
                table, key = self.chats, element["chatId"]
            else:
                table, key = self.messages, (element["chatId"], int(element["messageId"]))
            if name == "listAdd":
                table[key] = dict(element)
            else:
                current = table.setdefault(key, {})
                for field, field_value in element.items():
                    if field_value is None:
                        current.pop(field, None)
                    else:
                        current[field] = field_value

    def request(self, message):
        """What answers `message` (a cookie is added; empty for a request answered only
        when it fails): it is followed by a marker request, and everything else on the way
        is applied."""
        self.markers += 1
        cookie, marker = f"ask-{self.markers}", f"end-{self.markers}"
        name = next(iter(message))
        self.client.send({name: dict(message[name], cookie=cookie)}, {"identitiesGet": {"cookie": marker, "appUserIds": [self.user]}})
        answer = []
        for event in self.client.answer(marker)[:-1]:
            self.apply(event)
            if (next(iter(event.values())) or {}).get("cookie") == cookie:
                answer.append(event)
        return answer

    def elements(self, keys):
        answer = self.request({"requestListElements": {"type": "chatMessage", "elements": [{"chatId": c, "messageId": str(i)} for c, i in keys]}})
        found = {}
        for event in answer:
            for element in event.get("listChunk", {}).get("elements", []):
                found[(element["chatId"], int(element["messageId"]))] = element
        return found


class Model:
    """What each user must see: per message, each user's reactions and when each was given."""

    def __init__(self):
        self.messages = {}  # id -> {"sender", "recalled", "system", "mentions": set of users, "all": bool}
        self.joined = {}  # user -> first id they see
        self.read = {}  # user -> the id they read up to
        self.reactions = {}  # id -> {user: {reaction: when given}}
        self.pins = []  # (id, who pinned it), the newest pin first
        self.clock = 0

    def post(self, message_id, sender, mentions=(), everyone=False, system=False):
        mentioned = set(self.joined) if everyone else set(mentions)
        self.messages[message_id] = {"sender": sender, "recalled": False, "system": system, "mentions": set(mentions), "all": everyone,
                                     "mentioned": mentioned - {sender}}

    def mentioned(self, user, message_id):
        message = self.messages[message_id]
        return not message["recalled"] and user in message["mentioned"]

    def unread_mentions(self, user):
        return sum(1 for i, m in self.messages.items()
                   if self.visible(user, i) and i > self.read.get(user, 0) and not m["system"] and self.mentioned(user, i))

    def unread(self, user):
        """Incoming messages after the user's read mark, system messages (flag N) aside; a
        recalled one still counts until read."""
        return sum(1 for i, m in self.messages.items()
                   if self.visible(user, i) and i > self.read.get(user, 0) and not m["system"] and m["sender"] != user)

    def listed_mentions(self, user):
        return sorted((i for i in self.messages if self.visible(user, i) and self.mentioned(user, i)), reverse=True)

    def visible(self, user, message_id):
        return user in self.joined and message_id >= self.joined[user] and message_id in self.messages

    def react(self, user, message_id, reaction, remove):
        self.clock += 1
        mine = self.reactions.setdefault(message_id, {}).setdefault(user, {})
        if remove:
            mine.pop(reaction, None)
        else:
            mine.setdefault(reaction, self.clock)

    def recall(self, message_id):
        self.messages[message_id]["recalled"] = True
        self.reactions.pop(message_id, None)
        self.unpin(message_id)

    def pin(self, message_id, by):
        self.unpin(message_id)
        self.pins.insert(0, (message_id, by))

    def unpin(self, message_id):
        self.pins = [pin for pin in self.pins if pin[0] != message_id]

    def pinned_messages(self, user):
        shown = [str(i) for i, _ in self.pins if i >= self.joined[user]]
        return shown or None

    def pinned_by(self, message_id):
        return next((by for i, by in self.pins if i == message_id), None)

    def expected_reactions(self, user, message_id):
        """Per reaction given now: how many gave it, whether `user` did; ordered by the
        oldest of those still given (docs/protocol.md, chatMessage.reactions)."""
        first, count = {}, {}
        for mine in self.reactions.get(message_id, {}).values():
            for reaction, when in mine.items():
                first[reaction] = min(first.get(reaction, when), when)
                count[reaction] = count.get(reaction, 0) + 1
        mine = self.reactions.get(message_id, {}).get(user, {})
        tallies = [{"reaction": r, "count": count[r], "mine": r in mine} for r in sorted(first, key=first.get)]
        return tallies or None


NUMBERS = {"alice": 1, "bob": 2, "carol": 3, "dave": 4}
# How each user names each user: themselves as bbmpim://user/id/0.
uris = {viewer: {user: f"bbmpim://user/id/{0 if user == viewer else number}" for user, number in NUMBERS.items()} for viewer in NUMBERS}


def check(sessions, model, step):
    for session in sessions:
        session.sync()
    for session in sessions:
        user = session.user
        keys = [("1", i) for i in model.messages if model.visible(user, i)]
        asked = session.elements(keys)
        for key in keys:
            message_id = key[1]
            message = model.messages[message_id]
            expected = model.expected_reactions(user, message_id)
            for where, element in (("its events", session.messages.get(key, {})), ("asking", asked.get(key, {}))):
                seen = f"step {step}: {user} sees message {message_id} by {where} as {element}"
                assert element.get("reactions") == expected, f"{seen}; reactions expected {expected}"
                assert element.get("mentioned", False) == model.mentioned(user, message_id), f"{seen}; mentioned expected {model.mentioned(user, message_id)}"
                shown = not message["recalled"]
                assert len(element.get("mentions", [])) == (len(message["mentions"]) if shown else 0), seen
                assert element.get("mentionsAll", False) == (message["all"] and shown), seen
                by = model.pinned_by(message_id)
                expected_pin = {"byUri": uris[user][by]} if by else None
                assert element.get("pinned") == expected_pin, f"{seen}; pinned expected {expected_pin}"
        if user in model.joined:
            chat = session.request({"requestListElements": {"type": "chat", "elements": [{"chatId": "1"}]}})[-1]["listChunk"]["elements"][0]
            for where, element in (("its events", session.chats.get("1", {})), ("asking", chat)):
                assert element.get("numUnreadMentions") == model.unread_mentions(user), (
                    f"step {step}: {user}'s numUnreadMentions by {where} is {element.get('numUnreadMentions')}, expected {model.unread_mentions(user)}")
                assert element.get("numUnread") == model.unread(user), (
                    f"step {step}: {user}'s numUnread by {where} is {element.get('numUnread')}, expected {model.unread(user)}")
                assert element.get("pinnedMessages") == model.pinned_messages(user), (
                    f"step {step}: {user}'s pinnedMessages by {where} is {element.get('pinnedMessages')}, expected {model.pinned_messages(user)}")
            listed = session.request({"chatMessageMentionsGet": {"limit": 100}})[0]["chatMessageMentions"]["messages"]
            assert [int(m["messageId"]) for m in listed] == model.listed_mentions(user), f"step {step}: {user}'s mentions"
        # What they cannot see never reached them.
        for message_id in model.messages:
            if not model.visible(session.user, message_id):
                assert ("1", message_id) not in session.messages, f"step {step}: {session.user} was told of message {message_id}"


@pytest.fixture
def server():
    directory = tempfile.mkdtemp(prefix="chatcore-model-")
    path = os.path.join(directory, "socket")
    data = os.path.join(directory, "data")
    state = {"process": start_socket_server(data, path)}

    def restart(kill):
        process = state["process"]
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        process.wait(timeout=60)
        state["process"] = start_socket_server(data, path)

    yield path, restart
    state["process"].kill()
    state["process"].wait()


def test_reactions_mentions_and_pins_as_each_member_sees_them(server):
    path, restart = server
    rng = random.Random(41)
    model = Model()
    numbers = NUMBERS

    def connect():
        sessions = {name: Session(path, name.rstrip("2")) for name in ("alice", "bob", "bob2", "carol", "dave")}
        for session in sessions.values():
            # What a new session knows is what it asks for; from then on, its events.
            session.messages = session.elements([("1", i) for i in model.messages if model.visible(session.user, i)])
            if session.user in model.joined:
                session.chats = {"1": session.request({"requestListElements": {"type": "chat", "elements": [{"chatId": "1"}]}})[-1]["listChunk"]["elements"][0]}
        return sessions

    sessions = connect()
    alice = sessions["alice"]
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}, {"userId": "carol"}], "subject": "model"}})
    model.joined.update({"alice": 1, "bob": 1, "carol": 1})
    for i in (1, 2):
        model.post(i, "alice", system=True)
    # The numbering the uris below use: as alice sees the others, and bob sees alice.
    assert [i["uri"] for i in alice.request({"identitiesGet": {"appUserIds": ["bob", "carol", "dave"]}})[0]["identities"]["info"]] == [
        f"bbmpim://user/id/{numbers[name]}" for name in ("bob", "carol", "dave")]
    last = 2

    def send(name):
        nonlocal last
        session = sessions[name]
        members = sorted(model.joined)
        mentions = rng.sample(members, rng.randint(0, len(members))) if rng.random() < 0.6 else []
        everyone = session.user == "alice" and rng.random() < 0.3
        uris = [f"bbmpim://user/id/{0 if user == session.user else numbers[user]}" for user in mentions]
        request = {"chatId": "1", "tag": "Text", "content": f"from {name}", "mentions": uris}
        if everyone:
            request["mentionsAll"] = True
        answer = session.request({"chatMessageSend": request})
        assert "listAdd" in answer[0], answer
        last += 1
        model.post(last, session.user, mentions, everyone)
        done["mention"] += bool(mentions or everyone)

    done = {"react": 0, "mention": 0, "read": 0, "recall": 0, "pin": 0}
    for name in ("alice", "bob", "carol", "bob2"):
        send(name)
    check(sessions.values(), model, "start")
    for step in range(200):
        if step == 60:
            # dave joins: the messages before his Join are not his to see, react to, or be mentioned in.
            alice.request({"chatInvite": {"chatId": "1", "invitees": [{"userId": "dave"}]}})
            last += 1
            model.post(last, "alice", system=True)
            model.joined["dave"] = last
            refused = sessions["dave"].request({"chatMessageReact": {"chatId": "1", "messageId": "3", "reaction": "👍"}})
            assert refused[0]["requestFailed"]["error"] == "NotFound"
            sessions["dave"].chats = {"1": sessions["dave"].request(
                {"requestListElements": {"type": "chat", "elements": [{"chatId": "1"}]}})[-1]["listChunk"]["elements"][0]}
        if step == 130:
            restart(kill=True)
            sessions = connect()
            alice = sessions["alice"]
            check(sessions.values(), model, "after SIGKILL")
        name = rng.choice([n for n in sessions if sessions[n].user in model.joined])
        session = sessions[name]
        roll = rng.random()
        if roll < 0.2:
            send(name)
        elif roll < 0.3:
            target = rng.choice([i for i in model.messages if model.visible(session.user, i)])
            assert session.request({"chatMessageRead": {"chatId": "1", "messageId": str(target)}}) == []
            model.read[session.user] = max(model.read.get(session.user, 0), target)
            done["read"] += 1
        elif roll < 0.45:
            if rng.random() < 0.7:
                session = sessions["alice"]  # the admin: pinPolicy is AdminsOnly
            unpin = rng.random() < 0.3
            visible = [i for i in model.messages if model.visible(session.user, i)]
            pinnable = [i for i in visible if not model.messages[i]["recalled"] and not model.messages[i]["system"]]
            target = rng.choice(pinnable if pinnable and rng.random() < 0.8 else visible)
            answer = session.request({"chatMessagePin": {"chatId": "1", "messageId": str(target), "unpin": unpin}})
            message = model.messages[target]
            if session.user != "alice":
                assert answer[0]["requestFailed"]["error"] == "NotPermitted", answer  # pinPolicy AdminsOnly
            elif unpin:
                assert answer == [], answer
                model.unpin(target)
            elif message["recalled"] or message["system"]:
                assert answer[0]["requestFailed"]["error"] == "NotPermitted", answer
            else:
                assert answer == [], answer
                model.pin(target, session.user)
                done["pin"] += 1
        elif roll < 0.5:
            own = [i for i, m in model.messages.items() if m["sender"] == session.user and not m["recalled"] and not m["system"]]
            if own:
                target = rng.choice(own)
                assert session.request({"chatMessageDestroy": {"chatId": "1", "messageId": str(target)}}) == []
                model.recall(target)
                done["recall"] += 1
        else:
            target = rng.choice([i for i in model.messages if model.visible(session.user, i)])
            reaction, remove = rng.choice(REACTIONS), rng.random() < 0.35
            answer = session.request({"chatMessageReact": {"chatId": "1", "messageId": str(target), "reaction": reaction, "remove": remove}})
            if model.messages[target]["recalled"]:
                assert answer and answer[0]["requestFailed"]["error"] == "NotPermitted", answer
            else:
                assert answer == [], answer
                model.react(session.user, target, reaction, remove)
                done["react"] += 1
        check(sessions.values(), model, step)
    # The walk did each thing often enough to mean something.
    assert min(done.values()) >= 5, done
    restart(kill=False)
    check(connect().values(), model, "after a restart")


def test_a_reaction_reaches_the_change_feed_and_never_counts_unread(server):
    path, _ = server
    alice, bob = Session(path, "alice"), Session(path, "bob")
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}], "subject": "feed"}})
    alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "hello"}})
    bob.sync()
    chat_before = dict(bob.chats["1"])
    token = bob.request({"requestListChanges": {"type": "chatMessage"}})[0]["listChanges"]["token"]
    # bob goes away; alice reacts; bob comes back and asks what changed since.
    bob.client.close()
    alice.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "👋"}})
    bob = Session(path, "bob")
    changed = bob.request({"requestListChanges": {"type": "chatMessage", "since": token}})[0]["listChanges"]["changed"]
    assert [(m["messageId"], m.get("reactions")) for m in changed] == [("2", [{"reaction": "👋", "count": 1, "mine": False}])]
    chat_after = bob.request({"requestListElements": {"type": "chat", "elements": [{"chatId": "1"}]}})[-1]["listChunk"]["elements"][0]
    for field in ("numUnread", "lastActivity", "lastMessage"):
        assert chat_after[field] == chat_before[field], field


def test_a_message_takes_at_most_32_different_reactions(server):
    path, _ = server
    alice, bob = Session(path, "alice"), Session(path, "bob")
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}], "subject": "many"}})
    alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "react"}})
    for n in range(32):
        assert (alice if n % 2 else bob).request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": f"r{n}"}}) == []
    refused = bob.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "one more"}})[0]["requestFailed"]
    assert refused["error"] == "TooLarge" and "32" in refused["reason"]
    # One already there may still be given, and taking one back makes room for another.
    assert bob.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "r1"}}) == []
    assert bob.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "r0", "remove": True}}) == []
    assert bob.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "one more"}}) == []
    alice.sync()
    tallies = alice.messages[("1", 2)]["reactions"]
    assert len(tallies) == 32 and tallies[-1] == {"reaction": "one more", "count": 1, "mine": False}
    assert tallies[0] == {"reaction": "r1", "count": 2, "mine": True}
    pages, after = [], None
    while True:
        ask = {"chatId": "1", "messageId": "2", "limit": 10}
        if after:
            ask["after"] = after
        page = alice.request({"chatMessageReactionsGet": ask})[0]["chatMessageReactions"]
        pages.append(page["reactions"])
        after = page.get("next")
        if not after:
            break
    assert [len(p) for p in pages] == [10, 10, 10, 3]
    everyone = [r["reaction"] for p in pages for r in p]
    # Oldest first: bob's r1 came after everyone else's.
    assert everyone == [f"r{n}" for n in range(1, 32)] + ["r1", "one more"]


def test_a_pin_that_ends_while_the_service_is_down_is_gone_once_it_is_back(server):
    path, restart = server
    alice, bob = Session(path, "alice"), Session(path, "bob")
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}], "subject": "pins"}})
    for text in ("for an hour", "for good"):
        alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": text}})
    assert alice.request({"chatMessagePin": {"chatId": "1", "messageId": "3"}}) == []
    assert alice.request({"chatMessagePin": {"chatId": "1", "messageId": "2", "until": int(time.time()) + 2}}) == []
    bob.sync()
    assert bob.chats["1"]["pinnedMessages"] == ["2", "3"]
    restart(kill=True)
    time.sleep(2.5)
    restart(kill=False)
    bob = Session(path, "bob")
    deadline = time.time() + 10
    while True:
        chat = bob.request({"requestListElements": {"type": "chat", "elements": [{"chatId": "1"}]}})[-1]["listChunk"]["elements"][0]
        if chat.get("pinnedMessages") == ["3"]:
            break
        assert time.time() < deadline, f"the pin that ended is still there: {chat}"
        time.sleep(0.1)
    assert "pinned" not in bob.elements([("1", 2)])[("1", 2)]
    assert bob.elements([("1", 3)])[("1", 3)]["pinned"] == {"byUri": "bbmpim://user/id/1"}


def test_a_private_delete_hides_reactions_pins_and_mentions_from_that_user_alone(server):
    path, _ = server
    alice, bob = Session(path, "alice"), Session(path, "bob")
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}], "subject": "delete"}})
    alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "@bob", "mentions": ["bbmpim://user/id/2"]}})
    assert bob.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "👍"}}) == []
    assert alice.request({"chatMessagePin": {"chatId": "1", "messageId": "2"}}) == []
    assert [m["messageId"] for m in bob.request({"chatMessageMentionsGet": {}})[0]["chatMessageMentions"]["messages"]] == ["2"]
    assert bob.request({"chatMessageDelete": {"chatId": "1", "id": "2"}}) == []
    mine = bob.elements([("1", 2)])[("1", 2)]
    assert "D" in mine["flags"] and not {"content", "reactions", "pinned", "mentions", "mentioned"} & set(mine), mine
    assert bob.request({"chatMessageMentionsGet": {}})[0]["chatMessageMentions"]["messages"] == []
    refused = bob.request({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "🎉"}})[0]["requestFailed"]
    assert refused["error"] == "NotPermitted" and "deleted" in refused["reason"]
    # For alice nothing changed: bob's reaction still counts, the pin and the mention stay.
    theirs = alice.elements([("1", 2)])[("1", 2)]
    assert theirs["reactions"] == [{"reaction": "👍", "count": 1, "mine": False}]
    assert theirs["pinned"] == {"byUri": "bbmpim://user/id/0"} and theirs["mentions"] == ["bbmpim://user/id/2"]
    assert bob.request({"requestListElements": {"type": "chat", "elements": [{"chatId": "1"}]}})[-1]["listChunk"]["elements"][0][
        "pinnedMessages"] == ["2"], "the chat's pins are everyone's"


def test_a_pin_ends_on_time_when_a_later_one_was_timed_first(server):
    path, _ = server
    alice, bob = Session(path, "alice"), Session(path, "bob")
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}], "subject": "timers"}})
    for text in ("for a day", "for a moment"):
        alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": text}})
    # The engine's timer is set for the pin that ends in a day; the one that ends in two
    # seconds must not wait for it.
    assert alice.request({"chatMessagePin": {"chatId": "1", "messageId": "2", "until": int(time.time()) + 86400}}) == []
    assert alice.request({"chatMessagePin": {"chatId": "1", "messageId": "3", "until": int(time.time()) + 2}}) == []
    deadline = time.time() + 10
    while True:
        bob.sync()
        if bob.chats["1"].get("pinnedMessages") == ["2"]:
            break
        assert time.time() < deadline, f"the pin of message 3 did not end: {bob.chats['1']}"
        time.sleep(0.2)
    assert "pinned" not in bob.messages[("1", 3)] and bob.messages[("1", 2)]["pinned"]["until"] > time.time()
