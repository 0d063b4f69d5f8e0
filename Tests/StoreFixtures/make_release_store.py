#!/usr/bin/env python3
"""Makes Tests/StoreFixtures/release-0.2: a store written by chatcore as it was before
the store redesign (every message in memory, schema v6-endpoints), and the answers that
release gave to a fixed set of reads over it (`answers.ndjson`).

It was run once, with that release's binary; what it made is committed. Running it again
with a later binary makes a different store and must not replace the committed one:
`Tests/python/test_release_store.py` checks that today's chatcore opens that store and
answers those reads exactly as the release did.

    CHATCORE_BINARY=.build/debug/chatcore python3 Tests/StoreFixtures/make_release_store.py OUT
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

BINARY = os.environ["CHATCORE_BINARY"]
OUT = sys.argv[1]
FIXED_TIME = "1700000000"


def start(data, files):
    path = os.path.join(data, "s")
    process = subprocess.Popen([BINARY, "serve", "--data-dir", data, "--listen", "unix:" + path, "--insecure-no-auth",
                                "--attachments-dir", files], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=dict(os.environ, CHATCORE_FIXED_TIME=FIXED_TIME))
    # The socket file appears when it is bound, a moment before it accepts: wait until a
    # connection is accepted, not for the file.
    deadline = time.time() + 60
    while True:
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            break
        except OSError:
            assert process.poll() is None and time.time() < deadline, "chatcore did not start listening"
            time.sleep(0.05)
        finally:
            probe.close()
    return process, path


class Session:
    def __init__(self, path, user):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.buffer = b""
        self.n = 0
        self.ask({"authToken": {"userId": user, "authToken": "x", "cookie": "auth"}})

    def send(self, message):
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def lines(self):
        """Lines until the answer to a marker request."""
        self.n += 1
        marker = f"sync{self.n}"
        self.send({"identitiesGet": {"cookie": marker, "appUserIds": []}})
        out = []
        while True:
            while b"\n" not in self.buffer:
                self.buffer += self.sock.recv(1 << 20)
            line, self.buffer = self.buffer.split(b"\n", 1)
            if marker.encode() in line:
                return out
            out.append(line.decode())

    def ask(self, message, check=True):
        self.send(message)
        lines = self.lines()
        for line in lines:
            if check and ("requestFailed" in line or "chatStartFailed" in line):
                sys.exit(f"building the store: {message} was refused: {line}")
        return lines


def build(data, files):
    process, path = start(data, files)
    alice, bob, carol, dave = (Session(path, u) for u in ("alice", "bob", "carol", "dave"))
    alice.ask({"endpointUpdate": {"cookie": "e", "description": "alice's phone", "nickname": "Phone"}})
    alice.ask({"chatStart": {"cookie": "s1", "invitees": [{"userId": "bob"}, {"userId": "carol"}], "subject": "Lunch",
                             "data": {"place": "corner"}, "privateData": {"note": "mine"}}})
    for n in range(1, 31):
        sender = [alice, bob, carol][n % 3]
        sender.ask({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": f"message {n} héllo 🎉" if n % 7 == 0 else f"message {n}"}})
    # Messages 1 and 2 are the Joins, 3-32 the texts (3 is bob's, 5 alice's).
    bob.ask({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "quoting three", "ref": [{"tag": "Quote", "messageId": 3}]}})
    carol.ask({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "in the thread", "ref": [{"tag": "Thread", "messageId": 3}]}})
    alice.ask({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "deeper", "ref": [{"tag": "Thread", "messageId": 34}]}})
    bob.ask({"chatMessageSend": {"chatId": "1", "tag": "Edit", "content": "message 1, edited", "ref": [{"tag": "Edit", "messageId": 3}]}})
    alice.ask({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "to be recalled", "ref": [{"tag": "Quote", "messageId": 3}]}})
    alice.ask({"chatMessageDestroy": {"chatId": "1", "messageId": 37}})
    bob.ask({"chatMessageDelete": {"chatId": "1", "id": 5}})
    carol.ask({"requestListChange": {"type": "chatMessage", "elements": [{"chatId": "1", "messageId": "6", "localData": {"starred": True}}]}})
    carol.ask({"requestListChange": {"type": "chat", "elements": [{"chatId": "1", "localData": {"pinned": 1}}]}})
    bob.ask({"chatMessageRead": {"chatId": "1", "messageId": 20}})
    carol.ask({"chatMessageRead": {"chatId": "1", "messageId": 35}})
    alice.ask({"chatMessageSend": {"chatId": "1", "tag": "Ping", "data": {"n": 1}, "control": True, "neverCountUnread": True}})
    # A one-to-one chat that becomes Defunct, and a group someone joins later and hides.
    alice.ask({"chatStart": {"cookie": "s2", "invitees": [{"userId": "dave"}], "isOneToOne": True}})
    dave.ask({"chatMessageSend": {"chatId": "2", "tag": "Text", "content": "hi alice"}})
    alice.ask({"chatMessageRead": {"chatId": "2", "messageId": 2}})
    dave.ask({"chatLeave": {"chatIds": ["2"]}})
    bob.ask({"chatStart": {"cookie": "s3", "invitees": [{"userId": "alice"}], "subject": "Plans", "invitePolicy": "AdminsOnly"}})
    for n in range(1, 6):
        bob.ask({"chatMessageSend": {"chatId": "3", "tag": "Text", "content": f"plan {n}"}})
    bob.ask({"chatInvite": {"chatId": "3", "invitees": [{"userId": "carol"}]}})
    bob.ask({"requestListChange": {"type": "chat", "elements": [{"chatId": "3", "subject": "Plans, later"}]}})
    carol.ask({"chatMessageSend": {"chatId": "3", "tag": "Text", "content": "glad to be here"}})
    bob.ask({"participantPromote": {"chatId": "3", "userUri": "bbmpim://user/id/3"}})
    alice.ask({"chatHide": {"chatIds": ["3"]}})
    # Attachments: a thumb and a file, one downloaded by bob.
    with open(os.path.join(files, "thumb.png"), "wb") as f:
        f.write(b"\x89PNG fixture thumb")
    with open(os.path.join(files, "notes.txt"), "wb") as f:
        f.write(b"fixture file contents\n" * 10)
    alice.ask({"chatMessageSend": {"chatId": "1", "tag": "File", "content": "the notes", "thumb": "thumb.png", "file": "notes.txt"}})
    time.sleep(0.5)
    alice.lines()
    bob.ask({"chatMessageFileDownload": {"chatId": "1", "messageId": 39}})
    time.sleep(0.3)
    for s in (alice, bob, carol, dave):
        s.sock.close()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


READS = {
    "alice": [
        {"requestListAll": {"type": "chat", "cookie": "chats"}},
        {"requestListAll": {"type": "chatParticipant", "cookie": "people"}},
        {"requestListAll": {"type": "user", "cookie": "users"}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w1", "criteria": {"chatId": "1"}, "window": {"messageId": 20, "before": 25, "after": 25}}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w2", "criteria": {"chatId": "1", "ref": {"tag": "Thread", "messageId": 3}}, "withRefTargets": True}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w2b", "criteria": {"chatId": "1", "ref": {"tag": "Quote", "messageId": 3}}}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w3", "criteria": {"chatId": "1", "tag": "Text", "notRefTag": "Thread"}, "window": {"timestamp": 1700000000, "after": 10}}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w4", "criteria": {"chatId": "1", "senderUri": "bbmpim://user/id/2"}}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w5", "criteria": {"chatId": "2"}, "window": {"messageId": 1, "after": 10}}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w6", "criteria": {"chatId": "3"}, "window": {"messageId": 100, "before": 3, "reverse": True}}},
        {"requestListElements": {"type": "chatMessage", "cookie": "e1", "elements": [{"chatId": "1", "messageId": "39"}, {"chatId": "1", "messageId": "5"}, {"chatId": "1", "messageId": "999"}]}},
        {"requestListChanges": {"type": "chatMessage", "cookie": "f1", "since": "0", "limit": 15}},
        {"requestListChanges": {"type": "chatMessage", "cookie": "f2", "since": "40", "chatId": "1"}},
        {"chatMessageStateGet": {"chatId": "1", "messageId": 5, "cookie": "st"}},
        {"search": {"text": "message", "cookie": "q1", "suggestedMaxResults": 5}},
        {"search": {"text": "🎉", "cookie": "q2"}},
        {"search": {"text": "PLAN", "cookie": "q3"}},
        {"endpointsGet": {"cookie": "eps"}},
        {"requestListAll": {"type": "global", "cookie": "globals"}},
    ],
    "bob": [
        {"requestListAll": {"type": "chat", "cookie": "chats"}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w1", "criteria": {"chatId": "1"}, "window": {"messageId": 36, "before": 10, "after": 10}}},
        {"requestListChanges": {"type": "chatMessage", "cookie": "f1", "since": "30", "limit": 20}},
        {"search": {"text": "message 4", "cookie": "q1"}},
    ],
    "carol": [
        {"requestListAll": {"type": "chat", "cookie": "chats"}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w1", "criteria": {"chatId": "3"}, "window": {"messageId": 1, "after": 20}}},
        {"requestListElements": {"type": "chatMessage", "cookie": "e1", "elements": [{"chatId": "1", "messageId": "6"}, {"chatId": "3", "messageId": "2"}]}},
    ],
    "dave": [
        {"requestListAll": {"type": "chat", "cookie": "chats"}},
        {"requestListMatching": {"type": "chatMessage", "cookie": "w1", "criteria": {"chatId": "2"}, "window": {"messageId": 1, "after": 5}}},
    ],
}


def normalized(line, data, own_endpoint):
    """An answer with what differs from run to run named: the data directory's path is
    $DATA, the asking session's own (random) endpoint id $SELF."""
    text = line.replace(os.path.realpath(data), "$DATA").replace(data, "$DATA")
    if own_endpoint:
        text = text.replace(f'"{own_endpoint}"', '"$SELF"')
    return json.loads(text)


