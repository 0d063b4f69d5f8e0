"""The store failing underneath a running service (issue 11): fsync returning EIO
(injected with strace) and a filesystem that fills up (a small tmpfs). Every request gets
exactly one answer, nothing is announced `Sent` that is not durable, no session takes on
another user's identity, no blob of a live message goes, and once space is freed the
service goes on serving; a restart shows a consistent store."""
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from chatcore_harness import Client, auth, body, cookie_of, global_value, line, start_socket_server
from conftest import chatcore_binary

STRACE = shutil.which("strace")


def serve_stdio(data_dir, requests, prefix=()):
    """Runs `chatcore serve --user alice` over the given request lines; returns (events, code)."""
    command = list(prefix) + [chatcore_binary(), "serve", "--user", "alice", "--data-dir", data_dir]
    done = subprocess.run(command, input=b"".join(line(r) for r in requests), capture_output=True, timeout=300)
    events = [__import__("json").loads(text) for text in done.stdout.splitlines()]
    return events, done.returncode, done.stderr.decode(errors="replace")


def sent_messages(events):
    """messageId -> content of every message announced to the sender as Sent (or later)."""
    announced = {}
    for event in events:
        for kind in ("listAdd", "listChange"):
            value = event.get(kind)
            if value and value["type"] == "chatMessage":
                for element in value["elements"]:
                    if element.get("state") in ("Sent", "Delivered", "Read") and "I" not in element.get("flags", ""):
                        announced[(element["chatId"], element["messageId"])] = element.get("content")
    return announced


def history(data_dir, chat_id="1"):
    events, code, _ = serve_stdio(data_dir, [{"requestListMatching": {
        "type": "chatMessage", "criteria": {"chatId": chat_id}, "window": {"messageId": 1, "before": 0, "after": 1000},
        "cookie": "history"}}])
    assert code == 0
    messages = {}
    for event in events:
        chunk = event.get("listChunk") or event.get("listMatching")
        if chunk:
            for element in chunk.get("elements", chunk.get("result", [])):
                messages[element["messageId"]] = element
    return messages


