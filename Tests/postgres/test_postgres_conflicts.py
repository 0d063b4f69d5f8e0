"""A commit that loses to another node's. Each chat has a version in the database
(`chat_version`); every commit moves on the versions of the chats it changes from the ones
its decisions were made on, and a commit that finds one moved on is decided again on what
the database has then, instead of being answered Internal. "Another node" here is SQL run
beside the node, committing what a second deciding node would."""
import random
import threading
import time

import pytest

from conftest import chat_with_bob, search_ids, start, started_chat, stop, user_on
from postgres_cluster import PsqlSession, free_port, postgres_bin
from chatcore_harness import Client, auth, body, scrape

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def send(client, chat, content, cookie):
    """chatMessageSend; returns (the message ids of the chatMessage listAdds, the requestFailed answers)."""
    events = client.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": content, "cookie": cookie}})
    added = [element["messageId"] for event in events if "listAdd" in event and event["listAdd"]["type"] == "chatMessage"
             for element in event["listAdd"]["elements"] if element["tag"] == "Text"]
    return added, [event for event in events if "requestFailed" in event]


def chat_element(client, chat):
    events = client.request({"requestListElements": {"type": "chat", "cookie": "e", "elements": [{"chatId": chat}]}})
    return next(event["listChunk"]["elements"][0] for event in events if "listChunk" in event)


def test_a_send_into_a_chat_another_node_moved_on_is_decided_again_on_what_the_database_has(cluster, scratch):
    cluster.create_database("v")
    with user_on(cluster, "v", scratch) as alice:
        chat = chat_with_bob(alice, "versions")
        assert send(alice, chat, "one", "1") == (["2"], [])

        # Another node commits message 3 (and with it the chat's last message and version).
        cluster.psql(f"""
            BEGIN;
            INSERT INTO message (chat, id, sender, tag, content, "timestamp", "isControl", "neverCountsUnread", "isRecalled", "changeSeq", "searchRow")
                SELECT chat, 3, sender, tag, 'from another node', "timestamp", false, false, false, "changeSeq", 0 FROM message WHERE chat = {chat} AND id = 2;
            UPDATE chat SET "lastMessage" = 3 WHERE "number" = {chat};
            UPDATE chat_version SET version = version + 1 WHERE chat = {chat};
            COMMIT;
            """, database="v")
        # This node decided id 3 on what it had: its commit conflicts, and the send is
        # decided again, taking 4. Not Internal, not a duplicate key.
        assert send(alice, chat, "two", "2") == (["4"], [])
        assert texts(alice, chat) == [("2", "one"), ("3", "from another node"), ("4", "two")]

        # Another node renames the chat: no key of this node's next commit collides, only
        # the chat's version tells. The send is decided again on the chat as the database
        # has it.
        cluster.psql(f"""
            BEGIN;
            UPDATE chat SET subject = 'renamed on another node' WHERE "number" = {chat};
            UPDATE chat_version SET version = version + 1 WHERE chat = {chat};
            COMMIT;
            """, database="v")
        assert send(alice, chat, "three", "3") == (["5"], [])
        assert chat_element(alice, chat)["subject"] == "renamed on another node"
        # Made (1), "one", the other node's message, "two" (once: its conflicting commit
        # applied nothing), the rename, "three".
        assert cluster.psql(f"SELECT version FROM chat_version WHERE chat = {chat}", database="v").strip() == "6"


def test_a_store_from_before_chat_versions_gets_them(cluster, scratch):
    """The migration gives every chat a version: a node started on an older store decides on them."""
    cluster.create_database("m")
    with user_on(cluster, "m", scratch) as alice:
        chat = chat_with_bob(alice, "before")
    cluster.psql("""
        DROP TABLE chat_version; DROP FUNCTION chatcore_claim(bigint[], bigint[]);
        DELETE FROM chatcore_migration WHERE name IN ('v6-chat-versions', 'v8-claims-in-chat-order');
        """, database="m")
    with user_on(cluster, "m", scratch) as alice:
        assert cluster.psql(f"SELECT version FROM chat_version WHERE chat = {chat}", database="m").strip() == "1"
        assert send(alice, chat, "after the migration", "1") == (["2"], [])
        assert cluster.psql(f"SELECT version FROM chat_version WHERE chat = {chat}", database="m").strip() == "2"


