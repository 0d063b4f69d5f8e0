"""Sends and delivery over each kind of listener, in one run: TCP, WebSocket, TLS and
WebSocket over TLS, on one chatcore (`python3 Benchmarks/run.py transports`).

For each transport, alternating rounds: a pipelined sender's durable sends per second
(20,000 sends into a one-to-one chat whose recipient is connected the same way, the time
from the first send to the sender's last answer), and one-at-a-time delivery latency (a send,
then the recipient's listAdd; 1,000 of them, p50 and p99). The clients are the same few
lines of Python for every transport (a WebSocket is framed by hand, as a browser would), so
what differs is the service's side and the link's."""
import base64
import datetime
import ipaddress
import json
import os
import re
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINARY = os.environ.get("CHATCORE_BINARY", str(ROOT / ".build" / "release" / "chatcore"))


def certificate(directory):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    Path(cert_path).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(key_path).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


class Lines:
    """One session's lines over a socket (plain or TLS), framed as newlines or as WebSocket text frames."""

    def __init__(self, port, tls_context=None, web_socket=False):
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = tls_context.wrap_socket(raw, server_hostname="127.0.0.1") if tls_context else raw
        self.web_socket = web_socket
        self.buffer = b""
        if web_socket:
            key = base64.b64encode(os.urandom(16)).decode()
            self.sock.sendall((f"GET /b HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
            while b"\r\n\r\n" not in self.buffer:
                self.buffer += self.sock.recv(4096)
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 101"), head

    def frame(self, line):
        if not self.web_socket:
            return line + b"\n"
        mask = os.urandom(4)
        length = len(line)
        header = bytes([0x81]) + (bytes([0x80 | length]) if length < 126 else bytes([0x80 | 126]) + struct.pack("!H", length))
        # A fixed mask pattern XOR, fast enough in Python for short lines.
        masked = bytes(b ^ mask[i & 3] for i, b in enumerate(line))
        return header + mask + masked

    def send(self, *lines):
        self.sock.sendall(b"".join(self.frame(json.dumps(line).encode()) for line in lines))

    def lines(self):
        """Received lines, as they come (read by offset: a buffer holding thousands of them is
        not copied once per line)."""
        while True:
            buffer, at = self.buffer, 0
            if self.web_socket:
                while len(buffer) - at >= 2:
                    length = buffer[at + 1] & 0x7F
                    start = at + 2
                    if length == 126:
                        if len(buffer) - at < 4:
                            break
                        length, start = struct.unpack_from("!H", buffer, at + 2)[0], at + 4
                    elif length == 127:
                        if len(buffer) - at < 10:
                            break
                        length, start = struct.unpack_from("!Q", buffer, at + 2)[0], at + 10
                    if len(buffer) < start + length:
                        break
                    opcode = buffer[at] & 0x0F
                    at = start + length
                    if opcode == 1:
                        yield buffer[start:at]
            else:
                while (newline := buffer.find(b"\n", at)) >= 0:
                    yield buffer[at:newline]
                    at = newline + 1
            self.buffer = buffer[at:]
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return
            self.buffer += chunk

    def until(self, needle):
        for line in self.lines():
            if needle in line:
                return line
        raise ConnectionError("the connection ended")


def serve(work):
    cert, key = certificate(work)
    process = subprocess.Popen([BINARY, "serve", "--data-dir", os.path.join(work, "d"), "--insecure-no-auth", "--log-level", "info",
                                "--listen", "127.0.0.1:0", "--listen", "ws://127.0.0.1:0/b", "--listen", "tls://127.0.0.1:0",
                                "--listen", "wss://127.0.0.1:0/b", "--tls-cert", cert, "--tls-key", key],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ports = {}
    for line in process.stderr:
        found = re.search(r"address=(\S+) .*port=(\d+)", line)
        if found and "listening" in line:
            kind = found.group(1).split("://")[0] if "://" in found.group(1) else "tcp"
            ports[kind] = int(found.group(2))
            if len(ports) == 4:
                break
    log = os.environ.get("TRANSPORTS_LOG")

    def keep():
        for line in process.stderr:
            if log:
                with open(log, "a") as f:
                    f.write(line)

    threading.Thread(target=keep, daemon=True).start()
    context = ssl.create_default_context(cafile=cert)
    return process, {
        "TCP": lambda: Lines(ports["tcp"]),
        "WebSocket": lambda: Lines(ports["ws"], web_socket=True),
        "TLS": lambda: Lines(ports["tls"], tls_context=context),
        "WebSocket over TLS": lambda: Lines(ports["wss"], tls_context=context, web_socket=True),
    }


def pair(connect, round_number, name):
    """A sender and a connected recipient in a one-to-one chat of their own; (sender, recipient, chatId)."""
    users = [f"{name}-{round_number}-a".replace(" ", "_"), f"{name}-{round_number}-b".replace(" ", "_")]
    sender, recipient = connect(), connect()
    for session, user in ((sender, users[0]), (recipient, users[1])):
        session.send({"authToken": {"userId": user, "authToken": "x"}}, {"identitiesGet": {"cookie": "up", "appUserIds": [user]}})
        session.until(b'"cookie":"up"')
    sender.send({"chatStart": {"cookie": "c", "invitees": [{"userId": users[1]}], "isOneToOne": True}})
    started = json.loads(sender.until(b'"cookie":"c"'))
    recipient.until(b'"type":"chat"')
    return sender, recipient, started["listAdd"]["elements"][0]["chatId"]


def pipelined(connect, round_number, name, count=20_000):
    sender, recipient, chat = pair(connect, round_number, name)
    threading.Thread(target=lambda: [None for _ in recipient.lines()], daemon=True).start()
    last = f'"cookie":"p{count - 1}"'.encode()
    # The answers are read while the requests go: a client that only writes is held by
    # back-pressure until it reads.
    answered = threading.Thread(target=sender.until, args=(last,))
    started = time.perf_counter()
    answered.start()
    batch = 500
    for first in range(0, count, batch):
        sender.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"message {n}", "cookie": f"p{n}"}}
                      for n in range(first, min(count, first + batch))])
    answered.join()
    return count / (time.perf_counter() - started)


