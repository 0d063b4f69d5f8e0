#!/usr/bin/env python3
"""The web Simple Chat: starts chatcore with a WebSocket listener and serves the page.

    python3 Examples/web/serve.py [--binary PATH] [--port 8080] [--data-dir DIR]

(`make run-web` builds chatcore and runs this.) The page is plain HTML and the TypeScript
client's browser module (clients/typescript/browser.js), nothing else. Signing in asks this
server's development endpoint, /token?user=NAME, for a token: an HS256 JWT signed with a
secret made at start and given to chatcore (--auth-secret-file), as an application's own
server would make one for its signed-in user. Never expose such an endpoint to anyone: it
signs in whoever asks, as whoever they name.
"""
import argparse
import base64
import hashlib
import hmac
import http.server
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
AUDIENCE = "chatcore-web-example"
# What the page may load: its own files, and the client's browser modules.
FILES = {
    "/": os.path.join(HERE, "index.html"),
    "/app.js": os.path.join(HERE, "app.js"),
    "/style.css": os.path.join(HERE, "style.css"),
    "/client/browser.js": os.path.join(ROOT, "clients", "typescript", "browser.js"),
    "/client/core.js": os.path.join(ROOT, "clients", "typescript", "core.js"),
    "/client/protocol.js": os.path.join(ROOT, "clients", "typescript", "protocol.js"),
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_token(secret, user):
    now = int(time.time())
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64(json.dumps({"sub": user, "aud": AUDIENCE, "iat": now, "exp": now + 3600}).encode())
    signature = hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{b64(signature)}"


def find_binary(given):
    for candidate in [given, os.environ.get("CHATCORE_BINARY"), os.path.join(ROOT, ".build", "release", "chatcore"),
                      os.path.join(ROOT, ".build", "debug", "chatcore"), shutil.which("chatcore")]:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("chatcore was not found: run `make run-web`, or give --binary")


def start_chatcore(binary, data_dir, secret_path, origin):
    process = subprocess.Popen([binary, "serve", "--data-dir", data_dir, "--listen", "ws://127.0.0.1:0/chat", "--auth-secret-file", secret_path,
                                "--auth-audience", AUDIENCE, "--ws-allowed-origins", origin],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        sys.stderr.write(line)
        found = re.search(r"address=ws://\S+ .*port=(\d+)", line)
        if found:
            threading.Thread(target=lambda: shutil.copyfileobj(process.stderr, sys.stderr), daemon=True).start()
            return process, f"ws://127.0.0.1:{found.group(1)}/chat"
    sys.exit("chatcore did not start (its log is above)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary")
    parser.add_argument("--port", type=int, default=int(os.environ.get("WEB_PORT", "8080")))
    parser.add_argument("--data-dir", help="where chatcore keeps the chats (default: a new temporary directory)")
    arguments = parser.parse_args()
    work = tempfile.mkdtemp(prefix="chatcore-web-")
    secret = secrets.token_bytes(32)
    secret_path = os.path.join(work, "secret")
    with open(os.open(secret_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(secret)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            if url.path == "/token":
                user = urllib.parse.parse_qs(url.query).get("user", [""])[0].strip()
                if not user:
                    return self.answer(400, b'{"error":"give ?user=NAME"}', "application/json")
                body = json.dumps({"user": user, "token": make_token(secret, user), "url": chat_url}).encode()
                return self.answer(200, body, "application/json")
            path = FILES.get(url.path)
            if path is None:
                return self.answer(404, b"not found\n", "text/plain")
            with open(path, "rb") as f:
                self.answer(200, f.read(), TYPES[os.path.splitext(path)[1]])

        def answer(self, status, body, kind):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", arguments.port), Handler)
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    process, chat_url = start_chatcore(find_binary(arguments.binary), arguments.data_dir or os.path.join(work, "data"), secret_path, origin)

    def stop(*_):
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"The web Simple Chat is at {origin}/ (chatcore at {chat_url}). Open it in two windows, sign in as two users. Ctrl-C stops both.",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
