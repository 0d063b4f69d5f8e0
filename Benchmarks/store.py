"""Store benchmarks (issue 12, "the store is the truth"), run by `Benchmarks/run.py store`
(`make bench`): stores of 1,000,000 and 10,000,000 messages in 10,000 chats of 5 among
1,000 users, built by `store_gen.py` (kept in Benchmarks/out between runs), served by the
release binary over a Unix socket.

For each store:
- start-up until answering (process start to the first answer), after a clean stop and
  after SIGKILL, and the resident memory then;
- a mixed read load from 8 sessions (windows of 100 messages around random anchors, thread
  children, the change feed, search with common, rare, one- and two-character queries):
  p50 and p99 of each, the first pass cold (nothing of it was read since start-up), the
  second warm; resident memory after it, and at its peak;
- durable sends/s of one pipelining sender while the 8 readers go on, every Sent after a
  synced commit;
- 20 sessions reading (windows, thread children, the change feed, search) one request at
  a time while one session pipelines sends: the reads' p50 and p99, and what each side
  got done per second (issue 44: one session's pipelined work must not hold another's).

The previous engine kept every message in memory; its figures (from the issue that asked
for this redesign) are printed beside.
"""
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHATCORE = ROOT / ".build" / "release" / "chatcore"
OUT = ROOT / "Benchmarks" / "out"
USERS = 1000
CHATS = 10_000
MEMBERS = 5

# The in-memory engine, as measured before the redesign (issue 12's text).
BEFORE = {
    1_000_000: {"start": "3.2 s (one chat)", "rss": "424 MB (626 MB peak)"},
    10_000_000: {"start": "45 s", "rss": "3.5 GB (5.5 GB peak)", "kill": "40–50 s"},
}


def chats_of(user_number):
    """The chats user `u<n-1>` (number n) is in, as store_gen.py makes them."""
    index = user_number - 1
    return [chat for chat in range(1, CHATS + 1) if any(((chat - 1) * MEMBERS + k) % USERS == index for k in range(MEMBERS))]


def rss_kb(pid, field="VmRSS"):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Server:
    def __init__(self, data, binary=CHATCORE):
        self.data = data
        self.path = os.path.join(data, "s")
        self.binary = binary

    def start(self):
        if os.path.exists(self.path):
            os.remove(self.path)
        began = time.perf_counter()
        self.process = subprocess.Popen([str(self.binary), "serve", "--data-dir", self.data, "--listen", "unix:" + self.path,
                                         "--insecure-no-auth", "--log-level", "error"], stdin=subprocess.DEVNULL)
        while True:
            try:
                probe = Session(self.path, "u0")
                break
            except OSError:
                time.sleep(0.002)
        probe.ask({"identitiesGet": {"cookie": "up", "appUserIds": ["u0"]}}, "up")
        took = time.perf_counter() - began
        probe.close()
        return took

    def stop(self, kill=False):
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        self.process.wait(timeout=120)


class Session:
    def __init__(self, path, user):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.buffer = b""
        self.sock.sendall(json.dumps({"authToken": {"userId": user, "authToken": "x"}}).encode() + b"\n")
        self.sent = 0

    def lines(self):
        while True:
            while b"\n" not in self.buffer:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise EOFError
                self.buffer += chunk
            line, self.buffer = self.buffer.split(b"\n", 1)
            yield line

    def ask(self, request, cookie):
        """Sends a request; returns the seconds until its answer is complete."""
        began = time.perf_counter()
        self.sock.sendall(json.dumps(request, ensure_ascii=False).encode() + b"\n")
        marker = ('"cookie":"%s"' % cookie).encode()
        for line in self.lines():
            if marker not in line:
                continue
            if line.startswith((b'{"listAll"', b'{"listElements"', b'{"listMatching"')):
                continue
            if line.startswith(b'{"listChunk"') and b'"last":true' not in line:
                continue
            return time.perf_counter() - began

    def close(self):
        self.sock.close()


def percentile(values, fraction):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * fraction))] * 1000 if values else float("nan")


