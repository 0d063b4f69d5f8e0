"""Engine benchmarks (issue 4), run by `Benchmarks/run.py` (`make bench`).

- durable sends/s: one stdio session pipelining sends into a two-person chat, timed until
  the last `Sent` arrives; and 50 sessions on a Unix socket doing the same at once.
- the same with every recipient connected (40 senders), and into a chat of 50 members all
  connected, with the engine thread's CPU time per send (what bounds one node: each
  online member costs a rendering, an encoding and a delivery).
- latency from request to `Sent`, p50/p99: one session, one message at a time.
- a 100-message window and a thread's children in a chat of 1,000,000 messages, timed
  from request to answer through the real service.
- database bytes per message.
- the same pipelined loop against `reference_peer.py` (Python + SQLite, one commit per
  message), and the ratio.
"""
import json
import os
import pathlib
import re
import selectors
import socket
import statistics
import subprocess
import tempfile
import threading
import time

from procstat import thread_seconds

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHATCORE = ROOT / ".build" / "release" / "chatcore"
QUIET = ["--log-level", "error"]


class Stdio:
    """`chatcore serve --user USER` with a reader thread that notes when lines arrive."""

    def __init__(self, user, data_dir):
        self.process = subprocess.Popen([str(CHATCORE), "serve", "--user", user, "--data-dir", data_dir] + QUIET,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.sent = 0
        self.arrived = threading.Condition()
        self.answers = {}
        self.partial = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self.arrived:
                if line.startswith(b'{"listAdd":{"type":"chatMessage"'):
                    self.sent += line.count(b'"state":"Sent"')
                elif b'"cookie"' in line:
                    # A list answer is its header, then chunks up to the one marked last.
                    cookie = re.search(rb'"cookie":"([^"]*)"', line).group(1).decode()
                    lines = self.partial.setdefault(cookie, [])
                    lines.append(line)
                    is_header = line.startswith((b'{"listAll"', b'{"listElements"', b'{"listMatching"'))
                    if not is_header and (not line.startswith(b'{"listChunk"') or b'"last":true' in line):
                        self.answers[cookie] = (time.perf_counter(), self.partial.pop(cookie))
                self.arrived.notify_all()

    def write(self, data):
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def wait_sent(self, count, timeout=600):
        with self.arrived:
            return self.arrived.wait_for(lambda: self.sent >= count, timeout)

    def ask(self, request, cookie):
        start = time.perf_counter()
        self.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")
        with self.arrived:
            self.arrived.wait_for(lambda: cookie in self.answers, 60)
        at, lines = self.answers.pop(cookie)
        events = [json.loads(line) for line in lines]
        return at - start, events[0] if len(events) == 1 else events

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=600)


def send_line(chat, n):
    return b'{"chatMessageSend":{"chatId":"%s","tag":"Text","content":"benchmark message number %d"}}\n' % (chat.encode(), n)


def start_chat(session, other):
    session.ask({"chatStart": {"cookie": "start", "invitees": [{"userId": other}], "subject": "bench"}}, "start")


def pipelined(count=20000):
    with tempfile.TemporaryDirectory() as data:
        session = Stdio("alice", data)
        start_chat(session, "bob")
        before = session.sent
        payload = b"".join(send_line("1", n) for n in range(count))
        start = time.perf_counter()
        session.write(payload)
        session.wait_sent(before + count)
        seconds = time.perf_counter() - start
        session.close()
        size = sum(f.stat().st_size for f in pathlib.Path(data).iterdir() if f.name.startswith("chatcore.sqlite"))
    return count / seconds, seconds


def latency(count=2000):
    with tempfile.TemporaryDirectory() as data:
        session = Stdio("alice", data)
        start_chat(session, "bob")
        times = []
        for n in range(count):
            target = session.sent + 1
            start = time.perf_counter()
            session.write(send_line("1", n))
            session.wait_sent(target)
            times.append(time.perf_counter() - start)
        session.close()
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)]


def disk_floor(count=2000):
    """The disk's own cost of a durable commit, one at a time: 4 KiB appended to a file in
    a directory like the store's, then `fdatasync`. Returns p50 and p99 in seconds."""
    with tempfile.TemporaryDirectory() as data:
        descriptor = os.open(os.path.join(data, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        page = b"x" * 4096
        times = []
        try:
            for _ in range(count):
                start = time.perf_counter()
                os.write(descriptor, page)
                os.fdatasync(descriptor)
                times.append(time.perf_counter() - start)
        finally:
            os.close(descriptor)
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)]


