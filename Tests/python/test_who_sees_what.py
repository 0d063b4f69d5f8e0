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
            if (next(iter(event.values())) or {}).get("cookie") == cookie:
                answer.append(event)
            else:
                self.apply(event)
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
        self.messages = {}  # id -> {"sender", "recalled"}
        self.joined = {}  # user -> first id they see
        self.reactions = {}  # id -> {user: {reaction: when given}}
        self.clock = 0

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


def check(sessions, model, step):
    for session in sessions:
        session.sync()
    for session in sessions:
        keys = [("1", i) for i in model.messages if model.visible(session.user, i)]
        asked = session.elements(keys)
        for key in keys:
            expected = model.expected_reactions(session.user, key[1])
            for where, element in (("its events", session.messages.get(key, {})), ("asking", asked.get(key, {}))):
                assert element.get("reactions") == expected, (
                    f"step {step}: {session.user} sees message {key[1]}'s reactions by {where} as {element.get('reactions')}, expected {expected}")
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


def test_reactions_as_each_member_sees_them(server):
    path, restart = server
    rng = random.Random(41)
    model = Model()

    def connect():
        return {"alice": Session(path, "alice"), "bob": Session(path, "bob"), "bob2": Session(path, "bob"), "carol": Session(path, "carol"),
                "dave": Session(path, "dave")}

    sessions = connect()
    alice = sessions["alice"]
    alice.request({"chatStart": {"invitees": [{"userId": "bob"}, {"userId": "carol"}], "subject": "model"}})
    model.messages.update({i: {"sender": "alice", "recalled": False, "system": True} for i in (1, 2)})
    model.joined.update({"alice": 1, "bob": 1, "carol": 1})
    last = 2

    def send(by):
        nonlocal last
        sessions[by].request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": f"from {by}"}})
        last += 1
        model.messages[last] = {"sender": sessions[by].user, "recalled": False}

    for by in ("alice", "bob", "carol", "bob2"):
        send(by)
    check(sessions.values(), model, "start")
    for step in range(120):
        if step == 40:
            # dave joins: the messages before his Join are not his to see or react to.
            alice.request({"chatInvite": {"chatId": "1", "invitees": [{"userId": "dave"}]}})
            last += 1
            model.messages[last] = {"sender": "alice", "recalled": False, "system": True}
            model.joined["dave"] = last
            refused = sessions["dave"].request({"chatMessageReact": {"chatId": "1", "messageId": "3", "reaction": "👍"}})
            assert refused[0]["requestFailed"]["error"] == "NotFound"
        if step == 80:
            restart(kill=True)
            sessions = connect()
            alice = sessions["alice"]
            for session in sessions.values():
                # New sessions: what they know is what they ask for; from here on, events.
                session.messages = session.elements([("1", i) for i in model.messages if model.visible(session.user, i)])
            check(sessions.values(), model, "after SIGKILL")
        name = rng.choice([n for n in sessions if sessions[n].user in model.joined])
        session = sessions[name]
        roll = rng.random()
        if roll < 0.1:
            send(name)
        elif roll < 0.15:
            own = [i for i, m in model.messages.items() if m["sender"] == session.user and not m["recalled"] and not m.get("system")]
            if own:
                target = rng.choice(own)
                assert session.request({"chatMessageDestroy": {"chatId": "1", "messageId": str(target)}}) == []
                model.recall(target)
        else:
            target = rng.choice([i for i in model.messages if model.visible(session.user, i)])
            reaction, remove = rng.choice(REACTIONS), rng.random() < 0.35
            answer = session.request({"chatMessageReact": {"chatId": "1", "messageId": str(target), "reaction": reaction, "remove": remove}})
            if model.messages[target]["recalled"]:
                assert answer and answer[0]["requestFailed"]["error"] == "NotPermitted", answer
            else:
                assert answer == [], answer
                model.react(session.user, target, reaction, remove)
        check(sessions.values(), model, step)
    restart(kill=False)
    sessions = connect()
    for session in sessions.values():
        session.messages = session.elements([("1", i) for i in model.messages if model.visible(session.user, i)])
    check(sessions.values(), model, "after a restart")


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
