"""Several deciding nodes on one PostgreSQL database (`--all-nodes-decide`): each node
decides for its own sessions and follows the others' commits, instead of relaying its
connections to the writer. Real processes on a real cluster."""
import threading
import time

import pytest

from conftest import SANITIZED, started_chat
from postgres_cluster import postgres_bin
from chatcore_harness import Client, auth, body
from test_nodes import (Node, _no_node_outlives_its_test, alice_and_bob_in_a_chat, assert_kept, assert_moderated, conversation,  # noqa: F401 (the fixture
                        conversation_on_one_node, send_at_once, send_until_gone, wait_for)                    # kills what a failed test left)

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def deciding_nodes(cluster, scratch, database, count=2):
    cluster.create_database(database)
    url = cluster.database_url(database)
    nodes = [Node(url, scratch, f"{database}-{n}", "--all-nodes-decide") for n in range(count)]
    for node in nodes:
        node.wait_until_logged("store ready")
    return nodes


def test_users_on_two_deciding_nodes_see_what_they_would_see_on_one(cluster, scratch):
    on_one = conversation_on_one_node(cluster, scratch, "one")
    a, b = deciding_nodes(cluster, scratch, "deciding")
    on_two = conversation(a.socket, b.socket)
    assert on_two["alice"] == on_one["alice"]
    assert on_two["bob"] == on_one["bob"]
    assert len(on_one["bob"]) > 20, "the conversation reached bob"
    assert any('"reactions":[{"count":2,"mine":true' in line for line in on_one["bob"]), "reactions reached bob"
    assert any('"numUnreadMentions":1' in line for line in on_one["bob"]), "the mention reached bob"
    assert any('"pinnedMessages":["2"]' in line for line in on_one["bob"]), "the pin reached bob"
    assert_moderated(on_one)
    # Neither node relayed: each decided for its own session.
    assert "relaying" not in a.logged() + b.logged()
    assert b.stop() == 0
    assert a.stop() == 0


def alice_and_bob(a, b, subject):
    """alice on node `a` starts a chat with bob on node `b`, who has followed it; returns
    both clients and the chat's id."""
    alice, bob, chat = alice_and_bob_in_a_chat(a, b, subject)
    bob.request({"identitiesGet": {"cookie": "joined", "appUserIds": ["bob"]}})
    return alice, bob, chat


def test_concurrent_sends_through_two_deciding_nodes_take_ids_one_to_n_and_reach_everyone_once_in_order(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "race")
    alice, bob, chat = alice_and_bob(a, b, "race")
    per_sender = 300
    announced = send_at_once(chat, {"a": alice, "b": bob}, per_sender)
    assert len(announced) == 2 * per_sender
    # Message 1 is bob's Join; the sends take 2..N+1, each once.
    assert sorted(announced.values()) == list(range(2, 2 + 2 * per_sender))
    # Each node follows the other's last commits before answering these.
    for step in range(2):
        for client in (alice, bob):
            client.request({"identitiesGet": {"cookie": f"settle{step}", "appUserIds": ["bob"]}})
    for client in (alice, bob):
        seen = [int(element["messageId"]) for event in client.all if "listAdd" in event and body(event)["type"] == "chatMessage"
                for element in body(event)["elements"] if element["tag"] == "Text"]
        assert seen == list(range(2, 2 + 2 * per_sender)), "every message once, in id order"
    alice.close()
    bob.close()
    assert b.stop() == 0
    assert a.stop() == 0


