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
