"""Attachments over the wire (docs/protocol.md §7, issue 5): storing, Move, downloads with
the same bytes, detaching, recall releasing the stored copy, size limits, and every way a
socket session could try to reach a file outside --attachments-dir."""
import hashlib
import json
import os
import queue
import shutil
import re
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from chatcore_harness import ends_answer
from conftest import chatcore_binary


class Connection:
    def __init__(self, port=None, unix=None, process=None):
        if process is not None:
            self.reader, self.writer = process.stdout, process.stdin
        else:
            sock = socket.create_connection(("127.0.0.1", port)) if port else socket.socket(socket.AF_UNIX)
            if unix:
                sock.connect(unix)
            self.reader, self.writer = sock.makefile("rb"), sock.makefile("wb")
        self.events = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.reader:
            self.events.put(json.loads(line))

    def send(self, message):
        self.writer.write(json.dumps(message).encode() + b"\n")
        self.writer.flush()

    def expect(self, predicate, what, timeout=30):
        deadline = time.time() + timeout
        seen = []
        while True:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                raise AssertionError(f"never got {what}; saw {seen}")
            seen.append(event)
            if predicate(event):
                return event

    def failure(self, timeout=30):
        return self.expect(lambda e: "requestFailed" in e, "requestFailed", timeout)["requestFailed"]

    def message_change(self, message_id, field, timeout=60):
        def has(event):
            change = event.get("listChange")
            return change and change["type"] == "chatMessage" and any(
                e["messageId"] == str(message_id) and field in e for e in change["elements"])
        event = self.expect(has, f"a change of {field} on message {message_id}", timeout)
        return next(e for e in event["listChange"]["elements"] if e["messageId"] == str(message_id) and field in e)

    def added_message(self, message_id, timeout=60):
        """The listAdd that brings message `message_id`."""
        def has(event):
            added = event.get("listAdd")
            return added and added["type"] == "chatMessage" and any(e["messageId"] == str(message_id) for e in added["elements"])
        event = self.expect(has, f"message {message_id} added", timeout)
        return next(e for e in event["listAdd"]["elements"] if e["messageId"] == str(message_id))

    def added(self, timeout=30):
        event = self.expect(lambda e: e.get("listAdd", {}).get("type") == "chatMessage", "listAdd chatMessage", timeout)
        return event["listAdd"]["elements"][-1]

    def ask(self, message, timeout=30):
        cookie = next(iter(message.values()))["cookie"]
        self.send(message)
        return self.expect(lambda e: ends_answer(e, cookie), cookie, timeout)


class Server:
    """chatcore over TCP; with `allowed`, socket sessions attach from their user's
    directory under `self.root` (--attachments-dir): alice's is `self.allowed`."""

    def __init__(self, allowed=True):
        self.scratch = tempfile.TemporaryDirectory()
        self.data = os.path.join(self.scratch.name, "data")
        self.root = os.path.join(self.scratch.name, "uploads")
        self.allowed = os.path.join(self.root, "alice")
        self.outside = os.path.join(self.scratch.name, "outside")
        os.makedirs(self.allowed)
        os.makedirs(os.path.join(self.root, "bob"))
        os.makedirs(self.outside)
        self.arguments = ["--attachments-dir", self.root] if allowed else []
        self.start()

    def start(self):
        self.process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", self.data, "--listen", "127.0.0.1:0",
                                         "--insecure-no-auth", *self.arguments],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.process.stderr:
            match = re.search(r"port=(\d+)", line)
            if match:
                self.port = int(match.group(1))
                break
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def kill_and_restart(self):
        """SIGKILL, then the same store started again (on another port)."""
        self.process.kill()
        self.process.wait(timeout=30)
        self.start()

    def connect(self, user):
        connection = Connection(port=self.port)
        connection.send({"authToken": {"userId": user, "authToken": "-"}})
        connection.expect(lambda e: "listChange" in e and e["listChange"]["type"] == "global", "authenticated")
        return connection

    def write(self, directory, name, data):
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def blobs(self):
        return set(os.listdir(os.path.join(self.data, "attachments", "blobs")))

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=30)
        self.scratch.cleanup()


