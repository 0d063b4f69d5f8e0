"""The link between a relaying node and the writer, over TLS, tried as a network attacker
would: when the writer's relay listener is `tls://`, a node that is not the writer relays
its clients' connections and its standard input/output session to it over TLS, and
believes it is the writer only when its certificate is signed by one the node trusts
(`--node-tls-ca`) and names the address the writer advertised.

Between the nodes sits a proxy of the test's at the address the writer advertises. First
it passes bytes through and records them: the conversation works, and nothing of it (a
message, a token, a node's word for a user) is in what it saw. Then it is a man in the
middle with a certificate of its own: no node relays to it, and it reads nothing."""
import datetime
import ipaddress
import json
import os
import re
import socket
import ssl
import subprocess
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import chat_with_bob, node_key_file, real_binary
from postgres_cluster import postgres_bin
from chatcore_harness import Client, auth, start_auth
from test_nodes import Node, wait_for, _no_node_outlives_its_test  # noqa: F401 (the fixture kills what a test started)

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")

SECRET = "the-vault-code-is-4711"


def certificate(directory, name, names, issuer=None, ca=False):
    """A certificate for `names` (IP addresses or DNS names), signed by `issuer` (a
    (certificate, key) pair) or by itself; returns (certificate, key, cert path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_cert, signer_key = issuer or (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    alternatives = []
    for each in names:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(each)))
        except ValueError:
            alternatives.append(x509.DNSName(each))
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(signer_cert.subject if signer_cert else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if alternatives:
        builder = builder.add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
    made = builder.sign(signer_key, hashes.SHA256())
    cert_path, key_path = os.path.join(directory, name + ".pem"), os.path.join(directory, name + ".key")
    with open(cert_path, "wb") as f:
        f.write(made.public_bytes(serialization.Encoding.PEM))
    with open(os.open(key_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return made, key, cert_path, key_path


class Between:
    """What listens at the address the writer advertises: passes bytes to the writer's
    TLS listener and keeps a copy (`seen`), or, once `impersonate` is given a certificate,
    ends TLS itself with it and keeps what it could read (`read`)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.writer_port = None
        self.impostor = None
        self.seen = bytearray()
        self.read = bytearray()
        self.impostor_connections = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def impersonate(self, cert_path, key_path):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_path, key_path)
        self.impostor = context

    def _accept(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            target = self._impersonate if self.impostor else self._pass
            threading.Thread(target=target, args=(connection,), daemon=True).start()

    def _pass(self, connection):
        upstream = socket.create_connection(("127.0.0.1", self.writer_port))

        def pump(source, sink):
            """One way; its end is passed on as a half-close (a relayed session ends so)."""
            try:
                while chunk := source.recv(65536):
                    with self.lock:
                        self.seen += chunk
                    sink.sendall(chunk)
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        back = threading.Thread(target=pump, args=(upstream, connection), daemon=True)
        back.start()
        pump(connection, upstream)
        back.join()
        connection.close()
        upstream.close()

    def _impersonate(self, connection):
        try:
            with self.impostor.wrap_socket(connection, server_side=True) as secured:
                while chunk := secured.recv(65536):
                    with self.lock:
                        self.read += chunk
        except (ssl.SSLError, OSError):
            pass  # the node refused the handshake (a certificate it does not trust)
        with self.lock:
            # Or it completed it, and then closed (a certificate for another name).
            self.impostor_connections += 1

    def close(self):
        self.listener.close()


class TLSClient(Client):
    """A session over TLS to 127.0.0.1:`port`, the certificate verified against `cafile`."""

    def __init__(self, port, cafile):
        context = ssl.create_default_context(cafile=cafile)
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
        self._start_reading()


def relayed_stdio(url, scratch, name, ca, lines, user="carol"):
    """A node started as `user` on standard input/output, with `lines` as its input;
    (exit code, its output's events, its log)."""
    done = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, name), "--user", user, "--store", url,
                           "--node-key-file", node_key_file(), "--node-tls-ca", ca],
                          input="".join(json.dumps(line) + "\n" for line in lines).encode(), capture_output=True, timeout=60)
    return done.returncode, [json.loads(line) for line in done.stdout.decode().splitlines()], done.stderr.decode()


