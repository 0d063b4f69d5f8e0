"""What one client may cost the others (`python3 Benchmarks/run.py hostile`).

One release `chatcore serve` with its default limits. Bob sends to carol one message at a
time, all the while, and each send's request → Sent latency is kept per phase; in each
phase another client does one hostile thing, and the table gives how long its answers took
(a refusal, a capped answer, or the last page) beside bob's p50 / p99 meanwhile:

- 1,000 anonymous connections each sending 256 KiB of a line with no newline (RSS after);
- mallory: chatStart of 249 new invitees, again and again; chatStart of bob, again and
  again; typing, again and again (each until refused);
- a search built to be slow (1,022 `a` and `bb` over 40 messages of 70,000 `a`);
- a user in 2,000 chats of 50 who signs in, lists every participant, and recalls the
  20,000 messages they sent in one chat.
"""
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHATCORE = ROOT / ".build" / "release" / "chatcore"
sys.path.insert(0, str(ROOT / "Tests" / "python"))
from chatcore_harness import Client, auth, wait_until_accepting  # noqa: E402


def rss_mb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sender(threading.Thread):
    """Bob sending to carol one at a time; `phase` names where each latency goes."""

    def __init__(self, path, chat):
        super().__init__(daemon=True)
        self.client = Client(path)
        auth(self.client, "bob")
        self.chat = chat
        self.phase = "idle"
        self.samples = {}
        self.stopping = False

    def run(self):
        n = 0
        while not self.stopping:
            n += 1
            started = time.perf_counter()
            self.client.request({"chatMessageSend": {"chatId": self.chat, "tag": "Text", "content": f"bob {n}", "cookie": f"b{n}"}})
            self.samples.setdefault(self.phase, []).append((time.perf_counter() - started) * 1000)
            time.sleep(0.005)


def percentile(values, share):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else float("nan")


def serve(work, name, *extra):
    path = os.path.join(work, name + ".sock")
    process = subprocess.Popen([str(CHATCORE), "serve", "--data-dir", os.path.join(work, name), "--listen", "unix:" + path, "--insecure-no-auth",
                                "--log-level", "error", *extra], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_accepting(path, process)
    return process, path


def chat_of(events):
    return next(e["listAdd"]["elements"][0]["chatId"] for e in events if e.get("listAdd", {}).get("type") == "chat")


def measure(path, phases):
    """Bob sends all the while; each phase runs in turn. Returns the table's rows."""
    carol = Client(path)
    auth(carol, "carol")
    sender = Sender(path, chat_of(carol.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "steady"}})))
    sender.start()
    time.sleep(2)
    table = []
    for name, action in phases:
        sender.phase = name
        detail = action()
        if name is not None:  # None: setting up the next phase, not measured
            table.append((name, detail))
        time.sleep(0.5)
    sender.stopping = True
    sender.join(timeout=10)
    out = []
    for name, detail in [("(no attack)", "")] + table:
        samples = sender.samples.get("idle" if name == "(no attack)" else name, [])
        out.append((name, detail, f"{statistics.median(samples):.2f} / {percentile(samples, 0.99):.2f}" if samples else "-", len(samples)))
    return out


