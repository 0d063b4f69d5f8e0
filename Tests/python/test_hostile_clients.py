"""Slow and hostile clients (issue 6): one that never reads, one that sends a byte at a
time, 1,000 idle connections and clients that hang up in the middle of a line do not
slow a normal session down much, keep memory bounded, and lose nothing."""
import json
import os
import re
import resource
import socket
import subprocess
import tempfile
import threading
import time

from conftest import BOUND_SCALE, chatcore_binary


def serve(data, *arguments):
    process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", data, "--listen", "127.0.0.1:0", "--insecure-no-auth",
                                *arguments],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        match = re.search(r"port=(\d+)", line)
        if match:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, int(match.group(1))
    raise AssertionError("chatcore did not start listening")


def peak_memory_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


class Normal:
    """A well-behaved session: sends one message at a time and waits for its Sent."""

    def __init__(self, port, user):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")
        self.send({"authToken": {"userId": user, "authToken": "-"}})
        self.file.readline()

    def send(self, message):
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def until(self, predicate):
        while True:
            line = self.file.readline()
            assert line, "the server closed a well-behaved session"
            if predicate(line):
                return line

    def latencies(self, count):
        times = []
        for n in range(count):
            start = time.perf_counter()
            self.send({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": f"normal {n}"}})
            self.until(lambda line: line.startswith(b'{"listAdd":{"type":"chatMessage"') and b'"state":"Sent"' in line)
            times.append(time.perf_counter() - start)
        times.sort()
        return times[int(len(times) * 0.99)]


def test_hostile_clients_do_not_hurt_a_normal_session():
    with tempfile.TemporaryDirectory() as data:
        process, port = serve(data)
        try:
            alice = Normal(port, "alice")
            alice.send({"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "subject": "calm"}})
            alice.until(lambda line: line.startswith(b'{"listAdd":{"type":"chat","cookie"'))
            alice.latencies(100)  # warm up
            baseline = alice.latencies(400)

            stop = threading.Event()
            # 1. never reads, and asks for a lot of output
            deaf = socket.create_connection(("127.0.0.1", port))
            deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

            def flood():
                request = json.dumps({"identitiesGet": {"cookie": "x" * 200, "appUserIds": ["alice", "bob"]}}).encode() + b"\n"
                deaf.sendall(b'{"authToken":{"userId":"deaf","authToken":"-"}}\n')
                deaf.settimeout(1)
                while not stop.is_set():
                    try:
                        deaf.sendall(request * 100)
                    except (socket.timeout, OSError):
                        time.sleep(0.05)
            # 2. a byte at a time
            def trickle():
                slow = socket.create_connection(("127.0.0.1", port))
                line = json.dumps({"authToken": {"userId": "slow", "authToken": "-"}}).encode() + b"\n"
                while not stop.is_set():
                    for byte in line:
                        if stop.is_set():
                            break
                        slow.sendall(bytes([byte]))
                        time.sleep(0.01)
                slow.close()
            # 3. hang up in the middle of a line, again and again
            def hang_up():
                while not stop.is_set():
                    half = socket.create_connection(("127.0.0.1", port))
                    half.sendall(b'{"authToken":{"userId":"half","authToken":"-"}}\n{"chatMessageSend":{"chatId":"1","ta')
                    half.close()
                    time.sleep(0.01)
            threads = [threading.Thread(target=f, daemon=True) for f in (flood, trickle, hang_up)]
            for thread in threads:
                thread.start()
            # 4. a thousand idle connections
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
            time.sleep(0.5)
            # The best of up to three windows: on a machine busy with other work (a
            # parallel build, a sanitizer run) one window's p99 can catch that work's
            # hiccups; hostile clients that really cost alice time slow every window.
            windows = []
            for _ in range(3):
                windows.append(alice.latencies(400))
                if windows[-1] <= (2 * baseline + 0.002) * BOUND_SCALE:
                    break
            under_attack = min(windows)
            stop.set()
            for thread in threads:
                thread.join(timeout=10)
            peak = peak_memory_kb(process.pid)
            for sock in idle:
                sock.close()
            deaf.close()

            # Nothing lost: every message alice sent is there.
            alice.send({"requestListAll": {"type": "chat", "cookie": "c"}})
            chunk = json.loads(alice.until(lambda line: line.startswith(b'{"listChunk"')))
            assert chunk["listChunk"]["elements"][0]["lastMessage"] == 1 + 100 + 400 + 400 * len(windows)
            assert peak < 500 * 1024 * BOUND_SCALE, f"peak memory {peak} KB"
            # p99 at most twice the calm one (plus 2 ms of slack for scheduler noise on a
            # loaded 2-core machine: the calm p99 is well under a millisecond).
            assert under_attack <= (2 * baseline + 0.002) * BOUND_SCALE, (
                f"p99 {', '.join(f'{w * 1000:.2f}' for w in windows)} ms vs {baseline * 1000:.2f} ms calm")
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_max_sessions_and_idle_timeout():
    with tempfile.TemporaryDirectory() as data:
        process, port = serve(data, "--max-sessions", "3", "--idle-timeout", "1")
        try:
            kept = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
            time.sleep(0.2)
            extra = socket.create_connection(("127.0.0.1", port))
            extra.settimeout(5)
            assert extra.recv(1) == b"", "a fourth connection is closed at once"
            extra.close()
            kept[0].settimeout(5)
            assert kept[0].recv(1) == b"", "an idle connection is closed after --idle-timeout"
            for sock in kept:
                sock.close()
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_connections_that_never_authenticate_lose_their_place_at_the_auth_timeout():
    """Before --auth-timeout, connections that never signed in held their place for ever
    (the idle timeout is off by default): anyone who could connect could take every one
    of --max-sessions and keep every user out, without a credential."""
    with tempfile.TemporaryDirectory() as work:
        secret = os.path.join(work, "secret")
        with open(secret, "w") as f:
            f.write("a secret for this test, 32 bytes or more")
        good = subprocess.run([chatcore_binary(), "token", "--user", "alice", "--auth-secret-file", secret],
                              capture_output=True, text=True, check=True).stdout.strip()
        process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", os.path.join(work, "d"), "--listen", "127.0.0.1:0",
                                    "--auth-secret-file", secret, "--max-sessions", "4", "--auth-timeout", "2"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            port = None
            for line in process.stderr:
                match = re.search(r"port=(\d+)", line)
                if match:
                    port = int(match.group(1))
                    threading.Thread(target=process.stderr.read, daemon=True).start()
                    break
            assert port, "chatcore did not start listening"

            def connect():
                sock = socket.create_connection(("127.0.0.1", port))
                sock.settimeout(10)
                return sock

            def sign_in(sock, token):
                sock.sendall(json.dumps({"authToken": {"userId": "alice", "authToken": token}}).encode() + b"\n")

            def read_until_closed(sock):
                got = b""
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return got
                    got += chunk

            started = time.monotonic()
            signed_in = connect()
            sign_in(signed_in, good)
            silent = connect()
            refused = connect()
            sign_in(refused, "not a token")
            chatty = connect()  # sends requests, so it is never idle, but never signs in
            time.sleep(0.3)
            outsider = connect()
            assert outsider.recv(1) == b"", "a fifth connection is over --max-sessions"
            outsider.close()

            def chatter():
                try:
                    while True:
                        chatty.sendall(b'{"identitiesGet":{"cookie":"c"}}\n')
                        time.sleep(0.2)
                except OSError:
                    pass
            threading.Thread(target=chatter, daemon=True).start()

            assert read_until_closed(silent) == b""
            assert b"Rejected" in read_until_closed(refused)
            assert b'"cookie":"c"' in read_until_closed(chatty), "the unauthenticated requests were answered until the close"
            waited = time.monotonic() - started
            assert 1.5 < waited < 8, f"closed after {waited:.1f} s with --auth-timeout 2"

            # Their places are free again, and the session that signed in kept its own.
            late = connect()
            sign_in(late, good)
            late.sendall(b'{"identitiesGet":{"cookie":"late"}}\n')
            answers = late.makefile("rb")
            assert any(b'"cookie":"late"' in answers.readline() for _ in range(20)), "a new connection could not sign in"
            signed_in.sendall(b'{"identitiesGet":{"cookie":"first"}}\n')
            answers = signed_in.makefile("rb")
            assert any(b'"cookie":"first"' in answers.readline() for _ in range(20)), "the signed-in session was closed"
            for sock in (signed_in, silent, refused, chatty, late):
                sock.close()
            assert process.poll() is None
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_closed_connections_leave_nothing_behind():
    """Found by fuzzing: sessions, their handlers and partial lines outlived their
    connections. Thousands of connections that hang up mid-line must not add up."""
    with tempfile.TemporaryDirectory() as data:
        process, port = serve(data)
        try:
            def burst(count):
                for n in range(count):
                    sock = socket.create_connection(("127.0.0.1", port))
                    sock.sendall(b'{"authToken":{"userId":"same","authToken":"-"}}\n{"chatMessageSend":{"chatId":"1","content":"'
                                 + b"x" * 200_000)
                    sock.close()

            def resident_kb():
                for line in open(f"/proc/{process.pid}/status"):
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])

            burst(300)
            time.sleep(1)
            before = resident_kb()
            burst(2000)
            time.sleep(1)
            after = resident_kb()
            # 2,000 partial lines of 200 kB would be 400 MB if they were kept.
            assert after - before < 40 * 1024 * BOUND_SCALE, f"{(after - before) / 2000:.1f} kB per closed connection"
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_clients_that_reset_while_answers_are_written_do_not_crash_it():
    """Answers made on the event loop (decode failures) are written at once; a client that
    resets meanwhile makes NIO close the channel inside that write. That nested close
    once broke Swift's exclusivity rule and killed the process."""
    import struct
    with tempfile.TemporaryDirectory() as data:
        process, port = serve(data)
        try:
            for n in range(400):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.sendall(b"not json\n" * 2000)
                sock.close()  # RST
            assert process.poll() is None, "chatcore died"
            check = socket.create_connection(("127.0.0.1", port))
            check.sendall(b'{"nope":{"cookie":"alive"}}\n')
            assert b"alive" in check.recv(4096)
            check.close()
        finally:
            process.terminate()
            process.wait(timeout=30)


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_more_connections_than_file_descriptors_are_closed_not_left_spinning():
    """With 200 file descriptors (soft and hard limit) and the default --max-sessions
    (10,000), 150 connections used to leave ~80 waiting in the listen queue: every accept
    failed (EMFILE) and NIO retried at once for as long as they waited, taking a whole core,
    and said nothing. The service now fits --max-sessions to the limit (and says so): the
    connections past it are accepted and closed at once, like any past --max-sessions."""
    def two_hundred_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    with tempfile.TemporaryDirectory() as data:
        process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", data, "--listen", "127.0.0.1:0", "--insecure-no-auth"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=two_hundred_descriptors)
        log = []
        port = None
        for line in process.stderr:
            log.append(line)
            match = re.search(r"port=(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "".join(log)
        threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()
        try:
            # 200 less the 128 kept for the rest (on a node of a shared store, two per session).
            serving = [int(match.group(1)) for match in map(lambda line: re.search(r"servingAtMost=(\d+)", line), log) if match]
            assert serving in ([72], [36]), "".join(log)
            serving = serving[0]
            first = Normal(port, "alice")
            sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(150)]
            answered, closed = 0, 0
            for n, sock in enumerate(sockets):
                sock.settimeout(10)
                sock.sendall(json.dumps({"authToken": {"userId": f"u{n}", "authToken": "-"}}).encode() + b"\n")
            for sock in sockets:
                try:
                    reply = sock.recv(20)
                except ConnectionResetError:
                    reply = b""
                if reply:
                    answered += 1
                else:
                    closed += 1
            assert answered == serving - 1 and closed == 150 - (serving - 1), (serving, answered, closed)
            # Nothing waits to be accepted: the service is idle.
            before = cpu_seconds(process.pid)
            time.sleep(2)
            assert cpu_seconds(process.pid) - before < 0.5, "the service spins while connections wait"
            first.send({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "still here"}})
            first.until(lambda line: b'"cookie":"c"' in line)
            for sock in sockets:
                sock.close()
            time.sleep(0.5)
            Normal(port, "zed")
        finally:
            process.terminate()
            process.wait(timeout=30)


def current_rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_anonymous_connections_holding_partial_lines_cost_a_few_kib_each():
    """Before a token is accepted a line may be 16 KiB, not --max-line-bytes: 1,000
    connections each holding 256 KiB of a line with no newline held 256 MB before (each
    could hold 1 MiB: 10,000 of them pinned ~15 GB)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    with tempfile.TemporaryDirectory() as work:
        process, port = serve(os.path.join(work, "d"), "--auth-timeout", "120")
        try:
            time.sleep(0.5)
            before = current_rss_kb(process.pid)
            chunk = b'{"authToken":{"userId":"alice","authToken":"' + b"a" * (256 * 1024)
            connections = []
            for _ in range(1000):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(chunk)
                connections.append(sock)
            # Every one is told its line is too long, at once (it is not buffered).
            first = connections[0].makefile("rb").readline()
            assert b'"TooLarge"' in first and b"before a token is accepted" in first, first
            time.sleep(1)
            grown_mb = (current_rss_kb(process.pid) - before) / 1024
            assert grown_mb < 150 * BOUND_SCALE, f"1,000 anonymous partial lines grew RSS by {grown_mb:.0f} MB"
            for sock in connections:
                sock.close()
            # A signed-in session still sends long lines (up to --max-line-bytes).
            normal = Normal(port, "bob")
            normal.send({"identitiesGet": {"cookie": "x" * (200 * 1024), "appUserIds": ["bob"]}})
            answer = normal.until(lambda line: b'"identities"' in line or b"requestFailed" in line)
            assert b"TooLarge" not in answer and b"at most 256 bytes" in answer, answer[:200]
        finally:
            process.terminate()
            process.wait(timeout=60)


def test_partial_lines_of_all_sessions_together_are_bounded():
    with tempfile.TemporaryDirectory() as work:
        process, port = serve(os.path.join(work, "d"), "--max-input-total", str(2 << 20))
        try:
            clients = [Normal(port, f"user{n}") for n in range(6)]
            for client in clients:
                client.sock.sendall(b'{"identitiesGet":{"cookie":"' + b"x" * (600 * 1024))
            refused = []
            for client in clients:
                client.sock.settimeout(0.5)
                try:
                    line = client.file.readline()
                except (socket.timeout, OSError):
                    continue
                if b"TooLarge" in line:
                    refused.append(line)
            assert refused, "no line was refused past --max-input-total"
            assert b"unfinished lines" in refused[0]
            assert len(refused) < 6, "every session's line was refused"
        finally:
            process.terminate()
            process.wait(timeout=60)
