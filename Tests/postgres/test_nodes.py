"""Several chatcore nodes on one PostgreSQL database, against a real cluster (initdb in a
temporary directory) and real processes on Unix sockets.

One node at a time holds the database's writer lock and runs the engine; the others relay
the connections they accept to it, byte for byte, and take over when it goes (SIGKILL
included: PostgreSQL releases a dead session's lock)."""
import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import chat_with_bob, node_key_file, real_binary
from postgres_cluster import PsqlSession, postgres_bin
from chatcore_harness import Client, auth, body, connect_when_serving, scrape, start_auth, wait_until_accepting

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


# Every node a test started (its process, and its log when it has one): those still
# running when it ends are killed (a failed test would otherwise leave them serving), and
# when it failed their logs are printed, for the report.
_started = []


@pytest.fixture(autouse=True)
def _no_node_outlives_its_test(request):
    yield
    failed = getattr(request.node, "report_call", None) is not None and request.node.report_call.failed
    while _started:
        process, logged = _started.pop()
        if process.poll() is None:
            process.kill()
            process.wait()
        if failed and logged is not None:
            print(f"--- the log of node {process.args[process.args.index('--data-dir') + 1]} ---\n{logged()}")


class Node:
    def __init__(self, url, scratch, name, *arguments, stdio=False):
        """`stdio`: its standard input and output are pipes (a session with --user)."""
        self.socket = os.path.join(scratch, name + ".sock")
        self.log = open(os.path.join(scratch, name + ".log"), "w+")
        pipe = subprocess.PIPE if stdio else subprocess.DEVNULL
        self.process = subprocess.Popen([real_binary(), "serve", "--data-dir", os.path.join(scratch, name), "--listen", "unix:" + self.socket,
                                         "--insecure-no-auth", "--store", url, "--node-key-file", node_key_file(), *arguments],
                                        stdin=pipe, stdout=pipe, stderr=self.log)
        _started.append((self.process, self.logged))
        wait_until_accepting(self.socket, self.process, why=self.logged)

    def logged(self):
        self.log.seek(0)
        return self.log.read()

    def wait_until_logged(self, text, timeout=30, *others):
        """Until `text` (or one of `others`) is in the log."""
        deadline = time.time() + timeout
        while not any(t in self.logged() for t in (text, *others)):
            assert time.time() < deadline, f"not logged: {text}\n{self.logged()}"
            time.sleep(0.05)

    def stop(self):
        self.process.terminate()
        return self.process.wait(timeout=30)


def two_nodes(cluster, scratch, database, *arguments):
    cluster.create_database(database)
    url = cluster.database_url(database)
    writer = Node(url, scratch, database + "-a", *arguments)
    writer.wait_until_logged("this node is the writer")
    relay = Node(url, scratch, database + "-b", *arguments)
    relay.wait_until_logged("relaying connections to it")
    return writer, relay


def wait_for(check, what, timeout=20):
    """Polls `check` until it gives something true, and returns that; fails with `what`
    after `timeout` seconds."""
    deadline = time.time() + timeout
    while not (found := check()):
        assert time.time() < deadline, what
        time.sleep(0.05)
    return found


# Random per store (regIds, endpoint ids) or per second (timestamps): left out when the
# two runs are compared.
VARYING = re.compile(r'"(timestamp|lastActivity|regId|localRegId|endpointId)":("[^"]*"|\d+)')
VARYING_GLOBALS = re.compile(r'"name":"(localRegId|endpointId)","value":"[^"]*"')


