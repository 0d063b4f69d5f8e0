"""TLS listeners (`--listen tls://HOST:PORT`, `wss://HOST:PORT/PATH`, `--tls-cert`,
`--tls-key`): sessions over TLS 1.2 or later only, the certificate verified by the client,
read again on SIGHUP (new connections get the new one), and files that cannot serve
refused at start with a sentence that names them."""
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from websockets.sync.client import connect

from chatcore_harness import chatcore_binary


def make_certificate(directory, name):
    """A self-signed certificate for 127.0.0.1 and localhost; (cert path, key path, DER)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path + ".new", "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key_path + ".new", "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.replace(cert_path + ".new", cert_path)
    os.replace(key_path + ".new", key_path)
    return cert_path, key_path, certificate.public_bytes(serialization.Encoding.DER)


def serve(work, cert, key):
    """chatcore with a tls:// and a wss:// listener; (process, tls port, wss URL, log lines)."""
    process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", os.path.join(work, "d"), "--listen", "tls://127.0.0.1:0",
                                "--listen", "wss://127.0.0.1:0/chat", "--tls-cert", cert, "--tls-key", key, "--insecure-no-auth"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ports = {}
    log = []
    for line in process.stderr:
        log.append(line)
        if "listening" in line:
            kind = "wss" if "wss://" in line else "tls"
            ports[kind] = int(re.search(r"port=(\d+)", line).group(1))
            if len(ports) == 2:
                break

    def keep():
        for line in process.stderr:
            log.append(line)

    threading.Thread(target=keep, daemon=True).start()
    return process, ports["tls"], f"wss://127.0.0.1:{ports['wss']}/chat", log


def client_context(cafile):
    context = ssl.create_default_context(cafile=cafile)
    return context


def sign_in_over_tls(port, context):
    """A TLS session signs in; (TLS version, the server's certificate as DER)."""
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(json.dumps({"authToken": {"userId": "alice", "authToken": "x"}}).encode() + b"\n")
            answer = b""
            while b"\n" not in answer:
                answer += tls.recv(4096)
            assert "listChange" in json.loads(answer.split(b"\n")[0])
            return tls.version(), tls.getpeercert(binary_form=True)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")
def test_sessions_over_tls_and_wss_are_verified_and_the_certificate_is_reloaded_on_sighup():
    with tempfile.TemporaryDirectory() as work:
        cert, key, first = make_certificate(work, "first")
        process, port, url, log = serve(work, cert, key)
        try:
            version, presented = sign_in_over_tls(port, client_context(cert))
            assert version in ("TLSv1.2", "TLSv1.3") and presented == first
            with connect(url, ssl=client_context(cert)) as ws:
                ws.send(json.dumps({"authToken": {"userId": "bob", "authToken": "x"}}))
                assert "listChange" in json.loads(ws.recv(timeout=10))
            # A client that trusts another certificate refuses this one.
            other_dir = os.path.join(work, "other")
            os.mkdir(other_dir)
            other_cert, _, _ = make_certificate(other_dir, "other")
            with pytest.raises(ssl.SSLCertVerificationError):
                sign_in_over_tls(port, client_context(other_cert))
            # TLS 1.1 is refused (the client is allowed to offer it).
            old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            old.check_hostname = False
            old.verify_mode = ssl.CERT_NONE
            old.set_ciphers("DEFAULT:@SECLEVEL=0")
            old.minimum_version = ssl.TLSVersion.TLSv1
            old.maximum_version = ssl.TLSVersion.TLSv1_1
            with pytest.raises(ssl.SSLError):
                sign_in_over_tls(port, old)
            # Plain text on the TLS port is not a session.
            with socket.create_connection(("127.0.0.1", port)) as plain:
                plain.sendall(json.dumps({"authToken": {"userId": "mallory", "authToken": "x"}}).encode() + b"\n")
                plain.settimeout(10)
                assert b"listChange" not in plain.recv(4096)
            # A new certificate in the same files: SIGHUP, and new connections get it.
            _, _, second = make_certificate(work, "second")
            process.send_signal(signal.SIGHUP)
            deadline = time.time() + 10
            while not any("reloaded the TLS certificate" in line for line in log) and time.time() < deadline:
                time.sleep(0.05)
            _, presented = sign_in_over_tls(port, client_context(cert))
            assert presented == second != first
            # Files that cannot serve on SIGHUP: the certificate in use stays.
            with open(key, "w") as broken:
                broken.write("not a key\n")
            process.send_signal(signal.SIGHUP)
            deadline = time.time() + 10
            while not any("were not reloaded" in line for line in log) and time.time() < deadline:
                time.sleep(0.05)
            assert any("were not reloaded" in line for line in log)
            _, presented = sign_in_over_tls(port, client_context(cert))
            assert presented == second
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0


def test_files_that_cannot_serve_stop_the_start_with_a_sentence():
    with tempfile.TemporaryDirectory() as work:
        cert, key, _ = make_certificate(work, "first")
        data = os.path.join(work, "d")
        cases = [
            (["--listen", "tls://127.0.0.1:0"], "needs --tls-cert and --tls-key"),
            (["--listen", "tls://127.0.0.1:0", "--tls-cert", os.path.join(work, "missing.pem"), "--tls-key", key], "missing.pem"),
            (["--listen", "tls://127.0.0.1:0", "--tls-cert", cert, "--tls-key", cert], "private key"),
            (["--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key], "are for tls:// and wss:// listeners"),
        ]
        for arguments, said in cases:
            done = subprocess.run([chatcore_binary(), "serve", "--data-dir", data, "--insecure-no-auth", *arguments],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
            assert done.returncode != 0 and said in done.stderr, (arguments, done.stderr)
