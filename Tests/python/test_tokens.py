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

from chatcore_harness import Client, start_socket_server, wait_until_accepting
from conftest import chatcore_binary

# HS256 keys are at least 32 bytes, used as they are: this one ends in whitespace, which
# must not be stripped (that would change about one random key in 64).
SECRET = b"a secret of the service, 32+ bytes \n"
AUDIENCE = "chatcore-tests"
ISSUER = "https://idp.example"


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64_int(number):
    return b64(number.to_bytes((number.bit_length() + 7) // 8, "big"))


def claims(sub, **extra):
    now = int(time.time())
    return {"sub": sub, "iat": now, "exp": now + 3600, "aud": AUDIENCE, "iss": ISSUER, **extra}


def token(header, payload, sign):
    signing_input = b64(json.dumps(header).encode()) + "." + b64(json.dumps(payload).encode())
    return signing_input + "." + b64(sign(signing_input.encode()))


def rs256(key):
    return lambda data: key.sign(data, padding.PKCS1v15(), hashes.SHA256())


P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def es256(key, high_s=False):
    """ES256 in the low-S form chatcore accepts (or, with `high_s`, the other one: the
    same signature's twin, n - s, which verifies as well)."""
    def sign(data):
        r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
        if (s > P256_ORDER // 2) != high_s:
            s = P256_ORDER - s
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


def serve(directory, jwks, *arguments):
    jwks_path = os.path.join(directory, "jwks.json")
    with open(jwks_path, "w") as f:
        json.dump(jwks, f)
    secret_path = os.path.join(directory, "secret")
    with open(secret_path, "wb") as f:
        f.write(SECRET)
    command = [chatcore_binary(), "serve", "--data-dir", os.path.join(directory, "data"), "--listen", "unix:" + os.path.join(directory, "s"),
               "--auth-jwks", jwks_path, "--auth-secret-file", secret_path, "--auth-audience", AUDIENCE, "--auth-issuer", ISSUER, *arguments]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until_accepting(os.path.join(directory, "s"), process)
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
                # The Linux idp sample's tokens: iss, aud and jti besides sub (aud may be
                # a list of audiences).
                ("ES256 with iss, aud list, jti", "carol", token({"alg": "ES256", "typ": "JWT", "kid": "ec-1"},
                                                                claims("carol", aud=["SampleApplication", AUDIENCE], jti="x1"), es256(keys.ec)), "Ok"),
                ("ES256 without kid", "dave", token({"alg": "ES256"}, claims("dave"), es256(keys.ec)), "Ok"),
                ("HS256 by the secret", "erin", token({"alg": "HS256"}, claims("erin"), hs256(SECRET)), "Ok"),
                ("HS256 by the secret, trailing whitespace stripped", "erin", token({"alg": "HS256"}, claims("erin"), hs256(SECRET.rstrip())),
                 "InvalidToken"),
                # Another application of the same identity provider, or another provider.
                ("aud is another application", "amy", token({"alg": "ES256", "kid": "ec-1"}, claims("amy", aud="some-other-app"), es256(keys.ec)),
                 "InvalidToken"),
                ("aud list without this service", "amy", token({"alg": "ES256", "kid": "ec-1"}, claims("amy", aud=["a", "b"]), es256(keys.ec)),
                 "InvalidToken"),
                ("no aud", "amy", token({"alg": "ES256", "kid": "ec-1"}, {k: v for k, v in claims("amy").items() if k != "aud"}, es256(keys.ec)),
                 "InvalidToken"),
                ("iss is another provider", "amy", token({"alg": "ES256", "kid": "ec-1"}, claims("amy", iss="https://evil"), es256(keys.ec)),
                 "InvalidToken"),
                ("HS256 with aud of another application", "amy", token({"alg": "HS256"}, claims("amy", aud="some-other-app"), hs256(SECRET)),
                 "InvalidToken"),
                # The header's alg must agree with the key's type, and a kid must be one of the file's.
                ("ES256 naming the RSA key, signed RS256", "bea", token({"alg": "ES256", "kid": "rsa-1"}, claims("bea"), rs256(keys.rsa)), "InvalidToken"),
                ("an unknown kid signed by a known key", "bea", token({"alg": "ES256", "kid": "nope"}, claims("bea"), es256(keys.ec)), "InvalidToken"),
                ("crit names an extension", "bea", token({"alg": "ES256", "kid": "ec-1", "crit": ["exp"]}, claims("bea"), es256(keys.ec)), "InvalidToken"),
                ("ES256 in high-S form", "bea", token({"alg": "ES256", "kid": "ec-1"}, claims("bea"), es256(keys.ec, high_s=True)), "InvalidToken"),
                # Clocks: a second ahead is within the leeway; an hour is not; a token
                # valid for a thousand years is refused.
                ("the provider's clock a second ahead", "cat", token({"alg": "ES256", "kid": "ec-1"},
                                                                     claims("cat", iat=int(time.time()) + 1, nbf=int(time.time()) + 1), es256(keys.ec)), "Ok"),
                ("iat an hour in the future", "cat", token({"alg": "ES256", "kid": "ec-1"}, claims("cat", iat=int(time.time()) + 3600), es256(keys.ec)),
                 "InvalidToken"),
                ("valid for a thousand years", "cat", token({"alg": "ES256", "kid": "ec-1"}, claims("cat", exp=int(time.time()) + 1000 * 365 * 86400),
                                                            es256(keys.ec)), "InvalidToken"),
                ("valid for two days", "cat", token({"alg": "ES256", "kid": "ec-1"}, claims("cat", exp=int(time.time()) + 2 * 86400), es256(keys.ec)),
                 "InvalidToken"),
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
                                     "--auth-jwks", path, "--auth-audience", AUDIENCE], capture_output=True, timeout=60)
            assert result.returncode != 0
            assert says in result.stderr.decode(), result.stderr.decode()


def test_keys_and_audiences_that_would_let_others_in_refuse_to_start():
    keys = Keys()
    with tempfile.TemporaryDirectory() as directory:
        jwks = os.path.join(directory, "jwks.json")
        with open(jwks, "w") as f:
            json.dump(keys.jwks(ec_jwk(keys.ec, "ec-1")), f)
        short = os.path.join(directory, "short")
        with open(short, "wb") as f:
            f.write(b"x" * 31)  # a 1-byte key was accepted, zero-padded
        for arguments, says in [(["--auth-secret-file", short], "HS256 needs at least 32"),
                                (["--auth-secret-file", short, "--auth-jwks", jwks, "--auth-audience", "a"], "HS256 needs at least 32")]:
            result = subprocess.run([chatcore_binary(), "serve", "--data-dir", os.path.join(directory, "data"), "--listen", "127.0.0.1:0",
                                     *arguments], capture_output=True, timeout=60)
            assert result.returncode != 0, arguments
            assert says in result.stderr.decode(), result.stderr.decode()
        result = subprocess.run([chatcore_binary(), "token", "--user", "alice", "--auth-secret-file", short], capture_output=True, timeout=60)
        assert result.returncode != 0 and b"at least 32" in result.stderr
        # A JWKS without the audience starts (a deployment configured before the flag
        # goes on), and says at once what that lets in.
        result = subprocess.run([chatcore_binary(), "serve", "--data-dir", os.path.join(directory, "data"), "--auth-jwks", jwks], input=b"",
                                capture_output=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert b"--auth-jwks without --auth-audience" in result.stderr


def global_change(event):
    """The `global` elements a listChange carries, by name (None for other events)."""
    if "listChange" not in event or event["listChange"].get("type") != "global":
        return None
    return {element["name"]: element["value"] for element in event["listChange"]["elements"]}


def test_a_session_does_not_outlive_its_token_and_a_new_token_carries_it_on():
    keys = Keys()
    with tempfile.TemporaryDirectory() as directory:
        process, _ = serve(directory, keys.jwks(ec_jwk(keys.ec, "ec-1")), "--auth-leeway", "0", "--auth-timeout", "3")
        try:
            path = os.path.join(directory, "s")
            soon = lambda seconds: token({"alg": "ES256", "kid": "ec-1"}, claims("alice", exp=int(time.time()) + seconds), es256(keys.ec))
            client = Client(path)
            assert authenticate(client, "alice", soon(2)) == "Ok"
            client.request({"identitiesGet": {"cookie": "before", "appUserIds": ["alice"]}})
            # The token runs out: the session is told it needs a new one, and what it asks
            # meanwhile is refused.
            client.next_event(lambda e: global_change(e) == {"authTokenState": "Needed"}, timeout=10)
            refused = client.request({"identitiesGet": {"cookie": "after", "appUserIds": ["alice"]}})[-1]
            assert refused["requestFailed"]["error"] == "NotAuthenticated" and "expired" in refused["requestFailed"]["reason"], refused
            # A new token for the same user: the session goes on, as it was.
            client.send({"authToken": {"userId": "alice", "authToken": soon(2), "cookie": "again"}})
            assert global_change(next_event(client))["authTokenState"] == "Ok"
            answered = client.request({"identitiesGet": {"cookie": "refreshed", "appUserIds": ["alice"]}})[-1]
            assert "identities" in answered, answered
            # A token for someone else does not take the session over.
            client.send({"authToken": {"userId": "bob", "authToken": token({"alg": "ES256", "kid": "ec-1"}, claims("bob"), es256(keys.ec)),
                                       "cookie": "bob"}})
            assert next_event(client)["setupError"]["error"] == "AlreadyAuthenticated"
            # No new token within --auth-timeout: the session is closed.
            client.next_event(lambda e: global_change(e) == {"authTokenState": "Needed"}, timeout=10)
            assert client.closed.wait(timeout=10), "the session was not closed"
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_a_session_whose_key_left_the_jwks_needs_a_new_token():
    keys = Keys()
    with tempfile.TemporaryDirectory() as directory:
        process, jwks_path = serve(directory, keys.jwks(ec_jwk(keys.ec, "old"), ec_jwk(keys.other_ec, "new")), "--auth-timeout", "30")
        try:
            path = os.path.join(directory, "s")
            client = Client(path)
            assert authenticate(client, "alice", token({"alg": "ES256", "kid": "old"}, claims("alice"), es256(keys.ec))) == "Ok"
            other = Client(path)
            assert authenticate(other, "bob", token({"alg": "ES256", "kid": "new"}, claims("bob"), es256(keys.other_ec))) == "Ok"
            with open(jwks_path, "w") as f:
                json.dump(keys.jwks(ec_jwk(keys.other_ec, "new")), f)
            process.send_signal(signal.SIGHUP)
            client.next_event(lambda e: global_change(e) == {"authTokenState": "Needed"}, timeout=10)
            # Bob's key stayed: his session goes on.
            assert "identities" in other.request({"identitiesGet": {"cookie": "b", "appUserIds": ["bob"]}})[-1]
            assert not any(global_change(e) == {"authTokenState": "Needed"} for e in other.all)
            client.close()
            other.close()
        finally:
            process.terminate()
            process.wait(timeout=30)
