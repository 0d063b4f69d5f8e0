"""The search index on PostgreSQL: in the database, written by each commit. It finds what
the SQLite index finds (Tests/python runs every search test against it too); these tests
check what is its own: a store from before it gets an index of its old messages, a recall
takes the message out of it in the recall's own commit, and every node shares it."""
import os
import random
import string
import subprocess
import tempfile
import threading
import time

import pytest

from conftest import BOUND_SCALE, chat_with_bob, real_binary, search_ids, start, stop
from postgres_cluster import postgres_bin
from chatcore_harness import Client, auth, body

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")

TEXTS = ["Le café est prêt", "ΟΔΥΣΣΕΥΣ came home", "party time 🎉", "plain old ascii", "ok"]


def _send(client, chat, content, cookie):
    sent = client.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": content, "cookie": cookie}})
    return next(body(e)["elements"][0]["messageId"] for e in sent if "listAdd" in e and body(e).get("cookie") == cookie)


def _alice_on(cluster, scratch, database):
    """chatcore serving `database`, and alice connected to it."""
    process, socket_path = start(cluster, database, scratch)
    assert socket_path is not None, process.stderr.read().decode()
    alice = Client(socket_path)
    auth(alice, "alice")
    return process, alice


def _searches(client, ids):
    """What each query finds, against what it should (by the ids of TEXTS)."""
    queries = {"CAFÉ": [ids[0]], "é": [ids[0]], "οδυσσευσ": [ids[1]], "🎉": [ids[2]], "y t": [ids[2]], "OLD": [ids[3]],
               "ok": [ids[4]], "o": sorted([ids[1], ids[3], ids[4]]), "missing": []}
    return {query: search_ids(client, query) for query in queries}, queries


def test_a_store_from_before_the_index_gets_its_old_messages_indexed_once(cluster, scratch):
    cluster.create_database("old")
    process, alice = _alice_on(cluster, scratch, "old")
    chat = chat_with_bob(alice, "history")
    ids = [_send(alice, chat, text, f"m{n}") for n, text in enumerate(TEXTS)]
    alice.close()
    assert stop(process) == 0
    # What the release before the index left: no index, no migration of it, and none of
    # the later sequences (v7), but the counter of search rows they replaced.
    cluster.psql("DROP TABLE message_search; DELETE FROM counter WHERE name LIKE 'searchIndex%'; "
                 "INSERT INTO counter (name, value) SELECT 'searchRow', max(\"searchRow\") FROM message; "
                 "DROP SEQUENCE chat_number, user_number, search_row; "
                 "DELETE FROM chatcore_migration WHERE name IN ('v5-search-in-the-database', 'v7-numbers')", database="old")

    process, alice = _alice_on(cluster, scratch, "old")
    found, expected = _searches(alice, ids)
    assert found == expected
    newer = _send(alice, chat, "a newer café", "new")
    assert search_ids(alice, "café") == sorted([ids[0], newer])
    alice.close()
    assert stop(process) == 0
    assert b"the search index lacks messages" in process.stderr.read()
    assert cluster.psql("SELECT count(*) FROM message_search", database="old").strip() == str(len(TEXTS) + 1)

    # Indexed once: the next start has nothing to add.
    process, alice = _alice_on(cluster, scratch, "old")
    assert search_ids(alice, "café") == sorted([ids[0], newer])
    alice.close()
    assert stop(process) == 0
    assert b"the search index lacks messages" not in process.stderr.read()


def test_a_recall_takes_the_message_out_of_the_index_in_its_own_commit(cluster, scratch):
    cluster.create_database("recall")
    process, alice = _alice_on(cluster, scratch, "recall")
    chat = chat_with_bob(alice, "secrets")
    secret = _send(alice, chat, "the launch code is swordfish", "s")
    kept = _send(alice, chat, "the launch is at noon", "k")
    assert search_ids(alice, "launch") == sorted([secret, kept])
    alice.send({"chatMessageDestroy": {"chatId": chat, "messageId": secret}})  # no answer: the search after it is
    assert search_ids(alice, "launch") == [kept]
    rows = cluster.psql("SELECT id FROM message_search ORDER BY id", database="recall").split()
    assert secret not in rows and kept in rows
    alice.close()
    assert stop(process) == 0


