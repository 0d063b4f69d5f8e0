"""Tokens from identity providers: RS256 and ES256 JWTs checked against a JWKS file
(--auth-jwks, read again on SIGHUP) beside HS256 ones signed with the secret; whatever
else a token is, it is refused with the setupError that says why, and the requests a
client pipelines behind a token are answered in order, as that token decided."""
import base64
import json
import os
import signal
import subprocess
import tempfile
import time

from cryptography.hazmat.primitives import hashes, hmac, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from chatcore_harness import Client, start_socket_server
from conftest import chatcore_binary

SECRET = b"a secret of the service"


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64_int(number):
    return b64(number.to_bytes((number.bit_length() + 7) // 8, "big"))


def claims(sub, **extra):
    now = int(time.time())
    return {"sub": sub, "iat": now, "exp": now + 3600, **extra}


def token(header, payload, sign):
    signing_input = b64(json.dumps(header).encode()) + "." + b64(json.dumps(payload).encode())
    return signing_input + "." + b64(sign(signing_input.encode()))


def rs256(key):
    return lambda data: key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def es256(key):
    def sign(data):
        r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return sign


def hs256(secret):
    def sign(data):
        mac = hmac.HMAC(secret, hashes.SHA256())
        mac.update(data)
        return mac.finalize()
    return sign


def rsa_jwk(key, kid):
    numbers = key.public_key().public_numbers()
    return {"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": b64_int(numbers.n), "e": b64_int(numbers.e)}


def ec_jwk(key, kid):
    numbers = key.public_key().public_numbers()
    return {"kty": "EC", "kid": kid, "use": "sig", "crv": "P-256", "alg": "ES256",
            "x": b64(numbers.x.to_bytes(32, "big")), "y": b64(numbers.y.to_bytes(32, "big"))}


class Keys:
    def __init__(self):
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec = ec.generate_private_key(ec.SECP256R1())
        self.other_ec = ec.generate_private_key(ec.SECP256R1())

    def jwks(self, *keys):
        # A symmetric key and an encryption key are left out: only signing keys count.
        return {"keys": [{"kty": "oct", "kid": "sym", "k": b64(b"x" * 32)}, {**rsa_jwk(self.rsa, "enc"), "use": "enc"}, *keys]}


def serve(directory, jwks):
    jwks_path = os.path.join(directory, "jwks.json")
    with open(jwks_path, "w") as f:
        json.dump(jwks, f)
    secret_path = os.path.join(directory, "secret")
    with open(secret_path, "wb") as f:
        f.write(SECRET + b"\n")
    command = [chatcore_binary(), "serve", "--data-dir", os.path.join(directory, "data"), "--listen", "unix:" + os.path.join(directory, "s"),
               "--auth-jwks", jwks_path, "--auth-secret-file", secret_path]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(directory, "s")):
        assert process.poll() is None, process.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    return process, jwks_path


def next_event(client):
    return client.events.get(timeout=30)


def authenticate(client, user, value, cookie="t"):
    """What one authToken came to: "Ok" (set up), or the setupError's error."""
    client.send({"authToken": {"userId": user, "authToken": value, "cookie": cookie}})
    first = next_event(client)
    if "setupError" in first:
        return first["setupError"]["error"]
    if "listChange" in first and first["listChange"]["elements"][0]["value"] == "Rejected":
        return next_event(client)["setupError"]["error"]
    assert first["listChange"]["elements"][0] == {"name": "authTokenState", "value": "Ok"}, first
    return "Ok"


def test_identity_provider_tokens_are_checked_against_the_jwks():
    keys = Keys()
    with tempfile.TemporaryDirectory() as directory:
        process, _ = serve(directory, keys.jwks(rsa_jwk(keys.rsa, "rsa-1"), ec_jwk(keys.ec, "ec-1")))
        try:
            path = os.path.join(directory, "s")
            cases = [
                ("RS256 by a JWKS key", "alice", token({"alg": "RS256", "kid": "rsa-1"}, claims("alice"), rs256(keys.rsa)), "Ok"),
                ("ES256 by a JWKS key", "bob", token({"alg": "ES256", "kid": "ec-1", "typ": "JWT"}, claims("bob"), es256(keys.ec)), "Ok"),
                # The Linux idp sample's tokens: iss, aud and jti besides sub.
                ("ES256 with iss, aud, jti", "carol", token({"alg": "ES256", "typ": "JWT", "kid": "ec-1"},
                                                           claims("carol", iss="SimulatedIDP", aud="SampleApplication", jti="x1"), es256(keys.ec)), "Ok"),
                ("ES256 without kid", "dave", token({"alg": "ES256"}, claims("dave"), es256(keys.ec)), "Ok"),
                ("HS256 by the secret", "erin", token({"alg": "HS256"}, claims("erin"), hs256(SECRET)), "Ok"),
                ("ES256 by a key not in the JWKS", "frank", token({"alg": "ES256", "kid": "ec-1"}, claims("frank"), es256(keys.other_ec)), "InvalidToken"),
                ("RS256 naming the EC key", "grace", token({"alg": "RS256", "kid": "ec-1"}, claims("grace"), rs256(keys.rsa)), "InvalidToken"),
                ("expired", "heidi", token({"alg": "ES256", "kid": "ec-1"}, {**claims("heidi"), "exp": int(time.time()) - 60}, es256(keys.ec)), "TokenExpired"),
                ("not yet valid", "ivan", token({"alg": "ES256", "kid": "ec-1"}, claims("ivan", nbf=int(time.time()) + 600), es256(keys.ec)), "InvalidToken"),
                ("no exp", "judy", token({"alg": "RS256", "kid": "rsa-1"}, {"sub": "judy"}, rs256(keys.rsa)), "InvalidToken"),
                ("sub is someone else", "mallory", token({"alg": "RS256", "kid": "rsa-1"}, claims("alice"), rs256(keys.rsa)), "UserIdMismatch"),
                # The same letters spelled otherwise (é as e and a combining accent) are
                # another user for the identity provider: byte for byte, not canonically.
                ("sub is a look-alike", "jose\u0301", token({"alg": "RS256", "kid": "rsa-1"}, claims("jos\u00e9"), rs256(keys.rsa)), "UserIdMismatch"),
                ("alg none", "oscar", token({"alg": "none"}, claims("oscar"), lambda data: b""), "InvalidToken"),
                ("PS256 is not accepted", "peggy", token({"alg": "PS256", "kid": "rsa-1"}, claims("peggy"), rs256(keys.rsa)), "InvalidToken"),
                # The RSA public key's bytes as an HMAC secret (the classic confusion).
                ("HS256 with the public key as secret", "trent",
                 token({"alg": "HS256", "kid": "rsa-1"}, claims("trent"),
                       hs256(keys.rsa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))),
                 "InvalidToken"),
                ("a symmetric JWKS key is not used", "victor", token({"alg": "HS256", "kid": "sym"}, claims("victor"), hs256(b"x" * 32)), "InvalidToken"),
            ]
            for label, user, value, expected in cases:
                client = Client(path)
                outcome = authenticate(client, user, value)
                client.close()
                assert outcome == expected, (label, outcome)
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_sighup_reads_the_jwks_again_and_keeps_the_old_keys_when_the_file_is_bad():
    keys = Keys()
    with tempfile.TemporaryDirectory() as directory:
        process, jwks_path = serve(directory, keys.jwks(ec_jwk(keys.ec, "old")))
        path = os.path.join(directory, "s")
        old = lambda user: token({"alg": "ES256", "kid": "old"}, claims(user), es256(keys.ec))
        new = lambda user: token({"alg": "ES256", "kid": "new"}, claims(user), es256(keys.other_ec))
        try:
            def outcome(value, user):
                client = Client(path)
                result = authenticate(client, user, value)
                client.close()
                return result

            assert outcome(old("a1"), "a1") == "Ok"
            assert outcome(new("a2"), "a2") == "InvalidToken"
            # The key is rotated: the new one is used, the old one no more.
            with open(jwks_path, "w") as f:
                json.dump(keys.jwks(ec_jwk(keys.other_ec, "new")), f)
            process.send_signal(signal.SIGHUP)
            deadline = time.time() + 10
            while outcome(new("a3"), "a3") != "Ok":
                assert time.time() < deadline, "SIGHUP did not load the new key"
                time.sleep(0.1)
            assert outcome(old("a4"), "a4") == "InvalidToken"
            # A broken file is not taken: the keys in use stay.
            with open(jwks_path, "w") as f:
                f.write("{not json")
            process.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert outcome(new("a5"), "a5") == "Ok"
            assert process.poll() is None
        finally:
            process.terminate()
            _, stderr = process.communicate(timeout=30)
        assert b"the JWKS file was not reloaded" in stderr


