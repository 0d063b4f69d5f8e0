"""Several nodes on one PostgreSQL (`python3 Benchmarks/run.py nodes`): durable sends/s
and request → Sent p99 with 1, 2 and 4 chatcore nodes on one PostgreSQL cluster (made
here with initdb: fsync and synchronous_commit on, so that Sent means on disk), beside the
SQLite single node; and cross-node delivery latency (sent on the first node, received on
the last).

Senders are spread over the nodes round robin; a node that is not the writer relays its
connections to the writer (docs/running-several-nodes.md), so this measures what the
relay hop costs and shows that sends do not scale with nodes: one engine decides. The
last two rows start every node with `--all-nodes-decide` (each decides for its own
sessions and follows the others' commits). The last
column is how many cores the nodes, PostgreSQL and this benchmark's own clients used
during the sends (from /proc and getrusage): when they add up to the machine's cores, the
machine is the limit. The last is the deciding node's engine thread: the share of the
wall time it was on a core, and the sends/s at which it would be busy all the time (the
bound one engine puts on sends, whatever the cores around it).

Then the same sends with each node held to 0.2 of a core and PostgreSQL to 0.6 (cgroup
CPU quotas, `cpucap.py`: root only), as if each ran on a small machine of its own: what
deciding nodes add while a node is the limit, and where that stops (the database's share
used up). Where processes cannot be held, the table says why and is left out.
"""
import json
import os
import pathlib
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHATCORE = ROOT / ".build" / "release" / "chatcore"
sys.path.insert(0, str(ROOT / "Tests" / "postgres"))
sys.path.insert(0, str(ROOT / "Tests" / "python"))
from postgres_cluster import Cluster, free_port, postgres_bin  # noqa: E402
from procstat import cpu_seconds, thread_seconds  # noqa: E402
from chatcore_harness import scrape  # noqa: E402

QUIET = ["--log-level", "warning"]


def start_node(scratch, name, store=None, *arguments, held=None):
    """A node serving on a Unix socket in `scratch`; in the cgroup `held` (cpucap.Held)
    from its start when given."""
    path = os.path.join(scratch, name + ".sock")
    command = [str(CHATCORE), "serve", "--data-dir", os.path.join(scratch, name), "--listen", "unix:" + path, "--insecure-no-auth"] + QUIET
    command += list(arguments)
    if store:
        command += ["--store", store]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=held.enter if held else None)
    for _ in range(600):
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(path)
                probe.close()
                return process, path
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError("a node did not listen")


def start_nodes(scratch, url, count, deciding, held=None):
    """`count` nodes on the database `url`, the first the writer, each with
    `--all-nodes-decide` when `deciding`, the n-th in the cgroup `held[n]` when given:
    (processes, socket paths)."""
    processes, paths = [], []
    for n in range(count):
        process, path = start_node(scratch, f"node{n}", url, *(["--all-nodes-decide"] if deciding else []), held=held[n] if held else None)
        processes.append(process)
        paths.append(path)
        time.sleep(0.3)  # the first is the writer
    return processes, paths


def stop_nodes(processes):
    """Stops the nodes, the writer last."""
    for process in reversed(processes):
        process.terminate()
        process.wait()


class Session:
    def __init__(self, path, user):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.reader = self.sock.makefile("rb")
        self.send({"authToken": {"userId": user, "authToken": "-"}})
        self.until(lambda e: "listChange" in e and e["listChange"]["type"] == "global")

    def send(self, *messages):
        self.sock.sendall(b"".join(json.dumps(m, separators=(",", ":")).encode() + b"\n" for m in messages))

    def until(self, done):
        for line in self.reader:
            event = json.loads(line)
            if done(event):
                return event
        raise RuntimeError("connection closed")

    def start_chat(self, other):
        self.send({"chatStart": {"cookie": "start", "invitees": [{"userId": other}], "isOneToOne": True}})
        event = self.until(lambda e: "listAdd" in e and e["listAdd"].get("cookie") == "start")
        return event["listAdd"]["elements"][0]["chatId"]

    def close(self):
        self.reader.close()
        self.sock.close()


