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

from chatcore_harness import Client, auth, body, cookie_of, global_value, line, small_tmpfs, start_socket_server
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
                        key = (element["chatId"], element["messageId"])
                        if "content" in element or key not in announced:
                            announced[key] = element.get("content")
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
        assert code == 0 and any(e.get("listAdd", {}).get("cookie") == "start" for e in events)
        before = history(data_dir)
        assert sorted(before) == ["1"]  # the Join of bob

        sends = [{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "m%d" % n, "cookie": "s%d" % n}} for n in range(40)]
        inject = [STRACE, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync,fdatasync",
                  "-e", "inject=fsync,fdatasync:error=EIO"]
        events, code, stderr = serve_stdio(data_dir, sends, prefix=inject)
        assert sent_messages(events) == {}, "a message was announced Sent although no sync succeeded"
        # An I/O error stops the service: what it accepted is answered (Internal), in
        # order, once; then it exits 1 saying why.
        answered = [n for n in range(40) if any(cookie_of(e) == "s%d" % n for e in events)]
        assert answered and answered == list(range(len(answered))), answered
        for n in answered:
            answers = [e for e in events if cookie_of(e) == "s%d" % n]
            assert len(answers) == 1, (n, answers)
            failed = answers[0].get("requestFailed")
            assert failed and failed["error"] == "Internal", answers
            assert "store" in failed["reason"] or "shutting down" in failed["reason"], answers
        assert code == 1, (code, stderr)
        assert "I/O error" in stderr and "restart chatcore" in stderr, stderr

        # A restart shows a consistent store. (The refused sends may be there: their WAL
        # frames were written before the failing fdatasync, and SQLite's recovery keeps
        # frames that carry a commit marker. "Internal" means "not confirmed", like a
        # crash before the answer; what was confirmed is never lost.)
        after = history(data_dir)
        assert sorted(int(i) for i in after) == list(range(1, len(after) + 1))
        assert all(after[i] == before[i] for i in before)