def rows():
    work = tempfile.mkdtemp(prefix="chatcore-hostile-")
    process, path = serve(work, "a")
    try:
        mallory = Client(path)
        auth(mallory, "mallory")
        mallorys = chat_of(mallory.request({"chatStart": {"cookie": "own", "invitees": [{"userId": "carol"}], "subject": "hers"}}))

        def partial_lines():
            chunk = b'{"authToken":{"userId":"x","authToken":"' + b"a" * (256 * 1024)
            socks = []
            for _ in range(1000):
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(path)
                sock.sendall(chunk)
                socks.append(sock)
            time.sleep(1)
            rss = rss_mb(process.pid)
            for sock in socks:
                sock.close()
            return f"RSS {rss:.0f} MB with them open"

        def until_refused(make, limit=2000):
            """`make(n)`: a request with a cookie, or (one without an answer, such as
            chatTyping) a pair of it and a request whose answer follows it."""
            times = []
            for n in range(limit):
                began = time.perf_counter()
                made = make(n)
                if isinstance(made, tuple):
                    mallory.send(*made)
                    events = mallory.answer(made[1]["identitiesGet"]["cookie"])
                else:
                    events = mallory.request(made)
                times.append((time.perf_counter() - began) * 1000)
                if any("requestFailed" in e for e in events):
                    return f"refused at request {n + 1}; slowest answer {max(times):.1f} ms"
            return f"never refused; slowest answer {max(times):.1f} ms"

        def slow_search():
            alice = Client(path)
            auth(alice, "alice")
            own = chat_of(alice.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "dave"}], "subject": "long"}}))
            alice.send(*[{"chatMessageSend": {"chatId": own, "tag": "Text", "content": "abb" + "a" * 70_000, "cookie": f"l{n}"}} for n in range(40)])
            alice.answer("l39")
            # The index takes in what was just sent first (a search waits for it).
            alice.request({"search": {"cookie": "warm", "text": "nothing like it"}})
            began = time.perf_counter()
            found = alice.request({"search": {"cookie": "q", "text": "a" * 1022 + "bb"}})[-1]["searchResult"]
            return f"answered in {(time.perf_counter() - began) * 1000:.1f} ms ({'incomplete' if found.get('incomplete') else 'complete'})"

        first = measure(path, [
            ("1,000 anonymous partial lines of 256 KiB", partial_lines),
            ("chatStart of 249 new users, repeated", lambda: until_refused(
                lambda n: {"chatStart": {"cookie": f"u{n}", "invitees": [{"userId": f"m{n}-{i}"} for i in range(249)], "subject": "x"}})),
            ("chatStart, repeated", lambda: until_refused(lambda n: {"chatStart": {"cookie": f"k{n}", "invitees": [{"userId": "bob"}]}})),
            ("chatTyping, repeated", lambda: until_refused(lambda n: ({"chatTyping": {"chatId": mallorys}},
                                                                      {"identitiesGet": {"cookie": f"t{n}", "appUserIds": ["mallory"]}}))),
            ("search of 1,022 a + bb over 40 × 70 KB", slow_search),
        ])
    finally:
        process.terminate()
        process.wait(timeout=60)

    # A user in 2,000 chats of 50, each with a message waiting: made by a node without the
    # chat quotas (one builder makes them all), then measured with the other limits.
    process, path = serve(work, "b", "--max-chats-per-minute", "0", "--max-new-users-per-minute", "0")
    try:
        builder = Client(path)
        auth(builder, "builder")
        for n in range(2000):
            builder.send({"chatStart": {"cookie": f"c{n}", "invitees": [{"userId": "big"}] + [{"userId": f"g{n % 40}-{i}"} for i in range(48)],
                                        "subject": f"g{n}"}},
                         {"chatMessageSend": {"chatId": str(n + 1), "tag": "Text", "content": "hi", "cookie": f"m{n}"}})
            if n % 50 == 49:
                builder.answer(f"m{n}", timeout=300)
        big = Client(path)

        def sign_in():
            began = time.perf_counter()
            big.send({"authToken": {"userId": "big", "authToken": "x"}})
            big.events.get(timeout=300)
            return f"authTokenState after {(time.perf_counter() - began) * 1000:.1f} ms"

        def participants():
            began = time.perf_counter()
            big.send({"requestListAll": {"type": "chatParticipant", "cookie": "p"}})
            while "listAll" not in big.events.get(timeout=300):
                pass
            header = (time.perf_counter() - began) * 1000
            events = big.answer("p", timeout=300)
            count = sum(len(e["listChunk"]["elements"]) for e in events if "listChunk" in e)
            return f"header {header:.1f} ms, all {count:,} after {(time.perf_counter() - began) * 1000:.0f} ms"

        own = []

        def send_many():
            own.append(chat_of(big.request({"chatStart": {"cookie": "r", "invitees": [{"userId": "erin"}], "subject": "mine"}})))
            for block in range(20):
                big.send(*[{"chatMessageSend": {"chatId": own[0], "tag": "Text", "content": f"x{n}", "cookie": f"x{block}-{n}"}} for n in range(1000)])
                big.answer(f"x{block}-999", timeout=300)

        def recall_all():
            began = time.perf_counter()
            big.send({"chatMessageDestroy": {"chatId": own[0], "cookie": "all"}}, {"identitiesGet": {"cookie": "after", "appUserIds": ["big"]}})
            big.answer("after", timeout=300)
            return f"20,000 recalled, then Shred, in {(time.perf_counter() - began) * 1000:.0f} ms"

        second = measure(path, [
            ("sign-in of a user in 2,000 chats of 50", sign_in),
            ("requestListAll chatParticipant of that user", participants),
            (None, send_many),
            ("chatMessageDestroy of all 20,000 own messages", recall_all),
        ])
    finally:
        process.terminate()
        process.wait(timeout=60)
    return first + second[1:]


HEADER = f"{'what one client does':<46} {'its answers':<58} {'bob send→Sent p50 / p99 ms':>26} {'sends':>6}"


def print_table():
    print("\n" + HEADER)
    for name, detail, latency, count in rows():
        print(f"{name:<46} {detail:<58} {latency:>26} {count:>6}")


if __name__ == "__main__":
    print_table()
