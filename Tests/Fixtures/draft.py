#!/usr/bin/env python3
"""Drafts a transcript: plays the `NAME> ` and `!` steps of a script against the real
binary over TCP (`--insecure-no-auth`) and prints the script with what each session
received after each step (with the clock fixed, as the test runner does).

    python3 Tests/Fixtures/draft.py script.txt > Tests/Fixtures/x/y.transcript

A draft is not a test: read every received line against docs/protocol.md before keeping it.
Script steps: `!server ARGS` (first: extra arguments for `chatcore serve`), `!connect NAME`
(then `NAME> {"authToken":...}` as usual), `NAME> JSON`, `!close NAME`, `!restart`, `!kill`, `!sleep MS`,
`#` comments (kept).
"""
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.environ.get("CHATCORE_BINARY", os.path.join(ROOT, ".build", "debug", "chatcore"))


def start(data_dir, extra=()):
    process = subprocess.Popen([BINARY, "serve", "--data-dir", data_dir, "--listen", "127.0.0.1:0", "--insecure-no-auth", *extra],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, CHATCORE_FIXED_TIME="1700000000"))
    while True:
        line = process.stderr.readline()
        match = re.search(r"port=(\d+)", line)
        if match:
            return process, int(match.group(1))
        if not line:
            raise RuntimeError("chatcore did not start")


def scrub(value, key=None):
    if isinstance(value, dict):
        return {k: scrub(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def main():
    data_dir = tempfile.mkdtemp()
    steps = [raw.rstrip("\n") for raw in open(sys.argv[1])]
    extra = []
    while steps and steps[0].startswith("!server "):
        extra += steps.pop(0).split()[1:]
    process, port = start(data_dir, extra)
    sessions = {}
    buffers = {}

    def collect(wait=0.15):
        deadline = time.time() + wait
        out = []
        while True:
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            readable, _, _ = select.select(list(sessions.values()), [], [], remaining)
            for sock in readable:
                name = next(n for n, s in sessions.items() if s is sock)
                data = sock.recv(1 << 20)
                buffers[name] += data
                while b"\n" in buffers[name]:
                    line, buffers[name] = buffers[name].split(b"\n", 1)
                    event = scrub(json.loads(line))
                    text = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
                    try:
                        text.encode()
                    except UnicodeEncodeError:  # a lone surrogate in a free-form value
                        text = json.dumps(event, separators=(",", ":"))
                    out.append(f"{name}< " + text)
        return out

    print(" ".join(["!server", "--insecure-no-auth", *extra]))
    for step in steps:
        print(step + (" tcp" if step.startswith("!connect ") else ""))
        if not step or step.startswith("#"):
            continue
        if step.startswith("!connect "):
            name = step.split()[1]
            sessions[name] = socket.create_connection(("127.0.0.1", port))
            buffers[name] = b""
        elif step.startswith("!close "):
            name = step.split()[1]
            sessions.pop(name).close()
            for line in collect():
                print(line)
        elif step in ("!restart", "!kill"):
            process.send_signal(signal.SIGTERM if step == "!restart" else signal.SIGKILL)
            process.wait()
            sessions.clear()
            process, port = start(data_dir, extra)
        elif step.startswith("!sleep "):
            time.sleep(int(step.split()[1]) / 1000)
            for line in collect(0.05):
                print(line)
        else:
            name, line = step.split("> ", 1)
            sessions[name].sendall(line.encode() + b"\n")
            for line in collect():
                print(line)
    process.send_signal(signal.SIGTERM)
    process.wait()


if __name__ == "__main__":
    main()
