"""The PostgreSQL store's own behaviours, against a real cluster each test makes (initdb
in a temporary directory): how it is named and authenticated, one process per database,
and PostgreSQL restarted or out of disk under load. Every transcript and Python test also runs against
it (Tests/postgres/run.py)."""
import base64
import os
import pwd
import subprocess
import threading
import time

import pytest

from conftest import chat_with_bob, node_key_file, real_binary, start, stop, user_on
from postgres_cluster import postgres_bin
from chatcore_harness import Client, auth, body, small_tmpfs

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def test_a_store_url_with_a_password_is_refused(cluster, scratch):
    cluster.create_database("a")
    url = f"postgres://chatcore:secret@/a?host={cluster.socket_directory}"
    process, socket_path = start(cluster, "a", scratch, url=url)
    assert socket_path is None and process.wait(timeout=30) == 1
    assert b"--store must not carry a password" in process.stderr.read()


def test_the_password_comes_from_a_file_or_the_environment(cluster, scratch):
    cluster.create_database("p")
    cluster.psql("CREATE ROLE node LOGIN PASSWORD 'correct horse'; GRANT ALL ON DATABASE p TO node; ALTER DATABASE p OWNER TO node")
    hba = os.path.join(cluster.directory, "data", "pg_hba.conf")
    with open(hba) as f:
        rules = f.read()
    with open(hba, "w") as f:
        f.write("local all node scram-sha-256\n" + rules)
    cluster.pg_ctl("reload")
    time.sleep(0.5)
    url = f"postgres://node@/p?host={cluster.socket_directory}"

    process, socket_path = start(cluster, "p", scratch, url=url)
    assert socket_path is None and process.wait(timeout=60) == 1, "no password: refused by the server"
    said = process.stderr.read()
    assert b"cannot open the store" in said
    # Not tried again and again, as if the server might let it in by waiting.
    assert b"trying again" not in said, said.decode(errors="replace")

    password_file = os.path.join(scratch, "password")
    with open(password_file, "w") as f:
        f.write("correct horse\n")
    process, socket_path = start(cluster, "p", scratch, "--store-password-file", password_file, url=url)
    assert socket_path is not None, process.stderr.read().decode()
    client = Client(socket_path)
    auth(client, "alice")
    client.close()
    assert stop(process) == 0

    process, socket_path = start(cluster, "p", scratch, url=url, environment={"PGPASSWORD": "correct horse"})
    assert socket_path is not None, process.stderr.read().decode()
    assert stop(process) == 0


def test_one_process_writes_a_database_and_one_that_cannot_relay_says_why(cluster, scratch):
    cluster.create_database("one")
    first, first_socket = start(cluster, "one", scratch)
    assert first_socket is not None
    # A node relays either its standard input/output (without --listen: see
    # Tests/postgres/test_nodes.py) or its socket connections, not both.
    second = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "second"), "--user", "bob",
                             "--listen", "unix:" + os.path.join(scratch, "second.sock"), "--insecure-no-auth", "--store", cluster.database_url("one")],
                            input=b"", capture_output=True, timeout=60)
    assert second.returncode == 1
    assert b"another chatcore process is serving the database" in second.stderr
    assert b"not both" in second.stderr
    # Without --listen its session is relayed: an input that is over at once is answered
    # (nothing) and the process ends.
    third = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "third"), "--user", "bob",
                            "--store", cluster.database_url("one"), "--node-key-file", node_key_file()], input=b"", capture_output=True, timeout=60)
    assert third.returncode == 0, third.stderr
    assert b"relaying standard input/output to it" in third.stderr
    assert stop(first) == 0
    # Once the first is gone, the database can be served again, with what it had.
    fourth, fourth_socket = start(cluster, "one", scratch)
    assert fourth_socket is not None
    assert stop(fourth) == 0


