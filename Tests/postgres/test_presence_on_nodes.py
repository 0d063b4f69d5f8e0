"""Presence across two deciding nodes on one PostgreSQL database: a user connected to one
node is seen online, then offline, then online again by a peer watching on the other, and
hiding their presence there hides it here. (Mute, ban and block across nodes are in the
scripted conversation of test_nodes and test_deciding_nodes, which must equal one node's.)"""
import time

import pytest

from chatcore_harness import Client, auth, body
from postgres_cluster import postgres_bin
from test_deciding_nodes import deciding_nodes
from test_moderation import act, presence_changes as presence_of
from test_nodes import _no_node_outlives_its_test  # noqa: F401 (the fixture kills what a failed test left)

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def connected(node, user):
    client = Client(node.socket)
    auth(client, user)
    return client


def wait_for(condition, timeout=20):
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.1)
    return condition()


def test_presence_on_one_node_is_seen_on_the_other(cluster, scratch):
    a, b = deciding_nodes(cluster, scratch, "presence")
    alice, bob = connected(a, "alice"), connected(b, "bob")
    answer = alice.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "s"}})
    assert any("listAdd" in e for e in answer)
    bob_uri = next(body(e) for e in alice.request({"identitiesGet": {"cookie": "who", "appUserIds": ["bob"]}}) if "identities" in e)["info"][0]["uri"]
    time.sleep(2)  # bob, connected to b, is shown online on a
    act(alice, {"presenceSet": {"watch": True}})
    assert [online for online, _ in presence_of(alice, bob_uri)] == [True]
    bob.close()
    assert wait_for(lambda: len(presence_of(alice, bob_uri)) == 2), presence_of(alice, bob_uri)
    assert presence_of(alice, bob_uri)[-1][0] is False and presence_of(alice, bob_uri)[-1][1] is not None
    bob = connected(b, "bob")
    assert wait_for(lambda: len(presence_of(alice, bob_uri)) == 3), presence_of(alice, bob_uri)
    assert presence_of(alice, bob_uri)[-1][0] is True
    # Hidden on b: gone on a at once (with the settings the other node committed).
    act(bob, {"presenceSet": {"hidden": True}})
    assert wait_for(lambda: presence_of(alice, bob_uri)[-1] == (None, None)), presence_of(alice, bob_uri)
    alice.close()
    bob.close()
    assert b.stop() == 0
    assert a.stop() == 0