def cluster_pids(cluster):
    """The postmaster of `cluster` and its children (backends, WAL writer, ...)."""
    if cluster is None:
        return []
    with open(os.path.join(cluster.directory, "data", "postmaster.pid")) as f:
        postmaster = int(f.readline())
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def client_seconds():
    """CPU time (user + system) this process (the clients) used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def receive(session, count):
    """Reads `session`'s events until `count` messages were added to its lists (its own
    sends answered, or others' received), or requests refused."""
    for line in session.reader:
        if line.startswith(b'{"listAdd":{"type":"chatMessage"') or line.startswith(b'{"requestFailed"'):
            count -= 1
            if count == 0:
                return


def sends(paths, senders=40, each=1500, usage=None, before_sends=None):
    """Durable sends/s; with `usage` (node pids, cluster) also the cores each side used:
    nodes, PostgreSQL, clients, and the share of the wall time the deciding node's (the
    first's) engine thread was on a core. `before_sends` runs once the chats exist, and
    what it made is ended (`terminate`) once the sends are answered."""
    sessions = []
    for n in range(senders):
        session = Session(paths[n % len(paths)], f"sender{n}")
        sessions.append((session, session.start_chat(f"peer{n}")))
    made = before_sends() if before_sends else None
    readers = [threading.Thread(target=receive, args=(s, each)) for s, _ in sessions]
    for reader in readers:
        reader.start()
    started = time.perf_counter()
    writers = [threading.Thread(target=s.send, args=tuple({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"m{k}", "cookie": f"c{k}"}}
                                                           for k in range(each))) for s, chat in sessions]
    measured = usage and (usage[0], cluster_pids(usage[1]))
    before = measured and (cpu_seconds(measured[0]), cpu_seconds(measured[1]), client_seconds(), thread_seconds(measured[0][0], "engine"))
    for writer in writers:
        writer.start()
    for reader in readers:
        reader.join()
    seconds = time.perf_counter() - started
    if made is not None:
        made.terminate()
    if measured:
        # PostgreSQL's processes again: a backend that started during the sends (the
        # node's second commit connection) counts whole.
        usage[2:] = [(cpu_seconds(measured[0]) - before[0]) / seconds, (cpu_seconds(cluster_pids(usage[1])) - before[1]) / seconds,
                     (client_seconds() - before[2]) / seconds, (thread_seconds(measured[0][0], "engine") - before[3]) / seconds]
    for session, _ in sessions:
        session.close()
    return senders * each / seconds


def latencies(first, last, count=400):
    """Request → Sent for alice (on the last node), and alice's send → bob's listAdd with
    bob on the first node."""
    alice = Session(last, "alice")
    bob = Session(first, "bob")
    chat = alice.start_chat("bob")
    bob.until(lambda e: "listAdd" in e and e["listAdd"]["type"] == "chat")
    sent, delivered = [], []
    received = {}

    def watch():
        for line in bob.reader:
            if line.startswith(b'{"listAdd":{"type":"chatMessage"'):
                content = json.loads(line)["listAdd"]["elements"][0].get("content", "")
                received[content] = time.perf_counter()
                if content == f"l{count - 1}":
                    return

    watcher = threading.Thread(target=watch)
    watcher.start()
    for k in range(count):
        began = time.perf_counter()
        alice.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"l{k}", "cookie": f"l{k}"}})
        alice.until(lambda e: "listAdd" in e and e["listAdd"].get("cookie") == f"l{k}")
        sent.append(time.perf_counter() - began)
        while f"l{k}" not in received:
            time.sleep(0.0001)
        delivered.append(received[f"l{k}"] - began)
    watcher.join()
    alice.close()
    bob.close()

    def p(values, q):
        return sorted(values)[int(len(values) * q) - 1] * 1000
    return (statistics.median(sent) * 1000, p(sent, 0.99)), (statistics.median(delivered) * 1000, p(delivered, 0.99))