def test_postgresql_restarted_under_load_loses_and_duplicates_nothing(cluster, scratch):
    process, alice = _alice_on(cluster, "restart", scratch)
    chat = chat_with_bob(alice, "load")

    sent = {}
    stop_sending = threading.Event()

    def send_all():
        number = 0
        while not stop_sending.is_set() and number < 4000:
            number += 1
            message_id = _send_burst(alice, [(f"s{number}", chat, f"m{number}")])[0]
            if message_id is not None:
                sent[f"m{number}"] = str(message_id)

    sender = threading.Thread(target=send_all)
    sender.start()
    time.sleep(1.0)
    cluster.pg_ctl("-m", "fast", "-w", "restart")
    time.sleep(2.0)
    stop_sending.set()
    sender.join(timeout=120)
    assert not sender.is_alive()
    assert_still_serving(process)
    # Sends in flight when the server went away are answered Internal ("not confirmed");
    # the others waited for it to come back.
    count_after = len(sent)
    # It serves on: one more send is announced.
    answer = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    assert any(body(e).get("cookie") == "after" and "listAdd" in e for e in answer), answer
    alice.close()
    assert stop(process) == 0

    # Everything announced Sent is there, once, with the id it was announced with; ids
    # are consecutive.
    rows = cluster.psql(f"SELECT id, content FROM message WHERE chat = {int(chat)} AND tag = 'Text' ORDER BY id", database="restart").split()
    stored = dict(row.split("|")[::-1] for row in rows)
    for content, message_id in sent.items():
        assert stored.get(content) == message_id, (content, message_id)
    contents = [row.split("|")[1] for row in rows]
    assert len(contents) == len(set(contents)), "no message stored twice"
    ids = [int(row.split("|")[0]) for row in rows]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "ids consecutive"
    assert count_after > 0


def assert_still_serving(process):
    """`process` (started by `start`) has not exited; if it has, its log says why."""
    assert process.poll() is None, "chatcore stopped after the restart:\n" + process.stderr.read().decode(errors="replace")[-6000:]


def test_postgresql_restarted_under_pipelined_load_keeps_every_send_announced(cluster, scratch):
    # As above, with three users pipelining bursts into two chats each, so that two
    # commits may be in flight (the one behind in a transaction block of its own) when
    # the server goes. Whatever was announced Sent is stored once, with the id it was
    # announced with, and each sender saw its ids in order; each chat's ids are
    # consecutive. A send answered Internal may be stored (its commit's answer was lost
    # with the connection: "not confirmed"), but only once. The moment of the restart
    # decides which commit it hits: the deterministic guards of a commit refused at its
    # end are test_a_commit_that_fails_at_its_end_is_not_announced's.
    process, clients, chats, member_of = _three_users_in_three_chats(cluster, "pipelined", scratch)
    users = list(clients)
    announced = {user: [] for user in users}
    stop_sending = threading.Event()

    def run(user):
        n = 0
        while not stop_sending.is_set():
            burst = [(f"{user}{k}", member_of[user][k % 2], f"{user}-{k}") for k in range(n, n + 20)]
            n += 20
            for (_, chat, content), message_id in zip(burst, _send_burst(clients[user], burst)):
                if message_id is not None:
                    announced[user].append((chat, content, message_id))

    threads = [threading.Thread(target=run, args=(user,)) for user in users]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    cluster.pg_ctl("-m", "fast", "-w", "restart")
    time.sleep(2.0)
    stop_sending.set()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive()
    assert_still_serving(process)
    for client in clients.values():
        client.close()
    assert stop(process) == 0

    rows = cluster.psql("SELECT chat, id, content FROM message WHERE tag = 'Text' ORDER BY chat, id", database="pipelined").splitlines()
    stored = [(row.split("|")[0], int(row.split("|")[1]), row.split("|")[2]) for row in rows]
    where = {content: (chat, message_id) for chat, message_id, content in stored}
    assert len(where) == len(stored), "no message stored twice"
    for user in users:
        assert len(announced[user]) > 0
        for chat, content, message_id in announced[user]:
            assert where.get(content) == (chat, message_id), (content, chat, message_id, where.get(content))
        for chat in member_of[user]:
            ids = [message_id for c, _, message_id in announced[user] if c == chat]
            assert ids == sorted(ids), (user, chat)
    for chat in chats:
        ids = [message_id for c, message_id, _ in stored if c == chat]
        assert ids == list(range(ids[0], ids[0] + len(ids))), (chat, "ids consecutive")