class StdioClient(Client):
    """The standard input/output session of a `chatcore serve` process, with `Client`'s
    interface; `close` ends its input."""

    def __init__(self, process, log=None):
        self.process = process
        self.log = log
        self.sock = _Pipes(process)
        self._start_reading()

    @classmethod
    def spawn(cls, url, scratch, name, *arguments):
        """`chatcore serve` with these arguments on the store at `url`, logging to a file."""
        log = open(os.path.join(scratch, name + ".log"), "w+")
        process = subprocess.Popen([real_binary(), "serve", "--data-dir", os.path.join(scratch, name), "--insecure-no-auth",
                                    "--store", url, "--node-key-file", node_key_file(), *arguments],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        _started.append((process, lambda: (log.seek(0), log.read())[1]))
        return cls(process, log)

    def logged(self):
        self.log.seek(0)
        return self.log.read()


class _Pipes:
    """A process's standard input and output as the socket `Client` reads and writes."""

    def __init__(self, process):
        self.process = process

    def recv(self, size):
        return os.read(self.process.stdout.fileno(), size)

    def sendall(self, data):
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def close(self):
        self.process.stdin.close()


def conversation(alice_socket, bob_socket):
    """A scripted conversation; returns what each user's session received, in order.
    Either side may be a socket's path or a client."""
    alice = alice_socket if isinstance(alice_socket, Client) else Client(alice_socket)
    bob = bob_socket if isinstance(bob_socket, Client) else Client(bob_socket)
    auth(alice, "alice")
    auth(bob, "bob")
    step = [0]

    def settle(first):
        # The acting session first: its answer follows what it sent (a request without
        # a cookie included), so the other session's sync comes after its effects.
        for client in (first, bob if first is alice else alice):
            step[0] += 1
            client.request({"identitiesGet": {"cookie": f"sync{step[0]}", "appUserIds": ["alice"]}})

    def act(client, request):
        if "cookie" in body(request):
            client.request(request)
        else:
            client.send(request)  # answered only by events (or a failure)
        settle(client)

    act(alice, {"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "plans"}})
    act(bob, {"requestListAll": {"type": "chat", "cookie": "chats"}})
    act(alice, {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "lunch?", "cookie": "m1"}})
    act(bob, {"chatTyping": {"chatId": "1"}})
    act(bob, {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "yes", "cookie": "m2", "ref": [{"tag": "Quote", "messageId": "2"}]}})
    act(bob, {"chatMessageRead": {"chatId": "1", "messageId": "2"}})
    act(alice, {"chatMessageRead": {"chatId": "1", "messageId": "3"}})
    act(alice, {"chatEventSend": {"chatId": "1", "type": "poke", "data": {"n": 1}}})
    act(bob, {"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "🎉"}})
    act(alice, {"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "👍"}})
    act(alice, {"chatMessageReact": {"chatId": "1", "messageId": "3", "reaction": "👍"}})
    act(bob, {"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "👍"}})
    act(bob, {"chatMessageReact": {"chatId": "1", "messageId": "2", "reaction": "🎉", "remove": True}})
    act(alice, {"chatMessageReactionsGet": {"chatId": "1", "messageId": "2", "cookie": "who"}})
    act(bob, {"chatMessageDestroy": {"chatId": "1", "messageId": "3"}})
    act(bob, {"chatMessageRecall": {"chatId": "1", "messageId": "3", "cookie": "recall"}})
    act(alice, {"requestListMatching": {"type": "chatMessage", "cookie": "all", "criteria": {"chatId": "1"},
                                        "window": {"messageId": 1, "before": 0, "after": 50}}})
    bob_uri = next(element["userUri"] for event in alice.all if "listAdd" in event and body(event)["type"] == "chatParticipant"
                   for element in body(event)["elements"])
    act(alice, {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "@bob?", "mentions": [bob_uri], "cookie": "m3"}})
    act(bob, {"chatMessageMentionsGet": {"cookie": "mentions"}})
    act(alice, {"chatMessagePin": {"chatId": "1", "messageId": "2"}})
    act(alice, {"chatMessagePin": {"chatId": "1", "messageId": "2", "until": 4102444800}})
    # Moderation: a mute refuses bob's send and typing until it is lifted.
    act(alice, {"participantMute": {"chatId": "1", "userUri": bob_uri, "until": 4102444800}})
    act(bob, {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "muted?"}})
    act(bob, {"chatTyping": {"chatId": "1"}})
    act(alice, {"participantMute": {"chatId": "1", "userUri": bob_uri, "unmute": True}})
    # bob blocks alice: her messages are flagged for him, and no one-to-one chat either way.
    alice_uri = next(element["userUri"] for event in bob.all if "listAdd" in event and body(event)["type"] == "chatParticipant"
                     for element in body(event)["elements"])
    act(bob, {"userBlock": {"userUri": alice_uri}})
    act(alice, {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "still there?", "cookie": "m4"}})
    act(alice, {"chatStart": {"cookie": "one", "invitees": [{"userId": "bob"}], "isOneToOne": True}})
    act(bob, {"userBlock": {"userUri": alice_uri, "unblock": True}})
    # bob hides his presence: alice, watching, sees none of it.
    act(bob, {"presenceSet": {"hidden": True}})
    act(alice, {"presenceSet": {"watch": True}})
    act(bob, {"chatLeave": {"chatIds": ["1"]}})
    # Banned after he left: nobody can invite him back.
    act(alice, {"participantBan": {"chatId": "1", "userUri": bob_uri}})
    act(alice, {"chatInvite": {"chatId": "1", "invitees": [{"userId": "bob"}]}})
    events = {}
    for name, client in (("alice", alice), ("bob", bob)):
        client.close()
        events[name] = [VARYING_GLOBALS.sub(r'"name":"\1","value":"*"', VARYING.sub(r'"\1":"*"', line)) for line in map(_line, client.all)]
    return events


def assert_moderated(on_one):
    """The conversation's moderation, blocking and presence reached who they should."""
    assert any("you are muted in chat '1'" in line and "chatMessageSend" in line for line in on_one["bob"])
    assert any('"senderBlocked":true' in line for line in on_one["bob"]) and not any("senderBlocked" in line for line in on_one["alice"])
    assert any('"reason":"Blocked"' in line for line in on_one["alice"])
    assert any('"online":null' in line for line in on_one["alice"]), "alice sees no presence of bob's"
    assert any('"presenceHidden","value":true' in line for line in on_one["bob"])
    assert any('"banned":true' in line for line in on_one["alice"]) and any("is banned from chat '1'" in line for line in on_one["alice"])


def alice_and_bob_in_a_chat(writer, relay, subject):
    """alice on the writer starts a chat with bob on the relaying node; returns both
    clients and the chat's id."""
    alice, bob = Client(writer.socket), Client(relay.socket)
    auth(alice, "alice")
    auth(bob, "bob")
    return alice, bob, chat_with_bob(alice, subject)


def assert_kept(client, chat, announced):
    """Every message announced Sent (content → messageId) is in `chat` under that id, the
    chat's messages take consecutive ids, none twice; returns their ids, ascending."""
    stored = {}
    anchor = 1
    while True:
        listed = client.request({"requestListMatching": {"type": "chatMessage", "cookie": f"page{anchor}", "criteria": {"chatId": chat},
                                                         "window": {"messageId": anchor, "before": 0, "after": 999}}})
        elements = [element for event in listed if "listChunk" in event for element in body(event)["elements"]]
        for element in elements:
            if element.get("content") is not None:
                stored[element["content"]] = element["messageId"]
        if len(elements) < 1000:
            break
        anchor += 1000
    for content, message_id in announced.items():
        assert stored.get(content) == message_id, (content, message_id)
    ids = sorted(int(e) for e in stored.values())
    assert ids == list(range(ids[0], ids[0] + len(ids))), "no gap"
    assert len(set(stored.values())) == len(stored), "no id twice"
    return ids


def send_until_gone(chat, clients, answer_timeout):
    """Each client (by name) sends into `chat`, one message at a time, until its
    connection goes or its answer does not come; returns the sending threads (started)
    and what was announced Sent, content → messageId, filled as they go."""
    announced = {}
    lock = threading.Lock()

    def send(client, name):
        n = 0
        try:
            while True:
                client.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"{name}{n}", "cookie": f"{name}{n}"}})
                for event in client.answer(f"{name}{n}", timeout=answer_timeout):
                    if "listAdd" in event and body(event).get("cookie") == f"{name}{n}":
                        with lock:
                            announced[f"{name}{n}"] = body(event)["elements"][0]["messageId"]
                n += 1
        except Exception:
            return  # the node went, stopped answering, or closed the relayed connection

    threads = [threading.Thread(target=send, args=(client, name)) for name, client in clients.items()]
    for thread in threads:
        thread.start()
    return threads, announced


def _line(event):
    import json
    return json.dumps(_without_changed_activity(event), sort_keys=True, separators=(",", ":"))


def _without_changed_activity(event):
    """A chat's listChange carries lastActivity (seconds) only when the second changed, so
    whether it is there depends on when the run crossed a second: left out of changes."""
    if "listChange" in event:
        for element in event["listChange"].get("elements", []):
            element.pop("lastActivity", None)
    return event


def conversation_on_one_node(cluster, scratch, database):
    """What each user receives in the scripted conversation with both on one node."""
    cluster.create_database(database)
    single = Node(cluster.database_url(database), scratch, database)
    on_one = conversation(single.socket, single.socket)
    assert single.stop() == 0
    return on_one


def test_users_on_two_nodes_see_what_they_would_see_on_one(cluster, scratch):
    on_one = conversation_on_one_node(cluster, scratch, "single")
    writer, relay = two_nodes(cluster, scratch, "pair")
    on_two = conversation(writer.socket, relay.socket)
    assert on_two["alice"] == on_one["alice"]
    assert on_two["bob"] == on_one["bob"]
    # And the other way round: alice on the relaying node.
    assert relay.stop() == 0
    assert writer.stop() == 0
    assert len(on_one["bob"]) > 20, "the conversation reached bob"
    assert any('"reactions":[{"count":2,"mine":true' in line for line in on_one["bob"]), "reactions reached bob"
    assert any('"numUnreadMentions":1' in line for line in on_one["bob"]), "the mention reached bob"
    assert any('"pinnedMessages":["2"]' in line for line in on_one["bob"]), "the pin reached bob"
    assert_moderated(on_one)


def test_a_standard_input_output_session_relayed_to_the_writer_sees_what_it_would_see_there(cluster, scratch):
    # Bob's session is the standard input/output of a node started as bob (--user), the
    # way an application spawns chatcore: on the writer itself, then on a node that is
    # not the writer (no --listen), which relays it.
    cluster.create_database("stdio1")
    url = cluster.database_url("stdio1")
    single = Node(url, scratch, "stdio1-single", "--user", "bob", stdio=True)
    # Bob's session is set up first either way (the trusted user is the store's first).
    bob = StdioClient(single.process)
    bob.request({"identitiesGet": {"cookie": "up", "appUserIds": ["bob"]}})
    on_one = conversation(single.socket, bob)
    assert single.stop() == 0

    cluster.create_database("stdio2")
    url = cluster.database_url("stdio2")
    writer = Node(url, scratch, "stdio2-writer")
    writer.wait_until_logged("this node is the writer")
    bob = StdioClient.spawn(url, scratch, "stdio2-bob", "--user", "bob")
    bob.request({"identitiesGet": {"cookie": "up", "appUserIds": ["bob"]}})
    on_two = conversation(writer.socket, bob)
    assert on_two["alice"] == on_one["alice"]
    assert on_two["bob"] == on_one["bob"]
    assert "relaying standard input/output to it" in bob.logged()
    # Its input ended: the writer answered all of it, and the relaying process ends.
    assert bob.process.wait(timeout=30) == 0
    assert writer.stop() == 0
    assert len(on_one["bob"]) > 20, "the conversation reached bob"
    assert any('"reactions":[{"count":2,"mine":true' in line for line in on_one["bob"]), "reactions reached bob"
    assert any('"numUnreadMentions":1' in line for line in on_one["bob"]), "the mention reached bob"
    assert any('"pinnedMessages":["2"]' in line for line in on_one["bob"]), "the pin reached bob"
    assert_moderated(on_one)


def test_nodes_of_standard_input_output_only_serve_one_domain(cluster, scratch):
    # Two applications each spawn chatcore on the same database, as alice and as bob:
    # the first is the writer (it listens on loopback for the sessions of other nodes),
    # the second relays its session to it.
    cluster.create_database("spawned")
    url = cluster.database_url("spawned")
    alice = StdioClient.spawn(url, scratch, "spawned-alice", "--user", "alice")
    alice.request({"identitiesGet": {"cookie": "up", "appUserIds": ["alice"]}})
    assert "listening for sessions relayed by other nodes" in alice.logged()
    bob = StdioClient.spawn(url, scratch, "spawned-bob", "--user", "bob")
    bob.request({"identitiesGet": {"cookie": "up", "appUserIds": ["bob"]}})
    chat = chat_with_bob(alice, "spawned")
    sent = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "hello", "cookie": "m"}})
    message_id = next(body(e)["elements"][0]["messageId"] for e in sent if "listAdd" in e and body(e).get("cookie") == "m")
    wait_for(lambda: any("listAdd" in e and body(e)["type"] == "chatMessage" and body(e)["elements"][0].get("content") == "hello" for e in bob.all),
             bob.all, timeout=30)
    # The relayed session's lines are numbered as the client sent them (the relaying
    # node's own first line is not counted).
    failed = bob.request({"chatMessageSend": {"chatId": chat, "cookie": "bad"}})[-1]
    assert "requestFailed" in failed and body(failed)["line"] == 2, failed
    reply = bob.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "hi", "cookie": "r"}})
    assert any("listAdd" in e and body(e).get("cookie") == "r" and int(body(e)["elements"][0]["messageId"]) == int(message_id) + 1 for e in reply)
    # A relaying node stopped by SIGTERM ends its session as the end of its input would.
    carol = StdioClient.spawn(url, scratch, "spawned-carol", "--user", "carol")
    carol.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "not hers", "cookie": "x"}},
               {"identitiesGet": {"cookie": "up", "appUserIds": ["carol"]}})
    carol.answer("up")
    carol.process.send_signal(signal.SIGTERM)
    assert carol.process.wait(timeout=30) == 0
    assert carol.closed.wait(timeout=30)
    # The writer's input ends: it stops, and the session relayed to it is over (its
    # client starts chatcore again, which then serves by itself).
    alice.close()
    assert alice.process.wait(timeout=30) == 0
    assert bob.process.wait(timeout=30) == 1
    assert "the writer node closed the relayed session" in bob.logged()
    again = StdioClient.spawn(url, scratch, "spawned-bob-again", "--user", "bob")
    listed = again.request({"requestListMatching": {"type": "chatMessage", "cookie": "l", "criteria": {"chatId": chat},
                                                    "window": {"messageId": 1, "before": 0, "after": 10}}})
    contents = [element.get("content") for event in listed if "listChunk" in event for element in body(event)["elements"]]
    assert "hello" in contents and "hi" in contents
    assert "this node is the writer" in again.logged()
    again.close()
    assert again.process.wait(timeout=30) == 0