def measure(paths, processes, cluster=None, before_sends=None):
    usage = [[p.pid for p in processes], cluster]
    rate = sends(paths, usage=usage, before_sends=before_sends)
    sent, delivered = latencies(paths[0], paths[-1])
    return rate, sent, delivered, usage[2], usage[3] if cluster else None, usage[4], usage[5]


def rows():
    table = []
    with tempfile.TemporaryDirectory() as scratch:
        process, path = start_node(scratch, "sqlite")
        row = measure([path], [process])
        process.terminate()
        process.wait()
        table.append(("SQLite, 1 node",) + row)
    if postgres_bin() is None:
        return table
    for nodes, deciding in ((1, False), (2, False), (4, False), (2, True), (4, True)):
        with Cluster(settings=("shared_buffers=256MB",)) as cluster, tempfile.TemporaryDirectory() as scratch:
            database = cluster.create_database(f"bench{nodes}{'d' if deciding else ''}")
            processes, paths = start_nodes(scratch, cluster.database_url(database), nodes, deciding)
            row = measure(paths, processes, cluster)
            stop_nodes(processes)
            name = f"PostgreSQL, {nodes} {'deciding ' if deciding else ''}node{'s' if nodes > 1 else ''}"
            table.append((name,) + row)
    return table


HELD_NODE_CORES = 0.2
HELD_DATABASE_CORES = 0.6
HELD_ROWS = ((1, True), (2, True), (4, True), (6, True), (2, False), (4, False))


def held_rows(node_cores=HELD_NODE_CORES, database_cores=HELD_DATABASE_CORES, shapes=HELD_ROWS):
    """Sends as `rows` measures them, with each node held to `node_cores` of CPU and
    PostgreSQL (all its processes) to `database_cores` (cpucap: a cgroup quota each), as if
    each ran on a small machine of its own: what nodes add when a node, not this machine,
    is the limit, and where adding them stops paying (the database's share is used up).
    Empty when this machine cannot hold processes (`cpucap.available`)."""
    import cpucap
    if postgres_bin() is None or cpucap.available() is not None:
        return []
    table = []
    for count, deciding in shapes:
        groups = []
        with Cluster(settings=("shared_buffers=256MB",)) as cluster, tempfile.TemporaryDirectory() as scratch:
            url = cluster.database_url(cluster.create_database(f"held{count}{'d' if deciding else ''}"))
            database = cpucap.Held(database_cores)
            groups.append(database)
            # Backends started later are the postmaster's children: in its group.
            for pid in cluster_pids(cluster):
                database.add(pid)
            groups += [cpucap.Held(node_cores) for _ in range(count)]
            processes, paths = start_nodes(scratch, url, count, deciding, groups[1:])
            windows = []

            def count_held_back():
                windows.append(cpucap.HeldBack(groups))
                return windows[0]
            rate, sent, delivered, node_used, database_used, client_used, _ = measure(paths, processes, cluster, before_sends=count_held_back)
            held_back = windows[0].shares
            stop_nodes(processes)
        for group in groups:
            group.remove()
        name = f"{count} {'deciding' if deciding else 'relaying' if count > 1 else ''} node{'s' if count > 1 else ''}".replace("  ", " ")
        table.append((name, rate, sent, delivered, (node_used, count * node_cores), (database_used, database_cores), client_used,
                      (max(held_back[1:]), held_back[0])))
    return table


HELD_HEADER = (f"{'nodes (each held to a share of a core)':<40} {'durable sends/s':>16} {'× 1 node':>9} {'request → Sent p50/p99':>24}"
               f" {'cross-node p50/p99':>22} {'cores used / held: nodes, PostgreSQL':>38} {'clients':>8} {'held back: a node, PostgreSQL':>31}")