@pytest.fixture
def server():
    server = Server()
    yield server
    server.close()


def write_big(path):
    """120 MiB that take a while to store (hashed, copied, synced), no two MiB alike."""
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for n in range(120):
            f.write(block[n:] + block[:n])
    return path


def start_chat(alice):
    alice.send({"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "files"}})
    # The answer is the chat's listAdd with the cookie; the Join message follows it.
    alice.expect(lambda e: e.get("listAdd", {}).get("type") == "chat" and "cookie" in e["listAdd"], "the started chat")
    alice.expect(lambda e: e.get("listAdd", {}).get("type") == "chatMessage", "the Join message")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_move_reaches_the_recipient_who_downloads_the_same_bytes(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    payload = os.urandom(3 << 20)
    source = server.write(server.allowed, "holiday photo.jpg", payload)
    thumb = server.write(server.allowed, "thumb.png", b"\x89PNG small")
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "Picture", "content": "look", "file": source, "filePolicy": "Move",
                                    "thumb": thumb}})
    mine = alice.added()
    assert mine["state"] == "Sending" and "file" not in mine
    change = alice.message_change(2, "state")
    assert change["state"] in ("Sent", "Delivered")
    assert not os.path.exists(source), "Move removes the source once stored"
    assert os.path.exists(thumb), "Copy (the default) keeps it"

    # Bob gets the message once its file is stored, without a `file` until he downloads it.
    theirs = bob.added_message(2)
    assert theirs["fileState"] == "Available" and theirs["fileSize"] == len(payload) and "file" not in theirs
    assert open(theirs["thumb"], "rb").read() == b"\x89PNG small"

    bob.send({"chatMessageFileDownload": {"chatId": "1", "messageId": 2}})
    assert bob.message_change(2, "fileState")["fileState"] == "Transferring"
    done = bob.message_change(2, "fileState")
    assert done["fileState"] == "Done"
    assert sha256(done["file"]) == hashlib.sha256(payload).hexdigest()
    assert os.path.basename(done["file"]) == "holiday photo.jpg"

    bob.send({"chatMessageDetach": {"chatId": "1", "messageId": 2, "detachFile": True, "detachThumb": True}})
    detached = bob.message_change(2, "fileState")
    assert detached["fileState"] == "Available" and detached["thumb"] is None
    assert not os.path.exists(done["file"])


