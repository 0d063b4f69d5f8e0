#!/usr/bin/env python3
"""chatcore benchmarks: `make bench` runs this and prints one table.

Codec: decode, and decode+encode, of a fixed corpus of realistic requests, against YAJL
parsing the same bytes with no callbacks (Benchmarks/rawyajl.c, built from the same
library) and against Foundation's JSONSerialization — in the same run, reported as ratios.
End to end: 200,000 chatMessageSend lines whose last member is unknown, through the real
`chatcore serve` on stdin, each answered InvalidParameter.
Engine (Benchmarks/engine.py): durable sends, latency, a 1,000,000-message chat, and the
Python+SQLite reference peer.
Store (Benchmarks/store.py): stores of 1M and 10M messages built by store_gen.py: start-up,
memory, reads under load, sends while reading.

Nodes (Benchmarks/nodes.py): 1, 2 and 4 nodes on one PostgreSQL beside SQLite: durable
sends/s, request → Sent and cross-node delivery latency; and PostgreSQL alone (pgbench)
committing batch-shaped transactions from 1, 2 and 4 connections; and 1–6 nodes, each held
to a fifth of a core and PostgreSQL to 0.6 (cgroup quotas; root only).

Search (Benchmarks/search.py): the same 200,000 messages in SQLite and in PostgreSQL, and
the p50 / p99 of four kinds of search on each.

Hostile (Benchmarks/hostile.py): what one client may cost the others: 1,000 anonymous
partial lines, quota floods, a search built to be slow, a user in 2,000 chats signing in,
listing and recalling; each beside another user's request → Sent p50 / p99.

Transports (Benchmarks/transports.py): sends and delivery over TCP, WebSocket, TLS and both.

Sessions (Benchmarks/sessions.py): as many idle authenticated sessions as the descriptor
limit allows (50,000 at most): memory per session, how long their sign-ins take, and a
one-to-one send's latency while they are connected beside before.

Peers (Benchmarks/peers.py): ejabberd, Prosody and Synapse (installed by `make bench-setup`)
beside chatcore, each driven by a client of its own protocol: durable messages/s,
acknowledgement and delivery latency, memory, bytes and fsyncs per message.

    python3 Benchmarks/run.py [codec] [engine] [store] [nodes] [search] [hostile] [transports] [sessions] [peers]     (all when none is named)
"""
import json
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "Benchmarks" / "out"
RELEASE = ROOT / ".build" / "release"


def realistic_corpus(path, lines=100_000):
    """A fixed (seeded) mix of the requests a chat client sends most."""
    rng = random.Random(7)
    words = "hello world lunch tomorrow meeting thanks sure ok café 日本語 🙂 see you soon".split()
    with path.open("w") as f:
        for n in range(lines):
            chat = str(rng.randrange(1, 200))
            kind = rng.random()
            if kind < 0.55:
                body = {"chatId": chat, "tag": "Text", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(3, 25))),
                        "cookie": f"s{n}"}
                if rng.random() < 0.2:
                    body["ref"] = [{"tag": "Quote", "messageId": str(rng.randrange(1, 10_000))}]
                if rng.random() < 0.2:
                    body["data"] = {"priority": rng.randrange(3), "mentions": ["bbmpim://user/id/%d" % rng.randrange(1, 99)], "v": 1.5}
                message = {"chatMessageSend": body}
            elif kind < 0.75:
                message = {"chatMessageRead": {"chatId": chat, "messageId": str(rng.randrange(1, 10_000))}}
            elif kind < 0.85:
                message = {"requestListMatching": {"type": "chatMessage", "criteria": {"chatId": chat, "notRefTag": "Thread"},
                                                   "window": {"messageId": str(rng.randrange(1, 10_000)), "before": 50, "after": 0}, "cookie": f"w{n}"}}
            elif kind < 0.93:
                message = {"chatTyping": {"chatId": chat}}
            elif kind < 0.97:
                message = {"requestListChange": {"type": "chatMessage", "elements": [{"chatId": chat, "messageId": str(n), "localData": {"starred": True}}]}}
            else:
                message = {"identitiesGet": {"cookie": f"i{n}", "appUserIds": [f"user{rng.randrange(1000)}"]}}
            f.write(json.dumps(message, ensure_ascii=False, separators=(",", ":")) + "\n")


def unknown_field_corpus(path, lines=200_000):
    with path.open("w") as f:
        for n in range(lines):
            f.write('{"chatMessageSend":{"chatId":"%d","tag":"Text","content":"message number %d with some text in it","cookie":"c%d","unknownField":%d}}\n'
                    % (n % 50, n, n, n))