def serve_unix(data, extra=()):
    """`chatcore serve` on a Unix socket in `data`, once it accepts connections (the socket
    file appears before the server listens). `extra`: more arguments."""
    path = os.path.join(data, "chatcore.sock")
    process = subprocess.Popen([str(CHATCORE), "serve", "--data-dir", data, "--listen", "unix:" + path, "--insecure-no-auth"] + QUIET
                               + list(extra), stdin=subprocess.DEVNULL)
    for _ in range(400):
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            return process, path
        except OSError:
            time.sleep(0.05)
        finally:
            probe.close()
    raise RuntimeError("chatcore did not start listening")


def connect(path, user):
    """An authenticated Unix socket session of `user` (`--insecure-no-auth`) and its reader."""
    connection = socket.socket(socket.AF_UNIX)
    connection.connect(path)
    connection.sendall(b'{"authToken":{"userId":"%s","authToken":"-"}}\n' % user.encode())
    return connection, connection.makefile("rb")


def started_chat(connection, reader, invitees, one_to_one=True):
    """Starts a chat with `invitees` and returns its id."""
    listed = ",".join('{"userId":"%s"}' % user for user in invitees)
    kind = '"isOneToOne":true' if one_to_one else '"subject":"group"'
    connection.sendall(b'{"chatStart":{"cookie":"s","invitees":[%s],%s}}\n' % (listed.encode(), kind.encode()))
    for line in reader:
        if line.startswith(b'{"listAdd":{"type":"chat","cookie"'):
            return json.loads(line)["listAdd"]["elements"][0]["chatId"]
    raise RuntimeError("chatStart was not answered")


def discard(reader):
    """Reads a session's events (a recipient's) until it ends, on a thread of its own."""
    def run():
        for _ in reader:
            pass
    threading.Thread(target=run, daemon=True).start()


def engine_seconds(process):
    """CPU time the service's engine thread (the one that decides) used so far."""
    return thread_seconds(process.pid, "engine")


class Hook:
    """The application's server for notifications: answers every POST 200 (`up`), or
    nothing listens at its port."""

    def __init__(self, up):
        self.server = None
        if up:
            import http.server

            class Handler(http.server.BaseHTTPRequestHandler):
                protocol_version = "HTTP/1.1"

                def do_POST(self):
                    self.rfile.read(int(self.headers["Content-Length"]))
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

                def log_message(self, *arguments):
                    pass

            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            self.server.daemon_threads = True
            self.port = self.server.server_address[1]
            threading.Thread(target=self.server.serve_forever, daemon=True).start()
        else:
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            self.port = closed.getsockname()[1]
            closed.close()

    def close(self):
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def many_senders(senders=50, each=2000, peers_online=False, notify=None):
    """`senders` sessions, each sending `each` messages into its own one-to-one chat at
    once; with `peers_online`, every recipient is connected (each message is then
    delivered as it is sent, and both sides see it change). With `notify` ("up" or
    "down"), every message is a notification for the application's server
    (`--notify-url`), which answers, or is down. Returns sends/s, seconds, and the engine
    thread's CPU time per send (µs)."""
    with tempfile.TemporaryDirectory() as data:
        extra = []
        hook = None
        if notify:
            secret = os.path.join(data, "secret")
            with open(secret, "wb") as file:
                file.write(os.urandom(32))
            os.chmod(secret, 0o600)
            hook = Hook(up=notify == "up")
            extra = ["--notify-url", f"http://127.0.0.1:{hook.port}/hook", "--notify-secret-file", secret]
        process, path = serve_unix(data, extra)
        connections = []
        for n in range(senders):
            if peers_online:
                discard(connect(path, "peer%d" % n)[1])
            connection, reader = connect(path, "sender%d" % n)
            connections.append((connection, reader, started_chat(connection, reader, ["peer%d" % n])))
        counts = [0] * senders
        done = threading.Barrier(senders + 1)

        def drain(index, reader):
            while counts[index] < each:
                line = reader.readline()
                if not line:
                    break
                if line.startswith(b'{"listAdd":{"type":"chatMessage"'):
                    counts[index] += line.count(b'"state":"Sent"')
            done.wait()

        threads = [threading.Thread(target=drain, args=(i, reader), daemon=True) for i, (_, reader, _) in enumerate(connections)]
        payloads = [b"".join(send_line(chat, k) for k in range(each)) for (_, _, chat) in connections]
        for thread in threads:
            thread.start()
        engine_before = engine_seconds(process)
        start = time.perf_counter()
        writers = [threading.Thread(target=c.sendall, args=(p,)) for (c, _, _), p in zip(connections, payloads)]
        for writer in writers:
            writer.start()
        done.wait()
        seconds = time.perf_counter() - start
        engine = engine_seconds(process) - engine_before
        for connection, _, _ in connections:
            connection.close()
        process.terminate()
        process.wait()
        if hook:
            hook.close()
    return senders * each / seconds, seconds, engine / (senders * each) * 1e6