def record(data, files):
    """What each user is answered for READS, one session at a time (the authToken's
    answers included)."""
    process, path = start(data, files)
    answers = []
    for user, requests in READS.items():
        session = Session.__new__(Session)
        session.sock = socket.socket(socket.AF_UNIX)
        session.sock.connect(path)
        session.buffer = b""
        session.n = 0
        session.send({"authToken": {"userId": user, "authToken": "x"}})
        own = None
        for line in session.lines():
            for element in json.loads(line).get("listChange", {}).get("elements", []):
                if element["name"] == "endpointId":
                    own = element["value"]
            answers.append({"user": user, "request": {"authToken": {"userId": user, "authToken": "x"}}, "event": normalized(line, data, own)})
        for request in requests:
            for line in session.ask(request, check=False):
                answers.append({"user": user, "request": request, "event": normalized(line, data, own)})
        session.sock.close()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    return answers


def main():
    if os.path.exists(OUT):
        sys.exit(f"{OUT} exists: the committed release store must not be replaced")
    os.makedirs(OUT)
    data = os.path.join(OUT, "data")
    files = os.path.join(OUT, "files")
    os.makedirs(files)
    build(data, files)
    shutil.copytree(data, data + ".pristine")
    answers = record(data, files)
    # The store as the release left it, not as reading it left it.
    shutil.rmtree(data)
    os.rename(data + ".pristine", data)
    import sqlite3
    for name in ("chatcore.sqlite", "search.sqlite"):
        connection = sqlite3.connect(os.path.join(data, name))
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        connection.close()
    for name in ("lock", "s", "chatcore.sqlite-wal", "chatcore.sqlite-shm", "search.sqlite-wal", "search.sqlite-shm"):
        if os.path.exists(os.path.join(data, name)):
            os.remove(os.path.join(data, name))
    with open(os.path.join(OUT, "answers.ndjson"), "w") as f:
        for answer in answers:
            f.write(json.dumps(answer, ensure_ascii=False, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