def waiting_for_a_lock(cluster, database, query_contains):
    """Waits until a session running a statement with this text waits for a row lock."""
    deadline = time.time() + 10
    while cluster.psql(f"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%{query_contains}%'",
                       database=database).strip() != "1":
        assert time.time() < deadline, f"no session running {query_contains} waited for a lock"
        time.sleep(0.02)


def test_commits_claiming_the_same_chats_in_other_orders_wait_for_each_other_without_deadlock(cluster, scratch):
    """Two deciding nodes' commits may claim overlapping chats, each listing them in its own
    order. The claim locks them in chat order, so one waits for the other and then finds
    the versions it moved on (CCC01, decided again at once), never a deadlock that
    PostgreSQL breaks only after a second (40P01). Here node A holds chat 1001, node B
    claims 1002 and 1001 (1002 first, and first in the table too, so a claim that locked
    in list or table order would take it and wait for 1001), then A claims 1002 too."""
    cluster.create_database("order")
    with user_on(cluster, "order", scratch):
        pass
    cluster.psql("INSERT INTO chat_version (chat, version) VALUES (1002, 1), (1001, 1)", database="order")
    a = PsqlSession(cluster, "order", keep_errors=True)
    b = PsqlSession(cluster, "order", keep_errors=True)
    try:
        a.run("\\set VERBOSITY verbose")
        b.run("\\set VERBOSITY verbose")
        a.run("BEGIN; SELECT chatcore_claim('{1001}', '{1}');")
        deadline = time.time() + 10
        while cluster.psql("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND query LIKE '%{1001}%'",
                           database="order").strip() != "1":
            assert time.time() < deadline, "node A's claim did not run"
            time.sleep(0.02)
        b.run("SELECT chatcore_claim('{1002,1001}', '{1,1}');")
        waiting_for_a_lock(cluster, "order", "{1002,1001}")
        started = time.time()
        a.run("SELECT chatcore_claim('{1002}', '{1}'); COMMIT;")
        a_errors, a_status = a.errors()
        b_errors, b_status = b.errors()
        waited = time.time() - started
    finally:
        a.kill()
        b.kill()
    assert (a_status, a_errors) == (0, "")
    assert b_status != 0 and "CCC01" in b_errors and "40P01" not in b_errors, b_errors
    assert waited < 0.8, f"the claims waited {waited:.2f} s: PostgreSQL broke a deadlock"
    assert cluster.psql("SELECT chat, version FROM chat_version WHERE chat > 1000 ORDER BY chat", database="order").split() == ["1001|2", "1002|2"]


def test_sends_under_conflicts_are_each_answered_once_in_order(cluster, scratch):
    """Eight senders pipeline 300 sends each (in rounds of 30) into their chats while
    "another node" moves those chats' versions on (before each round, and every 20 ms):
    commits conflict and are decided again, under load, with two commits in flight. Every send is answered once, Sent, and each chat's
    ids follow the sender's order with no gap."""
    cluster.create_database("load")
    port = free_port()
    process, path = start(cluster, "load", scratch, "--metrics", f"127.0.0.1:{port}")
    assert path is not None, process.stderr.read().decode()
    senders, each = 8, 300
    clients, chats = [], []
    for n in range(senders):
        client = Client(path)
        auth(client, f"sender{n}")
        chats.append(chat_with_bob(client, f"load {n}"))
        clients.append(client)
    bumping = threading.Event()

    def bump():
        while not bumping.is_set():
            cluster.psql(f"UPDATE chat_version SET version = version + 1 WHERE chat = {random.choice(chats)}", database="load")
            time.sleep(0.02)

    bumper = threading.Thread(target=bump)
    bumper.start()
    try:
        # In rounds, each after every chat's version moved on (the round's first commits
        # must conflict), with the bumper moving them on at any time besides.
        for first in range(0, each, 30):
            cluster.psql(f"UPDATE chat_version SET version = version + 1 WHERE chat IN ({', '.join(chats)})", database="load")
            round_ = range(first, first + 30)
            for client, chat in zip(clients, chats):
                client.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"m{k}", "cookie": f"c{k}"}} for k in round_])
            for client in clients:
                for k in round_:
                    answer = client.answer(f"c{k}", timeout=120)
                    assert "listAdd" in answer[-1] and answer[-1]["listAdd"]["elements"][0]["state"] == "Sent", answer[-1]
                    assert not any("requestFailed" in event for event in answer), answer
    finally:
        bumping.set()
        bumper.join()
    conflicts = scrape(port)[("chatcore_commit_conflicts_total", frozenset())]
    assert conflicts >= each // 30, "commits did not conflict: the test did not test anything"
    for client, chat in zip(clients, chats):
        assert texts(client, chat) == [(str(k + 2), f"m{k}") for k in range(each)]
        client.close()
    assert stop(process) == 0