def send_at_once(chat, clients, per_sender):
    """Each client (by name) pipelines `per_sender` sends into `chat`, all at once; returns
    what each send was announced Sent as, content → messageId."""
    announced = {}

    def send(client, name):
        client.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"{name}{n}", "cookie": f"{name}{n}"}}
                      for n in range(per_sender)])
        for n in range(per_sender):
            for event in client.answer(f"{name}{n}", timeout=120):
                if "listAdd" in event and body(event).get("cookie") == f"{name}{n}":
                    announced[f"{name}{n}"] = int(body(event)["elements"][0]["messageId"])

    threads = [threading.Thread(target=send, args=(client, name)) for name, client in clients.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    return announced


def test_concurrent_sends_through_both_nodes_take_ids_one_to_n(cluster, scratch):
    writer, relay = two_nodes(cluster, scratch, "ids")
    alice, bob, chat = alice_and_bob_in_a_chat(writer, relay, "race")
    bob.request({"identitiesGet": {"cookie": "joined", "appUserIds": ["bob"]}})
    per_sender = 500
    announced = send_at_once(chat, {"a": alice, "b": bob}, per_sender)
    assert len(announced) == 2 * per_sender
    ids = sorted(announced.values())
    # Message 1 is bob's Join; the sends take 2..N+1, each once.
    assert ids == list(range(2, 2 + 2 * per_sender))
    rows = cluster.psql(f"SELECT id FROM message WHERE chat = {int(chat)} ORDER BY id", database="ids").split()
    assert [int(r) for r in rows] == list(range(1, 2 + 2 * per_sender))
    alice.close()
    bob.close()
    assert relay.stop() == 0
    assert writer.stop() == 0


def test_sigkill_of_the_writer_under_load_loses_nothing_announced(cluster, scratch):
    writer, relay = two_nodes(cluster, scratch, "kill")
    alice, bob, chat = alice_and_bob_in_a_chat(writer, relay, "load")
    threads, announced = send_until_gone(chat, {"a": alice, "b": bob}, answer_timeout=10)
    time.sleep(1.5)
    writer.process.kill()
    writer.process.wait()
    for thread in threads:
        thread.join(timeout=60)
    assert len(announced) > 50
    # The relaying node takes over; clients connect to it again and catch up.
    relay.wait_until_logged("this node holds the writer lock now")
    relay.wait_until_logged("this node is the writer")
    carol = _connect_when_serving(relay, "alice")
    assert_kept(carol, chat, announced)
    # The new writer goes on taking sends.
    answer = carol.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    assert any("listAdd" in e and body(e).get("cookie") == "after" for e in answer)
    carol.close()
    assert relay.stop() == 0


def test_a_relaying_node_stopped_while_it_takes_over_stops_cleanly(cluster, scratch):
    """SIGTERM to the relaying node just after the writer stopped (it is taking the lock,
    opening the store, starting to serve): it stops, exit 0, within the stop's deadline.
    It used to go on serving with its stop stuck for ever half-way."""
    for attempt, delay in enumerate((0, 0, 0.02, 0.1, 0.3, 0.6)):
        writer, relay = two_nodes(cluster, scratch, f"takeover{attempt}")
        assert writer.stop() == 0
        time.sleep(delay)
        relay.process.terminate()
        try:
            code = relay.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            relay.process.kill()
            relay.process.wait()
            pytest.fail(f"the relaying node did not stop (SIGTERM {delay} s after the writer stopped)\n{relay.logged()}")
        assert code == 0, relay.logged()
        assert "Cannot schedule tasks" not in relay.logged()


def test_both_nodes_outlive_a_restart_of_postgresql_and_the_writer_stays_the_writer(cluster, scratch):
    """PostgreSQL restarted with two idle nodes: the writer takes its lock again at once,
    the relaying node waits on (it used to die: its wait for the lock failed with the
    connection), and a conversation across the nodes goes on."""
    writer, relay = two_nodes(cluster, scratch, "restart")
    cluster.pg_ctl("-m", "fast", "-w", "restart")
    writer.wait_until_logged("taking it again")
    # The restart meets the relaying node waiting on its connection, or (a slow start:
    # ThreadSanitizer) still making it, which then tries again the same way.
    relay.wait_until_logged("waiting for the writer lock: waiting again", 30, "cannot reach PostgreSQL: trying again")
    time.sleep(3)  # past the relaying node's pause after losing its connection
    assert writer.process.poll() is None, writer.logged()
    assert relay.process.poll() is None, relay.logged()
    assert "holds the writer lock now" not in relay.logged()
    alice, bob = Client(relay.socket), Client(writer.socket)
    auth(alice, "alice")
    auth(bob, "bob")
    chat = chat_with_bob(alice, "after")
    sent = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "still here", "cookie": "m"}})
    assert any("listAdd" in e and body(e).get("cookie") == "m" for e in sent), sent
    got = bob.request({"identitiesGet": {"cookie": "sync", "appUserIds": ["bob"]}})
    assert any("listAdd" in e and body(e)["type"] == "chatMessage" and body(e)["elements"][0].get("content") == "still here" for e in got), got
    alice.close()
    bob.close()
    assert relay.stop() == 0
    assert writer.stop() == 0


