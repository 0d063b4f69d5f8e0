#!/usr/bin/env python3
"""Builds a chatcore store of any size directly in SQL (and its search index), for the
store benchmarks: `make bench` builds 1,000,000 and 10,000,000 messages this way in
minutes, where sending them through the service would take an hour.

    python3 Benchmarks/store_gen.py DATA_DIR --messages 10000000 --chats 10000 --users 1000

The schema is the service's own: chatcore itself creates the empty store first (its
migrations), then this fills the tables with what the service would have written:
users u0..u<N>, chats of 5 members with their Join messages, texts from a fixed
vocabulary with some Quote and Thread references, read and delivery marks with the exact
unread counts, reference counts, the change feed and search positions, and the search
index (both of its tables). Deterministic (seeded).
"""
import argparse
import hashlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import time

WORDS = ("hello world lunch tomorrow meeting thanks sure ok café coffee report deadline weekend project review "
         "call later today yes no maybe great idea plan update question answer photo ticket train office home "
         "日本語 中文 🙂 🎉 ✓ naïve über señor déjà vu").split()
BASE_TIME = 1_700_000_000
MEMBERS = 5


def scope_token(chat):
    """A chat as one trigram (SQLiteSearchIndex.scopeToken)."""
    base = 6400
    return "".join(chr(0xE000 + digit) for digit in (chat // (base * base) % base, chat // base % base, chat % base))


def reg_id(user_id):
    value = int.from_bytes(hashlib.sha256(user_id.encode()).digest()[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF
    return value or 1


def _hex(ch):
    return "%x" % ord(ch)


_SPACE = _hex(" ")
# Each word's grams, and the pairs it makes with a space before and after it: a text of
# words from the vocabulary has the union of its words' grams and of those pairs.
_WORD_GRAMS = {}
_EDGES = {}
for _word in WORDS:
    _codes = [_hex(ch) for ch in _word.lower()]
    _WORD_GRAMS[_word] = frozenset(["u" + c for c in _codes] + ["b%sv%s" % pair for pair in zip(_codes, _codes[1:])])
    _EDGES[_word] = ("b%sv%s" % (_SPACE, _codes[0]), "b%sv%s" % (_codes[-1], _SPACE))


def word_grams(words, chat):
    """`grams(" ".join(words), chat)`, from the words' precomputed grams (fast)."""
    out = set()
    for index, word in enumerate(words):
        out |= _WORD_GRAMS[word]
        if index:
            out.add(_EDGES[word][0])
        if index + 1 < len(words):
            out.add(_EDGES[word][1])
    if len(words) > 1:
        out.add("u" + _SPACE)
    return " ".join(out) + " c%d" % chat


def grams(text, chat):
    """The search index's one- and two-character grams (SQLiteSearchIndex.grams)."""
    scalars = text.lower()
    seen = []
    out = set()
    for index, ch in enumerate(scalars):
        single = "u%x" % ord(ch)
        if single not in out:
            out.add(single)
            seen.append(single)
        if index + 1 < len(scalars):
            pair = "b%xv%x" % (ord(ch), ord(scalars[index + 1]))
            if pair not in out:
                out.add(pair)
                seen.append(pair)
    seen.append("c%d" % chat)
    return " ".join(seen)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--chats", type=int, default=10_000)
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--binary", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".build", "release", "chatcore"))
    parser.add_argument("--no-search", action="store_true", help="leave the search index empty (the service then rebuilds it)")
    args = parser.parse_args()
    if os.path.exists(os.path.join(args.data_dir, "chatcore.sqlite")):
        sys.exit(f"{args.data_dir} already holds a store")
    started = time.time()
    # The service makes the empty store: its tables, indexes and migrations.
    subprocess.run([args.binary, "serve", "--user", "u0", "--data-dir", args.data_dir, "--log-level", "error"], input=b"", check=True)

    rng = random.Random(20261124)
    db = sqlite3.connect(os.path.join(args.data_dir, "chatcore.sqlite"), isolation_level=None)
    db.execute("PRAGMA journal_mode = DELETE")
    db.execute("PRAGMA synchronous = OFF")
    db.execute("PRAGMA cache_size = -262144")
    search = None
    if not args.no_search:
        # Bulk loading: segments are merged once at the end ('optimize').
        search = sqlite3.connect(os.path.join(args.data_dir, "search.sqlite"), isolation_level=None)
        search.execute("PRAGMA journal_mode = DELETE")
        search.execute("PRAGMA synchronous = OFF")
        search.execute("PRAGMA cache_size = -262144")
        for table in ("message_search", "message_grams"):
            search.execute(f"INSERT INTO {table} ({table}, rank) VALUES ('automerge', 0)")
        search.execute("BEGIN")
    db.execute("BEGIN")
    db.execute("DELETE FROM user")
    db.executemany("INSERT INTO user (number, userId, regId) VALUES (?, ?, ?)",
                   [(n + 1, f"u{n}", reg_id(f"u{n}")) for n in range(args.users)])

    per_chat = args.messages // args.chats
    extra = args.messages - per_chat * args.chats
    change_seq = 0
    search_row = 0
    messages = []
    refs = []
    ref_counts = {}
    members = []
    chats = []
    search_rows = []
    gram_rows = []

    def flush():
        db.executemany("""INSERT INTO message (chat, id, sender, tag, content, data, timestamp, isControl, neverCountsUnread, isRecalled,
                          changeSeq, searchRow) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, 0, ?, ?)""", messages)
        db.executemany("INSERT INTO message_ref (chat, source, tag, target) VALUES (?, ?, ?, ?)", refs)
        if search:
            search.executemany("INSERT INTO message_search (rowid, text, scope, chat, id) VALUES (?, ?, ?, ?, ?)", search_rows)
            search.executemany("INSERT INTO message_grams (rowid, grams) VALUES (?, ?)", gram_rows)
        messages.clear()
        refs.clear()
        search_rows.clear()
        gram_rows.clear()

    for chat in range(1, args.chats + 1):
        users = [((chat - 1) * MEMBERS + k) % args.users + 1 for k in range(MEMBERS)]
        count = per_chat + (1 if chat <= extra else 0)
        count = max(count, MEMBERS - 1)
        timestamp = BASE_TIME + chat
        scope = scope_token(chat)
        texts = []
        unread_by = {}
        for message_id in range(1, count + 1):
            change_seq += 1
            if message_id < MEMBERS:
                joined = users[message_id]
                data = json.dumps({"Join": {"userUri": f"bbmpim://user/id/{joined}"}}, separators=(",", ":"))
                messages.append((chat, message_id, users[0], "Join", None, data, timestamp, 1, change_seq, 0))
                continue
            timestamp += rng.randrange(0, 3)
            sender = rng.choice(users)
            words = [rng.choice(WORDS) for _ in range(rng.randrange(2, 12))]
            content = " ".join(words)
            search_row += 1
            messages.append((chat, message_id, sender, "Text", content, None, timestamp, 0, change_seq, search_row))
            if search:
                search_rows.append((search_row, content, scope, chat, message_id))
                gram_rows.append((search_row, word_grams(words, chat)))
            if texts and rng.random() < 0.05:
                tag = "Thread" if rng.random() < 0.6 else "Quote"
                target = rng.choice(texts[-200:])
                refs.append((chat, message_id, tag, target))
                key = (chat, target, tag)
                ref_counts[key] = (ref_counts.get(key, (0, 0))[0] + 1, message_id)
            texts.append(message_id)
            unread_by[message_id] = sender
        last = count
        # Everyone got everything; each member read up to somewhere in the last few dozen.
        for position, user in enumerate(users):
            read_up_to = max(MEMBERS - 1, last - rng.randrange(0, 60))
            unread = sum(1 for message_id, sender in unread_by.items() if message_id > read_up_to and sender != user)
            members.append((chat, user, 1, 1 if position == 0 else 0, 1, None, 0, None, None, last, read_up_to, unread))
        chats.append((chat, f"chat {chat}", 0, "ParticipantsOnly", 0, None, last, timestamp))
        if len(messages) >= 200_000:
            flush()
            print(f"  {chat}/{args.chats} chats, {time.time() - started:.0f} s", file=sys.stderr)
    flush()
    db.executemany("""INSERT INTO chat (number, subject, isOneToOne, invitePolicy, isDefunct, data, lastMessage, lastActivity)
                      VALUES (?, ?, ?, ?, ?, ?, ?, ?)""", chats)
    db.executemany("""INSERT INTO member (chat, user, isActive, isAdmin, joinedAt, leftAt, isHidden, localData, privateData, deliveredUpTo,
                      readUpTo, numUnread) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""", members)
    db.executemany("INSERT INTO ref_count (chat, target, tag, count, newest) VALUES (?, ?, ?, ?, ?)",
                   [(chat, target, tag, count, newest) for (chat, target, tag), (count, newest) in ref_counts.items()])
    db.execute("INSERT OR REPLACE INTO counter (name, value) VALUES ('changeSeq', ?), ('searchRow', ?)", (change_seq, search_row))
    db.execute("COMMIT")
    db.execute("PRAGMA journal_mode = WAL")
    db.close()
    if search:
        search.execute("COMMIT")
        for table in ("message_search", "message_grams"):
            search.execute(f"INSERT INTO {table} ({table}) VALUES ('optimize')")
            search.execute(f"INSERT INTO {table} ({table}, rank) VALUES ('automerge', 4)")
        search.execute("PRAGMA journal_mode = WAL")
        search.close()
    os.remove(os.path.join(args.data_dir, "store-state")) if os.path.exists(os.path.join(args.data_dir, "store-state")) else None
    print(f"built {args.messages:,} messages in {args.chats:,} chats for {args.users:,} users in {time.time() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
