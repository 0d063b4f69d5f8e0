#!/usr/bin/env python3
"""Simple Chat: the flow of the Spark "Simple Chat" sample, in a terminal, over chatcore.

Authenticate, create a chat, list chats, send Text messages, mark them read, and watch
each message's delivery status change live. It reacts to events as a bbmcore app does (one
handler per event), and builds its requests with the Python client's typed builders
(`chatcore.protocol`).

    # with the client installed (pip install ./clients/python, or PYTHONPATH=clients/python),
    # spawn chatcore on this user's own data directory (standard input/output):
    python3 simple_chat.py --user alice
    # or connect to a running service (make run) as one of several users:
    python3 simple_chat.py --user alice --connect 127.0.0.1:7400 [--token JWT]

Commands (anything else is sent as a Text message to the open chat):

    /start USERID [SUBJECT]   start a chat with someone (one-to-one without a subject)
    /chats                    list your chats, with unread counts
    /open CHATID              open a chat and show its last 20 messages
    /read                     mark everything in the open chat as read
    /quit
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, Any, TextIO

import chatcore
from chatcore import protocol


class Connection:
    """Newline-delimited JSON to chatcore: a spawned child, or a TCP / Unix socket."""

    def __init__(self, args: argparse.Namespace):
        self.process: subprocess.Popen[str] | None
        self.reader: IO[str]
        self.writer: IO[str]
        if args.connect:
            if args.connect.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(args.connect[5:])
            else:
                host, port = args.connect.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)))
            self.reader = sock.makefile("r", encoding="utf-8")
            self.writer = sock.makefile("w", encoding="utf-8")
            self.process = None
        else:
            data_dir = args.data_dir or os.path.join(tempfile.gettempdir(), "simple-chat-" + args.user)
            self.process = subprocess.Popen([args.binary, "serve", "--user", args.user, "--data-dir", data_dir],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                            text=True, bufsize=1)
            assert self.process.stdout is not None and self.process.stdin is not None
            self.reader, self.writer = self.process.stdout, self.process.stdin

    def send(self, message: dict[str, Any]) -> None:
        self.writer.write(json.dumps(message, separators=(",", ":"), ensure_ascii=False) + "\n")
        self.writer.flush()

    def events(self) -> Iterator[dict[str, Any]]:
        for line in self.reader:
            yield json.loads(line)

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError:
            pass
        if self.process:
            self.process.wait(timeout=30)


class SimpleChat:
    def __init__(self, connection: Connection, user: str, out: TextIO = sys.stdout):
        self.connection = connection
        self.user = user
        self.out = out
        self.lock = threading.Lock()
        self.my_uri: str | None = None
        self.users: dict[str, str] = {}             # uri -> userId
        self.chats: dict[str, dict[str, Any]] = {}  # chatId -> chat element (as changes left it)
        self.open_chat: str | None = None
        self.ready = threading.Event()

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(text + "\n")
            self.out.flush()

    def name(self, uri: str) -> str:
        if uri == self.my_uri:
            return "me"
        return self.users.get(uri, uri)

    # events

    def listen(self) -> None:
        for event in self.connection.events():
            (kind, body), = event.items()
            handler = getattr(self, "on_" + kind, None)
            if handler:
                handler(body)
        self.say("* chatcore closed the connection")

    def on_listChange(self, body: dict[str, Any]) -> None:
        if body["type"] == "global":
            for element in body["elements"]:
                if element["name"] == "localUri":
                    self.my_uri = element["value"]
                    self.say(f"* signed in as {self.user} ({self.my_uri})")
                    self.connection.send(protocol.request_list_all(type="chat", cookie="chats-initial"))
                    self.ready.set()
        elif body["type"] == "chat":
            for change in body["elements"]:
                chat = self.chats.setdefault(change["chatId"], {"chatId": change["chatId"]})
                chat.update({k: v for k, v in change.items() if v is not None})
        elif body["type"] == "chatMessage":
            for change in body["elements"]:
                if "state" in change and change["chatId"] == self.open_chat:
                    self.say(f"  #{change['messageId']} is now {change['state']}")

    def on_listAdd(self, body: dict[str, Any]) -> None:
        if body["type"] == "chat":
            for chat in body["elements"]:
                self.chats[chat["chatId"]] = chat
                self.say(f"* chat {chat['chatId']}: {chat['subject'] or '(one-to-one)'}")
            if body.get("cookie") is not None:
                # The answer to our chatStart: the new chat carries its cookie.
                self.opened(body["elements"][0]["chatId"])
        elif body["type"] == "chatMessage":
            for message in body["elements"]:
                self.show(message, live=True)
        elif body["type"] == "chatParticipant":
            for participant in body["elements"]:
                if participant["userUri"] not in self.users:
                    self.connection.send(protocol.request_list_elements_user(elements=[{"uri": participant["userUri"]}]))

    def on_listChunk(self, body: dict[str, Any]) -> None:
        # A list answer opens with its header (listAll, listElements, listMatching); its
        # chunks follow, the final one with "last": true.
        if body["type"] == "chatMessage":
            for message in body["elements"]:
                self.show(message, live=False)
        elif body["type"] == "global":
            # A spawned service trusts its parent: the identity comes from the global list.
            self.on_listChange(body)
        elif body["type"] == "chat":
            for chat in body["elements"]:
                self.chats[chat["chatId"]] = chat
        elif body["type"] == "user":
            for user in body["elements"]:
                self.users[user["uri"]] = user["userId"]
        if body["type"] == "chat" and body.get("cookie") == "chats" and body.get("last"):
            self.list_chats()

    def opened(self, chat_id: str) -> None:
        self.open_chat = chat_id
        self.say(f"* chat {chat_id} is open: type to send")

    def on_chatStartFailed(self, body: dict[str, Any]) -> None:
        if body["reason"] == "AlreadyExists":
            self.opened(body["chatId"])  # the one-to-one chat we already have
        else:
            self.say(f"! could not start the chat: {body['reason']} ({body.get('detail', '')})")

    def on_requestFailed(self, body: dict[str, Any]) -> None:
        self.say(f"! {body.get('request', 'request')} failed: {body['error']}: {body['reason']}")

    def on_setupError(self, body: dict[str, Any]) -> None:
        self.say(f"! authentication failed: {body['error']}")

    def show(self, message: dict[str, Any], live: bool) -> None:
        if message["tag"] != "Text":
            return  # like the Spark sample: only Text is rendered
        if live and message["chatId"] != self.open_chat:
            self.say(f"* new message in chat {message['chatId']}")
            return
        text = message.get("content", "(recalled)" if message.get("recall") else "(deleted)")
        status = f" [{message['state']}]" if message["senderUri"] == self.my_uri else ""
        self.say(f"  #{message['messageId']} {self.name(message['senderUri'])}: {text}{status}")

    def list_chats(self) -> None:
        if not self.chats:
            self.say("* no chats yet: /start USERID [SUBJECT]")
        for chat in sorted(self.chats.values(), key=lambda c: int(c["chatId"])):
            self.say(f"  chat {chat['chatId']}: {chat.get('subject') or '(one-to-one)'}  unread {chat.get('numUnread', 0)}")

    # commands

    def command(self, line: str) -> bool:
        if line.startswith("/start "):
            parts = line.split(maxsplit=2)
            subject = parts[2] if len(parts) == 3 else None
            self.connection.send(protocol.chat_start(cookie="start", invitees=[{"userId": parts[1]}], subject=subject,
                                                     isOneToOne=True if subject is None else None))
        elif line == "/chats":
            self.connection.send(protocol.request_list_all(type="chat", cookie="chats"))
        elif line.startswith("/open "):
            self.open_chat = line.split()[1]
            self.connection.send(protocol.request_list_matching_chat_message(
                criteria={"chatId": self.open_chat, "tag": "Text"}, window={"timestamp": 2 ** 40, "before": 20}, cookie="open"))
        elif line == "/read":
            chat = self.chats.get(self.open_chat) if self.open_chat else None
            if self.open_chat and chat and chat.get("lastMessage"):
                self.connection.send(protocol.chat_message_read(chatId=self.open_chat, messageId=str(chat["lastMessage"])))
        elif line == "/quit":
            return False
        elif line.startswith("/"):
            self.say("? commands: /start USERID [SUBJECT], /chats, /open CHATID, /read, /quit")
        elif self.open_chat is None:
            self.say("? open a chat first: /open CHATID or /start USERID")
        elif line:
            self.connection.send(protocol.chat_message_send(chatId=self.open_chat, tag="Text", content=line))
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--user", required=True)
    parser.add_argument("--connect", help="HOST:PORT or unix:PATH of a running chatcore")
    parser.add_argument("--token", default="-", help="JWT for --connect (any text with --insecure-no-auth)")
    parser.add_argument("--binary", help="the chatcore executable (default: $CHATCORE_BINARY, PATH, or this repository's build)")
    parser.add_argument("--data-dir")
    args = parser.parse_args()
    if not args.connect:
        try:
            args.binary = chatcore.find_binary(args.binary)
        except chatcore.BinaryNotFound as missing:
            sys.exit(str(missing))
    connection = Connection(args)
    app = SimpleChat(connection, args.user)
    threading.Thread(target=app.listen, daemon=True).start()
    if args.connect:
        connection.send(protocol.auth_token(userId=args.user, authToken=args.token))
    else:
        connection.send(protocol.request_list_all(type="global", cookie="me"))
    for line in sys.stdin:
        if not app.command(line.strip()):
            break
    connection.close()


if __name__ == "__main__":
    main()