# The writer lock's key (PostgresStore.writerLockKey), and how pg_locks shows an
# advisory lock on a bigint: its low 32 bits in objid.
WRITER_LOCK_KEY = 0x6368_6174_636F_7265
WRITER_LOCK_OBJID = WRITER_LOCK_KEY & 0xFFFFFFFF


def test_a_commit_in_flight_when_the_writer_lost_its_lock_lands_before_the_next_writer_reads_or_not_at_all(cluster, scratch):
    """The writer loses its lock while one of its commits waits (on a table lock the test
    holds), and another session gets the lock first (the test's, standing in for a node
    that won the race), then lets the relaying node have it. The relaying node must not
    read the store before that commit is decided. It used to: it served from memory that
    lacked the message, its first send into the chat took the same id (refused
    Internal, a duplicate key), and the old writer, idle, went on serving. Now the commit
    either lands first (the next writer's epoch waits for the commit's share lock on the
    epoch row, taken before it waits for the table) or is refused (its fence sees the next
    epoch: a commit written as one statement takes its table locks before its fence
    runs), and the old writer stops at once. Either way nothing announced is lost and the
    ids stay consecutive."""
    writer, relay = two_nodes(cluster, scratch, "fence")
    alice = Client(writer.socket)
    auth(alice, "alice")
    chat = chat_with_bob(alice, "fence")
    before = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "before", "cookie": "before"}})
    before_id = int(body(next(e for e in before if "listAdd" in e and body(e).get("cookie") == "before"))["elements"][0]["messageId"])

    def count(sql):
        return int(cluster.psql(sql, database="fence"))

    message_locks = "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation WHERE c.relname = 'message' AND "
    writer_lock = f"SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND l.objid = {WRITER_LOCK_OBJID} AND "
    holder = PsqlSession(cluster, "fence")
    try:
        holder.run("BEGIN; LOCK TABLE message IN SHARE MODE;")
        wait_for(lambda: count(message_locks + "l.mode = 'ShareLock' AND l.granted") == 1, "the test holds the message table")
        alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "in flight", "cookie": "flight"}})
        wait_for(lambda: count(message_locks + "NOT l.granted") == 1, "the writer's commit waits for the table")
        # Queued for the writer lock before the writer loses it: granted when it does.
        holder.run(f"SELECT pg_advisory_lock({WRITER_LOCK_KEY});")
        wait_for(lambda: count(writer_lock + "NOT l.granted AND a.application_name = 'psql'") == 1, "the test waits for the writer lock")
        cluster.psql(f"SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = {WRITER_LOCK_OBJID}")
        wait_for(lambda: count(writer_lock + "l.granted AND a.application_name = 'psql'") == 1, "the test holds the writer lock")
        # The old writer cannot take its lock back: it stops (once its commit is done).
        writer.wait_until_logged("another chatcore process became the writer")
        holder.run(f"SELECT pg_advisory_unlock({WRITER_LOCK_KEY});")
        relay.wait_until_logged("this node holds the writer lock now")
        time.sleep(1)  # time for a relaying node that does not wait to read the store
        holder.run("COMMIT;")
        holder.end()
    finally:
        holder.kill()
    flight = alice.answer("flight")
    sent = [e for e in flight if "listAdd" in e and body(e).get("cookie") == "flight"]
    refused = [e for e in flight if "requestFailed" in e and body(e)["error"] == "Internal"]
    assert len(sent) + len(refused) == 1, flight
    if sent:
        assert int(body(sent[0])["elements"][0]["messageId"]) == before_id + 1
    stored = [f"{before_id}|before"] + ([f"{before_id + 1}|in flight"] if sent else [])
    assert writer.process.wait(timeout=20) == 1, writer.logged()
    relay.wait_until_logged("this node is the writer")
    carol = Client(relay.socket)
    auth(carol, "alice")
    after = carol.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    added = [e for e in after if "listAdd" in e and body(e).get("cookie") == "after"]
    assert added, after
    after_id = before_id + len(stored)
    assert int(body(added[0])["elements"][0]["messageId"]) == after_id
    rows = cluster.psql(f"SELECT id, content FROM message WHERE chat = {int(chat)} AND tag = 'Text' ORDER BY id", database="fence").split("\n")
    assert [r for r in rows if r] == stored + [f"{after_id}|after"]
    carol.close()
    assert relay.stop() == 0