@pytest.mark.skipif(STRACE is None, reason="strace is not installed (make setup installs it)")
def test_a_new_store_is_made_without_a_sync_per_migration_and_still_syncs_each_commit():
    """Each migration of the store is a transaction of its own, and under synchronous =
    FULL each synced the log: a new store's start, asked nothing, made 26 fsync and
    fdatasync calls (about 15 ms here). They run under NORMAL now (a crash loses whole
    migrations, never half of one, and the next start runs them again); what is left is
    SQLite's own set-up of the store's and the search index's logs and the session's
    first commit. Commits are still synced one by one afterwards."""
    def syncs(data_dir, requests):
        counted = os.path.join(counts, "strace")
        events, code, stderr = serve_stdio(data_dir, requests, prefix=[STRACE, "-f", "-c", "-o", counted, "-e", "trace=fsync,fdatasync"])
        assert code == 0, stderr
        with open(counted) as f:
            summary = f.read()
        # strace leaves its summary empty when no call was made (the file is there).
        total = [line for line in summary.splitlines() if line.strip().endswith("total")]
        assert total or not summary.strip(), summary
        return events, int(total[0].split()[3]) if total else 0

    with tempfile.TemporaryDirectory() as data_dir, tempfile.TemporaryDirectory() as counts:
        _, made = syncs(data_dir, [])
        assert made <= 14, f"a new store's start made {made} syncs"
        syncs(data_dir, [{"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "s"}}])
        # A start of the existing store with one send syncs once more than one asked
        # nothing: the send's commit (under NORMAL it would not).
        _, idle = syncs(data_dir, [])
        events, one = syncs(data_dir, [{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "m", "cookie": "s"}}])
        assert sent_messages(events), events
        assert one >= idle + 1, (idle, one)


def wait_until(predicate, timeout=30):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def own_contents(events):
    """Contents of the messages this session was told it sent (its own listAdds)."""
    return [element.get("content") for event in events if "listAdd" in event and event["listAdd"]["type"] == "chatMessage"
            for element in event["listAdd"]["elements"] if "I" not in element["flags"]]


def stored_files(events):
    """Ids of own messages whose state reached Sent (or later) in a listChange."""
    done = set()
    for event in events:
        change = event.get("listChange")
        if change and change["type"] == "chatMessage":
            for element in change["elements"]:
                if element.get("state") in ("Sent", "Delivered", "Read"):
                    done.add(element["messageId"])
    return done


def fill(directory):
    """Fills the filesystem of `directory`; returns the filler's path."""
    path = os.path.join(directory, "filler")
    # Unbuffered: a buffered file would raise ENOSPC again when it is closed.
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 16, 4096, 1):
            while True:
                try:
                    os.write(descriptor, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(descriptor)
    return path


@pytest.fixture
def small_filesystem():
    with small_tmpfs("24m") as mount:
        if mount is None:
            pytest.skip("cannot mount a tmpfs here (it needs root)")
        yield mount


def test_full_filesystem_under_load(small_filesystem):
    data_dir = os.path.join(small_filesystem, "data")
    work = tempfile.mkdtemp(prefix="chatcore-sock-")
    sock = os.path.join(work, "s")
    uploads = os.path.join(work, "uploads")
    os.makedirs(os.path.join(uploads, "alice"))
    server = start_socket_server(data_dir, sock, "--attachments-dir", uploads)
    try:
        users = ["alice", "bob", "carol", "dave"]
        clients = {}
        for user in users:
            clients[user] = Client(sock)
            assert global_value(auth(clients[user], user), "authTokenState") == "Ok"
        alice = clients["alice"]
        started = alice.request({"chatStart": {"cookie": "start", "invitees": [{"userId": u} for u in users[1:]], "subject": "full"}})
        assert started[-1]["listAdd"]["elements"][0]["chatId"] == "1"
        # Three attachments sharing one blob (same content), stored before the disk fills.
        for n in range(3):
            path = os.path.join(uploads, "alice", "f%d.bin" % n)
            with open(path, "wb") as f:
                f.write(b"shared attachment content" * 100)
            alice.send({"chatMessageSend": {"chatId": "1", "tag": "File", "content": "file%d" % n, "file": path}})
        wait_until(lambda: stored_files(alice.all) >= {"4", "5", "6"})

        filler = fill(small_filesystem)

        # Under the full disk: every user sends, alice recalls two of the attachments,
        # and new users authenticate on new sessions.
        newcomers = {}
        for user in ["erin", "frank", "grace"]:
            newcomers[user] = Client(sock)
            newcomers[user].send({"authToken": {"userId": user, "authToken": "any"}})
        contents = {user: [] for user in users}
        for round_ in range(30):
            for user in users:
                content = "x" * 2000 + "%s-%d" % (user, round_)
                contents[user].append(content)
                clients[user].send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": content, "cookie": content[-12:]}})
        alice.send({"chatMessageDestroy": {"chatId": "1", "messageId": "4", "cookie": "recall4"}},
                   {"chatMessageDestroy": {"chatId": "1", "messageId": "5", "cookie": "recall5"}})
        for user in users:
            clients[user].request({"identitiesGet": {"cookie": "end", "appUserIds": [user]}})
            own = own_contents(clients[user].all)
            refused = [e["requestFailed"] for e in clients[user].all if "requestFailed" in e]
            for content in contents[user]:
                answers = own.count(content) + sum(1 for f in refused if f.get("cookie") == content[-12:])
                assert answers == 1, (user, content[-12:], answers)
        for user, client in newcomers.items():
            client.request({"identitiesGet": {"cookie": "end", "appUserIds": [user]}})
            answers = [e for e in client.all
                       if e.get("requestFailed", {}).get("request") == "authToken" or global_value([e], "authTokenState")]
            assert len(answers) == 1, (user, answers)
        failures = [e["requestFailed"] for user in users for e in clients[user].all if "requestFailed" in e]
        assert failures, "the full disk never made a commit fail: the test did not test anything"
        for failure in failures:
            assert failure["error"] == "Internal" and "store" in failure["reason"], failure

        # Space comes back: the service goes on serving, without a restart.
        os.unlink(filler)
        for user, client in newcomers.items():
            events = auth(client, user, cookie="again")
            assert global_value(events, "authTokenState") == "Ok" or any(
                e.get("setupError", {}).get("error") == "AlreadyAuthenticated" for e in events), events
        for user in users:
            clients[user].send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "after " + user}})
            clients[user].request({"identitiesGet": {"cookie": "after", "appUserIds": [user]}})
            assert ("after " + user) in own_contents(clients[user].all)

        # Nobody acts as someone else: every session's own regId and uri are its user's.
        for user, client in {**clients, **newcomers}.items():
            client.send({"requestListAll": {"type": "global", "cookie": "g"}})
            events = client.answer("g")
            values = {el["name"]: el["value"] for e in events if "listChunk" in e for el in e["listChunk"]["elements"]}
            (ids,) = [e for e in alice.request({"identitiesGet": {"cookie": "who-" + user, "appUserIds": [user]}}) if "identities" in e]
            (info,) = ids["identities"]["info"]
            # localUri is bbmpim://user/id/0 in everyone's own view; the regId (derived from
            # the user id) says who the session is, and so does asking for itself.
            assert str(values["localRegId"]) == str(info["regId"]) and values["localUri"] == "bbmpim://user/id/0", (user, values, info)
            (mine,) = [e for e in client.request({"identitiesGet": {"cookie": "me-" + user, "appUserIds": [user]}}) if "identities" in e]
            assert mine["identities"]["info"] == [dict(info, uri="bbmpim://user/id/0")], (user, mine)

        announced = {}
        for user in users:
            announced.update(sent_messages(clients[user].all))
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0

    # A restart shows a consistent store holding everything announced, and the blob of
    # every live attachment.
    after = history(data_dir)
    ids = sorted(int(i) for i in after)
    assert ids == list(range(1, len(ids) + 1)), "message ids are not consecutive"
    for (chat, message_id), content in announced.items():
        assert message_id in after, "message %s was announced Sent and is lost" % message_id
        assert content is None or after[message_id].get("recall") or after[message_id].get("content") == content
    live = [m for m in ("4", "5", "6") if not after[m].get("recall")]
    assert "6" in live
    blobs = os.listdir(os.path.join(data_dir, "attachments", "blobs"))
    assert len(blobs) == 1, "the shared blob of live messages %s is gone" % live
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(STRACE is None, reason="strace is not installed (make setup installs it)")
def test_eio_on_fsync_under_a_multi_session_load_stops_cleanly():
    """Sessions pipeline sends when every fsync starts failing: each session's answered
    requests are a prefix of what it sent, each answered once and none announced; the
    service exits 1 saying why, and a restart shows a consistent store."""
    work = tempfile.mkdtemp(prefix="chatcore-eio-")
    data_dir = os.path.join(work, "data")
    sock = os.path.join(work, "s")
    users = ["alice", "bob", "carol", "dave"]
    server = start_socket_server(data_dir, sock)
    alice = Client(sock)
    auth(alice, "alice")
    alice.request({"chatStart": {"cookie": "start", "invitees": [{"userId": u} for u in users[1:]], "subject": "eio"}})
    alice.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "before"}})
    alice.request({"identitiesGet": {"cookie": "x", "appUserIds": ["alice"]}})
    announced = sent_messages(alice.all)
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0

    inject = [STRACE, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync,fdatasync",
              "-e", "inject=fsync,fdatasync:error=EIO"]
    server = start_socket_server(data_dir, sock, prefix=inject)
    try:
        clients = {user: Client(sock) for user in users + ["erin"]}
        for user, client in clients.items():
            client.send({"authToken": {"userId": user, "authToken": "any", "cookie": "auth"}})
        cookies = {user: ["%s-%d" % (user, n) for n in range(200)] for user in users}
        for user in users:
            clients[user].send(*[{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": c, "cookie": c}} for c in cookies[user]])
        assert server.wait(timeout=120) == 1, "the service did not stop after the I/O error"
        stderr = server.stderr.read().decode(errors="replace")
        assert "I/O error" in stderr and "restart chatcore" in stderr, stderr[-2000:]
        for user, client in clients.items():
            assert client.closed.wait(30), "%s's connection stayed open" % user
        for user in users:
            events = clients[user].all
            answered = [c for c in cookies[user] if any(cookie_of(e) == c for e in events)]
            assert answered == cookies[user][:len(answered)], "%s: answers are not a prefix" % user
            for cookie in answered:
                (answer,) = [e for e in events if cookie_of(e) == cookie]
                failure = answer["requestFailed"]
                assert failure["error"] in ("Internal", "NotAuthenticated"), failure
            assert sent_messages(events) == {}, "announced without a sync"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    after = history(data_dir)
    assert sorted(int(i) for i in after) == list(range(1, len(after) + 1)), "message ids are not consecutive"
    for (chat, message_id), content in announced.items():
        assert message_id in after and after[message_id].get("content") == content, message_id
    shutil.rmtree(work, ignore_errors=True)
