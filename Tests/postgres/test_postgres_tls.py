"""The store over TCP with TLS (libpq's sslmode and sslrootcert in the --store URL),
against a real cluster on loopback that accepts TLS connections only (pg_hba `hostssl`,
plain TCP rejected). Its certificate names `localhost` only and is signed by a CA made
here; another CA signs nothing the server has."""
import datetime
import os
import pwd
import shutil
import tempfile
import time

import pytest

from conftest import start, started_chat
from postgres_cluster import Cluster, postgres_bin
from chatcore_harness import Client, auth

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def make_certificates(directory):
    """A CA, a server certificate for `localhost` signed by it, and an unrelated CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, key, issuer, issuer_key, ca, names=()):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=30))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(name, data, mode=0o644):
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        return path

    pem = serialization.Encoding.PEM
    ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = certificate("chatcore test CA", ca_key, "chatcore test CA", ca_key, True)
    other = certificate("another CA", other_key, "another CA", other_key, True)
    server = certificate("localhost", server_key, "chatcore test CA", ca_key, False, names=["localhost"])
    paths = {
        "ca": write("ca.crt", ca.public_bytes(pem)),
        "other": write("other.crt", other.public_bytes(pem)),
        "cert": write("server.crt", server.public_bytes(pem)),
        "key": write("server.key", server_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                                            serialization.NoEncryption()), 0o600),
    }
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        for path in paths.values():
            os.chown(path, owner.pw_uid, owner.pw_gid)
    return paths


@pytest.fixture(scope="module")
def tls_cluster():
    directory = tempfile.mkdtemp(prefix="chatcore-tls-")
    os.chmod(directory, 0o755)
    try:
        certificates = make_certificates(directory)
        settings = ("fsync=off", "ssl=on", f"ssl_cert_file={certificates['cert']}", f"ssl_key_file={certificates['key']}")
        hba = ("hostssl all all 127.0.0.1/32 trust", "host all all 127.0.0.1/32 reject")
        with Cluster(settings=settings, tcp=True, hba=hba) as cluster:
            cluster.create_database("tls")
            yield cluster, certificates
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def serve(url, scratch):
    """chatcore on a Unix socket with `url` as its store: (process, socket or None)."""
    return start(None, "tls", scratch, url=url)


def refused(url, scratch):
    """Starts chatcore on `url`, which must not open: returns what it said and how long it took."""
    began = time.time()
    process, socket_path = serve(url, scratch)
    if socket_path is not None:
        process.terminate()
        process.wait(timeout=30)
        pytest.fail(f"chatcore served {url}")
    assert process.wait(timeout=60) == 1
    return process.stderr.read().decode(), time.time() - began


def test_verify_full_with_the_right_ca_serves_over_tls(tls_cluster, scratch):
    cluster, certificates = tls_cluster
    process, socket_path = serve(cluster.tcp_url("tls", host="localhost", sslmode="verify-full", sslrootcert=certificates["ca"]), scratch)
    assert socket_path, process.stderr.read().decode()
    client = Client(socket_path)
    auth(client, "alice")
    started = client.request({"chatStart": {"cookie": "s", "invitees": [{"userId": "bob"}], "isOneToOne": True}})
    chat = started_chat(started)
    sent = client.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "over TLS", "cookie": "m"}})
    assert [e["listAdd"]["elements"][0]["content"] for e in sent if e.get("listAdd", {}).get("cookie") == "m"] == ["over TLS"]
    client.close()
    process.terminate()
    assert process.wait(timeout=30) == 0
    # The server accepts nothing but TLS: the message is in the database.
    assert cluster.psql("SELECT content FROM message WHERE tag = 'Text'", database="tls").strip() == "over TLS"


def test_verify_ca_checks_the_signer_not_the_name(tls_cluster, scratch):
    cluster, certificates = tls_cluster
    process, socket_path = serve(cluster.tcp_url("tls", sslmode="verify-ca", sslrootcert=certificates["ca"]), scratch)
    assert socket_path, process.stderr.read().decode()
    process.terminate()
    assert process.wait(timeout=30) == 0


def test_a_certificate_not_for_the_host_is_refused_by_verify_full(tls_cluster, scratch):
    cluster, certificates = tls_cluster
    said, seconds = refused(cluster.tcp_url("tls", sslmode="verify-full", sslrootcert=certificates["ca"]), scratch)
    assert "cannot open the store" in said and "127.0.0.1" in said, said
    assert seconds < 10, f"a certificate that does not check out is not waited on ({seconds:.1f} s): {said}"


def test_a_certificate_from_another_ca_is_refused(tls_cluster, scratch):
    cluster, certificates = tls_cluster
    said, seconds = refused(cluster.tcp_url("tls", host="localhost", sslmode="verify-full", sslrootcert=certificates["other"]), scratch)
    assert "cannot open the store" in said and "certificate" in said.lower(), said
    assert seconds < 10, f"a certificate that does not check out is not waited on ({seconds:.1f} s): {said}"


def test_without_tls_the_server_refuses_and_the_reason_is_shown(tls_cluster, scratch):
    cluster, _ = tls_cluster
    said, _ = refused(cluster.tcp_url("tls", sslmode="disable"), scratch)
    assert "pg_hba.conf rejects connection" in said and "no encryption" in said, said


def test_sslmode_and_sslrootcert_are_checked_before_connecting(tls_cluster, scratch):
    cluster, _ = tls_cluster
    said, _ = refused(cluster.tcp_url("tls", sslmode="always"), scratch)
    assert "sslmode must be one of disable, prefer, require, verify-ca, verify-full, not always" in said, said
    said, _ = refused(cluster.tcp_url("tls", sslmode="verify-full", sslrootcert="/nonexistent/ca.crt"), scratch)
    assert "sslrootcert /nonexistent/ca.crt cannot be read" in said, said
    said, _ = refused(cluster.tcp_url("tls", sslcert="client.crt"), scratch)
    assert "unknown parameter sslcert" in said, said


def test_require_refuses_a_server_without_tls(scratch):
    with Cluster(tcp=True) as plain:
        plain.create_database("plain")
        said, seconds = refused(plain.tcp_url("plain", sslmode="require"), scratch)
        assert "the server does not offer TLS, which sslmode asks for" in said, said
        assert seconds < 10, said
        # prefer (libpq's default) goes on without TLS.
        process, socket_path = serve(plain.tcp_url("plain"), scratch)
        assert socket_path, process.stderr.read().decode()
        process.terminate()
        assert process.wait(timeout=30) == 0
