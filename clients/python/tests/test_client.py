"""The Python client against the real binary: every kind of outcome, two users, errors."""
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from chatcore import BinaryNotFound, ChatcoreError, ChatcoreTimeout, Client, EventsLost, Server, find_binary, protocol  # noqa: E402


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def stopped(pid, timeout=10):
    """Returns once every thread of `pid` is stopped: a signal's stop is not immediate,
    and a thread still running could answer what is sent after the signal."""
    deadline = time.time() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # the thread ended
        if states and all(state == "T" for state in states):
            return
        assert time.time() < deadline, f"not stopped: {states}"
        time.sleep(0.01)


def test_every_kind_of_outcome_over_standard_input_output(tmp_path):
    async def scenario():
        async with await Client.spawn("alice", data_dir=tmp_path) as alice:
            chat = await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="Plans"))
            assert chat["chatId"] == "1" and chat["subject"] == "Plans"
            one = await alice.request(protocol.chat_start(invitees=[{"userId": "carol"}], isOneToOne=True))
            # A started chat: the listAdd carrying the cookie; a refused one: chatStartFailed.
            with pytest.raises(ChatcoreError) as refused:
                await alice.request(protocol.chat_start(invitees=[{"userId": "carol"}], isOneToOne=True))
            assert refused.value.event == "chatStartFailed" and refused.value.error == "AlreadyExists"
            assert refused.value.body["chatId"] == one["chatId"]

            sent = await alice.request(protocol.chat_message_send(chatId="1", tag="Text", content="hello"))
            assert sent["content"] == "hello" and sent["messageId"] == "2" and sent["state"] == "Sent"

            listed = await alice.request(protocol.request_list_all(type="chat"))
            assert listed["header"]["type"] == "chat"
            assert sorted(c["chatId"] for c in listed["elements"]) == ["1", "2"]
            window = await alice.request(protocol.request_list_matching_chat_message(
                criteria={"chatId": "1"}, window={"messageId": "2", "before": 5}))
            assert [m["messageId"] for m in window["elements"]] == ["1", "2"]
            assert window["header"]["hasMoreBefore"] is False

            found = await alice.request(protocol.search(text="hell"))
            assert [m["messageId"] for m in found["messages"]] == ["2"]
            identities = await alice.request(protocol.identities_get(appUserIds=["alice"]))
            assert identities["info"][0]["appUserId"] == "alice"

            # Requests answered only when they fail: None on success, the failure by its line.
            assert await alice.request(protocol.chat_message_read(chatId="1", messageId="2")) is None
            with pytest.raises(ChatcoreError) as missing:
                await alice.request(protocol.chat_leave(chatIds=["99"]))
            assert missing.value.error == "NotFound" and missing.value.body["request"] == "chatLeave"
            with pytest.raises(ChatcoreError) as invalid:  # requestListChange has no cookie
                await alice.request({"requestListChange": {"type": "chat", "elements": [{"chatId": "1", "numUnread": 3}]}})
            assert invalid.value.error == "InvalidParameter" and "read-only" in invalid.value.reason
            # A decode failure of a request with a cookie is found by its cookie's line too.
            with pytest.raises(ChatcoreError) as bad:
                await alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "bogus": 1}})
            assert bad.value.error == "InvalidParameter"
            # After all that, the session is in order.
            assert (await alice.request(protocol.chat_message_send(chatId="1", tag="Text", content="again")))["messageId"] == "3"
    run(scenario())


def test_two_users_see_delivered_and_read():
    async def scenario():
        async with await Server.start() as server:
            alice = await server.connect("alice")
            assert alice.globals["setupState"] == {"state": "Success"}
            bob = await server.connect("bob")
            bob_events = bob.events()
            chat = await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="Lunch"))
            alice_events = alice.events()
            sent = await alice.request(protocol.chat_message_send(chatId=chat["chatId"], tag="Text", content="Noon?"))
            _, added = await bob.wait_for(lambda n, b: n == "listAdd" and b["type"] == "chatMessage"
                                          and b["elements"][0].get("content") == "Noon?", events=bob_events)
            message = added["elements"][0]
            assert message["flags"] == "I"
            await bob.request(protocol.chat_message_read(chatId=message["chatId"], messageId=message["messageId"]))
            seen = []
            async for name, body in alice_events:
                if name == "listChange" and body["type"] == "chatMessage":
                    seen += [e["state"] for e in body["elements"] if e.get("messageId") == sent["messageId"] and "state" in e]
                if "Read" in seen:
                    break
            assert seen == ["Delivered", "Read"]
            await alice.close()
            await bob.close()
    run(scenario())


def test_a_refused_token_raises_and_a_silent_service_times_out(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)

    async def scenario():
        async with await Server.start(args=("--auth-secret-file", str(secret), "--log-level", "warning")) as server:
            client = await server.connect()
            with pytest.raises(ChatcoreError) as refused:
                await client.authenticate("alice", "not-a-jwt")
            assert refused.value.event == "setupError" and refused.value.error == "InvalidToken"
            with pytest.raises(ChatcoreError) as unauthenticated:
                await client.request(protocol.chat_message_send(chatId="1", tag="Text", content="x"))
            assert unauthenticated.value.error == "NotAuthenticated"
            # A service that does not answer (stopped) leaves the request without an outcome.
            server.process.send_signal(signal.SIGSTOP)
            stopped(server.process.pid)
            try:
                with pytest.raises(ChatcoreTimeout):
                    await client.request({"chatTyping": {"chatId": "1"}}, timeout=0.3)
            finally:
                server.process.send_signal(signal.SIGCONT)
            await client.close()
    run(scenario())


