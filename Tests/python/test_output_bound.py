"""A client that pipelines requests with huge answers and never reads cannot grow the
service's memory without bound (issue 11): its requests wait in the engine while its
unread output is over the mark, and everyone else is served meanwhile."""
import os
import socket
import subprocess
import tempfile
import time

from chatcore_harness import Client, auth, line, start_socket_server
from conftest import BOUND_SCALE, chatcore_binary


def peak_memory_mb(pid):
    for text in open(f"/proc/{pid}/status"):
        if text.startswith("VmHWM:"):
            return int(text.split()[1]) / 1024
    return 0


def test_a_never_reading_client_with_huge_answers_stays_bounded():
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "data")
        # A chat of 1,000 messages of 17 KB: a window over it is an ~18 MB answer.
        content = "y" * 17_000
        requests = [{"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "subject": "big"}}]
        requests += [{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": content}}] * 999
        made = subprocess.run([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                              input=b"".join(line(r) for r in requests), stdout=subprocess.DEVNULL, timeout=300)
        assert made.returncode == 0

        path = os.path.join(work, "s")
        server = start_socket_server(data, path)
        try:
            hog = socket.socket(socket.AF_UNIX)
            hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            hog.connect(path)
            window = {"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": "1"},
                                              "window": {"messageId": 1, "before": 0, "after": 999}, "cookie": "w"}}
            hog.sendall(line({"authToken": {"userId": "alice", "authToken": "any"}}) + line(window) * 200)
            # While the hog is stuck, someone else is served at once.
            bob = Client(path)
            auth(bob, "bob")
            started = time.time()
            bob.request({"identitiesGet": {"cookie": "i", "appUserIds": ["bob"]}})
            assert time.time() - started < 5 * BOUND_SCALE
            time.sleep(8)
            peak = peak_memory_mb(server.pid)
            assert server.poll() is None
            print("peak memory %.0f MB" % peak)
            assert peak < 500 * BOUND_SCALE, "peak memory %.0f MB with a never-reading client" % peak
            # The hog reads at last: it gets its answers, in order, up to the ones decided.
            hog.setblocking(False)
            received = 0
            deadline = time.time() + 20
            while received < 3 * 18_000_000 and time.time() < deadline:
                try:
                    chunk = hog.recv(1 << 20)
                    if not chunk:
                        break
                    received += len(chunk)
                except BlockingIOError:
                    time.sleep(0.01)
            assert received >= 3 * 18_000_000, received
            hog.close()
        finally:
            server.terminate()
            assert server.wait(timeout=60) == 0


def test_many_endpoints_that_never_read_are_bounded_together():
    """Each session's unread output is bounded (--max-output-bytes), but 40 endpoints of one
    user that never read, in a chat someone sends big messages into, held that bound each:
    the service's memory grew with the number of endpoints. Now the unread output of all
    clients together is bounded too (--max-output-total): while it is over, a client
    behind by more than its share is disconnected, and the sender goes on."""
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "s")
        server = start_socket_server(os.path.join(work, "data"), path, "--max-output-bytes", str(8 << 20),
                                     "--max-output-total", str(16 << 20))
        sinks = []
        try:
            time.sleep(0.5)
            baseline = peak_memory_mb(server.pid)
            for _ in range(40):
                sink = socket.socket(socket.AF_UNIX)
                sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sink.connect(path)
                sink.sendall(line({"authToken": {"userId": "mallory", "authToken": "any"}}))
                sinks.append(sink)
            sender = Client(path)
            auth(sender, "mallory")
            sender.send({"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "subject": "big"}})
            sender.answer("s", timeout=60)
            content = "z" * 60_000
            for n in range(150):
                sender.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": content, "cookie": f"m{n}"}})
            sender.answer("m149", timeout=300)
            grown = peak_memory_mb(server.pid) - baseline
            # 40 × 8 MB unread would be 320 MB; together they may keep 16 MB.
            assert grown < 150 * BOUND_SCALE, f"peak memory grew by {grown:.0f} MB"
            closed = 0
            for sink in sinks:
                sink.setblocking(False)
                try:
                    while sink.recv(1 << 20):
                        pass
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    pass
                closed += 1
            assert closed >= 30, f"only {closed} of the 40 endpoints that never read were disconnected"
            assert server.poll() is None
        finally:
            for sink in sinks:
                sink.close()
            server.terminate()
            server.wait(timeout=30)
