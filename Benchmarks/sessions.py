"""Many people connected: N authenticated sessions on one `chatcore serve`, each its own
user on its own Unix-socket connection, idle once signed in. Measures the process's memory
with them (above the same process with two sessions), how long their sign-ins took, and a
one-to-one send's request → Sent latency while they are all connected, beside the same
sends before they connected (a ratio within one run).

Each connection is a descriptor on both ends: the service and the clients (two processes)
each need one per session, so N is bounded by the descriptor limit this machine grants a
process (`ulimit -Hn`), which the benchmark raises its own soft limit to.
"""

import multiprocessing
import pathlib
import resource
import selectors
import socket
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine  # noqa: E402
import nodes  # noqa: E402

CLIENT_PROCESSES = 2


def raise_descriptor_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def memory_kb(pid):
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0])
    return fields


def sign_in_many(path, first, count, ready, done):
    """Opens `count` sessions (users s<first>…), 500 at a time: connects and sends each
    one's authToken, then reads until each is answered setupState Success. Reports the
    seconds it took, then holds them until told to close."""
    raise_descriptor_limit()
    selector = selectors.DefaultSelector()
    sockets = []
    began = time.perf_counter()
    for start in range(first, first + count, 500):
        waiting = {}
        for number in range(start, min(start + 500, first + count)):
            connection = socket.socket(socket.AF_UNIX)
            connection.connect(path)
            connection.sendall(b'{"authToken":{"userId":"s%d","authToken":"x"}}\n' % number)
            connection.setblocking(False)
            selector.register(connection, selectors.EVENT_READ)
            waiting[connection] = b""
            sockets.append(connection)
        while waiting:
            for key, _ in selector.select(timeout=60):
                connection = key.fileobj
                data = connection.recv(65536)
                if not data:
                    raise RuntimeError("the service closed a session while it signed in")
                waiting[connection] += data
                if b'"setupState","value":{"state":"Success"}' in waiting[connection]:
                    del waiting[connection]
                    selector.unregister(connection)
    ready.send(time.perf_counter() - began)
    done.recv()
    for connection in sockets:
        connection.close()


def send_latencies(alice, chat, count, tag):
    seconds = []
    for n in range(count):
        cookie = f"{tag}{n}"
        began = time.perf_counter()
        alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"hello {n}", "cookie": cookie}})
        alice.until(lambda e: "listAdd" in e and e["listAdd"].get("cookie") == cookie)
        seconds.append(time.perf_counter() - began)
    seconds.sort()
    return seconds[len(seconds) // 2] * 1000, seconds[int(len(seconds) * 0.99)] * 1000


def run(sessions=None, sends=1000):
    hard = raise_descriptor_limit()
    if sessions is None:
        # Each end needs a descriptor per session; keep a few hundred for everything else.
        sessions = min(50_000, (hard - 400) // CLIENT_PROCESSES * CLIENT_PROCESSES)
    rows = []
    with tempfile.TemporaryDirectory() as data:
        process, path = engine.serve_unix(data, ["--max-sessions", str(sessions + 100)])
        try:
            alice = nodes.Session(path, "alice")
            bob = nodes.Session(path, "bob")
            engine.discard(bob.reader)
            chat_id = alice.start_chat("bob")
            send_latencies(alice, chat_id, 200, "warm")
            quiet_p50, quiet_p99 = send_latencies(alice, chat_id, sends, "quiet")
            time.sleep(1)
            empty = memory_kb(process.pid)

            per_process = sessions // CLIENT_PROCESSES
            workers = []
            for index in range(CLIENT_PROCESSES):
                ready, ready_end = multiprocessing.Pipe(duplex=False)
                done_end, done = multiprocessing.Pipe(duplex=False)
                worker = multiprocessing.Process(
                    target=sign_in_many, args=(path, index * per_process, per_process, ready_end, done_end))
                workers.append((worker, ready, done))
            began = time.perf_counter()
            for worker, _, _ in workers:
                worker.start()
            for _, ready, _ in workers:
                ready.recv()
            sign_in_seconds = time.perf_counter() - began
            time.sleep(2)
            crowded = memory_kb(process.pid)
            busy_p50, busy_p99 = send_latencies(alice, chat_id, sends, "busy")
            for worker, _, done in workers:
                done.send(True)
            for worker, _, _ in workers:
                worker.join()
        finally:
            process.terminate()
            process.wait()
    count = per_process * CLIENT_PROCESSES
    label = f"{count:,} idle sessions"
    rows.append((label, "RSS: 2 sessions / all connected", f"{empty['VmRSS'] / 1024:.1f} / {crowded['VmRSS'] / 1024:.1f} MB"))
    rows.append((label, "RSS per idle session (anonymous)", f"{(crowded['VmRSS'] - empty['VmRSS']) / count:.1f} KB "
                 f"({(crowded['RssAnon'] - empty['RssAnon']) / count:.1f} KB)"))
    rows.append((label, "sign-ins, all of them", f"{sign_in_seconds:.1f} s ({count / sign_in_seconds:,.0f}/s)"))
    rows.append((label, "1:1 send → Sent p50 / p99, before", f"{quiet_p50:.2f} / {quiet_p99:.2f} ms"))
    rows.append((label, "1:1 send → Sent p50 / p99, all connected", f"{busy_p50:.2f} / {busy_p99:.2f} ms"))
    rows.append((label, "p99 all connected / before", f"{busy_p99 / quiet_p99:.2f}×"))
    return rows


def print_table(sessions=None):
    print(f"{'benchmark':<26} {'measure':<42} {'result':>24}")
    for row in run(sessions):
        print(f"{row[0]:<26} {row[1]:<42} {row[2]:>24}")
    sys.stdout.flush()


if __name__ == "__main__":
    print_table(int(sys.argv[1]) if len(sys.argv) > 1 else None)