def held_line(one, name, rate, sent, delivered, nodes_cores, database_cores, client_cores, held_back):
    """One row of `held_rows`; `one` is the first row's sends/s. The last column is the
    share of the quota periods during the sends in which the node held back most (the
    writer, when the others relay) and PostgreSQL used up their share and waited for the
    next: the higher is the limit. PostgreSQL is held back in some periods even when it
    uses a third of its share: its backends run on both cores at once in bursts."""
    return (f"{name:<40} {rate:>16,.0f} {rate / one:>8.2f}× {sent[0]:>11.2f} / {sent[1]:.2f} ms {delivered[0]:>8.2f} / {delivered[1]:.2f} ms"
            f" {nodes_cores[0]:>17.2f} / {nodes_cores[1]:.2f}, {database_cores[0]:.2f} / {database_cores[1]:.2f} {client_cores:>8.2f}"
            f" {held_back[0] * 100:>22.0f}%, {held_back[1] * 100:.0f}%")


def print_held():
    import cpucap
    why = cpucap.available()
    print(f"\nNodes each held to {HELD_NODE_CORES} of a core and PostgreSQL to {HELD_DATABASE_CORES} (a cgroup CPU quota each: "
          "a node, then the database, is the limit, not this machine)")
    if postgres_bin() is None or why is not None:
        print(f"(not measured: {why or 'PostgreSQL is not installed'})")
        return
    table = held_rows()
    print(HELD_HEADER)
    for row in table:
        print(held_line(table[0][1], *row))


# One batch-shaped transaction of the writer (`headroom`): 64 messages with twelve search
# keys each into the connection's own 40 chats, then those chats' and members' updates.
BATCH_SCRIPT = """
\\set c (:client_id + 1) * 1000
BEGIN;
INSERT INTO message (chat, id, sender, tag, content, "timestamp", "isControl", "neverCountsUnread", "isRecalled", "changeSeq", "searchRow")
  SELECT :c + g % 40, nextval('ids'), 1, 'Text', 'hello there, this is message ' || g, 1, false, false, false, nextval('seq'), nextval('seq')
  FROM generate_series(1, 64) g;
INSERT INTO message_search (chat, id, "searchRow", keys) SELECT :c + g % 40, currval('ids') - g, currval('seq') - g,
  (SELECT array_agg((random() * 2000)::int4) FROM generate_series(1, 12) k WHERE g > 0) FROM generate_series(1, 64) g;
UPDATE chat SET "lastMessage" = "lastMessage" + 2, "lastActivity" = 1 WHERE "number" BETWEEN :c AND :c + 39;
UPDATE member SET "numUnread" = "numUnread" + 2 WHERE chat BETWEEN :c AND :c + 39;
COMMIT;
"""


def headroom(connections=(1, 2, 4), seconds=5):
    """PostgreSQL alone (pgbench, no chatcore): messages/s committed in batch-shaped
    transactions from 1, 2 and 4 connections at once, on chatcore's schema, each on chats
    of its own. What several committers (deciding nodes, or commits in flight) could get
    from the database, beside what one gets."""
    if shutil.which("pgbench") is None:
        return []
    rates = []
    with Cluster(settings=("shared_buffers=256MB",)) as cluster, tempfile.TemporaryDirectory() as scratch:
        database = cluster.create_database("headroom")
        subprocess.run([str(CHATCORE), "serve", "--store", cluster.database_url(database), "--user", "schema", "--data-dir", scratch] + QUIET,
                       input=b"", capture_output=True, check=True, timeout=120)
        cluster.psql("CREATE SEQUENCE ids; CREATE SEQUENCE seq; "
                     "INSERT INTO chat SELECT g, '', true, 'AdminsOnly', false, NULL, 0, 0 FROM generate_series(1000, 6000) g; "
                     "INSERT INTO member SELECT g, u, true, false, 1, NULL, false, NULL, NULL, 0, 0, 0 FROM generate_series(1000, 6000) g, generate_series(1, 2) u",
                     database)
        script = os.path.join(scratch, "batch.sql")
        with open(script, "w") as f:
            f.write(BATCH_SCRIPT)
        for count in connections:
            done = subprocess.run(["pgbench", "-n", "-h", cluster.socket_directory, "-U", Cluster.USER, "-c", str(count), "-j", str(count),
                                   "-T", str(seconds), "-f", script, database], capture_output=True, text=True, check=True)
            tps = next(line for line in done.stdout.splitlines() if line.startswith("tps"))
            rates.append((count, float(tps.split()[2]) * 64))
    return rates


