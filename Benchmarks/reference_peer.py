#!/usr/bin/env python3
"""The reference a user would otherwise write: a plain Python peer that stores each chat
message in SQLite (WAL, synchronous=FULL, one commit per message, so that "Sent" means
durable, as in chatcore) and answers with a Sent line. It reads chatMessageSend lines on
standard input and writes one `{"sent":{"messageId":...}}` line per message.

`Benchmarks/engine.py` drives it with the same pipelined send-and-wait-for-Sent loop as
chatcore and prints the ratio.
"""
import json
import sqlite3
import sys
import time


def main():
    database = sqlite3.connect(sys.argv[1], isolation_level=None)
    database.execute("PRAGMA journal_mode=WAL")
    database.execute("PRAGMA synchronous=FULL")
    database.execute("CREATE TABLE IF NOT EXISTS message (chat TEXT, id INTEGER, content TEXT, timestamp INTEGER, PRIMARY KEY (chat, id))")
    next_id = {}
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)["chatMessageSend"]
        chat = request["chatId"]
        message_id = next_id.get(chat, 0) + 1
        next_id[chat] = message_id
        database.execute("BEGIN")
        database.execute("INSERT INTO message VALUES (?, ?, ?, ?)", (chat, message_id, request.get("content"), int(time.time())))
        database.execute("COMMIT")
        out.write(json.dumps({"sent": {"chatId": chat, "messageId": str(message_id)}}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