def texts(client, chat):
    """Every Text message of the chat (in windows of 100), as (id, content)."""
    found, start_at = [], 1
    while True:
        events = client.request({"requestListMatching": {"type": "chatMessage", "cookie": f"w{start_at}", "criteria": {"chatId": chat},
                                                         "window": {"messageId": start_at, "before": 0, "after": 99}}})
        page = [element for event in events if "listChunk" in event for element in event["listChunk"]["elements"]]
        found += [(element["messageId"], element.get("content")) for element in page if element["tag"] == "Text"]
        if not page or int(page[-1]["messageId"]) < start_at + 99:
            return found
        start_at = int(page[-1]["messageId"]) + 1


def test_a_node_alone_never_conflicts(cluster, scratch):
    """Versions move only with what is committed: one node alone, whatever its requests do
    (and do not change), never meets a conflict of its own making."""
    cluster.create_database("alone")
    port = free_port()
    process, path = start(cluster, "alone", scratch, "--metrics", f"127.0.0.1:{port}")
    assert path is not None, process.stderr.read().decode()
    alice, bob = Client(path), Client(path)
    auth(alice, "alice")
    auth(bob, "bob")
    started = alice.request({"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}, {"userId": "carol"}], "subject": "all"}})
    chat = started_chat(started)
    one_to_one = chat_with_bob(alice, "pair")
    def sent_id(client, request):
        answer = client.request(request)
        return next(e["listAdd"]["elements"][0]["messageId"] for e in answer if "listAdd" in e and body(e).get("cookie") == body(request)["cookie"])

    one = sent_id(alice, {"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "one", "cookie": "one"}})
    three = sent_id(alice, {"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "three", "cookie": "three",
                                                "ref": [{"tag": "Quote", "messageId": one}]}})
    requests = [
        {"chatMessageSend": {"chatId": one_to_one, "tag": "Text", "content": "two"}},
        {"chatTyping": {"chatId": chat}},
        {"requestListChange": {"type": "chat", "elements": [{"chatId": chat, "localData": {"pinned": True}}]}},
        {"participantPromote": {"chatId": chat, "userUri": "bbmpim://user/id/2"}},
        {"participantDemote": {"chatId": chat, "userUri": "bbmpim://user/id/2"}},
        {"chatMessageDelete": {"chatId": chat, "id": one}},
        {"chatMessageDestroy": {"chatId": chat, "messageId": three}},
        {"chatHide": {"chatIds": [one_to_one]}},
        # What changes nothing: hidden again, the same local data, a demoted member demoted.
        {"chatHide": {"chatIds": [one_to_one]}},
        {"requestListChange": {"type": "chat", "elements": [{"chatId": chat, "localData": {"pinned": True}}]}},
        {"participantDemote": {"chatId": chat, "userUri": "bbmpim://user/id/2"}},
        {"endpointUpdate": {"description": "laptop", "nickname": "l", "cookie": "e"}},
        {"search": {"text": "two", "cookie": "q"}},
    ]
    def all_done(client, requests):
        """Sends `requests` and waits until they are answered (most answer nothing)."""
        client.send(*requests, {"identitiesGet": {"cookie": "done", "appUserIds": ["alice"]}})
        answer = client.answer("done")
        assert [event for event in answer if "requestFailed" in event] == []

    # Pipelined sends from both: batches are decided while the one before commits (two
    # commits in flight, the second written by two statements).
    for client in (alice, bob):
        client.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"burst {n}", "cookie": f"burst{n}"}} for n in range(300)])
    for client in (alice, bob):
        client.answer("burst299")
    all_done(alice, requests)
    all_done(bob, [{"chatMessageRead": {"chatId": chat, "messageId": three}}] * 2  # the second moves nothing
             + [{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "four"}}, {"chatLeave": {"chatIds": [chat]}}])
    all_done(alice, [{"chatInvite": {"chatId": chat, "invitees": [{"userId": "bob"}]}}])
    assert scrape(port)[("chatcore_commit_conflicts_total", frozenset())] == 0
    alice.close()
    bob.close()
    assert stop(process) == 0