def test_sigkill_of_a_deciding_node_under_load_loses_nothing_announced_and_the_other_goes_on(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "kill")
    alice, bob, chat = alice_and_bob(a, b, "load")
    threads, announced = send_until_gone(chat, {"a": alice, "b": bob}, answer_timeout=10)
    # Under load: killed once sends have gone through both (a sanitizer build is slow).
    deadline = time.time() + 60
    while len(announced) <= 50:
        assert time.time() < deadline, "the sends did not go through"
        time.sleep(0.1)
    time.sleep(0.5)
    a.process.kill()
    a.process.wait()
    time.sleep(1)
    for client in (alice, bob):
        client.close()
    for thread in threads:
        thread.join(timeout=60)
    assert len(announced) > 50
    # The node that goes on forgets who was connected to the dead one (its feed slot's
    # lock went with it): a message to them is no longer delivered as if they were.
    deadline = time.time() + 10
    while cluster.psql("SELECT count(*) FROM node_online WHERE slot = 0", database="kill").strip() != "0":
        assert time.time() < deadline, "who was connected to the dead node is still said to be"
        time.sleep(0.1)
    # Alice connects to the node that goes on, which has everything announced.
    carol = Client(b.socket)
    auth(carol, "alice")
    assert_kept(carol, chat, announced)
    answer = carol.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    assert any("listAdd" in e and body(e).get("cookie") == "after" for e in answer)
    carol.close()
    assert b.stop() == 0


def test_idle_deciding_nodes_wait_to_be_told_and_follow_on_when_their_listening_connection_ends(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "told")
    alice, bob, chat = alice_and_bob(a, b, "told")

    def transactions():
        return int(cluster.psql("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = 'told'"))

    def bob_receives(content):
        alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": content, "cookie": content}})
        return bob.next_event(lambda e: "listAdd" in e and body(e)["type"] == "chatMessage" and body(e)["elements"][0].get("content") == content,
                              timeout=10)

    # Idle, each node asks the database a few things a second (a beat, a trim, one look),
    # not every few milliseconds: it is told when another node does something
    # (LISTEN/NOTIFY). Looking every 5 ms, two nodes made over a thousand a second.
    before = transactions()
    time.sleep(3)
    idle = transactions() - before
    assert idle < 300, f"{idle} transactions in 3 s while nothing happened"
    bob_receives("told")
    # Their connections for being told end (as in a restart of the server): they follow
    # on, looking by themselves, and listen again within a few seconds.
    ended = cluster.psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = 'told' AND query LIKE 'LISTEN%'")
    assert ended.strip() == "2", "each node listens on a connection of its own"
    bob_receives("deaf")
    deadline = time.time() + 10
    while cluster.psql("SELECT count(*) FROM pg_stat_activity WHERE datname = 'told' AND query LIKE 'LISTEN%'").strip() != "2":
        assert time.time() < deadline, "the nodes did not listen again"
        time.sleep(0.1)
    bob_receives("told again")
    assert "cannot listen" not in a.logged() + b.logged()
    alice.close()
    bob.close()
    assert b.stop() == 0
    assert a.stop() == 0


