"""WebSocket listeners (`--listen ws://HOST:PORT/PATH`), driven by a WebSocket library from
PyPI (`websockets`) and by hand-made frames on a raw socket: the same sessions as on TCP,
one message per text frame; an Origin not allowed, a wrong path or a plain HTTP request is
refused before the upgrade; binary and oversized frames, a client that does not sign in in
time or does not read, and a stopping service each close with a code that says why."""
import base64
import json
import os
import re
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from chatcore_harness import Client, auth, body, chatcore_binary


def serve(work, *arguments, log=None):
    """chatcore with a WebSocket listener at /chat and a Unix socket; (process, ws URL, socket
    path). `log`: a list that gets what it logs."""
    path = os.path.join(work, "s")
    process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", os.path.join(work, "d"), "--listen", "ws://127.0.0.1:0/chat",
                                "--listen", "unix:" + path, "--insecure-no-auth", *arguments],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    for line in process.stderr:
        if "listening" in line and "ws://" in line:
            port = int(re.search(r"port=(\d+)", line).group(1))
        if "listening" in line and "unix:" in line:
            break
    def keep():
        for line in process.stderr:
            if log is not None:
                log.append(line)

    threading.Thread(target=keep, daemon=True).start()
    assert port, "chatcore did not say where it listens"
    return process, f"ws://127.0.0.1:{port}/chat", path


def stop(process):
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def receive_until(ws, predicate, timeout=10):
    """Messages received until one for which `predicate` is true (included)."""
    got = []
    deadline = time.time() + timeout
    while True:
        message = json.loads(ws.recv(timeout=max(0.01, deadline - time.time())))
        got.append(message)
        if predicate(message):
            return got


def answered(cookie):
    return lambda message: any(isinstance(v, dict) and v.get("cookie") == cookie for v in message.values())


def test_a_session_over_a_websocket_talks_with_one_on_a_socket():
    with tempfile.TemporaryDirectory() as work:
        process, url, path = serve(work)
        try:
            bob = Client(path)
            auth(bob, "bob")
            with connect(url) as alice:
                alice.send(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}))
                first = json.loads(alice.recv(timeout=10))
                assert first["listChange"]["type"] == "global"
                alice.send(json.dumps({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "web"}}))
                started = receive_until(alice, answered("c"))
                chat = started[-1]["listAdd"]["elements"][0]["chatId"]
                bob.next_event(lambda e: e.get("listAdd", {}).get("type") == "chat")
                bob.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "hello browser\n(two lines)"}})
                added = receive_until(alice, lambda m: m.get("listAdd", {}).get("type") == "chatMessage" and
                                      m["listAdd"]["elements"][0].get("content", "").startswith("hello"))
                assert added[-1]["listAdd"]["elements"][0]["content"] == "hello browser\n(two lines)"
                # Several requests in one go, each its own frame; each answer its own frame.
                for n in range(3):
                    alice.send(json.dumps({"identitiesGet": {"cookie": f"i{n}", "appUserIds": ["bob"]}}))
                answers = receive_until(alice, answered("i2"))
                assert [m["identities"]["cookie"] for m in answers if "identities" in m] == ["i0", "i1", "i2"]
                # A request that fails is answered as on TCP.
                alice.send("{not json")
                failed = receive_until(alice, lambda m: "requestFailed" in m)
                assert failed[-1]["requestFailed"]["error"] == "ParseError"
            bob.close()
        finally:
            stop(process)


def test_origins_paths_and_plain_requests_are_refused_before_the_upgrade():
    with tempfile.TemporaryDirectory() as work:
        process, url, _ = serve(work, "--ws-allowed-origins", "https://chat.example, http://localhost:8080")
        try:
            with pytest.raises(InvalidStatus) as refused:
                connect(url, origin="https://evil.example")
            assert refused.value.response.status_code == 403
            assert b"--ws-allowed-origins" in refused.value.response.body
            with connect(url, origin="https://chat.example") as allowed:
                allowed.send(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}))
                assert "listChange" in json.loads(allowed.recv(timeout=10))
            with connect(url) as no_origin:  # not a browser
                no_origin.send(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}))
                assert "listChange" in json.loads(no_origin.recv(timeout=10))
            with pytest.raises(InvalidStatus) as wrong_path:
                connect(url.replace("/chat", "/other"))
            assert wrong_path.value.response.status_code == 404
            host, port = url[len("ws://"):].split("/")[0].split(":")
            with socket.create_connection((host, int(port))) as plain:
                plain.sendall(b"GET /chat HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = plain.recv(4096)
            assert answer.startswith(b"HTTP/1.1 426"), answer
        finally:
            stop(process)


def test_binary_and_oversized_frames_close_the_session_with_a_code():
    with tempfile.TemporaryDirectory() as work:
        process, url, _ = serve(work, "--max-line-bytes", "4096")
        try:
            with connect(url) as ws:
                ws.send(b"\x00binary")
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd.code == 1003
            with connect(url, max_size=None) as ws:
                ws.send(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}))
                ws.recv(timeout=10)
                ws.send("x" * 5000)
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd.code == 1009
            # Still serving.
            with connect(url) as ws:
                ws.send(json.dumps({"authToken": {"userId": "bob", "authToken": "x"}}))
                assert "listChange" in json.loads(ws.recv(timeout=10))
        finally:
            stop(process)


