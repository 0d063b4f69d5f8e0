"""Lines nested deep enough to overflow a stack, from an unauthenticated socket client
(issue 11): every one is answered (TooLarge) and the process never dies."""
import base64
import json
import os
import socket
import subprocess
import tempfile
import time

from chatcore_harness import Client, line, wait_until_accepting
from conftest import chatcore_binary


def deep_lines():
    yield '{"requestListElements":{"deep":' + "[" * 60000 + "]" * 60000 + "}}"
    yield '{"requestListElements":{"type":"chat","elements":' + "[" * 100000 + "]" * 100000 + "}}"
    yield '{"requestListMatching":{"criteria":' + '{"a":' * 30000 + "1" + "}" * 30000 + ',"type":"chatMessage"}}'
    yield '{"requestListChange":{"elements":[' + "[" * 60000 + "]" * 60000 + '],"type":"chat"}}'
    yield '{"chatMessageSend":{"chatId":"1","tag":"T","data":' + '{"a":' * 50000 + "1" + "}" * 50000 + "}}"
    yield "[" * 200000 + "]" * 200000
    yield '{"x":' * 100000 + "1" + "}" * 100000


def b64(data):
    return base64.urlsafe_b64encode(data.encode()).rstrip(b"=").decode()


def test_deep_lines_are_refused_and_nothing_dies():
    with tempfile.TemporaryDirectory() as work:
        secret = os.path.join(work, "secret")
        with open(secret, "w") as f:
            f.write("k" * 32)
        path = os.path.join(work, "s")
        server = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", os.path.join(work, "d"), "--listen", "unix:" + path,
                                   "--auth-secret-file", secret], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_accepting(path, server)
            lines = list(deep_lines())
            # A JWT whose header is as deep as the 8 KB token limit allows: parsed before
            # any signature check.
            deep = "[" * 2900 + "]" * 2900
            lines.append(json.dumps({"authToken": {"userId": "a", "authToken": b64(deep) + "." + b64("{}") + ".c2ln"}}))
            client = Client(path)
            client.sock.sendall(b"".join(text.encode() + b"\n" for text in lines))
            client.send({"identitiesGet": {"cookie": "alive"}})
            got = client.answer("alive", timeout=60)
            refused = [e for e in got if "requestFailed" in e and e["requestFailed"]["error"] in ("TooLarge", "ParseError")]
            assert len(refused) >= len(lines) - 1, got
            assert all(e["requestFailed"]["error"] == "TooLarge" for e in refused[:5]), refused[:5]
            assert any("setupError" in e for e in got), "the deep token was not answered"
            assert server.poll() is None, "chatcore died"
        finally:
            server.terminate()
            server.wait(timeout=30)
