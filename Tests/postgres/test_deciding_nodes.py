"""Several deciding nodes on one PostgreSQL database (`--all-nodes-decide`): each node
decides for its own sessions and follows the others' commits, instead of relaying its
connections to the writer. Real processes on a real cluster."""
import threading
import time

import pytest

from conftest import chat_with_bob
from postgres_cluster import postgres_bin
from chatcore_harness import Client, auth, body
from test_nodes import Node, _no_node_outlives_its_test, assert_kept, conversation, send_until_gone  # noqa: F401 (the fixture kills what a failed test left)

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def deciding_nodes(cluster, scratch, database, count=2):
    cluster.create_database(database)
    url = cluster.database_url(database)
    nodes = [Node(url, scratch, f"{database}-{n}", "--all-nodes-decide") for n in range(count)]
    for node in nodes:
        node.wait_until_logged("store ready")
    return nodes


def test_users_on_two_deciding_nodes_see_what_they_would_see_on_one(cluster, scratch):
    cluster.create_database("one")
    single = Node(cluster.database_url("one"), scratch, "one")
    on_one = conversation(single.socket, single.socket)
    assert single.stop() == 0

    a, b = deciding_nodes(cluster, scratch, "deciding")
    on_two = conversation(a.socket, b.socket)
    assert on_two["alice"] == on_one["alice"]
    assert on_two["bob"] == on_one["bob"]
    assert len(on_one["bob"]) > 20, "the conversation reached bob"
    # Neither node relayed: each decided for its own session.
    assert "relaying" not in a.logged() + b.logged()
    assert b.stop() == 0
    assert a.stop() == 0


def test_concurrent_sends_through_two_deciding_nodes_take_ids_one_to_n_and_reach_everyone_once_in_order(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "race")
    alice, bob = Client(a.socket), Client(b.socket)
    auth(alice, "alice")
    auth(bob, "bob")
    chat = chat_with_bob(alice, "race")
    bob.request({"identitiesGet": {"cookie": "joined", "appUserIds": ["bob"]}})
    per_sender = 300
    announced = {}

    def send(client, name):
        client.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"{name}{n}", "cookie": f"{name}{n}"}}
                      for n in range(per_sender)])
        for n in range(per_sender):
            for event in client.answer(f"{name}{n}", timeout=120):
                if "listAdd" in event and body(event).get("cookie") == f"{name}{n}":
                    announced[f"{name}{n}"] = int(body(event)["elements"][0]["messageId"])

    threads = [threading.Thread(target=send, args=(alice, "a")), threading.Thread(target=send, args=(bob, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
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
    alice, bob = Client(a.socket), Client(b.socket)
    auth(alice, "alice")
    auth(bob, "bob")
    chat = chat_with_bob(alice, "load")
    bob.request({"identitiesGet": {"cookie": "joined", "appUserIds": ["bob"]}})
    threads, announced = send_until_gone(chat, {"a": alice, "b": bob}, answer_timeout=10)
    time.sleep(1.5)
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