def test_a_writer_that_stops_answering_is_replaced_and_stops_when_it_wakes(cluster, scratch):
    """SIGSTOP stands for a writer whose machine went silent (power lost, network cut):
    PostgreSQL would keep its lock until TCP gives up (hours, by default), so the relaying
    node used to wait for ever. Now the writer beats every second; after --writer-timeout
    without a beat the waiting node ends the writer's database sessions and takes over.
    Nothing announced Sent is lost, and the old writer, woken, stops: the epoch fences it."""
    writer, relay = two_nodes(cluster, scratch, "silent", "--writer-timeout", "3")
    alice, bob, chat = alice_and_bob_in_a_chat(writer, relay, "silent")
    threads, announced = send_until_gone(chat, {"a": alice, "b": bob}, answer_timeout=8)
    time.sleep(1.5)
    os.kill(writer.process.pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        relay.wait_until_logged("ending its sessions to take over", timeout=20)
        relay.wait_until_logged("this node is the writer", timeout=30)
        took_over = time.time() - stopped_at
    finally:
        os.kill(writer.process.pid, signal.SIGCONT)
    assert 2 <= took_over < 15, took_over  # 3 s after the last beat, which came up to 1 s before
    # Woken, the old writer finds another writer and stops.
    assert writer.process.wait(timeout=30) == 1, writer.logged()
    assert "another chatcore process became the writer" in writer.logged()
    for thread in threads:
        thread.join(timeout=60)
    assert len(announced) > 20
    carol = Client(relay.socket)
    auth(carol, "alice")
    ids = assert_kept(carol, chat, announced)
    answer = carol.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    added = [e for e in answer if "listAdd" in e and body(e).get("cookie") == "after"]
    assert added and int(body(added[0])["elements"][0]["messageId"]) == ids[-1] + 1, answer
    carol.close()
    assert relay.stop() == 0


def _search(client, text, cookie):
    answer = client.request({"search": {"cookie": cookie, "text": text}})
    return [key["messageId"] for key in body(answer[-1])["messages"]]


def _connect_when_serving(node, user):
    """A client of `node` once it serves (it may still be taking over)."""
    return connect_when_serving(node.socket, user, why=node.logged)


def test_a_message_recalled_while_a_node_relayed_is_not_found_by_it_once_it_writes_again(cluster, scratch):
    """Node A indexes a message and stops; node B, writing now, recalls it; A comes back,
    and takes over when B stops: a search on A must not find the message. When each node
    kept an index of its own, A's still had the text (it never saw the recall), and A found
    the message (the index's hits were trusted). The index is the database's now, and a
    hit is checked against the store anyway."""
    writer, relay = two_nodes(cluster, scratch, "recall")
    alice, bob, chat = alice_and_bob_in_a_chat(writer, relay, "secrets")
    sent = alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "the launch code is swordfish", "cookie": "s"}})
    message = next(body(e)["elements"][0]["messageId"] for e in sent if "listAdd" in e and body(e).get("cookie") == "s")
    assert _search(alice, "swordfish", "q1") == [message]
    alice.close()
    bob.close()
    assert writer.stop() == 0

    relay.wait_until_logged("this node is the writer")
    alice = _connect_when_serving(relay, "alice")
    alice.send({"chatMessageDestroy": {"chatId": chat, "messageId": message}})  # no answer: the search after it is
    assert _search(alice, "swordfish", "q2") == []
    alice.close()

    again = Node(cluster.database_url("recall"), scratch, "recall-a")  # A's data directory, its index
    again.wait_until_logged("relaying connections to it")
    assert relay.stop() == 0
    again.wait_until_logged("this node is the writer")
    alice = _connect_when_serving(again, "alice")
    assert _search(alice, "swordfish", "q3") == []
    assert _search(alice, "launch", "q4") == []
    alice.close()
    assert again.stop() == 0