def test_one_content_is_stored_once_and_released_by_the_last_recall(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    source = server.write(server.allowed, "report.pdf", b"%PDF same bytes" * 1000)
    for n in range(2):
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": source}})
        alice.message_change(2 + n, "state")
    digest = hashlib.sha256(b"%PDF same bytes" * 1000).hexdigest()
    assert digest in server.blobs()
    alice.send({"chatMessageDestroy": {"chatId": "1", "messageId": 2}})
    alice.message_change(2, "recall")
    assert digest in server.blobs(), "message 3 still holds it"
    alice.send({"chatMessageDestroy": {"chatId": "1", "messageId": 3}})
    recalled = bob.message_change(3, "recall")
    assert recalled["fileState"] is None and recalled.get("file") is None
    assert digest not in server.blobs()


@pytest.mark.parametrize("policy", ["Copy", "Move", "Delete"])
def test_no_file_outside_the_attachments_directory_is_touched(server, policy):
    alice = server.connect("alice")
    start_chat(alice)
    secret = server.write(server.outside, "secret.txt", b"top secret")
    os.symlink(secret, os.path.join(server.allowed, "link-out"))
    os.makedirs(os.path.join(server.allowed, "sub"))
    os.symlink(server.outside, os.path.join(server.allowed, "sub", "dir-out"))
    attempts = [
        secret,
        os.path.join(server.allowed, "..", "outside", "secret.txt"),
        os.path.join(server.allowed, "sub", "..", "..", "outside", "secret.txt"),
        "../outside/secret.txt",
        os.path.join(server.allowed, "link-out"),
        os.path.join(server.allowed, "sub", "dir-out", "secret.txt"),
        "/etc/passwd",
        "/proc/self/environ",
    ]
    before = os.stat(secret)
    for path in attempts:
        for field in ("file", "thumb"):
            alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", field: path, field + "Policy": policy}})
            failed = alice.failure()
            assert failed["error"] == "NotPermitted", (path, failed)
    after = os.stat(secret)
    assert open(secret, "rb").read() == b"top secret"
    assert (after.st_ino, after.st_mtime_ns, after.st_atime_ns) == (before.st_ino, before.st_mtime_ns, before.st_atime_ns), "not even read"
    assert server.blobs() == set()


@pytest.mark.parametrize("policy", ["Copy", "Move", "Delete"])
def test_a_user_attaches_moves_and_deletes_only_files_of_their_own(server, policy):
    """Any socket user could delete any file of the directory (filePolicy Delete) and
    attach what other users put there; now each attaches only from its own directory."""
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    hers = server.write(server.allowed, "hers.txt", b"alice's")
    shared = server.write(server.root, "loose.txt", b"in no user's directory")
    for path in (hers, "../alice/hers.txt", shared, "../loose.txt"):
        bob.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": path, "filePolicy": policy}})
        assert bob.failure()["error"] == "NotPermitted", path
    assert open(hers, "rb").read() == b"alice's" and open(shared, "rb").read() == b"in no user's directory"
    # A file name relative to the directory is the user's own.
    mine = server.write(os.path.join(server.root, "bob"), "mine.txt", b"bob's")
    bob.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": "mine.txt", "filePolicy": policy}})
    assert bob.message_change(2, "state")["state"] in ("Sent", "Delivered")
    assert os.path.exists(mine) == (policy == "Copy")


def test_a_hard_link_in_the_directory_to_a_file_outside_is_refused(server):
    """A hard link resolves inside the directory, whatever it names: a link to the
    service's HMAC secret was attached and offered to the chat."""
    alice = server.connect("alice")
    start_chat(alice)
    secret = server.write(server.outside, "hmac.key", b"the service's secret")
    os.link(secret, os.path.join(server.allowed, "innocent.txt"))
    for policy in ("Copy", "Delete"):
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": "innocent.txt", "filePolicy": policy}})
        failed = alice.failure()
        assert failed["error"] == "NotPermitted" and "hard links" in failed["reason"], failed
    assert open(secret, "rb").read() == b"the service's secret"
    assert server.blobs() == set()


def test_the_data_and_attachments_directories_must_not_hold_one_another():
    with tempfile.TemporaryDirectory() as scratch:
        uploads = os.path.join(scratch, "uploads")
        os.makedirs(uploads)
        data = os.path.join(scratch, "data")
        os.makedirs(data)
        os.makedirs(os.path.join(data, "files"))
        for data_dir, attachments in ((os.path.join(uploads, "store"), uploads), (data, os.path.join(data, "files")), (data, data)):
            done = subprocess.run([chatcore_binary(), "serve", "--data-dir", data_dir, "--attachments-dir", attachments, "--listen", "127.0.0.1:0",
                                   "--insecure-no-auth"], input=b"", capture_output=True, timeout=60)
            assert done.returncode == 1, (data_dir, attachments)
            assert b"must not be inside one another" in done.stderr, done.stderr


def test_limits_missing_files_and_odd_names(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    big = os.path.join(server.allowed, "big.bin")
    with open(big, "wb") as f:
        f.truncate(129 << 20)  # sparse: 129 MiB
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": big, "filePolicy": "Move"}})
    assert alice.failure()["error"] == "TooLarge"
    assert os.path.exists(big)
    big_thumb = server.write(server.allowed, "thumb.bin", b"x" * 56321)
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "thumb": big_thumb}})
    assert alice.failure()["error"] == "TooLarge"
    thumb = server.write(server.allowed, "t.bin", b"x" * 50000)
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "y" * 22000, "thumb": thumb}})
    assert alice.failure()["error"] == "TooLarge"
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": os.path.join(server.allowed, "missing.bin")}})
    assert alice.failure()["error"] == "InvalidParameter"
    os.makedirs(os.path.join(server.allowed, "a-directory"))
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": os.path.join(server.allowed, "a-directory")}})
    assert alice.failure()["error"] == "InvalidParameter"
    os.mkfifo(os.path.join(server.allowed, "a-fifo"))
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": os.path.join(server.allowed, "a-fifo")}})
    assert alice.failure()["error"] == "InvalidParameter"
    # nothing was posted: the chat still ends at the Join
    alice.send({"requestListAll": {"type": "chat", "cookie": "all"}})
    chunk = alice.expect(lambda e: "listChunk" in e, "the chat list")
    assert chunk["listChunk"]["elements"][0]["lastMessage"] == 1

    odd = server.write(server.allowed, ".hidden\x01na:me*?.txt", b"odd")
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": odd}})
    assert bob.added_message(2)["fileState"] == "Available"
    bob.send({"chatMessageFileDownload": {"chatId": "1", "messageId": 2}})
    while (done := bob.message_change(2, "fileState"))["fileState"] != "Done":
        pass
    assert os.path.basename(done["file"]) == "hidden" + "na_me__.txt"


