"""SIGKILL in the middle of a pipelined load: after a restart nothing that was announced
`Sent` is lost, ids are consecutive, and refBy and the chat's counters agree with the
messages (docs/protocol.md §6, issue 4)."""
import json
import os
import random
import signal
import subprocess
import tempfile
import threading

from chatcore_harness import ends_answer
from conftest import chatcore_binary


class Server:
    def __init__(self, user, data_dir):
        self.process = subprocess.Popen([chatcore_binary(), "serve", "--user", user, "--data-dir", data_dir],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def send(self, message):
        self.process.stdin.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def events(self):
        for line in self.process.stdout:
            if not line.endswith(b"\n"):
                return  # the process was killed in the middle of writing this line
            yield json.loads(line)

    def request(self, message):
        """Sends one request and returns every event up to and including the one with its cookie."""
        cookie = next(iter(message.values()))["cookie"]
        self.send(message)
        self.process.stdin.flush()
        got = []
        for event in self.events():
            got.append(event)
            body = next(iter(event.values()))
            if ends_answer(event, cookie):
                return got
        raise AssertionError("chatcore ended before answering %s" % cookie)

    def close(self):
        self.process.stdin.close()
        assert self.process.wait(timeout=60) == 0


def all_messages(server, chat_id, last):
    messages = {}
    anchor = 1
    while anchor <= last:
        events = server.request({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": chat_id},
                                                         "window": {"messageId": anchor, "before": 0, "after": 999},
                                                         "cookie": "page%d" % anchor}})
        for message in (m for e in events if "listChunk" in e for m in e["listChunk"]["elements"]):
            messages[int(message["messageId"])] = message
        anchor += 1000
    return messages


def test_sigkill_during_pipelined_sends_loses_nothing_announced():
    rng = random.Random(4)
    with tempfile.TemporaryDirectory() as data_dir:
        server = Server("alice", data_dir)
        events = server.request({"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "load"}})
        assert events[-1]["listAdd"]["cookie"] == "start" and events[-1]["listAdd"]["elements"][0]["chatId"] == "1"
        announced = {}      # messageId -> content, as announced Sent to the sender
        enough = threading.Event()

        def read():
            for event in server.events():
                added = event.get("listAdd")
                if added and added["type"] == "chatMessage":
                    for message in added["elements"]:
                        assert message["state"] == "Sent"
                        announced[int(message["messageId"])] = message.get("content")
                if len(announced) >= 4000:
                    enough.set()
            enough.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            for n in range(30000):
                message = {"chatId": "1", "tag": "Text", "content": "m%d" % n}
                if n > 10 and rng.random() < 0.2:
                    message["ref"] = [{"tag": rng.choice(["Quote", "Thread"]), "messageId": rng.randrange(2, n)}]
                server.send({"chatMessageSend": message})
            server.process.stdin.flush()
        except BrokenPipeError:
            pass
        enough.wait(timeout=120)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        reader.join(timeout=10)
        assert len(announced) >= 4000

        server = Server("alice", data_dir)
        events = server.request({"requestListAll": {"type": "chat", "cookie": "chats"}})
        chat = events[-1]["listChunk"]["elements"][0]
        last = int(chat["lastMessage"])
        assert int(chat["numMessages"]) == last
        assert last >= max(announced)
        messages = all_messages(server, "1", last)
        assert sorted(messages) == list(range(1, last + 1)), "ids must be consecutive"
        for message_id, content in announced.items():
            assert messages[message_id].get("content") == content, message_id
        # Message k of the load is "m<k>" with id k + 2 (the Join is 1): nothing reordered.
        for message_id, message in messages.items():
            if message_id >= 2:
                assert message["content"] == "m%d" % (message_id - 2)
        # refBy agrees with the refs that exist.
        expected = {}
        for message_id, message in messages.items():
            for ref in message.get("ref", []):
                entry = expected.setdefault((int(ref["messageId"]), ref["tag"]), [])
                entry.append(message_id)
        for message_id, message in messages.items():
            got = {(message_id, r["tag"]): (int(r["count"]), int(r["newestRef"])) for r in message.get("refBy", [])}
            want = {key: (len(ids), max(ids)) for key, ids in expected.items() if key[0] == message_id}
            assert got == want, message_id
        server.close()

        # bob has never read anything: every message but the Join counts as unread for him.
        bob = Server("bob", data_dir)
        events = bob.request({"requestListAll": {"type": "chat", "cookie": "chats"}})
        chat = events[-1]["listChunk"]["elements"][0]
        assert chat["numUnread"] == last - 1
        assert chat["lastMessage"] == last
        bob.close()
