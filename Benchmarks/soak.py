#!/usr/bin/env python3
"""make soak: a bounded mixed load on the real service, to show leaks and slowdowns.

50 sessions on loopback TCP (50 users in 10 group chats of 5) for SOAK_SECONDS (default
180): each sends a message and waits for its Sent, now and then marks its chat read,
lists its chats, asks for a window, recalls one of its messages, or searches. Printed:
throughput, p50/p99 latency from request to Sent, and the service's resident memory, for
the first and the last fifth of the run.
"""
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATCORE = os.path.join(ROOT, ".build", "release", "chatcore")
SECONDS = float(os.environ.get("SOAK_SECONDS", "180"))
SESSIONS = 50


def rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Session:
    def __init__(self, port, user):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")
        self.sock.sendall(json.dumps({"authToken": {"userId": user, "authToken": "-"}}).encode() + b"\n")
        self.uri = json.loads(self.file.readline())["listChange"]["elements"][2]["value"].encode()

    def request(self, message, done):
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        while True:
            line = self.file.readline()
            if not line:
                raise EOFError
            if done(line):
                return line


def main():
    with tempfile.TemporaryDirectory() as data:
        process = subprocess.Popen([CHATCORE, "serve", "--data-dir", data, "--listen", "127.0.0.1:0", "--insecure-no-auth"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        for line in process.stderr:
            match = re.search(r"port=(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        threading.Thread(target=process.stderr.read, daemon=True).start()
        sessions = [Session(port, f"user{n}") for n in range(SESSIONS)]
        for group in range(SESSIONS // 5):
            members = sessions[group * 5:(group + 1) * 5]
            members[0].request({"chatStart": {"cookie": "s", "subject": f"group {group}",
                                              "invitees": [{"userId": f"user{group * 5 + k}"} for k in range(1, 5)]}},
                               lambda line: line.startswith(b'{"listAdd":{"type":"chat","cookie"'))
        samples = []          # (time, latency)
        memory = []           # (time, rss kb)
        start = time.time()
        stop = start + SECONDS

        def work(index, session):
            rng = random.Random(index)
            chat = str(index // 5 + 1)
            mine = []
            n = 0
            while time.time() < stop:
                kind = rng.random()
                begin = time.perf_counter()
                if kind < 0.8:
                    line = session.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"soak {index} {n}"}},
                                           lambda l: l.startswith(b'{"listAdd":{"type":"chatMessage"') and session.uri in l and b'"state":"Sent"' in l)
                    samples.append((time.time(), time.perf_counter() - begin))
                    mine.append(int(re.search(rb'"messageId":"(\d+)"', line).group(1)))
                elif kind < 0.88:
                    session.request({"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": chat},
                                                             "window": {"timestamp": 2 ** 40, "before": 50}, "cookie": "w"}},
                                    lambda l: l.startswith(b'{"listMatching"'))
                elif kind < 0.94:
                    session.request({"requestListAll": {"type": "chat", "cookie": "a"}}, lambda l: l.startswith(b'{"listAll"'))
                elif kind < 0.97 and mine:
                    session.request({"chatMessageDestroy": {"chatId": chat, "messageId": mine.pop(rng.randrange(len(mine)))}},
                                    lambda l: b'"recall":"Recalled"' in l)
                else:
                    session.request({"search": {"text": f"soak {index}", "cookie": "q"}}, lambda l: l.startswith(b'{"searchResult"'))
                n += 1

        threads = [threading.Thread(target=work, args=(i, s), daemon=True) for i, s in enumerate(sessions)]
        for thread in threads:
            thread.start()
        while time.time() < stop:
            memory.append((time.time(), rss_kb(process.pid)))
            time.sleep(1)
        for thread in threads:
            thread.join(timeout=30)
        process.terminate()
        process.wait()

    fifth = SECONDS / 5
    print(f"soak: {SESSIONS} sessions, {SECONDS:.0f} s, {len(samples):,} sends")
    print(f"{'window':<14} {'sends/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'peak RSS MB':>12}")
    for label, low, high in [("first fifth", start, start + fifth), ("last fifth", stop - fifth, stop)]:
        window = sorted(latency for at, latency in samples if low <= at < high)
        peak = max((kb for at, kb in memory if low <= at < high), default=0)
        if not window:
            continue
        print(f"{label:<14} {len(window) / fifth:>10,.0f} {statistics.median(window) * 1000:>8.2f} "
              f"{window[int(len(window) * 0.99)] * 1000:>8.2f} {peak / 1024:>12.1f}")


if __name__ == "__main__":
    sys.exit(main())
