"""`make run-nodes` (Examples/two-nodes.sh): two nodes on a throwaway PostgreSQL, as a
newcomer runs it. Users on the two nodes chat; the deciding node is stopped and the other
serves; Ctrl-C stops everything and leaves nothing behind."""
import os
import re
import signal
import socket
import subprocess

import pytest

from conftest import ROOT, real_binary
from postgres_cluster import postgres_bin
from chatcore_harness import Client, auth, body, connect_when_serving

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def free_port_pair():
    """A port p such that p and p + 1 are free on loopback now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65535:
            with socket.socket() as next_one:
                try:
                    next_one.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    pass
    raise RuntimeError("no two free ports in a row")


def test_two_nodes_on_a_throwaway_postgresql_serve_one_domain_and_stop_cleanly():
    port = free_port_pair()
    script = subprocess.Popen([str(ROOT / "Examples" / "two-nodes.sh"), real_binary(), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = []
    try:
        for text in script.stdout:
            output.append(text)
            if text.startswith("Ctrl-C stops everything"):
                break
        printed = "".join(output)
        assert f"nc 127.0.0.1 {port + 1}" in printed, printed
        directory = re.search(r"with PostgreSQL in (\S+)\.", printed).group(1)
        writer = int(re.search(r"kill (\d+)", printed).group(1))

        alice = Client(("127.0.0.1", port))
        auth(alice, "alice")
        bob = Client(("127.0.0.1", port + 1))
        auth(bob, "bob")
        alice.send({"chatStart": {"cookie": "c1", "invitees": [{"userId": "bob"}], "subject": "across nodes"}})
        chat = body(bob.next_event(lambda e: "listAdd" in e and body(e)["type"] == "chat"))["elements"][0]
        assert chat["subject"] == "across nodes"

        # The deciding node goes; the other takes over, and bob, connecting again, is served.
        os.kill(writer, signal.SIGKILL)
        bob = connect_when_serving(("127.0.0.1", port + 1), "bob", why=lambda: "the second node did not serve after the first was killed")
        answer = bob.request({"chatMessageSend": {"chatId": chat["chatId"], "tag": "Text", "content": "still here", "cookie": "m1"}})
        assert any("listAdd" in e and body(e)["elements"][0].get("content") == "still here" for e in answer), answer
    finally:
        os.killpg(script.pid, signal.SIGINT)
        rest = script.communicate(timeout=60)[0]
    assert script.returncode == 0, "".join(output) + rest
    assert "stopped both nodes and PostgreSQL" in rest
    assert not os.path.exists(directory)