def test_sockets_without_an_attachments_directory_attach_nothing():
    server = Server(allowed=False)
    try:
        alice = server.connect("alice")
        start_chat(alice)
        path = server.write(server.outside, "a.txt", b"a")
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": path}})
        assert alice.failure()["error"] == "NotPermitted"
    finally:
        server.close()


def test_standard_input_may_name_any_readable_file_and_a_truncated_one_fails():
    with tempfile.TemporaryDirectory() as scratch:
        process = subprocess.Popen([chatcore_binary(), "serve", "--user", "alice", "--data-dir", os.path.join(scratch, "data")],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        alice = Connection(process=process)
        start_chat(alice)
        path = os.path.join(scratch, "anywhere.txt")
        with open(path, "wb") as f:
            f.write(b"from anywhere")
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": path, "filePolicy": "Delete"}})
        assert alice.message_change(2, "state")["state"] == "Sent"
        assert not os.path.exists(path)

        # A file cut short while it is being stored: Failed, and nothing half-stored.
        big = os.path.join(scratch, "big.bin")
        with open(big, "wb") as f:
            f.write(os.urandom(1 << 20) * 100)
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": big}})
        os.truncate(big, 1000)
        state = alice.message_change(3, "state")["state"]
        assert state in ("Failed", "Sent")
        if state == "Failed":
            assert len(os.listdir(os.path.join(scratch, "data", "attachments", "blobs"))) == 1
        assert os.listdir(os.path.join(scratch, "data", "attachments", "tmp")) == []
        process.stdin.close()
        assert process.wait(timeout=60) == 0


def test_stored_files_survive_a_restart_and_a_kill_mid_store_leaves_no_half_file():
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "data")

        def spawn(user):
            process = subprocess.Popen([chatcore_binary(), "serve", "--user", user, "--data-dir", data],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            return process, Connection(process=process)

        alice_process, alice = spawn("alice")
        start_chat(alice)
        small = os.path.join(scratch, "notes.txt")
        with open(small, "wb") as f:
            f.write(b"kept across restarts")
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": small}})
        assert alice.message_change(2, "state")["state"] == "Sent"
        big = write_big(os.path.join(scratch, "big.bin"))
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": big}})
        assert alice.added()["state"] == "Sending"
        alice_process.kill()
        alice_process.wait()

        bob_process, bob = spawn("bob")
        listed = bob.ask({"requestListElements": {"type": "chatMessage", "cookie": "m",
                                                   "elements": [{"chatId": "1", "messageId": 2}, {"chatId": "1", "messageId": 3}]}})
        bob.send({"chatMessageFileDownload": {"chatId": "1", "messageId": 2}})
        bob.message_change(2, "fileState")
        done = bob.message_change(2, "fileState")
        assert done["fileState"] == "Done" and open(done["file"], "rb").read() == b"kept across restarts"
        bob_process.stdin.close()
        assert bob_process.wait(timeout=60) == 0

        alice_process, alice = spawn("alice")
        alice.send({"requestListElements": {"type": "chatMessage", "cookie": "again", "elements": [{"chatId": "1", "messageId": 3}]}})
        chunk = alice.expect(lambda e: "listChunk" in e, "message 3")
        third = chunk["listChunk"]["elements"][0]
        assert third["state"] in ("Failed", "Sent"), third
        if third["state"] == "Sent":
            assert sha256(third["file"]) == sha256(big)
        assert os.listdir(os.path.join(data, "attachments", "tmp")) == []
        alice_process.stdin.close()
        assert alice_process.wait(timeout=60) == 0


def test_a_stored_content_no_message_uses_is_removed_at_start():
    """A crash between storing a message's attachment and committing its link to it left
    the copy for ever; the next start finds it and removes it, and keeps what is used."""
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "data")
        process = subprocess.Popen([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        alice = Connection(process=process)
        start_chat(alice)
        kept = os.path.join(scratch, "kept.txt")
        with open(kept, "wb") as f:
            f.write(b"a message uses this")
        alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": kept}})
        assert alice.message_change(2, "state")["state"] == "Sent"
        process.stdin.close()
        assert process.wait(timeout=60) == 0
        blobs = os.path.join(data, "attachments", "blobs")
        used = hashlib.sha256(b"a message uses this").hexdigest()
        assert os.listdir(blobs) == [used]
        orphan = hashlib.sha256(b"stored, then the process died").hexdigest()
        with open(os.path.join(blobs, orphan), "wb") as f:
            f.write(b"stored, then the process died")
        process = subprocess.Popen([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 30
        while os.path.exists(os.path.join(blobs, orphan)):
            assert time.time() < deadline, "the unused copy was not removed"
            time.sleep(0.1)
        assert os.listdir(blobs) == [used]
        process.stdin.close()
        assert process.wait(timeout=60) == 0
        assert b"no message uses" in process.stderr.read()


def chat_window(connection, cookie, chat_id="1"):
    """The ids of a chat's messages as `connection` sees them, oldest first."""
    connection.send({"requestListMatching": {"type": "chatMessage", "cookie": cookie, "criteria": {"chatId": chat_id},
                                             "window": {"timestamp": 2 ** 40, "before": 100}}})
    ids = []
    while True:
        event = connection.expect(lambda e: "listChunk" in e and e["listChunk"].get("cookie") == cookie, cookie)
        ids += [int(m["messageId"]) for m in event["listChunk"]["elements"]]
        if event["listChunk"].get("last"):
            return ids


def seen(connection, cookie, message_id="2"):
    """Message `message_id` of chat 1 as `connection` sees it (asked by key)."""
    connection.send({"requestListElements": {"type": "chatMessage", "cookie": cookie, "elements": [{"chatId": "1", "messageId": message_id}]}})
    return connection.expect(lambda e: e.get("listChunk", {}).get("cookie") == cookie, f"message {message_id}")["listChunk"]["elements"][0]


def unread(connection, cookie):
    connection.send({"requestListElements": {"type": "chat", "cookie": cookie, "elements": [{"chatId": "1"}]}})
    event = connection.expect(lambda e: "listChunk" in e and e["listChunk"].get("cookie") == cookie, cookie)
    return event["listChunk"]["elements"][0]


def test_others_see_a_message_only_once_its_attachments_are_stored(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    bob.added_message(1)
    big = write_big(os.path.join(server.allowed, "big.bin"))
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "content": "the big one", "file": big}})
    assert alice.added_message(2)["state"] == "Sending"
    # While it is stored (a 120 MB copy, hashed and synced): bob sends, and sees no message 2.
    bob.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "meanwhile"}})
    assert bob.added_message(3)["content"] == "meanwhile"
    assert chat_window(bob, "during") == [1, 3]
    bob.send({"requestListElements": {"type": "chatMessage", "cookie": "two", "elements": [{"chatId": "1", "messageId": "2"}]}})
    header = bob.expect(lambda e: e.get("listElements", {}).get("cookie") == "two", "the answer for message 2")["listElements"]
    assert header["missing"] == [{"chatId": "1", "messageId": "2"}]
    bob.send({"search": {"cookie": "s", "text": "big"}})
    assert bob.expect(lambda e: "searchResult" in e, "the search")["searchResult"]["messages"] == []
    during = unread(bob, "chat-during")
    assert during["numUnread"] == 0 and during["lastMessage"] == 3
    # Not sent yet: not to be reacted to or pinned, even by its sender.
    for cookie, request in (("react", {"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "👍"}}),
                            ("pin", {"chatMessagePin": {"chatId": "1", "messageId": "2"}})):
        alice.send({next(iter(request)): dict(next(iter(request.values())), cookie=cookie)})
        assert alice.failure()["error"] == "NotPermitted", cookie
    bob.send({"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "👍", "cookie": "bob-react"}})
    assert bob.failure()["error"] == "NotFound"
    assert alice.message_change(2, "state", timeout=120)["state"] in ("Sent", "Delivered")

    # Then it reaches bob as a new message, counted unread, and the ids are consecutive.
    theirs = bob.added_message(2)
    assert theirs["content"] == "the big one" and theirs["fileState"] == "Available" and "file" not in theirs
    assert chat_window(bob, "after") == [1, 2, 3] == chat_window(alice, "after")
    assert unread(bob, "chat-after")["numUnread"] == 1
    bob.send({"search": {"cookie": "s2", "text": "big"}})
    assert [m["messageId"] for m in bob.expect(lambda e: "searchResult" in e, "the search")["searchResult"]["messages"]] == ["2"]


def test_a_message_whose_attachments_fail_is_its_senders_alone_and_a_gap_for_the_others(server):
    alice, bob, carol = server.connect("alice"), server.connect("bob"), server.connect("carol")
    start_chat(alice)
    bob.added_message(1)
    alice.send({"chatInvite": {"chatId": "1", "invitees": [{"userId": "carol"}]}})
    carol.added_message(2)
    # A real fault: where copies are made is not a directory any more.
    temporary = os.path.join(server.data, "attachments", "tmp")
    os.rmdir(temporary)
    open(temporary, "w").close()
    source = server.write(server.allowed, "report.pdf", b"%PDF secret plans")
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "content": "secret plans", "file": source}})
    assert alice.added_message(3)["state"] == "Sending"
    assert alice.message_change(3, "state")["state"] == "Failed"
    gap = bob.added_message(3)
    assert gap["tag"] == "Gap" and gap["state"] == "Sent" and gap["flags"] == "N"
    assert not {"content", "file", "fileState", "fileSize", "thumb", "data"} & set(gap)
    # Each viewer's Gap is their own: posted by them (carol's is not bob's).
    assert carol.added_message(3)["senderUri"] == gap["senderUri"] == "bbmpim://user/id/0"
    bob.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "mine"}})
    assert gap["senderUri"] == bob.added_message(4)["senderUri"], "a Gap is posted by the viewer"
    assert unread(bob, "chat")["numUnread"] == 0
    bob.send({"search": {"cookie": "s", "text": "secret"}})
    assert bob.expect(lambda e: "searchResult" in e, "the search")["searchResult"]["messages"] == []
    # Never sent: neither its sender nor anyone else reacts to it or pins it (a Gap is not a message).
    for who in (alice, bob):
        who.send({"chatMessageReact": {"chatId": "1", "messageId": "3", "reaction": "👍", "cookie": "react"}})
        assert who.failure()["error"] == "NotPermitted"
        who.send({"chatMessagePin": {"chatId": "1", "messageId": "3", "cookie": "pin"}})
        assert who.failure()["error"] == "NotPermitted"
    # Destroying a Failed message is ignored, not refused; the next message follows on.
    alice.send({"chatMessageDestroy": {"chatId": "1", "messageId": "3"}})
    os.remove(temporary)
    os.mkdir(temporary)
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "after"}})
    added = alice.expect(lambda e: "requestFailed" in e or (e.get("listAdd", {}).get("type") == "chatMessage"
                                                             and e["listAdd"]["elements"][0]["messageId"] == "5"), "message 5")
    assert "requestFailed" not in added, added
    assert chat_window(bob, "bob") == [1, 2, 3, 4, 5] == chat_window(alice, "alice")
    own = seen(alice, "two", "3")
    assert own["state"] == "Failed" and own["content"] == "secret plans" and own["tag"] == "File"