def test_the_search_index_is_the_databases_so_a_node_that_takes_over_searches_at_once(cluster, scratch):
    """The index is in PostgreSQL, written by each commit: a node that takes over has
    nothing to index first, and keeps no index of its own. Before, each node had one: a
    relaying node followed the store to keep it (as much CPU as the writer's indexing),
    and, before that, indexed everything written while it relayed once it took over (at
    10,000,000 messages, about 7 minutes during which searches waited)."""
    writer, relay = two_nodes(cluster, scratch, "follow")
    alice, bob, chat = alice_and_bob_in_a_chat(writer, relay, "history")
    bob.close()
    alice.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"entry {n} of the log"}} for n in range(300)])
    alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "the needle", "cookie": "last"}})
    assert cluster.psql("SELECT count(*) FROM message_search", database="follow").strip() == "301"
    alice.close()
    writer.process.kill()
    writer.process.wait()
    relay.wait_until_logged("this node is the writer")
    alice = _connect_when_serving(relay, "alice")
    assert len(_search(alice, "needle", "q")) == 1
    assert len(_search(alice, "of the log", "q2")) == 100  # a search's default limit
    assert "the search index lacks messages" not in relay.logged()
    assert not any(name.startswith("search.sqlite") for name in os.listdir(os.path.join(scratch, "follow-b")))
    alice.close()
    assert relay.stop() == 0