@pytest.mark.skipif(STRACE is None, reason="strace is not installed (make setup installs it)")
def test_eio_on_fsync_refuses_every_send_and_announces_nothing():
    with tempfile.TemporaryDirectory() as data_dir:
        events, code, _ = serve_stdio(data_dir, [{"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "s"}}])
        assert code == 0 and {"chatStarted": {"cookie": "start", "chatId": "1"}} in events
        before = history(data_dir)
        assert sorted(before) == ["1"]  # the Join of bob

        sends = [{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "m%d" % n, "cookie": "s%d" % n}} for n in range(40)]
        inject = [STRACE, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync,fdatasync",
                  "-e", "inject=fsync,fdatasync:error=EIO"]
        events, code, stderr = serve_stdio(data_dir, sends, prefix=inject)
        assert sent_messages(events) == {}, "a message was announced Sent although no sync succeeded"
        for n in range(40):
            answers = [e for e in events if cookie_of(e) == "s%d" % n]
            assert len(answers) == 1, (n, answers)
            failed = answers[0].get("requestFailed")
            assert failed and failed["error"] == "Internal" and "store" in failed["reason"], answers
        assert "commit failed" in stderr

        # A restart shows a consistent store. (The refused sends may be there: their WAL
        # frames were written before the failing fdatasync, and SQLite's recovery keeps
        # frames that carry a commit marker. "Internal" means "not confirmed", like a
        # crash before the answer; what was confirmed is never lost.)
        after = history(data_dir)
        assert sorted(int(i) for i in after) == list(range(1, len(after) + 1))
        assert all(after[i] == before[i] for i in before)


def fill(directory):
    """Fills the filesystem of `directory`; returns the filler's path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb") as filler:
        block = b"\0" * (1 << 16)
        try:
            while True:
                filler.write(block)
                filler.flush()
        except OSError:
            pass
    return path


@pytest.fixture
def small_filesystem():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tempfile.mkdtemp(prefix="chatcore-full-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", mount], capture_output=True).returncode != 0:
        os.rmdir(mount)
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", mount])
        os.rmdir(mount)


def test_full_filesystem_under_load(small_filesystem):
    data_dir = os.path.join(small_filesystem, "data")
    work = tempfile.mkdtemp(prefix="chatcore-sock-")
    sock = os.path.join(work, "s")
    uploads = os.path.join(work, "uploads")
    os.mkdir(uploads)
    server = start_socket_server(data_dir, sock, "--attachments-dir", uploads)
    try:
        users = ["alice", "bob", "carol", "dave"]
        clients = {}
        for user in users:
            clients[user] = Client(sock)
            assert global_value(auth(clients[user], user), "authTokenState") == "Ok"
        alice = clients["alice"]
        started = alice.request({"chatStart": {"cookie": "start", "invitees": [{"userId": u} for u in users[1:]], "subject": "full"}})
        assert {"chatStarted": {"cookie": "start", "chatId": "1"}} in started
        # Attachments whose blobs are shared (same content), before the disk fills.
        for n in range(3):
            path = os.path.join(uploads, "f%d.bin" % n)
            with open(path, "wb") as f:
                f.write(b"shared attachment content" * 100)
            alice.request({"chatMessageSend": {"chatId": "1", "tag": "File", "file": path, "cookie": "file%d" % n}})
        deadline = time.time() + 30
        while time.time() < deadline and len([e for e in alice.all if "listChange" in e and any(
                el.get("state") in ("Sent", "Delivered") and el.get("messageId") in ("5", "6", "7")
                for el in e["listChange"].get("elements", []) if e["listChange"]["type"] == "chatMessage")]) < 3:
            time.sleep(0.05)

        filler = fill(small_filesystem)

        # Under the full disk: every user sends, alice recalls two attachments, and new
        # users authenticate on new sessions.
        newcomers = {}
        for n, user in enumerate(["erin", "frank", "grace"]):
            newcomers[user] = Client(sock)
            newcomers[user].send({"authToken": {"userId": user, "authToken": "any", "cookie": "a"}})
        cookies = {user: [] for user in users}
        for round_ in range(30):
            for user in users:
                cookie = "%s-%d" % (user, round_)
                cookies[user].append(cookie)
                clients[user].send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "x" * 2000 + cookie, "cookie": cookie}})
        alice.send({"chatMessageDestroy": {"chatId": "1", "messageId": "5", "cookie": "recall5"}},
                   {"chatMessageDestroy": {"chatId": "1", "messageId": "6", "cookie": "recall6"}})
        cookies["alice"] += ["recall5", "recall6"]
        for user in users:
            clients[user].send({"identitiesGet": {"cookie": "end", "userIds": [user]}})
            clients[user].answer("end", timeout=60)
            for cookie in cookies[user]:
                answers = [e for e in clients[user].all if cookie_of(e) == cookie]
                assert len(answers) == 1, (cookie, answers)
        failures = sum(1 for user in users for e in clients[user].all
                       if "requestFailed" in e and e["requestFailed"]["error"] == "Internal")
        assert failures > 0, "the full disk never made a commit fail: the test did not test anything"
        for e in (e for user in users for e in clients[user].all if "requestFailed" in e):
            assert e["requestFailed"]["error"] == "Internal" and "store" in e["requestFailed"]["reason"], e

        # Space comes back: the service goes on serving, without a restart.
        os.unlink(filler)
        for user, client in newcomers.items():
            events = auth(client, user, cookie="again")
            assert global_value(events, "authTokenState") == "Ok", events
        for user in users:
            clients[user].request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "after " + user, "cookie": "after"}})

        # Nobody acts as someone else: every session's own uri resolves to its own user.
        everyone = {**clients, **newcomers}
        for user, client in everyone.items():
            client.send({"requestListAll": {"type": "global", "cookie": "g"}})
            events = client.answer("g", final="listChunk")
            values = {el["name"]: el["value"] for e in events if "listChunk" in e for el in e["listChunk"]["elements"]}
            (ids,) = [e for e in alice.request({"identitiesGet": {"cookie": "who-" + user, "userIds": [user]}})
                      if "identities" in e]
            info = ids["identities"].get("info", ids["identities"].get("identities"))
            assert str(values["localRegId"]) == str(info[0]["regId"]), (user, values, info)

        announced = {}
        for user in users:
            announced.update(sent_messages(clients[user].all))
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0

    # A restart shows a consistent store holding everything announced.
    server = start_socket_server(data_dir, sock, "--attachments-dir", uploads)
    try:
        bob = Client(sock)
        auth(bob, "bob")
        events = bob.request({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": "1"},
                                                      "window": {"messageId": 1, "before": 0, "after": 1000}, "cookie": "h"}},
                             final="listChunk" if False else None)
        while not any("listChunk" in e and e["listChunk"].get("last") for e in events) and not any(
                "listMatching" in e and "result" in e["listMatching"] for e in events):
            events += [bob.events.get(timeout=30)]
        stored = {}
        for e in events:
            chunk = e.get("listChunk") or e.get("listMatching")
            for element in (chunk or {}).get("elements", (chunk or {}).get("result", [])):
                stored[element["messageId"]] = element
        ids = sorted(int(i) for i in stored)
        assert ids == list(range(1, len(ids) + 1)), "message ids are not consecutive"
        for (chat, message_id), content in announced.items():
            assert message_id in stored, "message %s was announced Sent and is lost" % message_id
            assert stored[message_id].get("content") == content
        # Every live attachment can still be downloaded: its blob is there.
        for message_id in ("5", "6", "7"):
            message = stored[message_id]
            if message.get("recall"):
                continue
            answer = bob.request({"chatMessageFileDownload": {"chatId": "1", "messageId": message_id, "cookie": "d" + message_id}}) \
                if False else None
            blobs = os.path.join(data_dir, "attachments", "blobs")
            assert os.listdir(blobs), "the blob of live message %s is gone" % message_id
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
