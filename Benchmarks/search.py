"""Search on PostgreSQL against SQLite (`python3 Benchmarks/run.py search`): one user in 20
chats of 10,000 messages each (200,000 messages of common words, one of them holding a
word found nowhere else), then 20 searches of each kind, one at a time: a common word, a
two-letter word, the word found in one message, and a two-word phrase (after one untimed
pass; PostgreSQL vacuumed and analyzed after the load, as autovacuum would be). p50 and
p99 of request → `searchResult` (100 results at most), release build, both
stores filled the same way in one run.
"""
import random
import statistics
import tempfile
import threading
import time

import nodes
from postgres_cluster import Cluster, postgres_bin

WORDS = ("hello world lunch tomorrow meeting thanks sure ok café see you soon coffee deadline report review "
         "call later great idea plan budget draft send update weekend train late office home").split()
QUERIES = [("a common word", "lunch"), ("two letters", "ok"), ("a word in one message", "zanzibarite"),
           ("a phrase", "coffee deadline")]
CHATS = 20
PER_CHAT = 10_000


def fill(path):
    """20 chats of `PER_CHAT` messages each, sent by their peers to `reader`, who connects
    once they are sent (a session that does not read its events would hold them up)."""
    rng = random.Random(11)
    peers = []
    for n in range(CHATS):
        peer = nodes.Session(path, f"peer{n}")
        chat = peer.start_chat("reader")
        peers.append((peer, chat))
    rare = (rng.randrange(CHATS), rng.randrange(PER_CHAT))
    readers = [threading.Thread(target=nodes.receive, args=(peer, PER_CHAT)) for peer, _ in peers]
    for thread in readers:
        thread.start()
    for index, (peer, chat) in enumerate(peers):
        lines = []
        for k in range(PER_CHAT):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12)))
            if (index, k) == rare:
                text += " zanzibarite"
            lines.append({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": text}})
        peer.send(*lines)
    for thread in readers:
        thread.join()
    for peer, _ in peers:
        peer.close()
    return nodes.Session(path, "reader")


def timings(reader, repeat=20):
    # One untimed pass: the first searches after a bulk load read pages it left cold.
    for n, (_, text) in enumerate(QUERIES):
        reader.send({"search": {"text": text, "cookie": f"w{n}"}})
        reader.until(lambda e: "searchResult" in e and e["searchResult"].get("cookie") == f"w{n}")
    results = []
    for name, text in QUERIES:
        seconds = []
        for n in range(repeat):
            began = time.perf_counter()
            reader.send({"search": {"text": text, "cookie": f"q{n}"}})
            answer = reader.until(lambda e: "searchResult" in e and e["searchResult"].get("cookie") == f"q{n}")
            seconds.append(time.perf_counter() - began)
            assert answer["searchResult"]["messages"], (text, answer)
        seconds.sort()
        results.append((name, text, statistics.median(seconds) * 1000, seconds[int(len(seconds) * 0.99) - 1] * 1000))
    return results


def rows():
    table = {}
    with tempfile.TemporaryDirectory() as scratch:
        process, path = nodes.start_node(scratch, "sqlite")
        reader = fill(path)
        table["SQLite (index file)"] = timings(reader)
        reader.close()
        process.terminate()
        process.wait()
    if postgres_bin() is not None:
        with Cluster(settings=("shared_buffers=256MB",)) as cluster, tempfile.TemporaryDirectory() as scratch:
            database = cluster.create_database("search")
            process, path = nodes.start_node(scratch, "postgres", cluster.database_url(database))
            reader = fill(path)
            # What autovacuum does after a bulk load, done now: right after 200,000 sends,
            # with autovacuum still going, searches took 50-160 ms instead of 5-15.
            cluster.psql("VACUUM ANALYZE", database)
            table["PostgreSQL (message_search)"] = timings(reader)
            reader.close()
            process.terminate()
            process.wait()
    return table


def print_table():
    table = rows()
    print(f"\n{'search, 200,000 messages in 20 chats':<40}" + "".join(f"{store:>30}" for store in table))
    for position, (name, text, _, _) in enumerate(next(iter(table.values()))):
        cells = "".join(f"{f'{results[position][2]:.1f} / {results[position][3]:.1f} ms':>30}" for results in table.values())
        print(f"{f'{name} ({text!r}) p50 / p99':<40}" + cells)


if __name__ == "__main__":
    print_table()