def holding_the_chat_table(cluster, database):
    """A PostgreSQL session of the test's holding `database`'s chat table, returned once
    the lock is granted: a node taking over reads it before it serves, and waits there
    until the session's `COMMIT` (or `kill`)."""
    holder = PsqlSession(cluster, database)
    try:
        holder.run("BEGIN; LOCK TABLE chat IN ACCESS EXCLUSIVE MODE;")
        wait_for(lambda: cluster.psql("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation WHERE c.relname = 'chat' "
                                      "AND l.mode = 'AccessExclusiveLock' AND l.granted", database=database).strip() == "1",
                 "the test holds the chat table")
    except BaseException:
        holder.kill()
        raise
    return holder


def test_a_client_of_a_relaying_node_waits_for_the_next_writer_while_it_starts(cluster, scratch):
    """The writer dies; one relaying node takes over and is held (the test locks the chat
    table, which it reads before it serves); a client connects meanwhile to the other
    relaying node. The old writer's address must be gone (the next writer removes it when
    it takes its epoch), and the client must wait for the new writer, not be closed: it
    used to be relayed to the dead writer's address and closed at once."""
    writer, first = two_nodes(cluster, scratch, "handover")
    second = Node(cluster.database_url("handover"), scratch, "handover-c")
    second.wait_until_logged("relaying connections to it")
    alice = Client(writer.socket)
    auth(alice, "alice")
    chat = chat_with_bob(alice, "handover")
    alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "before", "cookie": "before"}})
    alice.close()

    def value(sql):
        return cluster.psql(sql, database="handover").strip()

    epoch = int(value("SELECT epoch FROM writer_epoch"))
    holder = holding_the_chat_table(cluster, "handover")
    try:
        writer.process.kill()
        writer.process.wait()
        wait_for(lambda: int(value("SELECT epoch FROM writer_epoch")) != epoch, "no node took the next epoch")
        taking, relaying = (first, second) if "this node holds the writer lock now" in first.logged() else (second, first)
        assert "this node holds the writer lock now" in taking.logged()
        assert value("SELECT count(*) FROM writer_node") == "0", "the dead writer's address is still advertised"
        carol = Client(relaying.socket)
        start_auth(carol, "alice")
        # One that sends all it has and ends its input while it waits: what it sent is
        # relayed once a writer serves (it was read at its end and dropped).
        grace = Client(relaying.socket)
        start_auth(grace, "grace", "grace")
        grace.sock.shutdown(socket.SHUT_WR)
        time.sleep(1.5)
        assert not carol.closed.is_set(), "the relaying node closed a client while the next writer was starting\n" + relaying.logged()
        assert "this node is the writer" not in taking.logged()
        holder.run("COMMIT;")
        holder.end()
    finally:
        holder.kill()
    try:
        carol.answer("auth-sync")
    except queue.Empty:
        pytest.fail("the waiting client was not served once the next writer served\n" + relaying.logged())
    try:
        grace.answer("grace-sync")
    except queue.Empty:
        pytest.fail("what a client sent before it ended its input, while it waited for the writer, was lost\n" + relaying.logged())
    grace.close()
    answer = carol.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "after", "cookie": "after"}})
    added = [e for e in answer if "listAdd" in e and body(e).get("cookie") == "after"]
    assert added, answer
    carol.close()
    assert relaying.stop() == 0
    assert taking.stop() == 0


def test_nodes_killed_and_replaced_one_after_another_under_load_lose_nothing_announced(cluster, scratch):
    """Three nodes, and four rounds of senders spread over them, one message at a time
    into one chat. In each round a node goes under load and a new one joins: the writer
    (SIGKILL), a relaying node (SIGKILL), the writer (SIGTERM), the writer again
    (SIGKILL). Every message announced Sent is kept under its id, and the chat's ids stay
    consecutive with none twice, across three takeovers."""
    cluster.create_database("rounds")
    url = cluster.database_url("rounds")
    names = iter(range(100))

    def join():
        return Node(url, scratch, f"rounds-{next(names)}")

    nodes = [join()]
    nodes[0].wait_until_logged("this node is the writer")
    nodes += [join(), join()]
    for node in nodes[1:]:
        node.wait_until_logged("relaying connections to it")
    alice = _connect_when_serving(nodes[0], "alice")
    chat = chat_with_bob(alice, "rounds")
    alice.close()
    announced = {}
    for number, (goes, how) in enumerate([("writer", signal.SIGKILL), ("relay", signal.SIGKILL), ("writer", signal.SIGTERM),
                                         ("writer", signal.SIGKILL)]):
        clients = {f"r{number}c{k}-": _connect_when_serving(nodes[k % len(nodes)], ("alice", "bob")[k % 2]) for k in range(4)}
        threads, sent = send_until_gone(chat, clients, answer_timeout=20)
        time.sleep(1.5)
        # A writer serves its own clients just before it advertises itself.
        address = wait_for(lambda: cluster.psql("SELECT address FROM writer_node", database="rounds").strip(), "no writer advertised", timeout=30)
        writer = next(node for node in nodes if address.endswith(node.socket))
        victim = writer if goes == "writer" else next(node for node in nodes if node is not writer)
        victim.process.send_signal(how)
        assert victim.process.wait(timeout=60) == (0 if how == signal.SIGTERM else -how), victim.logged()
        nodes.remove(victim)
        time.sleep(1)
        for client in clients.values():
            client.close()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a sender got no answer and no close"
        assert len(sent) > 20, (number, goes, len(sent))
        announced.update(sent)
        nodes.append(join())
    checker = _connect_when_serving(nodes[-1], "alice")
    assert_kept(checker, chat, announced)
    checker.close()
    for node in nodes:
        assert node.stop() == 0, node.logged()