def drain(connections):
    """Reads every one of `connections` (recipients' sessions) until each ends, on one
    thread: a chat of 250 members online must not be slowed by 250 readers of its own."""
    def run():
        chooser = selectors.DefaultSelector()
        for connection in connections:
            chooser.register(connection, selectors.EVENT_READ)
        while chooser.get_map():
            for key, _ in chooser.select():
                try:
                    if not key.fileobj.recv(1 << 20):
                        chooser.unregister(key.fileobj)
                except OSError:
                    chooser.unregister(key.fileobj)
    threading.Thread(target=run, daemon=True).start()


def group_sends(members=50, sends=2000):
    """One session pipelining `sends` messages into a chat of `members`, every one of them
    connected: each message is rendered, encoded and delivered for each member, and
    changes each member's chat. Returns sends/s and the engine thread's CPU time per send
    (µs)."""
    with tempfile.TemporaryDirectory() as data:
        process, path = serve_unix(data)
        recipients = [connect(path, "member%d" % n)[0] for n in range(members - 1)]
        connection, reader = connect(path, "sender")
        chat = started_chat(connection, reader, ["member%d" % n for n in range(members - 1)], one_to_one=False)
        drain(recipients)
        payload = b"".join(send_line(chat, k) for k in range(sends))
        engine_before = engine_seconds(process)
        start = time.perf_counter()
        # Written on a thread: the sender's own events come back while it writes.
        threading.Thread(target=connection.sendall, args=(payload,), daemon=True).start()
        sent = 0
        while sent < sends:
            line = reader.readline()
            if not line:
                raise RuntimeError("the service ended the session")
            if line.startswith(b'{"listAdd":{"type":"chatMessage"'):
                sent += line.count(b'"state":"Sent"')
        seconds = time.perf_counter() - start
        engine = engine_seconds(process) - engine_before
        connection.close()
        process.terminate()
        process.wait()
    return sends / seconds, engine / sends * 1e6


