"""--log-format json: one object per line an operator's collector can parse, saying what
an operator needs (sessions and why they closed, refused sign-ins and why) and never a
token."""
import json
import os
import socket
import subprocess
import tempfile
import time

from conftest import chatcore_binary


def test_json_logs_say_why_sessions_close_and_sign_ins_fail_but_never_the_token():
    token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2VjcmV0LXNpZ25hdHVyZS10aGF0LW11c3Qtbm90LWxlYWs"
    with tempfile.TemporaryDirectory() as work:
        secret = os.path.join(work, "secret")
        with open(secret, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(secret, 0o600)
        path = os.path.join(work, "s")
        server = subprocess.Popen([chatcore_binary(), "serve", "--listen", "unix:" + path, "--auth-secret-file", secret,
                                   "--data-dir", os.path.join(work, "d"), "--log-format", "json", "--auth-timeout", "1"],
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 30
            while not os.path.exists(path) and time.time() < deadline:
                time.sleep(0.05)
            refused = socket.socket(socket.AF_UNIX)
            for _ in range(100):
                try:
                    refused.connect(path)
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    time.sleep(0.05)
            reader = refused.makefile("rb")
            refused.sendall(json.dumps({"authToken": {"userId": "alice", "authToken": token}}).encode() + b"\n")
            while b"setupError" not in reader.readline():
                pass
            silent = socket.socket(socket.AF_UNIX)
            silent.connect(path)
            assert silent.recv(100) == b"", "a connection that does not sign in is closed after --auth-timeout"
            reader.close()
            refused.close()
            silent.close()
            time.sleep(0.5)
        finally:
            server.terminate()
            _, log = server.communicate(timeout=30)
    assert token not in log and token.split(".")[2] not in log
    entries = [json.loads(line) for line in log.splitlines()]
    for entry in entries:
        assert {"time", "level", "message", "fields"} <= entry.keys(), entry
        assert len(entry["time"]) == len("2026-11-28T16:48:50.269Z") and entry["time"].endswith("Z")
    messages = [(entry["message"], entry["fields"]) for entry in entries]
    assert ("sign-in refused", {"reason": "InvalidToken", "transport": "unix", "userId": "alice"}) in messages
    opened = [fields for message, fields in messages if message == "session opened"]
    closed = [fields for message, fields in messages if message == "session closed"]
    assert len(opened) == 2 and len(closed) == 2, messages
    assert any(fields["reason"] == "it did not sign in within --auth-timeout" for fields in closed), closed
    assert all(fields["signedIn"] == "false" for fields in closed)


def test_a_service_that_accepts_any_token_says_so():
    with tempfile.TemporaryDirectory() as work:
        done = subprocess.run([chatcore_binary(), "serve", "--insecure-no-auth", "--data-dir", work, "--log-format", "json"],
                              input=b"", capture_output=True, timeout=60)
    warnings = [json.loads(line) for line in done.stderr.decode().splitlines() if json.loads(line)["level"] == "warning"]
    assert any(entry["message"].startswith("--insecure-no-auth") for entry in warnings), warnings