CONFLICT_HEADER = (f"{'another node moves chats on':<30} {'durable sends/s':>16} {'commits decided again/s':>24}"
                   f" {'sends answered Internal':>24}")


def conflict_rows(rates=(0, 100, 1000)):
    """One PostgreSQL node, 40 senders into 40 chats, while "another node" (a loop in
    PostgreSQL) moves a random one of those chats' versions on `rate` times a second:
    each commit of the node on a chat moved since it read it conflicts, and its batch is
    decided again (docs/several-deciding-nodes.md, step 3). What that costs in sends/s."""
    if postgres_bin() is None:
        return []
    table = []
    for rate in rates:
        with Cluster(settings=("shared_buffers=256MB",)) as cluster, tempfile.TemporaryDirectory() as scratch:
            database = cluster.create_database(f"conflicts{rate}")
            port = free_port()
            process, path = start_node(scratch, "node", cluster.database_url(database), "--metrics", f"127.0.0.1:{port}")
            if rate:
                # Started once the senders' chats exist (40 of them, numbered from 1).
                def move():
                    return subprocess.Popen(["psql", "-h", cluster.socket_directory, "-p", str(cluster.port), "-U", Cluster.USER, "-d", database,
                                             "-qAt", "-c", "SET synchronous_commit = off", "-c", "DO $$ BEGIN FOR i IN 1..100000000 LOOP "
                                             "UPDATE chat_version SET version = version + 1 WHERE chat = 1 + floor(random() * 40)::bigint; "
                                             f"COMMIT; PERFORM pg_sleep({1 / rate}); END LOOP; END $$"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rate_sent = sends([path], before_sends=move if rate else None)
            seconds = 40 * 1500 / rate_sent
            samples = scrape(port)
            if rate:
                cluster.psql("SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE query LIKE '%chat_version SET version%' AND pid <> pg_backend_pid()",
                             database)
            process.terminate()
            process.wait()
            internal = samples.get(("chatcore_request_failures_total", frozenset({("request", "chatMessageSend"), ("error", "Internal")})), 0)
            table.append((rate, rate_sent, samples[("chatcore_commit_conflicts_total", frozenset())] / seconds, internal))
    return table


def conflict_line(rate, sent, redone, internal):
    moves = "no" if rate == 0 else f"{rate:,} times a second"
    return f"{moves:<30} {sent:>16,.0f} {redone:>24,.0f} {internal:>24,.0f}"


HEADER = (f"{'store, nodes':<31} {'durable sends/s (60,000)':>26} {'request → Sent p50/p99':>24} {'cross-node delivery p50/p99':>28}"
          f" {'cores: nodes / PostgreSQL / clients':>36} {'engine thread busy → its bound':>32}")


def line(name, rate, sent, delivered, node_cores, database_cores, client_cores, engine_busy):
    """One row. The last column is the share of the sends' wall time the deciding node's
    engine thread was on a core, and the sends/s at which it would be busy all the time
    (the rate over that share: the bound one engine puts on sends, whatever the cores
    around it; a low estimate, as a busier engine decides larger batches)."""
    database = "-" if database_cores is None else f"{database_cores:.2f}"
    bound = f"{rate / engine_busy:>8,.0f}" if engine_busy > 0 else f"{'-':>8}"
    return (f"{name:<31} {rate:>26,.0f} {sent[0]:>11.2f} / {sent[1]:.2f} ms {delivered[0]:>14.2f} / {delivered[1]:.2f} ms"
            f" {node_cores:>19.2f} / {database:>4} / {client_cores:.2f} {engine_busy * 100:>20.0f}% → {bound}")


def print_headroom():
    rates = headroom()
    if rates:
        print("\nPostgreSQL alone (pgbench, batch-shaped transactions of 64 messages): messages/s committed")
        print("   ".join(f"{count} connection{'s' if count > 1 else ''}: {rate:,.0f}" for count, rate in rates))


if __name__ == "__main__":
    print(HEADER)
    for row in rows():
        print(line(*row))
    print_headroom()
    print_held()