def test_a_relaying_node_serves_metrics_and_says_whether_it_decides(cluster, scratch):
    """`--metrics` on every node: a relaying node serves them too (it used to serve none
    until it took over), with `chatcore_deciding` 0 and the connections it relays; the
    writer says 1; and the relaying node's endpoint goes on across its takeover."""
    def port_of(node):
        node.wait_until_logged("serving metrics")
        return int(re.search(r"port=(\d+) \[chatcore\] serving metrics", node.logged()).group(1))

    def value(node, name):
        return scrape(port_of(node))[(name, frozenset())]

    def event_loop_groups(node):
        # NIO names its event-loop threads NIO-ELT-<group>-#<thread>: the metrics and the
        # relayed sockets share one group (PostgreSQL's connections use NIO's singleton).
        tasks = f"/proc/{node.process.pid}/task"
        names = [open(f"{tasks}/{task}/comm").read().strip() for task in os.listdir(tasks)]
        return {name.split("-")[2] for name in names if name.startswith("NIO-ELT-")}

    writer, relay = two_nodes(cluster, scratch, "metrics", "--metrics", "127.0.0.1:0")
    assert value(writer, "chatcore_deciding") == 1
    assert value(relay, "chatcore_deciding") == 0
    assert len(event_loop_groups(relay)) == 1, event_loop_groups(relay)
    # The harness's probe that the node listens was a connection too, closed since.
    wait_for(lambda: value(relay, "chatcore_relayed_connections_open") == 0, "the probe's connection is still counted", timeout=10)
    before = value(relay, "chatcore_relayed_connections_total")
    alice = Client(relay.socket)
    auth(alice, "alice")
    assert value(relay, "chatcore_relayed_connections_open") == 1
    assert value(relay, "chatcore_relayed_connections_total") == before + 1
    assert value(writer, "chatcore_sessions") == 1
    alice.close()
    wait_for(lambda: value(relay, "chatcore_relayed_connections_open") == 0, "a closed relayed connection is still counted", timeout=10)
    writer.process.kill()
    writer.process.wait()
    relay.wait_until_logged("this node is the writer")
    assert value(relay, "chatcore_deciding") == 1
    assert len(event_loop_groups(relay)) == 1, event_loop_groups(relay)
    assert relay.stop() == 0


def test_a_relayed_client_slow_to_read_gets_every_answer_before_the_writer_closes_it(cluster, scratch):
    """A client that sends its requests, ends its input and reads slowly: the writer answers
    everything and closes the session; the relaying node passes that close on only once
    it has written every answer (before, what it still held was dropped with the close)."""
    writer, relay = two_nodes(cluster, scratch, "slowreader")
    requests = 3000
    client = socket.socket(socket.AF_UNIX)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(relay.socket)
    lines = [{"authToken": {"userId": "bob", "authToken": "any", "cookie": "a"}}]
    lines += [{"identitiesGet": {"cookie": f"i{n}", "appUserIds": ["bob"]}} for n in range(requests)]
    client.sendall(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    client.shutdown(socket.SHUT_WR)
    received = b""
    while chunk := client.recv(8192):
        received += chunk
        time.sleep(0.005)
    client.close()
    # What follows the last newline is a line cut short.
    answered = {body(json.loads(line)).get("cookie") for line in received.split(b"\n")[:-1]}
    assert {f"i{n}" for n in range(requests)} <= answered, f"{len(answered)} answers of {requests}"
    assert relay.stop() == 0
    assert writer.stop() == 0


def test_a_node_taking_over_keeps_listening_and_serves_who_connected_meanwhile(cluster, scratch):
    """The writer dies; the relaying node takes the lock and reads the store (held there by
    the test, which locks the chat table). Its socket stays: a client connecting then waits
    and is served once the node serves. Before, the node closed its listeners when it took
    the lock and listened again once it served: a client connecting in between found no
    socket (ENOENT; on TCP, refused)."""
    writer, relay = two_nodes(cluster, scratch, "keeplistening")
    holder = holding_the_chat_table(cluster, "keeplistening")
    try:
        writer.process.kill()
        writer.process.wait()
        relay.wait_until_logged("this node holds the writer lock now")
        assert "this node is the writer" not in relay.logged()
        dave = Client(relay.socket)
        start_auth(dave, "dave")
        # One that sends all it has and ends its input while held: answered too.
        frank = Client(relay.socket)
        start_auth(frank, "frank", "frank")
        frank.sock.shutdown(socket.SHUT_WR)
        time.sleep(1)
        assert not dave.closed.is_set() and dave.all == []
        holder.run("COMMIT;")
        holder.end()
    finally:
        holder.kill()
    dave.answer("auth-sync")
    frank.answer("frank-sync")
    frank.close()
    # And those who connect afterwards are served as ever.
    erin = connect_when_serving(relay.socket, "erin")
    erin.close()
    dave.close()
    assert relay.stop() == 0