def test_a_statement_failing_inside_a_commit_applies_nothing_of_it(cluster, scratch):
    # A trigger makes PostgreSQL refuse one message in the middle of a batch's statements
    # (which are all sent before any answer is read): the whole batch is answered
    # Internal, nothing of it is stored, and the service goes on.
    cluster.create_database("fault")
    process, socket_path = start(cluster, "fault", scratch)
    alice = Client(socket_path)
    auth(alice, "alice")
    chat = chat_with_bob(alice, "faults")
    cluster.psql("""
        CREATE FUNCTION refuse_boom() RETURNS trigger AS $$
        BEGIN IF NEW.content = 'boom' THEN RAISE EXCEPTION 'refused on purpose'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql;
        CREATE TRIGGER refuse_boom BEFORE INSERT ON message FOR EACH ROW EXECUTE FUNCTION refuse_boom();
        """, database="fault")
    alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "before", "cookie": "b1"}},
               {"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "boom", "cookie": "b2"}},
               {"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "beside", "cookie": "b3"}})
    outcomes = {cookie: _outcome(alice, cookie) for cookie in ("b1", "b2", "b3")}
    assert outcomes["b2"] == "Internal"
    stored = set(cluster.psql(f"SELECT content FROM message WHERE chat = {int(chat)} AND tag = 'Text'", database="fault").split())
    assert "boom" not in stored
    for cookie, content in (("b1", "before"), ("b3", "beside")):
        assert (outcomes[cookie] == "listAdd") == (content in stored), (cookie, outcomes, stored)
    answer = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    assert any("listAdd" in e and body(e).get("cookie") == "after" for e in answer)
    alice.close()
    assert stop(process) == 0


def test_a_commit_that_fails_at_its_end_is_not_announced(cluster, scratch):
    # A commit's statement runs as one implicit transaction, which PostgreSQL commits only
    # when it reaches the statement's Sync, after it has said the statement is complete.
    # A deferred trigger refuses the transaction there (as a server stopped at that moment
    # ends it): the send must be answered Internal, not Sent, and its id stays free.
    process, alice = _alice_on(cluster, "late", scratch)
    chat = chat_with_bob(alice, "late faults")
    cluster.psql("""
        CREATE FUNCTION refuse_late() RETURNS trigger AS $$
        BEGIN IF NEW.content = 'late boom' THEN RAISE EXCEPTION 'refused at commit on purpose'; END IF; RETURN NULL; END $$ LANGUAGE plpgsql;
        CREATE CONSTRAINT TRIGGER refuse_late AFTER INSERT ON message DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION refuse_late();
        """, database="late")
    def sent(content):
        """The id `content` was announced Sent with, or None (answered Internal)."""
        return _send_burst(alice, [(content, chat, content)])[0]

    before_id = sent("before")
    assert sent("late boom") is None
    after_id = sent("after")
    assert after_id == before_id + 1, "the refused message's id was not kept"
    # Behind a commit still running (held by a slow insert), a batch commits in a
    # transaction block of its own, whose COMMIT reports the refusal.
    _slow_inserts(cluster, "late")
    alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "slow one", "cookie": "slow"}})
    time.sleep(0.3)
    alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "late boom", "cookie": "behind"}})
    assert (_outcome(alice, "slow"), _outcome(alice, "behind")) == ("listAdd", "Internal")
    assert sent("last") == after_id + 2
    alice.close()
    assert stop(process) == 0
    rows = cluster.psql(f"SELECT id, content FROM message WHERE chat = {int(chat)} AND tag = 'Text' ORDER BY id", database="late").strip().split("\n")
    assert rows == [f"{before_id}|before", f"{after_id}|after", f"{after_id + 1}|slow one", f"{after_id + 2}|last"]