def test_a_relaying_node_reaches_a_tls_writer_and_believes_no_one_else(cluster, scratch):
    authority = certificate(scratch, "authority", [], ca=True)
    _, _, writer_cert, writer_key = certificate(scratch, "writer", ["127.0.0.1", "localhost"], issuer=authority[:2])
    _, _, relay_cert, relay_key = certificate(scratch, "relay", ["127.0.0.1"], issuer=authority[:2])
    cluster.create_database("tlsrelay")
    url = cluster.database_url("tlsrelay")
    between = Between()
    try:
        # The writer's relay listener is its TLS one (it has a Unix socket too), reached at
        # the proxy's address.
        writer = Node(url, scratch, "w", "--listen", "tls://127.0.0.1:0", "--tls-cert", writer_cert, "--tls-key", writer_key,
                      "--advertise", f"127.0.0.1:{between.port}")
        writer.wait_until_logged("this node is the writer")
        between.writer_port = int(re.search(r"address=tls://127\.0\.0\.1:0 .*port=(\d+)", writer.logged()).group(1))
        assert cluster.psql("SELECT address FROM writer_node", database="tlsrelay").strip() == f"tls://127.0.0.1:{between.port}"

        # The relaying node has a TLS listener of its own too: it ends its clients' TLS
        # with its own certificate.
        relay = Node(url, scratch, "b", "--listen", "tls://127.0.0.1:0", "--tls-cert", relay_cert, "--tls-key", relay_key,
                     "--node-tls-ca", authority[2])
        relay.wait_until_logged("relaying connections to it")
        relay_port = int(re.search(r"address=tls://127\.0\.0\.1:0 port=(\d+)", relay.logged()).group(1))
        alice = Client(writer.socket)
        auth(alice, "alice")
        bob = TLSClient(relay_port, authority[2])
        auth(bob, "bob")
        chat = chat_with_bob(alice, "over TLS")
        alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": SECRET, "cookie": "m"}})
        got = bob.next_event(lambda e: any(m.get("content") == SECRET for m in e.get("listAdd", {}).get("elements", [])
                                           if e["listAdd"]["type"] == "chatMessage"))
        assert got["listAdd"]["elements"][0]["senderUri"] != ""
        bob.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": SECRET + "-answered", "cookie": "r"}})
        alice.next_event(lambda e: any(m.get("content") == SECRET + "-answered" for m in e.get("listAdd", {}).get("elements", [])))

        # A session started as carol on standard input/output, relayed with the node's
        # word for her: over TLS too.
        code, events, log = relayed_stdio(url, scratch, "c", authority[2],
                                          [{"chatStart": {"cookie": "s", "invitees": [{"userId": "alice"}], "subject": SECRET + "-stdio"}}])
        assert code == 0, log
        assert any(e.get("listAdd", {}).get("type") == "chat" and e["listAdd"]["elements"][0]["subject"] == SECRET + "-stdio"
                   for e in events), events
        alice.next_event(lambda e: any(c.get("subject") == SECRET + "-stdio" for c in e.get("listAdd", {}).get("elements", [])))

        # What went between the nodes was TLS (a handshake record first), and none of it
        # can be read: not the messages, not the sign-ins, not the node's word for carol.
        with between.lock:
            seen = bytes(between.seen)
        assert seen[:1] == b"\x16", seen[:16]
        for clear in (SECRET.encode(), b"authToken", b"chatMessageSend", b"carol", b"\"bob\"", b"chatcore-node"):
            assert clear not in seen

        # A man in the middle with a certificate of its own, and one the nodes' authority
        # signed for another name: no node relays to either, and neither reads a byte.
        _, _, self_signed, self_signed_key = certificate(scratch, "impostor", ["127.0.0.1"])
        _, _, other_name, other_name_key = certificate(scratch, "elsewhere", ["elsewhere.example"], issuer=authority[:2])
        for cert, key, why in ((self_signed, self_signed_key, "is not signed by a certificate this node trusts"),
                               (other_name, other_name_key, "is not for the address it advertised")):
            between.impersonate(cert, key)
            ended_before = between.impostor_connections
            mallory = Client(relay.socket)
            start_auth(mallory, "bob")
            relay.wait_until_logged(why)
            wait_for(lambda: between.impostor_connections > ended_before, "no node tried the impostor")
            assert mallory.all == []
            mallory.close()
            code, events, log = relayed_stdio(url, scratch, "c", authority[2], [{"identitiesGet": {"cookie": "i", "appUserIds": ["carol"]}}])
            assert code == 1 and events == [], (code, events)
            assert "cannot be relayed to" in log and why in log, log
            with between.lock:
                assert bytes(between.read) == b""
        # The conversation that was relayed before goes on.
        bob.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "still here", "cookie": "again"}})
        alice.close()
        bob.close()
        assert relay.stop() == 0
        assert writer.stop() == 0
    finally:
        between.close()


def test_what_a_node_is_given_to_trust_the_writer_with_is_checked_at_start(cluster, scratch):
    authority = certificate(scratch, "authority", [], ca=True)
    url = cluster.database_url("postgres")
    cases = [
        (["--node-tls-ca", os.path.join(scratch, "missing.pem")], "--node-tls-ca: cannot read the certificates in " + os.path.join(scratch, "missing.pem")),
        (["--node-tls-ca", authority[3]], "--node-tls-ca: cannot read the certificates in " + authority[3] + " (PEM expected)"),
        (["--advertise", "nowhere"], "--advertise nowhere: expected HOST:PORT or unix:PATH"),
        (["--listen", "tls://127.0.0.1:0", "--tls-cert", authority[2], "--tls-key", authority[3], "--advertise", "unix:/tmp/x.sock"],
         "the relay listener is tls://127.0.0.1:0, which other nodes reach at a HOST:PORT"),
    ]
    for arguments, said in cases:
        done = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "d"), "--insecure-no-auth", "--store", url, *arguments],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and said in done.stderr, (arguments, done.stderr)
    # Without a shared store there is no writer to trust, or to be.
    for arguments in (["--node-tls-ca", authority[2]], ["--advertise", "127.0.0.1:7400"]):
        done = subprocess.run([real_binary(), "serve", "--data-dir", os.path.join(scratch, "d"), "--insecure-no-auth", *arguments],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "is for nodes of a shared store" in done.stderr, (arguments, done.stderr)
