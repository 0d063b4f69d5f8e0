"""Drives two Simple Chat terminals (alice and bob) against one real chatcore over TCP:
start a chat, send, see the delivery status move to Delivered and then Read."""
import os
import pathlib
import queue
import re
import subprocess
import sys
import tempfile
import threading

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BINARY = os.environ.get("CHATCORE_BINARY") or str(ROOT / ".build" / "debug" / "chatcore")


class Terminal:
    def __init__(self, user, *args):
        self.process = subprocess.Popen([sys.executable, str(HERE / "simple_chat.py"), "--user", user, "--binary", BINARY, *args],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                        env={**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python")})
        self.lines = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line.rstrip("\n")) for line in self.process.stdout], daemon=True).start()
        self.seen = []

    def type(self, text):
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def expect(self, pattern, timeout=20):
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}; saw {self.seen}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def quit(self):
        self.type("/quit")
        assert self.process.wait(timeout=30) == 0


def serve(data_dir):
    process = subprocess.Popen([BINARY, "serve", "--data-dir", data_dir, "--listen", "127.0.0.1:0", "--insecure-no-auth"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        match = re.search(r"port=(\d+)", line)
        if match:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, match.group(1)
    raise AssertionError("chatcore did not start")


def test_two_terminals_chat_and_see_delivery_and_read():
    with tempfile.TemporaryDirectory() as data_dir:
        server, port = serve(data_dir)
        try:
            alice = Terminal("alice", "--connect", f"127.0.0.1:{port}")
            alice.expect(r"signed in as alice \(bbmpim://user/id/0\)")  # yourself, in your own view
            bob = Terminal("bob", "--connect", f"127.0.0.1:{port}")
            bob.expect(r"signed in as bob")

            alice.type("/start bob Lunch")
            alice.expect(r"chat 1: Lunch")
            alice.expect(r"chat 1 is open")
            bob.expect(r"chat 1: Lunch")

            alice.type("Pizza at noon?")
            alice.expect(r"#2 me: Pizza at noon\? \[Sent\]")
            alice.expect(r"#2 is now Delivered")      # bob is connected
            bob.expect(r"new message in chat 1")

            bob.type("/chats")
            bob.expect(r"chat 1: Lunch  unread 1")
            bob.type("/open 1")
            bob.expect(r"#2 alice: Pizza at noon\?$")
            bob.type("/read")
            alice.expect(r"#2 is now Read")
            bob.type("Sure!")
            bob.expect(r"#3 me: Sure! \[Sent\]")
            alice.expect(r"new message in chat 1|#3 bob: Sure!")

            alice.quit()
            bob.quit()
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_spawned_service_keeps_history():
    with tempfile.TemporaryDirectory() as data_dir:
        alice = Terminal("alice", "--data-dir", data_dir)
        alice.expect(r"signed in as alice")
        alice.type("/start bob Notes")
        alice.expect(r"chat 1 is open")
        alice.type("remember the milk")
        alice.expect(r"#2 me: remember the milk \[Sent\]")
        alice.quit()

        again = Terminal("alice", "--data-dir", data_dir)
        again.expect(r"signed in as alice")
        again.type("/chats")
        again.expect(r"chat 1: Notes  unread 0")
        again.type("/open 1")
        again.expect(r"#2 me: remember the milk \[Sent\]")
        again.quit()