def test_a_store_of_the_previous_release_is_migrated_and_each_writer_takes_the_next_epoch(cluster, scratch):
    cluster.create_database("epoch")
    process, socket_path = start(cluster, "epoch", scratch)
    client = Client(socket_path)
    auth(client, "alice")
    chat = chat_with_bob(client, "kept")
    client.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "one", "cookie": "one"}})
    client.close()
    assert stop(process) == 0
    assert cluster.psql("SELECT epoch FROM writer_epoch", database="epoch").strip() == "1"
    # What the release before the writer epoch left: its two migrations only.
    cluster.psql("DROP FUNCTION chatcore_fence(bigint); DROP TABLE writer_epoch, writer_beat; DELETE FROM chatcore_migration WHERE name = 'v3-writer-epoch'",
                 database="epoch")
    for expected in ("1", "2"):
        with user_on(cluster, "epoch", scratch) as client:
            sent = client.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "again", "cookie": "again"}})
            assert any("listAdd" in e and body(e).get("cookie") == "again" for e in sent), sent
        assert cluster.psql("SELECT epoch FROM writer_epoch", database="epoch").strip() == expected
    applied = cluster.psql("SELECT name FROM chatcore_migration", database="epoch").split()
    assert sorted(applied, key=lambda name: int(name[1:].split("-")[0])) == [
        "v1-chatcore", "v2-writer-address", "v3-writer-epoch", "v4-node-credential", "v5-search-in-the-database", "v6-chat-versions",
        "v7-numbers", "v8-claims-in-chat-order", "v9-all-nodes-decide", "v10-notify-followers",
        "v11-no-credential-in-the-database", "v12-external-ids", "v13-reactions", "v14-mentions", "v15-pins", "v16-notifications",
        "v17-moderation"]
    contents = cluster.psql(f"SELECT content FROM message WHERE chat = {int(chat)} AND tag = 'Text' ORDER BY id", database="epoch").split("\n")
    assert [c for c in contents if c] == ["one", "again", "again"]


def test_a_database_whose_collation_is_not_bytewise_gives_the_same_order(cluster, scratch):
    # A database made with a language's collation (ICU en-US: 'quote' before 'Thread')
    # must not change what a message looks like once it is read back from the store: its
    # references are in the order memory keeps them (bytewise, as in SQLite).
    cluster.psql("CREATE DATABASE \"icu\" TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'")
    process, socket_path = start(cluster, "icu", scratch, "--cache-mb", "0")
    alice = Client(socket_path)
    auth(alice, "alice")
    chat = chat_with_bob(alice, "order")
    alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "first", "cookie": "f"}})
    refs = [{"tag": tag, "messageId": "2"} for tag in ("Thread", "quote", "Quote")]
    sent = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "second", "ref": refs, "cookie": "s"}})
    announced = next(body(e)["elements"][0]["ref"] for e in sent if "listAdd" in e and body(e).get("cookie") == "s")
    assert [r["tag"] for r in announced] == ["Quote", "Thread", "quote"]
    window = alice.request({"requestListElements": {"cookie": "w", "type": "chatMessage", "elements": [{"chatId": chat, "messageId": "3"}]}})
    read_back = next(body(e)["elements"][0]["ref"] for e in window if "listChunk" in e)
    assert read_back == announced
    alice.close()
    assert stop(process) == 0


def _alice_on(cluster, database, scratch):
    """chatcore serving a new database `database`, and alice connected to it."""
    cluster.create_database(database)
    process, socket_path = start(cluster, database, scratch)
    alice = Client(socket_path)
    auth(alice, "alice")
    return process, alice


@pytest.fixture
def small_tablespace(cluster):
    """A tablespace on a 3 MB tmpfs (root only): its tables fill it, while PostgreSQL's
    WAL and the rest of the cluster stay on the big disk. Yields (name, mount)."""
    with small_tmpfs("3m", prefix="chatcore-pg-full-") as mount:
        if mount is None:
            pytest.skip("cannot mount a tmpfs here (it needs root)")
        owner = pwd.getpwnam("postgres")
        os.chown(mount, owner.pw_uid, owner.pw_gid)
        cluster.psql(f"CREATE TABLESPACE small LOCATION '{mount}'")
        yield "small", mount