def plan_for(rng, chats, messages_per_chat, change_seq, count, words):
    """`count` random reads of a user's chats: windows of 100 around random anchors, thread
    children, the change feed from up to 200,000 positions back, searches."""
    plan = []
    for _ in range(count):
        chat = rng.choice(chats)
        kind = rng.random()
        if kind < 0.55:
            plan.append(("window", {"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": str(chat)},
                                                            "window": {"messageId": rng.randrange(1, messages_per_chat + 1), "before": 50, "after": 49}}}))
        elif kind < 0.75:
            plan.append(("thread", {"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": str(chat), "ref": {"tag": "Thread",
                                                            "messageId": rng.randrange(5, messages_per_chat + 1)}}, "window": {"messageId": 1, "after": 100}}}))
        elif kind < 0.87:
            plan.append(("feed", {"requestListChanges": {"type": "chatMessage", "since": str(max(0, change_seq - rng.randrange(1, 200_000))), "limit": 100}}))
        else:
            plan.append(("search", {"search": {"text": rng.choice(words)}}))
    return plan


WORDS = ["coffee", "report deadline", "naïve", "déjà vu", "🎉", "vu", "日本", "x", "train office home", "zzz"]


def one_session(path, messages_per_chat, change_seq, count=1500):
    """One user's random reads, one at a time (latency, not throughput): the plan once
    cold (nothing of it read since start-up), then again warm. Returns
    {kind: (cold timings, warm timings)}."""
    rng = random.Random(7)
    user = 1 + rng.randrange(USERS)
    plan = plan_for(rng, chats_of(user), messages_per_chat, change_seq, count, WORDS)
    session = Session(path, f"u{user - 1}")
    results = {}
    for run_pass in range(2):
        for index, (kind, request) in enumerate(plan):
            cookie = f"o{run_pass}-{index}"
            next(iter(request.values()))["cookie"] = cookie
            results.setdefault(kind, ([], []))[run_pass].append(session.ask(request, cookie))
    session.close()
    return results


def read_load(path, messages_per_chat, change_seq, seconds, passes=2, sessions=8):
    """Each session is a user reading their chats; the same random requests run twice
    (cold, then warm). Returns {kind: [(p50, p99) per pass]}."""
    results = {}
    lock = threading.Lock()
    done = [0]

    def run(n):
        rng = random.Random(n)
        user = 1 + rng.randrange(USERS)
        plan = plan_for(rng, chats_of(user), messages_per_chat, change_seq, 400, WORDS)
        session = Session(path, f"u{user - 1}")
        for run_pass in range(passes):
            timings = {}
            deadline = time.time() + seconds
            for index, (kind, request) in enumerate(plan):
                if time.time() > deadline:
                    break
                cookie = f"c{run_pass}-{index}"
                body = next(iter(request.values()))
                body["cookie"] = cookie
                timings.setdefault(kind, []).append(session.ask(request, cookie))
            with lock:
                done[0] += sum(len(values) for values in timings.values())
                for kind, values in timings.items():
                    results.setdefault(kind, [[] for _ in range(passes)])[run_pass].extend(values)
        session.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(sessions)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rate = done[0] / (time.perf_counter() - began)
    return {kind: [(percentile(v, 0.5), percentile(v, 0.99)) for v in runs] for kind, runs in results.items()}, rate


def sends_while_reading(server, messages_per_chat, count=20_000):
    stop = threading.Event()

    def reader(n):
        rng = random.Random(100 + n)
        user = 1 + rng.randrange(USERS)
        session = Session(server.path, f"u{user - 1}")
        chats = chats_of(user)
        index = 0
        while not stop.is_set():
            index += 1
            session.ask({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": str(rng.choice(chats))}, "cookie": f"r{index}",
                                                 "window": {"messageId": rng.randrange(1, messages_per_chat + 1), "before": 50, "after": 49}}}, f"r{index}")
        session.close()

    readers = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
    for thread in readers:
        thread.start()
    took = pipelined_sends(server, count, "while reading")
    stop.set()
    for thread in readers:
        thread.join()
    return count / took


