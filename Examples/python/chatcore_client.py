"""A minimal chatcore client: spawns `chatcore serve --user ID` and speaks its protocol.

    client = ChatcoreClient("alice")
    client.send({"identitiesGet": {"cookie": "1", "appUserIds": ["alice"]}})
    print(client.receive())        # {'identities': {...}}
    client.close()

Requests are one JSON object per line on the child's standard input; events come back one
per line on its standard output. `request` waits for the event that carries the cookie.
"""
import itertools
import json
import os
import subprocess
import tempfile


class ChatcoreClient:
    def __init__(self, user, binary=None, data_dir=None):
        binary = binary or os.environ.get("CHATCORE_BINARY", "chatcore")
        self._data = None
        if data_dir is None:
            self._data = tempfile.TemporaryDirectory()
            data_dir = self._data.name
        self.process = subprocess.Popen(
            [binary, "serve", "--user", user, "--data-dir", data_dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )
        self._cookies = (f"py{n}" for n in itertools.count(1))
        self.events = []  # events that arrived while waiting for something else

    def send(self, message):
        self.process.stdin.write(json.dumps(message, separators=(",", ":")) + "\n")
        self.process.stdin.flush()

    def receive(self):
        line = self.process.stdout.readline()
        if not line:
            raise EOFError("chatcore closed its output")
        return json.loads(line)

    def request(self, name, fields):
        """Sends a request with a fresh cookie and returns the first event carrying it."""
        cookie = next(self._cookies)
        self.send({name: dict(fields, cookie=cookie)})
        while True:
            event = self.receive()
            (event_name, body), = event.items()
            if isinstance(body, dict) and body.get("cookie") == cookie:
                return event
            self.events.append(event)

    def close(self):
        self.process.stdin.close()
        code = self.process.wait(timeout=30)
        if self._data:
            self._data.cleanup()
        return code


if __name__ == "__main__":
    client = ChatcoreClient("alice")
    print(client.request("identitiesGet", {"appUserIds": ["alice"]}))
    print(client.request("requestListAll", {"type": "global"}))
    print("exit code", client.close())