def test_postgresql_out_of_disk_answers_internal_and_serves_again_once_space_is_freed(cluster, scratch, small_tablespace):
    # The message table lives on a small filesystem that fills up under pipelined sends of
    # incompressible text. Every send gets exactly one answer; what failed is answered
    # Internal with PostgreSQL's reason and is nowhere in the store; everything announced
    # Sent is, with its id; ids stay consecutive; and once space is freed the same
    # process serves on.
    tablespace, mount = small_tablespace
    process, alice = _alice_on(cluster, "full", scratch)
    chat = chat_with_bob(alice, "full")
    cluster.psql(f"ALTER TABLE message SET TABLESPACE {tablespace}", database="full")

    sent, failed, reasons = {}, [], set()
    number = 0

    def burst(count):
        nonlocal number
        cookies = []
        for _ in range(count):
            number += 1
            content = f"m{number} " + base64.b64encode(os.urandom(6000)).decode()
            cookies.append((f"s{number}", content))
            alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": content, "cookie": f"s{number}"}})
        for cookie, content in cookies:
            answers = [e for e in alice.answer(cookie, timeout=60) if body(e).get("cookie") == cookie]
            assert len(answers) == 1, answers
            name, value = next(iter(answers[0].items()))
            if name == "listAdd":
                sent[content] = value["elements"][0]["messageId"]
            else:
                assert name == "requestFailed" and value["error"] == "Internal", answers
                failed.append(content)
                reasons.add(value["reason"])

    while len(failed) < 40 and number < 2000:
        burst(20)
    assert len(failed) >= 40, f"the tablespace never filled ({len(sent)} sent)"
    assert process.poll() is None, "chatcore went on"
    assert any("out of resources" in reason for reason in reasons), reasons

    subprocess.run(["mount", "-o", "remount,size=64m", mount], check=True)
    before = len(sent)
    burst(20)
    assert len(sent) == before + 20, "every send is announced once space is freed"
    alice.close()
    assert stop(process) == 0

    rows = cluster.psql(f"SELECT id, split_part(content, ' ', 1) FROM message WHERE chat = {int(chat)} AND tag = 'Text' ORDER BY id",
                        database="full").split()
    stored = {row.split("|")[1]: row.split("|")[0] for row in rows}
    for content, message_id in sent.items():
        assert stored.get(content.split(" ")[0]) == message_id, (content[:8], message_id)
    for content in failed:
        assert content.split(" ")[0] not in stored, f"{content[:8]} was answered Internal but stored"
    ids = [int(row.split("|")[0]) for row in rows]
    assert ids == list(range(ids[0], ids[0] + len(ids))), "ids consecutive"
    assert len(ids) == len(sent)


def _slow_inserts(cluster, database):
    """Triggers hold a commit that inserts a message whose content starts with 'slow', or
    a chat whose subject does, for a second; a message 'slow boom' is then refused."""
    cluster.psql("""
        CREATE FUNCTION slow_message() RETURNS trigger AS $$
        BEGIN
            IF NEW.content LIKE 'slow%' THEN PERFORM pg_sleep(1); END IF;
            IF NEW.content = 'slow boom' THEN RAISE EXCEPTION 'refused on purpose'; END IF;
            RETURN NEW;
        END $$ LANGUAGE plpgsql;
        CREATE FUNCTION slow_chat() RETURNS trigger AS $$
        BEGIN IF NEW.subject LIKE 'slow%' THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END $$ LANGUAGE plpgsql;
        CREATE TRIGGER slow_message BEFORE INSERT ON message FOR EACH ROW EXECUTE FUNCTION slow_message();
        CREATE TRIGGER slow_chat BEFORE INSERT ON chat FOR EACH ROW EXECUTE FUNCTION slow_chat();
        """, database=database)


def _outcome(client, cookie):
    """How the request with `cookie` was answered: the answer's name, or its error."""
    for event in client.answer(cookie, timeout=60):
        name, value = next(iter(event.items()))
        if value.get("cookie") == cookie:
            return name if name != "requestFailed" else value["error"]


def test_a_commit_decided_behind_one_that_fails_is_not_applied(cluster, scratch):
    # While a batch commits, the next is handed over (two commits in flight). The first
    # fails: the second was decided on memory holding the first's changes, so nothing of
    # it may land either, though it touches another chat; both are answered Internal,
    # and the ids they would have taken are taken by the next sends.
    process, alice = _alice_on(cluster, "chain", scratch)
    first = chat_with_bob(alice, "first")
    second = _started(alice, "carol", "second")
    _slow_inserts(cluster, "chain")
    alice.send({"chatMessageSend": {"chatId": first, "tag": "Text", "content": "slow boom", "cookie": "boom"}})
    time.sleep(0.3)
    alice.send({"chatMessageSend": {"chatId": second, "tag": "Text", "content": "behind", "cookie": "behind"}})
    assert _outcome(alice, "boom") == "Internal"
    assert _outcome(alice, "behind") == "Internal"
    stored = cluster.psql("SELECT content FROM message WHERE tag = 'Text'", database="chain").split()
    assert stored == [], stored
    assert process.poll() is None
    for chat in (first, second):
        answer = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after" + chat}})
        assert any("listAdd" in e and body(e).get("cookie") == "after" + chat for e in answer), answer
    alice.close()
    assert stop(process) == 0
    for chat in (first, second):
        ids = [int(i) for i in cluster.psql(f"SELECT id FROM message WHERE chat = {int(chat)} ORDER BY id", database="chain").split()]
        assert ids == list(range(1, len(ids) + 1)), (chat, ids)


