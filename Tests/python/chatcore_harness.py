"""Shared helpers for the Python tests: start the real binary, talk to it over stdio or
a Unix socket, and read what it answers."""
import contextlib
import json
import os
import queue
import re
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

from conftest import chatcore_binary


def line(message):
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def body(event):
    """The value of a one-member event object."""
    return next(iter(event.values()))


def cookie_of(event):
    value = body(event)
    return value.get("cookie") if isinstance(value, dict) else None


LIST_HEADERS = ("listAll", "listElements", "listMatching")


def ends_answer(event, cookie):
    """True for the last event of the answer to the request with `cookie`: a list answer
    is its header and then chunks, the final one `"last": true`; any other answer is
    one event."""
    if cookie_of(event) != cookie:
        return False
    name = next(iter(event))
    if name == "listChunk":
        return bool(event[name].get("last"))
    return name not in LIST_HEADERS


def wait_until_accepting(path, process, timeout=60, why=lambda: ""):
    """Returns once something accepts connections on the Unix socket `path`: its file
    appears when it is bound, a moment before it listens (a connection then is refused),
    so the file alone is no sign. Fails when `process` exits first, or after `timeout`."""
    deadline = time.time() + timeout
    while True:
        assert process.poll() is None, f"chatcore exited ({process.returncode}) before it listened. {why()}"
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            return
        except OSError:
            assert time.time() < deadline, f"chatcore did not listen on {path}. {why()}"
            time.sleep(0.02)
        finally:
            probe.close()


def start_socket_server(data_dir, path, *arguments, prefix=()):
    """`chatcore serve --listen unix:PATH --insecure-no-auth`; returns once it accepts."""
    command = list(prefix) + [chatcore_binary(), "serve", "--data-dir", data_dir, "--listen", "unix:" + path,
                              "--insecure-no-auth", *arguments]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline:
        if process.poll() is not None:
            raise AssertionError("chatcore exited: %s" % process.stderr.read().decode(errors="replace"))
        try:
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(path)
            probe.close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise AssertionError("chatcore did not listen on %s" % path)


class ConnectionEnded(queue.Empty, ConnectionError):
    """The connection ended before the answer waited for came."""


class Client:
    """One socket session; a thread reads its events into a queue."""

    def __init__(self, path):
        """`path`: a Unix socket's, or (host, port) for TCP."""
        if isinstance(path, tuple):
            self.sock = socket.create_connection(path)
        else:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(path)
        self._start_reading()

    def _start_reading(self):
        """Reads `self.sock` (anything with `recv`) into `events` and `all`."""
        self.events = queue.Queue()
        self.all = []
        self.closed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    text, buffer = buffer.split(b"\n", 1)
                    event = json.loads(text)
                    self.all.append(event)
                    self.events.put(event)
        except OSError:
            pass
        self.closed.set()

    def send(self, *messages):
        self.sock.sendall(b"".join(line(message) for message in messages))

    def answer(self, cookie, timeout=30):
        """Events up to the end of the answer with `cookie` (see `ends_answer`). Raises
        `queue.Empty` when it does not come within `timeout` seconds, and
        `ConnectionEnded` (a `queue.Empty` too) as soon as the connection ended without it."""
        got = []
        deadline = time.time() + timeout
        while True:
            event = self._next(deadline, lambda: f"the answer to {cookie!r}: {got}")
            got.append(event)
            if ends_answer(event, cookie):
                return got

    def next_event(self, matching, timeout=30):
        """The next event for which `matching` is true (those before it are passed over).
        Raises as `answer` does."""
        deadline = time.time() + timeout
        while True:
            event = self._next(deadline, lambda: "the event waited for")
            if matching(event):
                return event

    def _next(self, deadline, waited_for):
        """The next event read: `queue.Empty` at `deadline`, `ConnectionEnded` as soon as
        the connection ended with nothing left to read (`waited_for()` says what did not come)."""
        while True:
            try:
                return self.events.get(timeout=max(0.01, min(0.1, deadline - time.time())))
            except queue.Empty:
                if self.closed.is_set() and self.events.empty():
                    raise ConnectionEnded(f"the connection ended before {waited_for()}") from None
                if time.time() >= deadline:
                    raise

    def request(self, message):
        self.send(message)
        return self.answer(body(message)["cookie"])

    def close(self):
        """Ends the connection. `shutdown` first: while the reading thread waits in `recv`,
        `close` alone would leave the socket open (and the service would see no end)."""
        try:
            if isinstance(self.sock, socket.socket):
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def start_auth(client, user, cookie="auth"):
    """Sends an authToken, then an identitiesGet (cookie `cookie`-sync) whose answer says the
    sign-in's is complete (the authToken answer, a `global` listChange, carries no cookie);
    waits for nothing."""
    client.send({"authToken": {"userId": user, "authToken": "any", "cookie": cookie}},
                {"identitiesGet": {"cookie": cookie + "-sync", "appUserIds": [user]}})


def auth(client, user, cookie="auth"):
    """`start_auth`, then its answer. Returns the events before the identities answer."""
    start_auth(client, user, cookie)
    return client.answer(cookie + "-sync")[:-1]


def connect_when_serving(address, user, timeout=30, why=lambda: ""):
    """A client of `address` (as `Client` takes it) authenticated as `user`, once the
    service there serves (it may be starting, or taking over): tries again every 200 ms
    for `timeout` seconds, then fails with `why()`."""
    deadline = time.time() + timeout
    while True:
        try:
            client = Client(address)
            auth(client, user)
            return client
        except (OSError, queue.Empty):
            assert time.time() < deadline, why()
            time.sleep(0.2)


def global_value(events, name):
    for event in events:
        change = event.get("listChange")
        if change and change["type"] == "global":
            for element in change["elements"]:
                if element["name"] == name:
                    return element["value"]
    return None


@contextlib.contextmanager
def small_tmpfs(size, prefix="chatcore-full-"):
    """A tmpfs of `size` (such as "24m") mounted on a new directory, which it yields, or
    None when it cannot be mounted here (mounting needs root); unmounted at the end."""
    if os.geteuid() != 0:
        yield None
        return
    mount = tempfile.mkdtemp(prefix=prefix)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount], capture_output=True).returncode != 0:
        os.rmdir(mount)
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", mount])
        os.rmdir(mount)


# Prometheus' text format, one sample per line (`--metrics`).
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*)?\})? (-?[0-9.eE+-]+|NaN|\+Inf|-Inf)$')


def parse(text):
    """{(name, frozenset(labels)): value}; fails on anything that is not Prometheus text."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}, line
            typed.add(name)
            continue
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        samples[(match.group(1), labels)] = float(match.group(5))
        base = re.sub(r"_(bucket|sum|count)$", "", match.group(1))
        assert match.group(1) in typed or base in typed, f"{match.group(1)} has no TYPE line"
    return samples


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(response.read().decode())