def best_of(runs, command, **kwargs):
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def codec_rows(corpus):
    out = subprocess.run([str(RELEASE / "chatcore-bench"), "codec", str(corpus)], check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        name, lines, seconds = line.split()
        rows[name] = (int(lines), float(seconds))
    return rows


def main():
    wanted = set(sys.argv[1:]) or {"codec", "engine", "store", "nodes", "search", "hostile", "transports", "sessions", "peers"}
    if "codec" in wanted:
        codec_table()
    if "engine" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import engine
        rows = engine.rows()
        print(f"\n{'benchmark':<48} {'measure':<32} {'result':>20}")
        for group, name, value in rows:
            print(f"{group:<48} {name:<32} {value:>20}")
    if "nodes" in wanted:
        nodes_table()
    if "search" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import search
        search.print_table()
    if "hostile" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import hostile
        hostile.print_table()
    if "transports" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import transports
        transports.print_table()
    if "sessions" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import sessions
        print()
        sessions.print_table()
    if "peers" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import peers
        peers.print_table()
    if "store" in wanted:
        sys.path.insert(0, str(ROOT / "Benchmarks"))
        import store
        print(f"\n{'benchmark':<34} {'measure':<40} {'result':>22}   in-memory engine / notes")
        for group, name, value, note in store.rows():
            print(f"{group:<34} {name:<40} {value:>22}   {note}")


def nodes_table():
    sys.path.insert(0, str(ROOT / "Benchmarks"))
    import nodes
    print("\n" + nodes.HEADER)
    for row in nodes.rows():
        print(nodes.line(*row))
    nodes.print_headroom()
    nodes.print_held()
    print("\nOne PostgreSQL node while another node moves its chats on (each commit on a moved chat conflicts and is decided again)")
    print(nodes.CONFLICT_HEADER)
    for row in nodes.conflict_rows():
        print(nodes.conflict_line(*row))


def codec_table():
    OUT.mkdir(parents=True, exist_ok=True)
    rawyajl = OUT / "rawyajl"
    subprocess.run(["cc", "-O2", "-o", str(rawyajl), str(ROOT / "Benchmarks" / "rawyajl.c"), "-lyajl"], check=True)
    realistic = OUT / "realistic.ndjson"
    unknown = OUT / "unknown-field.ndjson"
    if not realistic.exists():
        realistic_corpus(realistic)
    if not unknown.exists():
        unknown_field_corpus(unknown)

    table = []
    for label, corpus in [("realistic requests", realistic), ("chatMessageSend + unknown field", unknown)]:
        rows = codec_rows(corpus)
        lines, floor = rows["yajl-raw"]
        for name in ["yajl-raw", "decode", "decode+encode", "foundation"]:
            _, seconds = rows[name]
            table.append((f"codec: {label}", name, lines, seconds, seconds / floor))

    # End to end through the real service, against the C program on the same file.
    lines = sum(1 for _ in unknown.open())
    per_line = best_of(3, [str(rawyajl), str(unknown)], stdout=subprocess.DEVNULL)
    streamed = best_of(3, [str(rawyajl), "--stream", str(unknown)], stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as data, tempfile.TemporaryFile() as answers:
        def serve():
            answers.seek(0)
            answers.truncate()
            with unknown.open("rb") as stdin:
                subprocess.run([str(RELEASE / "chatcore"), "serve", "--user", "bench", "--data-dir", data, "--log-level", "error"],
                               stdin=stdin, stdout=answers, check=True)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            serve()
            best = min(best, time.perf_counter() - start)
        answers.seek(0)
        answered = [json.loads(line) for line in answers.read().decode().splitlines()]
    assert len(answered) == lines and all(a["requestFailed"]["error"] == "InvalidParameter" for a in answered)
    # What of that is the process's start and stop: a new store, no input.
    started = float("inf")
    for _ in range(3):
        with tempfile.TemporaryDirectory() as data:
            start = time.perf_counter()
            subprocess.run([str(RELEASE / "chatcore"), "serve", "--user", "bench", "--data-dir", data, "--log-level", "error"],
                           stdin=subprocess.DEVNULL, check=True)
            started = min(started, time.perf_counter() - start)
    label = "end to end: chatcore serve < unknown-field file"
    table.append((label, "rawyajl (handle per line)", lines, per_line, 1.0))
    table.append((label, "rawyajl --stream (one handle)", lines, streamed, streamed / per_line))
    table.append((label, "chatcore serve", lines, best, best / per_line))
    table.append((label, "chatcore serve vs --stream", lines, best, best / streamed))
    table.append((label, "of which start and stop (no input)", 0, started, started / per_line))

    print(f"{'benchmark':<48} {'measure':<34} {'lines/s':>12} {'seconds':>9} {'× floor':>8}")
    for group, name, count, seconds, ratio in table:
        rate = f"{count / seconds:>12,.0f}" if count else f"{'-':>12}"
        print(f"{group:<48} {name:<34} {rate} {seconds:>9.3f} {ratio:>8.2f}")
    print("\n'× floor' is time divided by YAJL's own parse of the same bytes (per line, unless named).")


if __name__ == "__main__":
    sys.exit(main())