def test_requests_behind_a_token_wait_for_its_check_and_keep_their_order():
    """A signature is checked off the connection's thread; what the client pipelined
    behind the token must be served after it, as the token decided, in order."""
    keys = Keys()
    with tempfile.TemporaryDirectory() as directory:
        process, _ = serve(directory, keys.jwks(ec_jwk(keys.ec, "ec-1")))
        try:
            path = os.path.join(directory, "s")
            good = token({"alg": "ES256", "kid": "ec-1"}, claims("alice"), es256(keys.ec))
            bad = token({"alg": "ES256", "kid": "ec-1"}, claims("alice"), es256(keys.other_ec))
            client = Client(path)
            lines = [{"authToken": {"userId": "alice", "authToken": bad, "cookie": "bad"}},
                     {"identitiesGet": {"cookie": "i1", "appUserIds": ["alice"]}},
                     "not json",
                     {"authToken": {"userId": "alice", "authToken": good, "cookie": "good"}}]
            lines += [{"identitiesGet": {"cookie": f"i{n}", "appUserIds": ["alice"]}} for n in range(2, 40)]
            lines += [{"requestListAll": {"type": "global", "cookie": "end"}}]
            client.sock.sendall(b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines))
            seen = []
            while True:
                event = next_event(client)
                name, value = next(iter(event.items()))
                seen.append((name, value.get("cookie"), value.get("error")))
                if name == "listChunk":
                    break
            assert seen[0] == ("listChange", None, None)  # authTokenState Rejected
            assert seen[1] == ("setupError", "bad", "InvalidToken")
            assert seen[2] == ("requestFailed", "i1", "NotAuthenticated")
            assert seen[3] == ("requestFailed", None, "ParseError")
            assert seen[4] == ("listChange", None, None)  # set up
            assert [cookie for name, cookie, _ in seen[5:-2]] == [f"i{n}" for n in range(2, 40)]
            assert all(name == "identities" for name, _, _ in seen[5:-2])
            assert seen[-2:] == [("listAll", "end", None), ("listChunk", "end", None)]
            client.close()
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_a_jwks_that_cannot_be_used_refuses_to_start():
    with tempfile.TemporaryDirectory() as directory:
        for content, says in [("{}", "'keys' array"), ('{"keys":[{"kty":"oct","k":"eA"}]}', "no RSA or EC signing key"),
                              ('{"keys":[{"kty":"EC","crv":"P-256","x":"AA","y":"AA"}]}', "has no 'kid'")]:
            path = os.path.join(directory, "jwks.json")
            with open(path, "w") as f:
                f.write(content)
            result = subprocess.run([chatcore_binary(), "serve", "--data-dir", os.path.join(directory, "data"), "--listen", "127.0.0.1:0",
                                     "--auth-jwks", path], capture_output=True, timeout=60)
            assert result.returncode != 0
            assert says in result.stderr.decode(), result.stderr.decode()