def test_a_download_that_fails_can_be_tried_again_and_a_lost_file_fails_for_good(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    source = server.write(server.allowed, "notes.txt", b"the notes")
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": source}})
    assert "file" not in bob.added_message(2)
    downloads = os.path.join(server.data, "attachments", "downloads")
    shutil.rmtree(downloads)
    open(downloads, "w").close()
    bob.send({"chatMessageFileDownload": {"chatId": "1", "messageId": "2"}})
    assert bob.message_change(2, "fileState")["fileState"] == "Transferring"
    failed = bob.message_change(2, "fileState")
    assert failed["fileState"] == "FailedAvailable" and failed.get("file") is None
    os.remove(downloads)
    bob.send({"chatMessageFileDownload": {"chatId": "1", "messageId": "2"}})
    while (done := bob.message_change(2, "fileState"))["fileState"] != "Done":
        pass
    assert open(done["file"], "rb").read() == b"the notes"

    # The stored content itself is gone: nothing to download.
    second = server.write(server.allowed, "other.txt", b"other notes")
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "file": second}})
    bob.added_message(3)
    for blob in server.blobs():
        if sha256(os.path.join(server.data, "attachments", "blobs", blob)) == hashlib.sha256(b"other notes").hexdigest():
            os.remove(os.path.join(server.data, "attachments", "blobs", blob))
    bob.send({"chatMessageFileDownload": {"chatId": "1", "messageId": "3"}})
    while (lost := bob.message_change(3, "fileState"))["fileState"] == "Transferring":
        pass
    assert lost["fileState"] == "Failed"