def handshake(url, receive_buffer=None):
    """A raw socket upgraded to a WebSocket by hand (nothing reads it after)."""
    host, rest = url[len("ws://"):].split("/", 1)
    address, port = host.split(":")
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((address, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /{rest} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(1)
    assert response.startswith(b"HTTP/1.1 101"), response
    return sock


def text_frame(text):
    payload = text.encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    length = len(payload)
    header = bytes([0x81]) + (bytes([0x80 | length]) if length < 126 else bytes([0x80 | 126]) + struct.pack("!H", length))
    return header + mask + masked


def test_a_client_that_never_reads_is_disconnected_as_on_tcp():
    """bob's browser tab stopped reading (a WebSocket on a raw socket, nothing read after
    the upgrade) while alice sends big messages into their chat: once more than
    --max-output-bytes wait for him he is disconnected, and alice goes on."""
    with tempfile.TemporaryDirectory() as work:
        logged = []
        process, url, path = serve(work, "--max-output-bytes", "1MiB", "--output-high-water", "256KiB", log=logged)
        try:
            bob = handshake(url, receive_buffer=4096)
            bob.sendall(text_frame(json.dumps({"authToken": {"userId": "bob", "authToken": "x"}})))
            alice = Client(path)
            auth(alice, "alice")
            alice.send({"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "subject": "big"}})
            alice.answer("s")
            content = "z" * 60_000
            # One at a time (alice reads each answer): only bob's output piles up.
            for n in range(200):
                alice.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": content, "cookie": f"m{n}"}})
                if any("does not read its output" in line for line in logged):
                    break
            assert any("does not read its output" in line for line in logged), "bob was not disconnected"
            bob.settimeout(10)
            try:
                while bob.recv(1 << 20):
                    pass
            except ConnectionResetError:
                pass
            alice.close()
        finally:
            stop(process)


def test_a_session_that_does_not_sign_in_in_time_and_the_service_stopping_close_with_codes():
    with tempfile.TemporaryDirectory() as work:
        process, url, _ = serve(work, "--auth-timeout", "1")
        try:
            with connect(url) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd.code == 1008 and "sign in" in closed.value.rcvd.reason
            with connect(url) as ws:
                ws.send(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}))
                ws.recv(timeout=10)
                process.send_signal(signal.SIGTERM)
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        ws.recv(timeout=10)
                assert closed.value.rcvd.code == 1001
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                stop(process)


def test_a_pipelined_burst_over_a_websocket_is_answered_whole():
    """More requests at once than the engine takes from one session (--max-requests-in-flight):
    its input is paused, and must be resumed when the engine catches up. A WebSocket's session
    handler joins the channel after it is active, and was never resumed: the burst stalled."""
    with tempfile.TemporaryDirectory() as work:
        process, url, _ = serve(work, "--max-requests-in-flight", "16")
        try:
            with connect(url, max_queue=None) as ws:
                ws.send(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}))
                ws.recv(timeout=10)
                ws.send(json.dumps({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "burst"}}))
                chat = receive_until(ws, answered("c"))[-1]["listAdd"]["elements"][0]["chatId"]
                # Each send is committed before it is answered: the engine falls behind at once.
                for n in range(3000):
                    ws.send(json.dumps({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"m{n}", "cookie": f"m{n}"}}))
                got = receive_until(ws, answered("m2999"), timeout=60)
                assert sum(1 for m in got if m.get("listAdd", {}).get("cookie", "").startswith("m")) == 3000
        finally:
            stop(process)