def test_each_deciding_node_gives_each_feed_position_once_while_it_follows_the_other(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "positions")
    senders = []
    for n in range(8):
        client = Client((a, b)[n % 2].socket)
        auth(client, f"sender{n}")
        chat = started_chat(client.request({"chatStart": {"cookie": "c", "invitees": [{"userId": f"peer{n}"}], "isOneToOne": True}}))
        senders.append((client, chat))
    # Enough that each node follows the other with a commit of its own in flight many
    # times (fewer under a sanitizer, whose build is many times slower).
    each = 150 if SANITIZED else 500

    def send(client, chat):
        client.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"m{k}", "cookie": f"m{k}"}} for k in range(each)])
        client.answer(f"m{each - 1}", timeout=120)

    # Each node commits its own senders' chats while it follows the other's commits.
    threads = [threading.Thread(target=send, args=sender) for sender in senders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    # Each node numbers its changes in its feed slot, each position once. A node that
    # followed the other while a commit of its own was in flight took its counters back
    # from what it read, and gave later changes positions it had given already (in one
    # run of the nodes benchmark, 4,792 of them): a feed reader past them misses those.
    assert cluster.psql("SELECT count(*) FROM message WHERE tag = 'Text'", database="positions").strip() == str(8 * each)
    assert cluster.psql('SELECT count(*) FROM (SELECT "changeSeq" FROM message GROUP BY 1 HAVING count(*) > 1) d', database="positions").strip() == "0"
    # And the change feed, read from the start in pages, gives each sender's messages.
    for client, chat in senders:
        ids, since = [], "0"
        while True:
            asked = {"type": "chatMessage", "cookie": "feed", "chatId": chat, "limit": 100, "since": since}
            answer = next(body(e) for e in client.request({"requestListChanges": asked}) if "listChanges" in e)
            ids += [message["messageId"] for message in answer["changed"] if message.get("tag") == "Text"]
            since = answer["token"]
            if not answer["hasMore"]:
                break
        assert len(set(ids)) == each, f"the feed gave {len(set(ids))} of {each} messages"
        client.close()
    assert b.stop() == 0
    assert a.stop() == 0


def test_a_deciding_writer_stopped_while_it_follows_lets_its_lock_go_and_takes_it_no_more(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "stopping")
    alice, bob, chat = alice_and_bob(a, b, "stopping")
    # bob (on b, in four sessions) sends on while alice's node stops: a follows b's
    # commits until it ends.
    sessions = [bob]
    for _ in range(3):
        sessions.append(Client(b.socket))
        auth(sessions[-1], "bob")
    threads, announced = send_until_gone(chat, {f"b{n}": client for n, client in enumerate(sessions)}, answer_timeout=10)
    wait_for(lambda: len(announced) > 20, "bob's sends did not go through")
    epoch = cluster.psql("SELECT epoch FROM writer_epoch", database="stopping").strip()
    assert a.stop() == 0
    time.sleep(0.5)
    # A follow still running after the store let its connections go took the writer lock,
    # and a new epoch, again, as if PostgreSQL had restarted (1 stop in 3 here).
    assert "taking it again" not in a.logged()
    assert "could not be read" not in a.logged()
    assert cluster.psql("SELECT epoch FROM writer_epoch", database="stopping").strip() == epoch
    assert "every answer decided was written" in a.logged()
    # b goes on.
    count = len(announced)
    wait_for(lambda: len(announced) > count + 10, "bob's sends stopped with alice's node")
    alice.close()
    for client in sessions:
        client.close()
    for thread in threads:
        thread.join(timeout=30)
    assert b.stop() == 0


def test_a_deciding_node_that_missed_trimmed_commits_reads_the_store_whole_and_goes_on(cluster, scratch):
    import signal
    a, b = deciding_nodes(cluster, scratch, "trimmed")
    alice, bob, chat = alice_and_bob(a, b, "trimmed")
    # b stands still while a commits, and the log is trimmed of what b had not read (as
    # the nodes' trim does to rows older than a minute).
    b.process.send_signal(signal.SIGSTOP)
    try:
        answer = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "missed", "cookie": "missed"}})
        missed = next(body(e)["elements"][0]["messageId"] for e in answer if "listAdd" in e and body(e).get("cookie") == "missed")
        cluster.psql("""WITH gone AS (DELETE FROM node_commit RETURNING slot, "number")
                        INSERT INTO node_commit_trimmed (slot, "upTo") SELECT slot, max("number") FROM gone GROUP BY slot
                        ON CONFLICT (slot) DO UPDATE SET "upTo" = greatest(node_commit_trimmed."upTo", EXCLUDED."upTo")""", database="trimmed")
    finally:
        b.process.send_signal(signal.SIGCONT)
    b.wait_until_logged("reading the store again whole")
    # bob's node has what it missed, and follows on from there.
    assert_kept(bob, chat, {"missed": missed})
    alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    bob.next_event(lambda e: "listAdd" in e and body(e)["type"] == "chatMessage" and body(e)["elements"][0].get("content") == "after", timeout=10)
    alice.close()
    bob.close()
    assert b.stop() == 0
    assert a.stop() == 0