def test_without_a_binary_the_error_says_how_to_point_at_one(tmp_path, monkeypatch):
    monkeypatch.delenv("CHATCORE_BINARY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("chatcore.client.__file__", str(tmp_path / "client.py"))
    with pytest.raises(BinaryNotFound) as error:
        find_binary()
    assert "CHATCORE_BINARY" in str(error.value) and "make build" in str(error.value)


def test_wait_for_closes_the_event_iterator_it_opened(tmp_path):
    async def scenario():
        async with await Client.spawn("alice", data_dir=tmp_path) as alice:
            for n in range(8):
                waiting = asyncio.ensure_future(alice.wait_for(lambda name, body, n=n: name == "identities" and body.get("cookie") == f"w{n}"))
                await asyncio.sleep(0)  # it is listening before the request goes out
                await alice.send(protocol.identities_get(cookie=f"w{n}", appUserIds=["alice"]))
                await waiting
            assert alice._subscribers == [], "each wait_for left a queue taking every later event"
    run(scenario())


def test_a_wrong_chatcore_binary_raises_the_clients_own_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATCORE_BINARY", str(tmp_path / "nothing-here"))
    with pytest.raises(BinaryNotFound) as error:
        find_binary()
    assert str(error.value) == f"CHATCORE_BINARY is {tmp_path / 'nothing-here'}, which is not an executable file: point it at the chatcore binary"


def test_the_package_installs_into_a_fresh_virtualenv_and_its_example_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the repository
    subprocess.run(["cp", "-r", str(HERE.parent), str(source)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(source)], check=True, timeout=300)
    done = subprocess.run([str(python), str(HERE.parent / "example.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CHATCORE_BINARY": find_binary()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["alice sees Delivered", "alice sees Read"]


def test_opened_with_async_with_and_no_extra_await_and_closed_at_the_end(tmp_path):
    async def scenario():
        async with Client.spawn("alice", data_dir=tmp_path / "spawned") as alice:
            assert (await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="s")))["chatId"] == "1"
            process = alice._process
        assert process is not None and process.returncode == 0, "the spawned chatcore was not ended with the block"
        async with Server.start() as server:
            async with server.connect("alice") as alice:
                assert alice.globals["authTokenState"] == "Ok"
            assert alice._writer.is_closing()
            process = server.process
        assert process.returncode is not None, "the server was not stopped with the block"
    run(scenario())


def test_a_tcp_listener_on_ipv6_loopback_is_reached_by_its_bracketed_address(tmp_path):
    import socket
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]

    async def scenario():
        listen = ("--listen", f"[::1]:{port}", "--insecure-no-auth", "--log-level", "warning")
        async with Server.start(args=listen, data_dir=tmp_path / "data"):
            # Server.start returns once its Unix socket serves; the TCP listener may open
            # a moment later.
            for _ in range(250):
                try:
                    _, probe = await asyncio.open_connection("::1", port)
                    probe.close()
                    break
                except OSError:
                    await asyncio.sleep(0.02)
            async with Client.connect(f"[::1]:{port}") as client:
                await client.authenticate("alice")
                assert client.globals["localUri"]
            with pytest.raises(ValueError):
                await Client.connect("::1")
    run(scenario())


def test_an_iterator_left_unread_keeps_its_bound_then_says_events_were_lost(tmp_path):
    async def scenario():
        async with Client.spawn("alice", data_dir=tmp_path) as alice:
            lagging = alice.events(max_buffered=5)
            following = alice.events()
            for n in range(8):
                await alice.request(protocol.identities_get(appUserIds=["alice"]))
            received = []
            with pytest.raises(EventsLost) as lost:
                async for name, _ in lagging:
                    received.append(name)
            assert len(received) == 5 and lost.value.kept == 5
            assert lagging not in alice._subscribers and len(alice._subscribers) == 1
            # The session and the other iterator lost nothing.
            names = [name for name, _ in [await following.__anext__() for _ in range(8)]]
            assert names == ["identities"] * 8
            assert (await alice.request(protocol.identities_get(appUserIds=["alice"])))["info"][0]["appUserId"] == "alice"
    run(scenario())


def test_wait_for_listens_from_the_call_not_from_the_await(tmp_path):
    async def scenario():
        async with Client.spawn("alice", data_dir=tmp_path) as alice:
            waiting = alice.wait_for(lambda name, body: name == "identities" and body.get("cookie") == "early")
            await alice.request(protocol.identities_get(cookie="early", appUserIds=["alice"]))
            # The answer arrived before anything awaited `waiting`: it is still seen.
            name, body = await waiting
            assert body["cookie"] == "early"
    run(scenario())