SEARCH_ROW_BLOCK = 16_384  # PostgresStore.searchRowBlock


def search_row(cluster, database, content):
    return int(cluster.psql(f"SELECT \"searchRow\" FROM message WHERE content = '{content}'", database=database).strip())


def test_new_chats_users_and_search_rows_take_numbers_no_other_node_takes(cluster, scratch):
    """Numbers for new chats and users, and search rows, come from sequences in the
    database, which every deciding node takes from: a chat and a user another node made do
    not make this node's next ones conflict (numbered from memory, it would take the same
    ones), and search rows are taken a block at a time, never given twice, also across a
    restart. A store from before the sequences gets them, going on after the highest
    numbers stored."""
    cluster.create_database("numbers")
    port = free_port()
    process, path = start(cluster, "numbers", scratch, "--metrics", f"127.0.0.1:{port}")
    assert path is not None, process.stderr.read().decode()
    alice = Client(path)
    auth(alice, "alice")
    assert chat_with_bob(alice, "first") == "1"
    # Another node makes user 3 (carol) and chat 2, numbered as every node numbers them.
    cluster.psql("""
        BEGIN;
        INSERT INTO "user" ("number", "userId", "regId") VALUES (nextval('user_number'), 'carol', 333);
        INSERT INTO chat ("number", subject, "isOneToOne", "invitePolicy", "isDefunct", "lastMessage", "lastActivity")
            VALUES (nextval('chat_number'), 'on another node', false, 'ParticipantsOnly', false, 0, 0);
        INSERT INTO chat_version (chat, version) SELECT max("number"), 1 FROM chat;
        COMMIT;
        """, database="numbers")
    started = alice.request({"chatStart": {"cookie": "d", "invitees": [{"userId": "dave"}], "subject": "second"}})
    assert [event for event in started if "requestFailed" in event] == []
    assert started_chat(started) == "3"
    assert scrape(port)[("chatcore_commit_conflicts_total", frozenset())] == 0
    users = cluster.psql('SELECT "number", "userId" FROM "user" ORDER BY "number"', database="numbers").split()
    assert users == ["1|alice", "2|bob", "3|carol", "4|dave"]

    # Search rows: the node's first block is 1 to BLOCK; another node takes the next.
    assert send(alice, "3", "first text", "t1") == (["2"], [])
    assert search_row(cluster, "numbers", "first text") == 1
    assert cluster.psql("SELECT nextval('search_row')", database="numbers").strip() == str(2 * SEARCH_ROW_BLOCK)
    assert send(alice, "3", "second text", "t2") == (["3"], [])
    assert search_row(cluster, "numbers", "second text") == 2
    alice.close()
    assert stop(process) == 0
    # Restarted, the node takes a new block, after the other node's; search finds all.
    with user_on(cluster, "numbers", scratch) as alice:
        assert send(alice, "3", "third text", "t3") == (["4"], [])
        assert search_row(cluster, "numbers", "third text") == 2 * SEARCH_ROW_BLOCK + 1
        assert search_ids(alice, "text") == ["2", "3", "4"]

    # A store from before the sequences: they go on after what it holds.
    cluster.psql("""
        DROP SEQUENCE chat_number; DROP SEQUENCE user_number; DROP SEQUENCE search_row;
        INSERT INTO counter (name, value) SELECT 'searchRow', max("searchRow") FROM message;
        DELETE FROM chatcore_migration WHERE name = 'v7-numbers';
        """, database="numbers")
    with user_on(cluster, "numbers", scratch) as alice:
        started = alice.request({"chatStart": {"cookie": "e", "invitees": [{"userId": "erin"}], "subject": "after the migration"}})
        assert started_chat(started) == "4"
        assert send(alice, "4", "fourth text", "t4") == (["2"], [])
        assert search_ids(alice, "text") == ["2", "2", "3", "4"]
    assert cluster.psql('SELECT "number" FROM "user" WHERE "userId" = \'erin\'', database="numbers").strip() == "5"
    assert search_row(cluster, "numbers", "fourth text") == 2 * SEARCH_ROW_BLOCK + 2
    assert cluster.psql("SELECT count(*) FROM counter WHERE name = 'searchRow'", database="numbers").strip() == "0"


