"""What nodes of one database trust each other with, tried as an attacker would.

A node that relays its standard input/output session (started as a user with --user) to
the writer vouches for that user with a key every node is given out of band
(--node-key-file), never written to the database. Before, the writer put a credential in
`writer_node` and took the first line of any connection carrying it for a session of
whatever userId that line named: anyone who could read that table, or see a relay's first
line go by, could act as any user."""
import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import subprocess
import time

import pytest

from conftest import accepting, node_key_file, real_binary, stop
from postgres_cluster import postgres_bin
from chatcore_harness import Client, scrape
from test_nodes import Node, _no_node_outlives_its_test  # noqa: F401 (the fixture kills what a test started)

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def node_token(key, instance, user, issued=None, lifetime=60, token_id=None):
    """A token as a relaying node makes it (HS256 over the node key)."""
    issued = int(time.time()) if issued is None else issued
    claims = {"iss": "chatcore-node", "aud": instance, "sub": user, "iat": issued, "exp": issued + lifetime,
              "jti": token_id or secrets.token_hex(16)}
    signing_input = b64(b'{"alg":"HS256","typ":"JWT"}') + "." + b64(json.dumps(claims).encode())
    return signing_input + "." + b64(hmac.new(key, signing_input.encode(), hashlib.sha256).digest())


def writer_with_real_tokens(cluster, scratch, database):
    """A writer that checks tokens (an HS256 secret), with the node key; its socket."""
    cluster.create_database(database)
    secret = os.path.join(scratch, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    path = os.path.join(scratch, database + ".sock")
    log = open(os.path.join(scratch, database + ".log"), "w+")
    process = subprocess.Popen([real_binary(), "serve", "--data-dir", os.path.join(scratch, database), "--listen", "unix:" + path,
                                "--auth-secret-file", secret, "--store", cluster.database_url(database), "--node-key-file", node_key_file()],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while not accepting(path):
        assert process.poll() is None, open(log.name).read()
        assert time.time() < deadline, "the writer did not listen"
        time.sleep(0.05)
    return process, path


def first_line_as(path, user, token):
    """What a connection whose first line is an authToken for `user` carrying `token` is
    then served as: "trusted" (served as `user` with no answer to that line, as a relayed
    session is), or the error its token was refused with (setupError, or requestFailed for
    a token that is not one)."""
    client = Client(path)
    try:
        client.send({"authToken": {"userId": user, "authToken": token, "cookie": "t"}},
                    {"identitiesGet": {"cookie": "who", "appUserIds": [user]}})
        events = client.answer("who")
        refused = [e["setupError"]["error"] for e in events if "setupError" in e]
        refused += [e["requestFailed"]["error"] for e in events if e.get("requestFailed", {}).get("cookie") == "t"]
        if refused:
            return refused[0]
        assert "identities" in events[-1] and len(events) == 1, events
        return "trusted"
    finally:
        client.close()


def test_what_a_database_reader_sees_lets_no_one_act_as_a_user(cluster, scratch):
    process, path = writer_with_real_tokens(cluster, scratch, "reader")
    try:
        # Everything the writer advertised, as any role that may read the table sees it.
        row = cluster.psql("SELECT row_to_json(w) FROM writer_node w", database="reader").strip()
        values = [str(value) for value in json.loads(row).values()]
        assert values
        for value in values:
            assert first_line_as(path, "bob", value) != "trusted", value
        instance = cluster.psql("SELECT instance FROM writer_node", database="reader").strip()
        assert len(instance) == 32
        with open(node_key_file(), "rb") as f:
            key = f.read()
        # Signed with another key, for another writer, expired, or for a lifetime longer
        # than a node's: refused.
        assert first_line_as(path, "bob", node_token(os.urandom(32), instance, "bob")) == "InvalidToken"
        assert first_line_as(path, "bob", node_token(key, "another-writer", "bob")) == "InvalidToken"
        assert first_line_as(path, "bob", node_token(key, instance, "bob", issued=int(time.time()) - 120)) == "InvalidToken"
        assert first_line_as(path, "bob", node_token(key, instance, "bob", lifetime=3600)) == "InvalidToken"
        # A token for bob does not make a session of carol's.
        assert first_line_as(path, "carol", node_token(key, instance, "bob")) == "InvalidToken"
        # A node's own token: the session is bob's. Seen on the wire and sent again (a
        # network observer's replay), it is refused.
        seen = node_token(key, instance, "bob")
        assert first_line_as(path, "bob", seen) == "trusted"
        assert first_line_as(path, "bob", seen) == "InvalidToken"
    finally:
        assert stop(process) == 0


def test_a_node_relaying_a_user_without_the_node_key_says_why(cluster, scratch):
    process, _ = writer_with_real_tokens(cluster, scratch, "nokey")
    try:
        relayed = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "relay"), "--user", "bob",
                                  "--store", cluster.database_url("nokey")], input=b"", capture_output=True, timeout=60)
        assert relayed.returncode == 1
        assert b"needs --node-key-file" in relayed.stderr, relayed.stderr
        # With another key than the writer's, its session is refused by the writer.
        other = os.path.join(scratch, "other.key")
        with open(other, "wb") as f:
            f.write(os.urandom(32))
        relayed = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "relay2"), "--user", "bob",
                                  "--store", cluster.database_url("nokey"), "--node-key-file", other],
                                 input=b'{"identitiesGet":{"cookie":"i","appUserIds":["bob"]}}\n', capture_output=True, timeout=60)
        assert b'"setupError"' in relayed.stdout and b"InvalidToken" in relayed.stdout, relayed.stdout
        assert b'"identities"' not in relayed.stdout
        # A key too short to be one is refused at start.
        short = os.path.join(scratch, "short.key")
        with open(short, "wb") as f:
            f.write(b"k" * 31)
        refused = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "relay3"), "--user", "bob",
                                  "--store", cluster.database_url("nokey"), "--node-key-file", short], input=b"", capture_output=True, timeout=60)
        assert refused.returncode != 0 and b"at least 32" in refused.stderr, refused.stderr
    finally:
        assert stop(process) == 0