def test_a_message_pending_when_the_process_is_killed_is_a_gap_for_others_and_counts_stay_right(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    bob.added_message(1)
    big = write_big(os.path.join(server.allowed, "big.bin"))
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "content": "never stored", "file": big}})
    assert alice.added_message(2)["state"] == "Sending"
    bob.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "meanwhile"}})
    bob.added_message(3)
    server.kill_and_restart()
    alice, bob = server.connect("alice"), server.connect("bob")
    assert chat_window(bob, "bob") == [1, 2, 3] == chat_window(alice, "alice")
    gap = seen(bob, "two")
    assert gap["tag"] == "Gap" and "content" not in gap
    own = seen(alice, "own")
    assert own["state"] == "Failed" and own["content"] == "never stored"
    # bob's own message is not unread for him; alice has bob's one unread; nothing else.
    assert unread(bob, "bob-chat")["numUnread"] == 0
    mine = unread(alice, "alice-chat")
    assert mine["numUnread"] == 1 and mine["lastMessage"] == 3


def test_a_message_recalled_while_its_attachments_are_stored_is_a_gap_for_the_others(server):
    alice, bob = server.connect("alice"), server.connect("bob")
    start_chat(alice)
    bob.added_message(1)
    big = write_big(os.path.join(server.allowed, "big.bin"))
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "content": "changed my mind", "file": big}})
    assert alice.added_message(2)["state"] == "Sending"
    alice.send({"chatMessageDestroy": {"chatId": "1", "messageId": "2"}})
    assert alice.message_change(2, "recall")["recall"] == "Recalled"
    gap = bob.added_message(2)
    assert gap["tag"] == "Gap" and "content" not in gap and "recall" not in gap
    assert chat_window(bob, "bob") == [1, 2] and unread(bob, "chat")["numUnread"] == 0
