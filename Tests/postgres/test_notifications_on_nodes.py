"""Notifications of offline recipients with several nodes on one PostgreSQL database: every
node that decides sends from the one outbox, and each notification reaches the
application's server once; when the writer is killed, the node that takes over sends what
it left. Real processes, a real cluster and a real HTTP receiver (Tests/python's)."""
import signal

import pytest

from chatcore_harness import Client, auth, body
from postgres_cluster import postgres_bin
from test_deciding_nodes import deciding_nodes  # noqa: F401
from test_nodes import Node, _no_node_outlives_its_test, two_nodes  # noqa: F401 (the fixture kills what a failed test left)
from test_notifications import Receiver, secret_file

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def notify_arguments(receiver, secret_path):
    return ["--notify-url", receiver.url, "--notify-secret-file", secret_path, "--notify-timeout", "1", "--notify-longest-retry", "2",
            "--notify-batch", "7"]


def chat_with(client, invitee, subject):
    answer = client.request({"chatStart": {"cookie": "start", "invitees": [{"userId": invitee}], "subject": subject}})
    return next(body(e) for e in answer if "listAdd" in e)["elements"][0]["chatId"]


def regid(client, user):
    answer = client.request({"identitiesGet": {"cookie": "who", "appUserIds": [user]}})
    return next(body(e) for e in answer if "identities" in e)["info"][0]["regId"]


def send_many(client, chat, prefix, count):
    """`count` messages, pipelined; their ids."""
    client.send(*[{"chatMessageSend": {"cookie": f"{prefix}{n}", "chatId": chat, "tag": "Text", "content": f"{prefix} {n}"}}
                  for n in range(count)])
    ids = []
    for n in range(count):
        added = next(body(e) for e in client.answer(f"{prefix}{n}") if "listAdd" in e and body(e).get("cookie") == f"{prefix}{n}")
        ids.append(added["elements"][0]["messageId"])
    return ids


def connected(node, user):
    client = Client(node.socket)
    auth(client, user)
    return client


def test_two_deciding_nodes_send_each_notification_once(cluster, scratch):
    secret_path, secret = secret_file(scratch)
    receiver = Receiver(secret)
    receiver.start()
    try:
        cluster.create_database("notify")
        url = cluster.database_url("notify")
        nodes = [Node(url, scratch, f"notify-{n}", "--all-nodes-decide", *notify_arguments(receiver, secret_path)) for n in range(2)]
        for node in nodes:
            node.wait_until_logged("store ready")
        alice, carol = connected(nodes[0], "alice"), connected(nodes[1], "carol")
        to_bob, to_dave = chat_with(alice, "bob", "a"), chat_with(carol, "dave", "c")
        bob, dave = regid(alice, "bob"), regid(carol, "dave")
        expected = {f"{to_bob}:{m}:{bob}" for m in send_many(alice, to_bob, "a", 40)}
        expected |= {f"{to_dave}:{m}:{dave}" for m in send_many(carol, to_dave, "c", 40)}
        assert receiver.wait_for(lambda r: set(r.accepted()) >= expected, 60), len(expected - set(receiver.accepted()))
        sent = [n["id"] for _, _, request in receiver.requests for n in request["notifications"]]
        assert sorted(sent) == sorted(expected), "each notification was sent once, by one of the nodes"
        assert all(valid for _, valid, _ in receiver.requests)
        alice.close()
        carol.close()
        for node in reversed(nodes):
            assert node.stop() == 0
    finally:
        receiver.stop()


def test_the_node_that_takes_over_sends_what_the_killed_writer_left(cluster, scratch):
    secret_path, secret = secret_file(scratch)
    receiver = Receiver(secret)  # down: the writer's notifications wait in the outbox
    try:
        writer, relay = two_nodes(cluster, scratch, "takeover", *notify_arguments(receiver, secret_path))
        alice = connected(relay, "alice")  # relayed to the writer
        chat = chat_with(alice, "bob", "t")
        bob = regid(alice, "bob")
        before = send_many(alice, chat, "before", 10)
        writer.process.send_signal(signal.SIGKILL)
        writer.process.wait()
        relay.wait_until_logged("this node is the writer", 60)
        receiver.start()
        alice = connected(relay, "alice")
        after = send_many(alice, chat, "after", 5)
        expected = {f"{chat}:{m}:{bob}" for m in before + after}
        assert receiver.wait_for(lambda r: set(r.accepted()) >= expected, 60), sorted(expected - set(receiver.accepted()))
        assert set(receiver.accepted()) == expected
        alice.close()
        assert relay.stop() == 0
    finally:
        receiver.stop()