def delivery(connect, round_number, name, count=1000):
    sender, recipient, chat = pair(connect, round_number, name + "-d")
    waits = []
    incoming = recipient.lines()
    for n in range(count):
        started = time.perf_counter()
        sender.send({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"one {n}"}})
        needle = f'"content":"one {n}"'.encode()
        for line in incoming:
            if needle in line:
                break
        waits.append(time.perf_counter() - started)
    waits.sort()
    return statistics.median(waits), waits[int(len(waits) * 0.99) - 1]


def rows(rounds=2):
    results = {}
    with tempfile.TemporaryDirectory() as work:
        process, transports = serve(work)
        try:
            for round_number in range(rounds):
                for name, connect in transports.items():
                    rate = pipelined(connect, round_number, name)
                    p50, p99 = delivery(connect, round_number, name)
                    results.setdefault(name, []).append((rate, p50, p99))
        finally:
            process.terminate()
            process.wait(timeout=60)
    table = []
    tcp = statistics.median(r[0] for r in results["TCP"])
    for name, runs in results.items():
        rate = statistics.median(r[0] for r in runs)
        table.append((name, "pipelined sends/s (median)", f"{rate:,.0f}"))
        table.append((name, "  of TCP's, same run", f"{rate / tcp:.2f}×"))
        table.append((name, "delivery p50 / p99", f"{statistics.median(r[1] for r in runs) * 1000:.2f} / {statistics.median(r[2] for r in runs) * 1000:.2f} ms"))
    return table


def print_table():
    print(f"\n{'transport':<24} {'measure':<32} {'result':>20}")
    for name, measure, value in rows():
        print(f"{name:<24} {measure:<32} {value:>20}")


if __name__ == "__main__":
    print_table()