def test_a_message_sent_while_its_chat_is_still_being_committed_lands_after_it(cluster, scratch):
    # The chat's commit is held for a second; a message sent into it meanwhile is decided
    # and handed over behind it. It must update the chat and member rows that commit
    # inserts (not insert them again), and its events come after the chat's.
    process, alice = _alice_on(cluster, "behind", scratch)
    chat_with_bob(alice, "warm up")
    _slow_inserts(cluster, "behind")
    alice.send({"chatStart": {"cookie": "slow", "invitees": [{"userId": "bob"}], "subject": "slow chat"}})
    time.sleep(0.3)
    alice.send({"chatMessageSend": {"chatId": "2", "tag": "Text", "content": "hello", "cookie": "hello"}})
    events = alice.answer("hello", timeout=60)
    names = [(next(iter(e)), body(e).get("type"), body(e).get("cookie")) for e in events]
    assert ("listAdd", "chat", "slow") in names, names
    assert names.index(("listAdd", "chat", "slow")) < names.index(("listAdd", "chatMessage", "hello")), names
    alice.close()
    assert stop(process) == 0
    assert cluster.psql('SELECT "lastMessage" FROM chat WHERE "number" = 2', database="behind").strip() == \
        cluster.psql("SELECT max(id) FROM message WHERE chat = 2", database="behind").strip()
    assert cluster.psql("SELECT content FROM message WHERE chat = 2 AND tag = 'Text'", database="behind").split() == ["hello"]


def _started(client, invitee, subject):
    """The chatId of a chat `client` starts with `invitee` (found by its cookie: other
    events may come first)."""
    events = client.request({"chatStart": {"cookie": subject, "invitees": [{"userId": invitee}], "subject": subject}})
    return next(body(e)["elements"][0]["chatId"] for e in events if "listAdd" in e and body(e).get("cookie") == subject)


def _three_users_in_three_chats(cluster, database, scratch):
    """chatcore serving a new database `database`, with alice, bob and carol connected and
    three chats, each user in two: (process, clients by user, chats, each user's chats)."""
    cluster.create_database(database)
    process, socket_path = start(cluster, database, scratch)
    clients = {user: Client(socket_path) for user in ("alice", "bob", "carol")}
    for user, client in clients.items():
        auth(client, user)
    chats = [chat_with_bob(clients["alice"], "ab"), _started(clients["carol"], "alice", "ca"), _started(clients["bob"], "carol", "bc")]
    return process, clients, chats, {"alice": chats[:2], "bob": [chats[0], chats[2]], "carol": chats[1:]}


