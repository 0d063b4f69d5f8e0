"""A group whose members see their chat differently (admins, a muted member, one with
local data, one who hid it, members who read to different points, a second session of
one user): after every send and read, each session's chat element as its events made
it must equal the element it is answered when it asks. The service renders a member's
chat change once per kind of member and shares it with the next members of that kind;
a member told another kind's change would fail here. A seeded random walk, so a failure
names the step."""

import os
import random
import tempfile

import pytest

from chatcore_harness import start_socket_server
from test_who_sees_what import Session

USERS = [f"member{n}" for n in range(12)]


@pytest.fixture
def path():
    directory = tempfile.mkdtemp(prefix="chatcore-group-views-")
    socket_path = os.path.join(directory, "socket")
    process = start_socket_server(os.path.join(directory, "data"), socket_path)
    yield socket_path
    process.kill()
    process.wait()


def asked_chat(session, chat_id):
    answer = session.request({"requestListElements": {"type": "chat", "elements": [{"chatId": chat_id}]}})
    return answer[-1]["listChunk"]["elements"][0]


def test_each_member_of_a_group_is_told_the_chat_as_they_see_it(path):
    rng = random.Random(7)
    sessions = [Session(path, user) for user in USERS] + [Session(path, USERS[6])]
    owner = sessions[0]
    started = owner.request({"chatStart": {"invitees": [{"userId": user} for user in USERS[1:]], "subject": "views"}})
    chat_id = next(e["listAdd"]["elements"][0]["chatId"] for e in started if "listAdd" in e)
    uri = {user: f"bbmpim://user/id/{n + 1}" for n, user in enumerate(USERS)}
    for user in USERS[1:3]:
        assert not any("requestFailed" in e for e in owner.request({"participantPromote": {"chatId": chat_id, "userUri": uri[user]}}))
    assert not any("requestFailed" in e for e in owner.request({"participantMute": {"chatId": chat_id, "userUri": uri[USERS[3]]}}))
    assert not any("requestFailed" in e for e in sessions[4].request(
        {"requestListChange": {"type": "chat", "elements": [{"chatId": chat_id, "localData": {"draft": "hello"}}]}}))
    assert not any("requestFailed" in e for e in sessions[5].request({"chatHide": {"chatIds": [chat_id]}}))
    for session in sessions:
        session.chats = {chat_id: asked_chat(session, chat_id)}
    last = 1
    for step in range(60):
        session = rng.choice([s for s in sessions if s.user != USERS[3]])
        if rng.random() < 0.6:
            answer = session.request({"chatMessageSend": {"chatId": chat_id, "tag": "Text", "content": f"step {step}"}})
            assert not any("requestFailed" in e for e in answer), answer
            last += 1
        else:
            answer = session.request({"chatMessageRead": {"chatId": chat_id, "messageId": str(rng.randint(1, last))}})
            assert not any("requestFailed" in e for e in answer), answer
        for each in sessions:
            each.sync()
        for each in sessions:
            asked = asked_chat(each, chat_id)
            assert each.chats[chat_id] == asked, f"step {step}: {each.user}'s chat by its events {each.chats[chat_id]}, asked {asked}"
    # The walk did make members of different kinds.
    kinds = {(c["flags"], c.get("numUnread"), c.get("muted"), "localData" in c) for c in (s.chats[chat_id] for s in sessions)}
    assert len(kinds) >= 5, kinds