def pipelined_sends(server, count, content, started=None):
    """User u0 pipelines `count` sends into their first chat at once; returns the seconds
    until their own `count` listAdds came back (each after a synced commit). `started`
    is set just before the first is written."""
    sender = Session(server.path, "u0")
    chat = str(chats_of(1)[0])
    lines = b"".join(b'{"chatMessageSend":{"chatId":"%s","tag":"Text","content":"%s %d"}}\n' % (chat.encode(), content.encode(), n)
                     for n in range(count))
    began = time.perf_counter()
    if started is not None:
        started.set()
    writer = threading.Thread(target=sender.sock.sendall, args=(lines,))
    writer.start()
    got = 0
    for line in sender.lines():
        if line.startswith(b'{"listAdd":{"type":"chatMessage"') and b'"senderUri":"bbmpim://user/id/0"' in line:
            got += 1
            if got == count:
                break
    took = time.perf_counter() - began
    writer.join()
    sender.close()
    return took


def first_start_of_a_copy(data):
    """The store copied elsewhere (new modification times: it changed since its last
    clean stop, as a restore or a move to another machine leaves it), then started with
    nothing of it in the page cache when that can be dropped. Returns (seconds until
    answering, whether the cache was dropped)."""
    copy = pathlib.Path(str(data) + "-copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(data, copy, copy_function=shutil.copyfile, ignore=shutil.ignore_patterns("s", "lock"))
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as caches:
            caches.write("3\n")
        cold = True
    except OSError:
        cold = False
    server = Server(str(copy))
    took = server.start()
    server.stop()
    shutil.rmtree(copy, ignore_errors=True)
    return took, cold


def reads_beside_a_writer(server, messages_per_chat, change_seq, readers=20, count=20_000):
    """Issue 44's fairness: `readers` sessions read one request at a time (windows, thread
    children, the change feed, search) while one session pipelines `count` sends. Returns
    ({kind: (p50, p99)} of the reads made while the sends went on, sends/s, reads/s)."""
    stop = threading.Event()
    sending = threading.Event()
    timings = {}
    lock = threading.Lock()

    def reader(n):
        rng = random.Random(200 + n)
        user = 1 + rng.randrange(USERS)
        plan = plan_for(rng, chats_of(user), messages_per_chat, change_seq, 2000, WORDS)
        session = Session(server.path, f"u{user - 1}")
        mine = {}
        for index, (kind, request) in enumerate(plan):
            if stop.is_set():
                break
            cookie = f"b{index}"
            next(iter(request.values()))["cookie"] = cookie
            seconds = session.ask(request, cookie)
            if sending.is_set() and not stop.is_set():
                mine.setdefault(kind, []).append(seconds)
        session.close()
        with lock:
            for kind, values in mine.items():
                timings.setdefault(kind, []).extend(values)

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(readers)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    took = pipelined_sends(server, count, "beside readers", started=sending)
    stop.set()
    for thread in threads:
        thread.join()
    reads = sum(len(values) for values in timings.values())
    return {kind: (percentile(values, 0.5), percentile(values, 0.99)) for kind, values in timings.items()}, count / took, reads / took


def bench(messages):
    data = OUT / f"store-{messages // 1_000_000}M"
    if not (data / "chatcore.sqlite").exists():
        OUT.mkdir(parents=True, exist_ok=True)
        began = time.time()
        subprocess.run([sys.executable, str(ROOT / "Benchmarks" / "store_gen.py"), str(data), "--messages", str(messages), "--chats", str(CHATS),
                        "--users", str(USERS), "--binary", str(CHATCORE)], check=True)
        print(f"  (built the {messages:,}-message store in {time.time() - began:.0f} s)", file=sys.stderr)
    server = Server(str(data))
    label = f"store: {messages // 1_000_000}M messages, {CHATS:,} chats"
    rows = []
    starts = []
    for _ in range(3):
        starts.append(server.start())
        rss_start = rss_kb(server.process.pid)
        server.stop()
    after_kill = []
    for _ in range(2):
        server.start()
        server.stop(kill=True)
        after_kill.append(server.start())
        server.stop()
    before = BEFORE[messages]
    rows.append((label, "start-up until answering", f"{statistics.median(starts) * 1000:.0f} ms", before["start"]))
    rows.append((label, "start-up after SIGKILL", f"{statistics.median(after_kill) * 1000:.0f} ms", before.get("kill", "")))
    first, cold = first_start_of_a_copy(data)
    rows.append((label, "first start of a copy until answering", f"{first * 1000:.0f} ms",
                 ("page cache dropped" if cold else "page cache not dropped (needs root)") + "; whole-file check before listening: 34,632 ms"))
    rows.append((label, "RSS after start-up", f"{rss_start / 1024:.0f} MB", before["rss"]))

    server.start()
    change_seq = 0
    import sqlite3
    database = sqlite3.connect(f"file:{data}/chatcore.sqlite?mode=ro", uri=True)
    change_seq = database.execute("SELECT value FROM counter WHERE name = 'changeSeq'").fetchone()[0]
    database.close()
    per_chat = messages // CHATS
    names = {"window": "100-message window", "thread": "thread children", "feed": "change feed (limit 100)", "search": "search (mixed queries)"}
    single = one_session(server.path, per_chat, change_seq)
    for kind in ["window", "thread", "feed", "search"]:
        cold, warm = single[kind]
        rows.append((label, f"{names[kind]} p50 / p99", f"{percentile(warm, 0.5):.2f} / {percentile(cold + warm, 0.99):.2f} ms",
                     f"cold: p50 {percentile(cold, 0.5):.2f}, p99 {percentile(cold, 0.99):.2f}, max {max(cold) * 1000:.1f}"))
    rows.append((label, "RSS after one user's reads", f"{rss_kb(server.process.pid) / 1024:.0f} MB", ""))
    results, rate = read_load(server.path, per_chat, change_seq, seconds=30)
    for kind in ["window", "thread", "feed", "search"]:
        (cold50, cold99), (warm50, warm99) = results.get(kind, [(float("nan"),) * 2] * 2)
        rows.append((label, f"8 readers: {names[kind]} p50 / p99", f"{warm50:.2f} / {cold99:.2f} ms", f"cold p50 {cold50:.2f}, warm p99 {warm99:.2f}"))
    rows.append((label, "8 readers: reads answered per second", f"{rate:,.0f}", "one engine thread decides; 2 cores shared with the clients"))
    rows.append((label, "RSS after the mixed read load (peak)", f"{rss_kb(server.process.pid) / 1024:.0f} MB ({rss_kb(server.process.pid, 'VmHWM') / 1024:.0f})", ""))
    rate = sends_while_reading(server, per_chat)
    rows.append((label, "durable sends/s while 8 sessions read", f"{rate:,.0f}", ""))
    beside, sends, reads = reads_beside_a_writer(server, per_chat, change_seq)
    for kind in ["window", "thread", "feed", "search"]:
        p50, p99 = beside.get(kind, (float("nan"),) * 2)
        rows.append((label, f"20 readers beside a writer: {names[kind]}", f"{p50:.2f} / {p99:.2f} ms", "p50 / p99, while one session pipelines sends"))
    rows.append((label, "20 readers beside a writer: throughput", f"{sends:,.0f} sends/s, {reads:,.0f} reads/s", ""))
    server.stop()
    return rows


def rows(sizes=(1_000_000, 10_000_000)):
    table = []
    for messages in sizes:
        table += bench(messages)
    return table


if __name__ == "__main__":
    sizes = tuple(int(size) for size in sys.argv[1:]) or (1_000_000, 10_000_000)
    print(f"{'benchmark':<34} {'measure':<40} {'result':>22}   in-memory engine / notes")
    for group, name, value, note in rows(sizes):
        print(f"{group:<34} {name:<40} {value:>22}   {note}")