def _send_burst(client, burst):
    """Pipelines the sends of `burst` ((cookie, chat, content) each), then reads their
    answers, one each: the messageId each was announced Sent with, or None for Internal."""
    client.send(*({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": content, "cookie": cookie}} for cookie, chat, content in burst))
    ids = []
    for cookie, _, _ in burst:
        answers = [e for e in client.answer(cookie, timeout=60) if body(e).get("cookie") == cookie]
        assert len(answers) == 1, answers
        name, value = next(iter(answers[0].items()))
        if name == "listAdd":
            ids.append(int(value["elements"][0]["messageId"]))
        else:
            assert value["error"] == "Internal", value
            ids.append(None)
    return ids


def test_random_statement_failures_under_pipelined_load_keep_every_answer_true(cluster, scratch):
    # Two commits in flight, and PostgreSQL refuses about one message in a hundred (a
    # trigger), so batches fail while the next is committing behind them. Three users
    # pipeline sends into three chats. Whatever was answered Sent is stored with the id it
    # was announced with; whatever was answered Internal is not stored; every send has
    # one answer; each chat's ids are 1..N; and each sender saw its Sent ids in order.
    process, clients, chats, member_of = _three_users_in_three_chats(cluster, "chaos", scratch)
    users = list(clients)
    cluster.psql("""
        CREATE FUNCTION refuse_some() RETURNS trigger AS $$
        BEGIN
            -- Slowly, so that the batch behind is in flight when it fails.
            IF NEW.content LIKE '%refuse%' THEN PERFORM pg_sleep(0.05); RAISE EXCEPTION 'refused on purpose'; END IF;
            RETURN NEW;
        END $$ LANGUAGE plpgsql;
        CREATE TRIGGER refuse_some BEFORE INSERT ON message FOR EACH ROW EXECUTE FUNCTION refuse_some();
        """, database="chaos")
    outcomes = {user: [] for user in users}

    def run(user):
        for start_at in range(0, 300, 20):
            burst = [(f"{user}{n}", member_of[user][n % 2], f"{user}-{n}" + (" refuse" if n % 97 == 13 + len(user) else ""))
                     for n in range(start_at, start_at + 20)]
            for (_, chat, content), message_id in zip(burst, _send_burst(clients[user], burst)):
                outcomes[user].append((chat, content, message_id))

    threads = [threading.Thread(target=run, args=(user,)) for user in users]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert process.poll() is None
    for client in clients.values():
        client.close()
    assert stop(process) == 0

    rows = cluster.psql("SELECT chat, id, content FROM message WHERE tag = 'Text' ORDER BY chat, id", database="chaos").splitlines()
    stored = {(row.split("|")[0], row.split("|")[2]): int(row.split("|")[1]) for row in rows}
    failed = sum(1 for user in users for _, _, i in outcomes[user] if i is None)
    assert failed > 0, "nothing failed: the trigger did not bite"
    for user in users:
        for chat, content, message_id in outcomes[user]:
            assert stored.get((chat, content)) == message_id, (user, chat, content, message_id)
        for chat in member_of[user]:
            ids = [i for c, _, i in outcomes[user] if c == chat and i is not None]
            assert ids == sorted(ids), (user, chat, ids)
    for chat in chats:
        ids = [int(row) for row in cluster.psql(f"SELECT id FROM message WHERE chat = {int(chat)} ORDER BY id", database="chaos").split()]
        assert ids == list(range(1, len(ids) + 1)), (chat, ids)


def test_commits_are_durable_when_the_database_sets_synchronous_commit_off(scratch):
    """`ALTER DATABASE … SET synchronous_commit = off` (or the same on the role) makes
    PostgreSQL answer a commit before its WAL is written: a crash of the server then loses
    commits chatcore already announced Sent. chatcore sets it on for its connections."""
    from postgres_cluster import Cluster
    # The WAL writer waits 10 s between its rounds: a commit not flushed by its own
    # backend stays in PostgreSQL's memory that long, and an immediate stop loses it.
    with Cluster(settings=("fsync=off", "wal_writer_delay=10000ms", "wal_writer_flush_after=0")) as cluster:
        cluster.create_database("async")
        cluster.psql('ALTER DATABASE "async" SET synchronous_commit = off')
        process, socket_path = start(cluster, "async", scratch)
        assert socket_path is not None, process.stderr.read().decode()
        alice = Client(socket_path)
        auth(alice, "alice")
        chat = chat_with_bob(alice, "durable")
        for n in range(20):
            answer = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"m{n}", "cookie": f"m{n}"}})
            assert any("listAdd" in e and body(e).get("cookie") == f"m{n}" for e in answer), answer
        # PostgreSQL dies at once (as in a crash: nothing in its memory is written).
        cluster.pg_ctl("-m", "immediate", "-w", "restart")
        stored = cluster.psql(f"SELECT count(*) FROM message WHERE chat = {int(chat)} AND tag = 'Text'", database="async").strip()
        assert stored == "20", f"{stored} of 20 announced messages survived the crash"
        alice.close()
        process.kill()
        process.wait()
        assert b"synchronous_commit = off" in process.stderr.read()