def test_a_search_reads_back_window_by_window_past_candidates_that_do_not_match(cluster, scratch):
    """A search reads the newest search rows first, a window at a time (16,384 rows, then
    four times more each time), and a window page by page. The message sought is the
    oldest, 17,500 rows back (past the first window), behind 500 newer candidates that have
    the query's keys but not its text (more than one page of them)."""
    cluster.create_database("windows")
    process, alice = _alice_on(cluster, scratch, "windows")
    chat = chat_with_bob(alice, "long")
    sought = _send(alice, chat, "abcXabc", "sought")
    # "abc cXa" has the keys of "abcXabc" (abc, cXa), not the text.
    alice.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "abc cXa"}} for _ in range(500)])
    alice.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"entry {n}"}} for n in range(17_000)])
    last = _send(alice, chat, "the newest entry", "last")
    assert int(last) == int(sought) + 17_501
    # Asking for one hit, the index reads 256 candidates at a time.
    one = alice.request({"search": {"cookie": "one", "text": "abcXabc", "suggestedMaxResults": 1}})
    assert [key["messageId"] for key in body(one[-1])["messages"]] == [sought]
    newest = alice.request({"search": {"cookie": "n", "text": "entry", "suggestedMaxResults": 3}})
    assert [key["messageId"] for key in body(newest[-1])["messages"]] == [last, str(int(last) - 1), str(int(last) - 2)]
    alice.close()
    assert stop(process) == 0


def _random_text(length, rng):
    alphabet = string.ascii_letters + string.digits + " .,;:!?-_()[]{}@#$%^&*+=/<>"
    return "".join(rng.choice(alphabet) for _ in range(length))


def test_a_message_with_too_many_keys_is_still_found(cluster, scratch):
    """A text with more than 4,096 keys (20 KB of random text here) is filed under a key
    of its own that every query reads too; its words are found like any other's."""
    rng = random.Random(5)
    cluster.create_database("long")
    process, alice = _alice_on(cluster, scratch, "long")
    chat = chat_with_bob(alice, "long")
    text = _random_text(20_000, rng)
    long = _send(alice, chat, text, "long")
    short = _send(alice, chat, "short and sweet", "short")
    assert search_ids(alice, text[12_345:12_360].upper()) == [long]
    assert search_ids(alice, "sweet") == [short]
    assert search_ids(alice, "zzzzqqqq") == []
    assert cluster.psql(f"SELECT array_length(keys, 1) FROM message_search WHERE id = {long}", database="long").strip() == "2"
    alice.close()
    assert stop(process) == 0


def test_long_random_texts_do_not_make_a_commit_hold_their_keys(cluster, scratch):
    """300 sends of 70 KB of random text (70,000 keys each) through standard input: the
    keys of a batch's messages were held whole, twice (the array and its encoding), up to
    193 MB at the peak (release build; 177 MB in a debug build); 53 MB once such a text
    has one key."""
    rng = random.Random(6)
    database = cluster.create_database("flood")
    server = subprocess.Popen([real_binary(), "serve", "--user", "alice", "--data-dir", os.path.join(scratch, "flood"),
                               "--store", cluster.database_url(database)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = [0]

    def watch():
        while server.poll() is None:
            try:
                with open(f"/proc/{server.pid}/status") as status:
                    peak[0] = max(peak[0], next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM:")))
            except (OSError, StopIteration):
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    server.stdin.write(b'{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"flood"}}\n')
    for _ in range(300):
        server.stdin.write(('{"chatMessageSend":{"chatId":"1","tag":"Text","content":"' + _random_text(70_000, rng).replace("\\", "") + '"}}\n').encode())
    server.stdin.close()
    assert server.wait(timeout=300) == 0
    watcher.join()
    assert cluster.psql("SELECT count(*) FROM message_search", database=database).strip() == "300"
    # ThreadSanitizer's shadow memory (`make tsan`) makes the bound meaningless there.
    assert peak[0] < 120 * BOUND_SCALE, f"{peak[0]} MB at the peak"


def test_commits_after_the_refill_leave_its_record_alone(cluster, scratch):
    """The engine hands the index what each commit wrote; a commit has written it to
    the index itself. The index used to record the refill's end for it anyway: a write
    of the counter on the engine thread after every commit (and, during a refill, a
    record that the refill was done)."""
    cluster.create_database("record")
    process, alice = _alice_on(cluster, scratch, "record")
    chat = chat_with_bob(alice, "quiet")
    before = cluster.psql("SELECT xmin FROM counter WHERE name = 'searchIndexUpTo'", database="record").strip()
    ids = [_send(alice, chat, f"message {n}", f"m{n}") for n in range(20)]
    assert cluster.psql("SELECT xmin FROM counter WHERE name = 'searchIndexUpTo'", database="record").strip() == before
    assert search_ids(alice, "message 7") == [ids[7]]
    alice.close()
    assert stop(process) == 0