def million(count=1_000_000):
    with tempfile.TemporaryDirectory() as data:
        corpus = pathlib.Path(data) / "load.ndjson"
        with corpus.open("wb") as f:
            f.write(b'{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"million"}}\n')
            for n in range(count):
                if n % 10 == 9:
                    # Thread replies under message 1000.
                    f.write(b'{"chatMessageSend":{"chatId":"1","tag":"Text","content":"reply %d","ref":[{"tag":"Thread","messageId":1000}]}}\n' % n)
                else:
                    f.write(send_line("1", n))
        start = time.perf_counter()
        with corpus.open("rb") as stdin:
            subprocess.run([str(CHATCORE), "serve", "--user", "alice", "--data-dir", data] + QUIET, stdin=stdin,
                           stdout=subprocess.DEVNULL, check=True)
        load_seconds = time.perf_counter() - start
        size = sum(f.stat().st_size for f in pathlib.Path(data).iterdir() if f.name.startswith("chatcore.sqlite"))
        index_size = sum(f.stat().st_size for f in pathlib.Path(data).iterdir() if f.name.startswith("search.sqlite"))
        start = time.perf_counter()
        session = Stdio("alice", data)
        session.ask({"identitiesGet": {"cookie": "ready", "appUserIds": ["alice"]}}, "ready")
        restart_seconds = time.perf_counter() - start
        windows = []
        threads = []
        for n in range(200):
            anchor = 1 + (n * 4999) % count
            seconds, answer = session.ask({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": "1"},
                                                                    "window": {"messageId": anchor, "before": 99, "after": 0},
                                                                    "cookie": "w%d" % n}}, "w%d" % n)
            assert sum(len(e["listChunk"]["elements"]) for e in answer if "listChunk" in e) == 100 or anchor <= 100
            windows.append(seconds)
            seconds, answer = session.ask({"requestListMatching": {"type": "chatMessage",
                                                                    "criteria": {"chatId": "1", "ref": {"tag": "Thread", "messageId": 1000}},
                                                                    "window": {"messageId": anchor, "before": 50, "after": 50},
                                                                    "cookie": "t%d" % n}}, "t%d" % n)
            threads.append(seconds)
        searches = []
        for n in range(100):
            term = "number %d" % (n * 7919 % count // 10 * 10)   # never a reply (those end in 9)
            seconds, answer = session.ask({"search": {"text": term, "cookie": "s%d" % n}}, "s%d" % n)
            assert answer["searchResult"]["messages"], term
            searches.append(seconds)
        session.close()
        # The same searches as a plain LIKE scan over the same store, in the same run.
        import sqlite3
        database = sqlite3.connect(os.path.join(data, "chatcore.sqlite"))
        scans = []
        for n in range(10):
            term = "number %d" % (n * 7919 % count)
            start = time.perf_counter()
            database.execute("SELECT chat, id FROM message WHERE content LIKE ? ORDER BY timestamp DESC, id DESC LIMIT 100",
                             ("%" + term + "%",)).fetchall()
            scans.append(time.perf_counter() - start)
        database.close()
    return {
        "load": (count / load_seconds, load_seconds),
        "restart": restart_seconds,
        "window": (statistics.median(windows), sorted(windows)[int(len(windows) * 0.99)]),
        "thread": (statistics.median(threads), sorted(threads)[int(len(threads) * 0.99)]),
        "bytes": size / (count + 2),
        "index bytes": index_size / (count + 2),
        "search": (statistics.median(searches), sorted(searches)[int(len(searches) * 0.99)]),
        "like": (statistics.median(scans), max(scans)),
    }


def reference(count=5000):
    with tempfile.TemporaryDirectory() as data:
        process = subprocess.Popen(["python3", str(ROOT / "Benchmarks" / "reference_peer.py"), os.path.join(data, "ref.sqlite")],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        payload = b"".join(send_line("1", n) for n in range(count))
        start = time.perf_counter()
        writer = threading.Thread(target=lambda: (process.stdin.write(payload), process.stdin.close()))
        writer.start()
        got = 0
        for _ in process.stdout:
            got += 1
            if got == count:
                break
        seconds = time.perf_counter() - start
        writer.join()
        process.wait()
    return count / seconds, seconds


def attachment_ingest(megabytes=100):
    """Storing a 100 MB file (hash, copy, fsync, rename) against `cp` of the same file."""
    with tempfile.TemporaryDirectory() as scratch:
        source = pathlib.Path(scratch) / "big.bin"
        with source.open("wb") as f:
            for _ in range(megabytes):
                f.write(os.urandom(1 << 20))
        start_line = b'{"chatStart":{"cookie":"s","invitees":[{"userId":"bob"}],"subject":"files"}}\n'
        send_line_ = b'{"chatMessageSend":{"chatId":"1","tag":"File","file":"%s"}}\n' % str(source).encode()

        def replay(payload):
            data = tempfile.mkdtemp(dir=scratch)
            start = time.perf_counter()
            result = subprocess.run([str(CHATCORE), "serve", "--user", "alice", "--data-dir", data] + QUIET, input=payload,
                                    capture_output=True, check=True)
            return time.perf_counter() - start, result.stdout

        best_base = min(replay(start_line)[0] for _ in range(3))
        best = float("inf")
        for _ in range(3):
            seconds, out = replay(start_line + send_line_)
            assert b'"state":"Sent"' in out
            best = min(best, seconds)
        ingest = best - best_base
        copies = []
        for n in range(3):
            target = pathlib.Path(scratch) / f"copy{n}"
            start = time.perf_counter()
            subprocess.run(["cp", str(source), str(target)], check=True)
            copies.append(time.perf_counter() - start)
        synced = []
        for n in range(3):
            target = pathlib.Path(scratch) / f"synced{n}"
            start = time.perf_counter()
            subprocess.run(["cp", str(source), str(target)], check=True)
            subprocess.run(["sync", str(target)], check=True)
            synced.append(time.perf_counter() - start)
    return megabytes / ingest, megabytes / min(copies), megabytes / min(synced)


def scale(users=1000, chats=1000, messages=1_000_000):
    """One process, 1,000 users in 1,000 chats of 5, 1,000,000 messages: start-up time and
    memory, then window, thread, search and change-feed latency as one user, and sizes."""
    with tempfile.TemporaryDirectory() as data:
        process, path = serve_unix(data)

        def finish(connection, cookie):
            """Reads (discarding) until the answer to the marker request that ends what was
            sent: everything before it is done."""
            marker = b'"cookie":"%s"' % cookie.encode()
            tail = b""
            while True:
                chunk = connection.recv(1 << 20)
                if not chunk:
                    raise EOFError
                tail = (tail + chunk)[-4096:]
                if marker in tail:
                    return

        per_chat = messages // chats
        start = time.perf_counter()
        for chat in range(chats):
            members = [f"u{(chat * 5 + k) % users}" for k in range(5)]
            starter, _ = connect(path, members[0])
            starter.sendall(json.dumps({"chatStart": {"cookie": "s", "subject": f"chat {chat}", "invitees": [{"userId": m} for m in members[1:]]}}).encode() + b"\n")
            lines = []
            for n in range(per_chat):
                if n % 10 == 9:
                    lines.append(b'{"chatMessageSend":{"chatId":"%d","tag":"Text","content":"reply %d","ref":[{"tag":"Thread","messageId":10}]}}\n' % (chat + 1, n))
                else:
                    lines.append(send_line(str(chat + 1), n + chat * per_chat))
            # One writer, the marker last (two threads writing one socket would interleave).
            lines.append(b'{"identitiesGet":{"cookie":"done","appUserIds":[]}}\n')
            writer = threading.Thread(target=starter.sendall, args=(b"".join(lines),))
            writer.start()
            finish(starter, "done")
            writer.join()
            starter.close()
        load_seconds = time.perf_counter() - start
        process.terminate()
        process.wait()
        size = sum(f.stat().st_size for f in pathlib.Path(data).iterdir() if f.name.startswith(("chatcore.sqlite", "search.sqlite")))

        begin = time.perf_counter()
        session = Stdio("u0", data)
        session.ask({"identitiesGet": {"cookie": "ready", "appUserIds": []}}, "ready")
        startup = time.perf_counter() - begin
        rss = 0
        for line in open(f"/proc/{session.process.pid}/status"):
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) / 1024
        timings = {"window": [], "thread": [], "search": [], "feed": []}
        for n in range(100):
            seconds, _ = session.ask({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": "1"},
                                                               "window": {"messageId": 1 + (n * 37) % per_chat, "before": 99}, "cookie": f"w{n}"}}, f"w{n}")
            timings["window"].append(seconds)
            seconds, _ = session.ask({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": "1", "ref": {"tag": "Thread", "messageId": 10}},
                                                               "cookie": f"t{n}"}}, f"t{n}")
            timings["thread"].append(seconds)
            seconds, _ = session.ask({"search": {"text": "number %d" % (n * 9973 % per_chat // 10 * 10), "cookie": f"s{n}"}}, f"s{n}")
            timings["search"].append(seconds)
            seconds, _ = session.ask({"requestListChanges": {"type": "chatMessage", "since": str(n * 1000), "limit": 100, "cookie": f"f{n}"}}, f"f{n}")
            timings["feed"].append(seconds)
        session.close()
    result = {name: (statistics.median(values), sorted(values)[98]) for name, values in timings.items()}
    result.update(load=messages / load_seconds, startup=startup, rss=rss, bytes=size / messages)
    return result


def rows():
    """(benchmark, measure, value) rows for the table."""
    table = []
    rate, seconds = pipelined()
    table.append(("engine: one stdio sender, pipelined", "durable sends/s (20,000)", f"{rate:,.0f}"))
    reference_rate, _ = reference()
    table.append(("engine: reference Python+SQLite peer", "durable sends/s (5,000)", f"{reference_rate:,.0f}"))
    table.append(("engine: chatcore vs reference", "ratio", f"{rate / reference_rate:.1f}×"))
    rate, seconds, _ = many_senders()
    table.append(("engine: 50 senders on a Unix socket", "durable sends/s (100,000)", f"{rate:,.0f}"))
    # Alternated in this run: what notifying costs the sends, and what a server that is
    # down costs them more than one that answers.
    runs = {"plain": [], "up": [], "down": []}
    for _ in range(3):
        for kind in runs:
            runs[kind].append(many_senders(notify=None if kind == "plain" else kind)[0])
    median = {kind: statistics.median(rates) for kind, rates in runs.items()}
    label = "engine: 50 senders, recipients offline, notified"
    table.append((label, "durable sends/s, the server answering (median of 3)", f"{median['up']:,.0f}"))
    table.append((label, "durable sends/s, the server down (median of 3)", f"{median['down']:,.0f}"))
    table.append((label, "down against answering / answering against not notifying", f"{median['down'] / median['up']:.2f}× / {median['up'] / median['plain']:.2f}×"))
    rate, seconds, engine = many_senders(senders=40, each=2500, peers_online=True)
    table.append(("engine: 40 senders, recipients online", "durable sends/s (100,000)", f"{rate:,.0f}"))
    table.append(("engine: 40 senders, recipients online", "engine thread CPU per send", f"{engine:.1f} µs"))
    rate, engine = group_sends()
    table.append(("engine: a chat of 50, all online", "durable sends/s (2,000)", f"{rate:,.0f}"))
    table.append(("engine: a chat of 50, all online", "engine thread CPU per send", f"{engine:.0f} µs"))
    # The biggest chat there is (250 participants, docs/protocol.md's chatStart): what
    # each online member costs the engine thread, median of 3.
    runs = sorted(group_sends(members=250, sends=1000) for _ in range(3))
    rate, engine = runs[1]
    table.append(("engine: a chat of 250 (the most), all online", "durable sends/s (1,000)", f"{rate:,.0f}"))
    table.append(("engine: a chat of 250 (the most), all online", "engine thread CPU per send / per member", f"{engine:.0f} / {engine / 249:.2f} µs"))
    # The disk's floor, measured just before and after the sends (its tail moves with
    # what else the machine does): the ratio is against the worse of the two.
    floor_before = disk_floor()
    p50, p99 = latency()
    floor_after = disk_floor()
    floor_p50, floor_p99 = max(floor_before[0], floor_after[0]), max(floor_before[1], floor_after[1])
    table.append(("engine: one at a time, request → Sent", "p50 / p99 latency", f"{p50 * 1000:.2f} / {p99 * 1000:.2f} ms"))
    table.append(("disk: 4 KiB + fdatasync, one at a time", "p50 / p99 latency", f"{floor_p50 * 1000:.2f} / {floor_p99 * 1000:.2f} ms"))
    table.append(("engine: one at a time, request → Sent", "p99 / the disk's p99", f"{p99 / floor_p99:.1f}×"))
    big = million()
    table.append(("engine: 1,000,000-message chat", "load through stdio", f"{big['load'][0]:,.0f} msg/s"))
    table.append(("engine: 1,000,000-message chat", "restart until answering", f"{big['restart']:.2f} s"))
    table.append(("engine: 1,000,000-message chat", "100-message window p50 / p99", f"{big['window'][0] * 1000:.2f} / {big['window'][1] * 1000:.2f} ms"))
    table.append(("engine: 1,000,000-message chat", "thread children p50 / p99", f"{big['thread'][0] * 1000:.2f} / {big['thread'][1] * 1000:.2f} ms"))
    table.append(("engine: 1,000,000-message chat", "database bytes per message", f"{big['bytes']:.0f}"))
    table.append(("engine: 1,000,000-message chat", "search index bytes per message", f"{big['index bytes']:.0f}"))
    table.append(("search: 1,000,000 messages", "search p50 / p99 (trigram index)", f"{big['search'][0] * 1000:.2f} / {big['search'][1] * 1000:.2f} ms"))
    table.append(("search: 1,000,000 messages", "plain LIKE scan p50 / max", f"{big['like'][0] * 1000:.1f} / {big['like'][1] * 1000:.1f} ms"))
    big = scale()
    label = "scale: 1,000 users, 1,000 chats, 1M msgs"
    table.append((label, "load over a Unix socket", f"{big['load']:,.0f} msg/s"))
    table.append((label, "start-up until answering", f"{big['startup']:.2f} s"))
    table.append((label, "peak memory after start-up", f"{big['rss']:,.0f} MB"))
    for name in ("window", "thread", "search", "feed"):
        table.append((label, f"{name} p50 / p99", f"{big[name][0] * 1000:.2f} / {big[name][1] * 1000:.2f} ms"))
    table.append((label, "store + index bytes per message", f"{big['bytes']:.0f}"))
    stored, copied, synced = attachment_ingest()
    table.append(("attachments: a 100 MB file", "chatcore store (hash+copy+fsync)", f"{stored:,.0f} MB/s"))
    table.append(("attachments: a 100 MB file", "cp / cp + sync", f"{copied:,.0f} / {synced:,.0f} MB/s"))
    return table
