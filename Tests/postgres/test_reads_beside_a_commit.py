"""A read that shows only what is durable is answered once it is decided, not once the
commits decided before it are. Here a commit is held for as long as the test says: the
test locks the message table against writes (`LOCK TABLE … IN EXCLUSIVE MODE` in a
transaction it keeps open), which reads go past."""
import time

import pytest

from conftest import chat_with_bob, start, started_chat, stop
from postgres_cluster import PsqlSession, postgres_bin
from chatcore_harness import Client, auth, body

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def sent(events):
    return [element for event in events if event.get("listAdd", {}).get("type") == "chatMessage"
            for element in event["listAdd"]["elements"] if element["tag"] == "Text"]


def test_a_read_of_a_chat_no_commit_changes_is_answered_while_a_commit_waits(cluster, scratch):
    """Before, a read waited for the commit of everything decided before it: beside a
    session sending without pause, each window waited for a commit of the sender's
    messages (window p50 118–163 ms with 20 readers on the 10M-message store). Messages
    of the chat whose commit waits are still answered only after it."""
    cluster.create_database("r")
    process, path = start(cluster, "r", scratch)
    assert path is not None, process.stderr.read().decode()
    alice, carol = Client(path), Client(path)
    locker = None
    try:
        auth(alice, "alice")
        auth(carol, "carol")
        flooded = chat_with_bob(alice, "sends")
        quiet = started_chat(carol.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "dave"}], "subject": "quiet"}}))
        assert len(sent(carol.request({"chatMessageSend": {"chatId": quiet, "tag": "Text", "content": "said before", "cookie": "said"}}))) == 1

        locker = PsqlSession(cluster, "r")
        locker.run("BEGIN; LOCK TABLE message IN EXCLUSIVE MODE;")
        deadline = time.time() + 30
        while cluster.psql("SELECT count(*) FROM pg_locks WHERE relation = 'message'::regclass AND mode = 'ExclusiveLock' AND granted",
                           database="r").strip() == "0":
            assert time.time() < deadline, "the lock was not taken"
            time.sleep(0.05)
        # Two commits wait (PostgreSQL takes two in flight): the first for the lock, the
        # second behind it.
        for n in (1, 2):
            alice.send({"chatMessageSend": {"chatId": flooded, "tag": "Text", "content": f"held back {n}", "cookie": f"held{n}"}})
            deadline = time.time() + 30
            while int(cluster.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'", database="r")) < n:
                assert time.time() < deadline, f"alice's commit {n} did not wait for the lock"
                time.sleep(0.05)

        def read(cookie):
            carol.send({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": quiet}, "window": {"messageId": 100, "before": 10},
                                                "cookie": cookie}})
            window = carol.answer(cookie, timeout=15)
            return [element["content"] for event in window if "listChunk" in event for element in body(event)["elements"] if element["tag"] == "Text"]

        # Decided in a batch of its own, answered at once.
        assert read("w") == ["said before"]
        carol.send({"requestListElements": {"type": "chatMessage", "cookie": "e", "elements": [{"chatId": quiet, "messageId": "2"}]}})
        assert body(carol.answer("e", timeout=15)[-1])["elements"][0]["content"] == "said before"
        # A third send: its batch waits for the first commit before it is handed over, and
        # the engine with it; reads are answered meanwhile.
        alice.send({"chatMessageSend": {"chatId": flooded, "tag": "Text", "content": "held back 3", "cookie": "held3"}})
        time.sleep(0.5)
        assert read("w2") == ["said before"]
        # A read of the chat being committed waits for it, as does the send's answer.
        alice.send({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": flooded}, "window": {"messageId": 100, "before": 10},
                                            "cookie": "f"}})
        time.sleep(0.5)
        assert not any(body(event).get("cookie") in ("held1", "held2", "held3", "f") for event in list(alice.all)
                       if isinstance(body(event), dict)), "an answer came while its commit waited"

        locker.run("COMMIT;")
        locker.end()
        locker = None
        for n in (1, 2, 3):
            assert [element["content"] for element in sent(alice.answer(f"held{n}"))] == [f"held back {n}"]
        assert [element["content"] for event in alice.answer("f") if "listChunk" in event for element in body(event)["elements"]
                if element["tag"] == "Text"] == ["held back 1", "held back 2", "held back 3"]
    finally:
        if locker is not None:
            locker.kill()
        alice.close()
        carol.close()
        assert stop(process) == 0