def free_tcp_port():
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_node_never_relays_to_itself(cluster, scratch):
    """A writer advertised an address that, seen from another node, is that node: before,
    each relayed connection was relayed again to itself, without end, until the node ran
    out of descriptors."""
    cluster.create_database("loop")
    relay_port = free_tcp_port()
    writer = Node(cluster.database_url("loop"), scratch, "loop-w", "--advertise", f"127.0.0.1:{relay_port}")
    writer.wait_until_logged("this node is the writer")
    relay = Node(cluster.database_url("loop"), scratch, "loop-r", "--listen", f"127.0.0.1:{relay_port}")
    relay.wait_until_logged("relaying connections to it")
    client = Client(("127.0.0.1", relay_port))
    client.send({"authToken": {"userId": "alice", "authToken": "any", "cookie": "a"}})
    assert client.closed.wait(timeout=20), "the looping connection was not closed"
    assert "reaches this node itself" in relay.logged()
    # The node is alive, and holds no pile of connections to itself.
    time.sleep(0.5)
    assert relay.process.poll() is None
    assert len(os.listdir(f"/proc/{relay.process.pid}/fd")) < 200


def test_a_wildcard_listener_on_a_shared_store_needs_an_advertised_address(cluster, scratch):
    cluster.create_database("wild")
    refused = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "x"), "--listen", "0.0.0.0:0", "--auth-secret-file",
                              node_key_file(), "--store", cluster.database_url("wild")], input=b"", capture_output=True, timeout=60)
    assert refused.returncode != 0
    assert b"needs --advertise" in refused.stderr, refused.stderr


def test_a_relaying_node_holds_no_more_connections_than_max_sessions(cluster, scratch):
    """The relaying proxy had no bound of its own: every connection took two descriptors
    until there were none left."""
    cluster.create_database("bounded")
    writer = Node(cluster.database_url("bounded"), scratch, "bounded-w")
    writer.wait_until_logged("this node is the writer")
    relay = Node(cluster.database_url("bounded"), scratch, "bounded-r", "--max-sessions", "3", "--metrics", "127.0.0.1:0")
    relay.wait_until_logged("relaying connections to it")
    # The harness's probe that the node listens was a connection too: once it is gone,
    # all three places are free.
    relay.wait_until_logged("serving metrics")
    port = int(re.search(r"port=(\d+) \[chatcore\] serving metrics", relay.logged()).group(1))
    deadline = time.time() + 30
    while scrape(port)[("chatcore_relayed_connections_open", frozenset())] != 0:
        assert time.time() < deadline, "the probe's connection is still open"
        time.sleep(0.05)
    clients = [Client(relay.socket) for _ in range(5)]
    time.sleep(1)
    closed = [client for client in clients if client.closed.is_set()]
    assert len(closed) == 2, f"{len(closed)} of 5 connections closed with --max-sessions 3"
    assert "--max-sessions reached" in relay.logged()
    # The three it holds are relayed to the writer and served.
    held = [c for c in clients if not c.closed.is_set()]
    for n, client in enumerate(held):
        client.send({"authToken": {"userId": f"u{n}", "authToken": "any"}})
        assert "listChange" in client.events.get(timeout=30)
    # One leaves: a newcomer takes its place, and is relayed too while the others' relays
    # are open (a Unix socket's client ends have no name: once, every one of them was
    # taken for this node's own relay coming back, and refused).
    held[0].close()
    time.sleep(0.5)
    newcomer = Client(relay.socket)
    newcomer.send({"authToken": {"userId": "late", "authToken": "any"}})
    assert "listChange" in newcomer.events.get(timeout=30)
    assert "reaches this node itself" not in relay.logged()