def feed(client, since):
    """requestListChanges for chat messages: (the ids changed, the token)."""
    request = {"type": "chatMessage", "cookie": "feed", **({"since": since} if since is not None else {})}
    answer = next(event for event in client.request({"requestListChanges": request}) if "listChanges" in event or "requestFailed" in event)
    if "requestFailed" in answer:
        return answer["requestFailed"]["error"], None
    return [element["messageId"] for element in answer["listChanges"]["changed"]], answer["listChanges"]["token"]


def test_a_feed_token_holds_a_position_for_each_deciding_node(cluster, scratch):
    """Each deciding node numbers its changes in a slot of its own (slot 0 while one node
    decides, whose token is the plain number it always was): a change another node
    committed in slot 1 (its own counter, `changeSeq.1`, moved in the same commit) is in
    this node's feed, and the token then holds both positions."""
    cluster.create_database("slots")
    with user_on(cluster, "slots", scratch) as alice:
        chat = chat_with_bob(alice, "feed")
        assert send(alice, chat, "one", "1") == (["2"], [])
        changed, start = feed(alice, None)
        assert changed == [] and start.isdigit()
        cluster.psql(f"""
            BEGIN;
            INSERT INTO counter (name, value) VALUES ('changeSeq.1', (1::bigint << 56) + 1);
            UPDATE message SET "changeSeq" = (1::bigint << 56) + 1 WHERE chat = {chat} AND id = 2;
            COMMIT;
            """, database="slots")
        assert feed(alice, start) == (["2"], start + ".1")
        assert feed(alice, start + ".1") == ([], start + ".1")
        assert feed(alice, start + ".2") == ("InvalidParameter", None)
        assert sorted(feed(alice, "0")[0]) == ["1", "2"]


FEED_SLOT_0_LOCK = 0x6368_6174_636f_7265 + 0x100  # PostgresStore.feedSlotLockKey


def test_a_node_numbers_its_changes_in_the_first_feed_slot_no_other_node_holds(cluster, scratch):
    """A deciding node holds its feed slot by an advisory lock while it is the writer. With
    slot 0 held by another (here a psql session, as another deciding node would), the node
    takes slot 1: its changes are numbered there (counter `changeSeq.1`) and its tokens
    name both slots. Started again with slot 0 free, it takes slot 0 again, and a token
    from either run still finds every change after it."""
    cluster.create_database("slot")
    with user_on(cluster, "slot", scratch) as alice:
        chat = chat_with_bob(alice, "slots")
        assert send(alice, chat, "in slot 0", "a") == (["2"], [])
        _, before = feed(alice, None)
    assert before.isdigit()

    holder = PsqlSession(cluster, "slot")
    try:
        holder.run(f"SELECT pg_advisory_lock({FEED_SLOT_0_LOCK});")
        deadline = time.time() + 10
        while cluster.psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted", database="slot").strip() != "1":
            assert time.time() < deadline, "the test did not get feed slot 0's lock"
            time.sleep(0.05)
        with user_on(cluster, "slot", scratch) as alice:
            assert send(alice, chat, "in slot 1", "b") == (["3"], [])
            changed, in_slot_1 = feed(alice, before)
            assert changed == ["3"]
            slot_0, slot_1 = in_slot_1.split(".")
            assert slot_0 == before and int(slot_1) > 0
            assert cluster.psql("SELECT value - (1::bigint << 56) FROM counter WHERE name = 'changeSeq.1'", database="slot").strip() == slot_1
    finally:
        holder.kill()

    with user_on(cluster, "slot", scratch) as alice:
        assert send(alice, chat, "slot 0 again", "c") == (["4"], [])
        changed, after = feed(alice, in_slot_1)
        assert changed == ["4"]
        assert after.split(".")[1] == slot_1 and int(after.split(".")[0]) > int(before)
        assert sorted(feed(alice, before)[0]) == ["3", "4"]
        assert feed(alice, after) == ([], after)
