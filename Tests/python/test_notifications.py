"""Notifications of recipients who are not connected (`--notify-url`), against a real HTTP
receiver standing for the application's server: it is down, slow, answers 500, 429, 400
or 200, checks every request's signature, and keeps what it was sent. Each notification
must arrive by its idempotency key exactly once, across failures and a SIGKILL of
chatcore; a connected recipient is notified only when they have not read the message in
time; a refusal is not retried; the outbox keeps the newest when it is full."""
import hashlib
import hmac
import http.server
import json
import os
import re
import signal
import socket
import tempfile
import threading
import time

from chatcore_harness import Client, auth, scrape
from test_quotas import serve as serve_with_metrics


class Receiver:
    """The application's server: answers as `mode` says ("200", "500", "429", "400", or
    "slow": 200 after the client gave up), or is down (not listening) until `start`."""

    def __init__(self, secret):
        self.secret = secret
        self.mode = "200"
        self.requests = []  # (mode answered, signature valid, body)
        self.arrived = threading.Condition()
        self.server = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self):
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                mode = receiver.mode
                valid = receiver.verify(self.headers.get("Chatcore-Signature", ""), body)
                if mode == "slow":
                    time.sleep(2.5)
                status = {"200": 200, "slow": 200, "500": 500, "429": 429, "400": 400}[mode]
                with receiver.arrived:
                    receiver.requests.append((mode, valid, json.loads(body)))
                    receiver.arrived.notify_all()
                try:
                    self.send_response(status)
                    if status == 429:
                        self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the client gave up (slow)

            def log_message(self, *arguments):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        if self.server:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def verify(self, header, body):
        match = re.fullmatch(r"t=(\d+),v1=([0-9a-f]{64})", header)
        if not match or abs(int(match.group(1)) - time.time()) > 300:
            return False
        expected = hmac.new(self.secret, match.group(1).encode() + b"." + body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, match.group(2))

    def accepted(self):
        """Every notification in a request answered 2xx, by id (a repeated one once)."""
        with self.arrived:
            return {n["id"]: n for mode, _, body in self.requests if mode in ("200", "slow") for n in body["notifications"]}

    def wait_for(self, predicate, timeout=60):
        with self.arrived:
            return self.arrived.wait_for(lambda: predicate(self), timeout)


def secret_file(work):
    path = os.path.join(work, "notify-secret")
    secret = os.urandom(40)
    with open(path, "wb") as file:
        file.write(secret)
    os.chmod(path, 0o600)
    return path, secret


def serve(work, receiver, secret_path, *arguments):
    """chatcore on a Unix socket with metrics, notifying `receiver` (test_quotas' start)."""
    return serve_with_metrics(work, "--notify-url", receiver.url, "--notify-secret-file", secret_path, "--notify-timeout", "1",
                              "--notify-longest-retry", "2", *arguments)


def connect(path, user):
    client = Client(path)
    auth(client, user)
    return client


def start_chat(client, *invitees):
    client.send({"chatStart": {"cookie": "start", "invitees": [{"userId": u} for u in invitees], "subject": "s"}})
    added = next(e for e in client.answer("start") if "listAdd" in e)
    return added["listAdd"]["elements"][0]["chatId"]


def send(client, chat, content):
    client.send({"chatMessageSend": {"cookie": "send", "chatId": chat, "tag": "Text", "content": content}})
    added = next(e["listAdd"] for e in client.answer("send") if e.get("listAdd", {}).get("cookie") == "send")
    return added["elements"][0]["messageId"]


def regid(client, user):
    client.send({"identitiesGet": {"cookie": "who", "appUserIds": [user]}})
    return next(e for e in client.answer("who") if "identities" in e)["identities"]["info"][0]["regId"]


def register(path, user, token):
    """`user` registers an endpoint that carries `token`, then disconnects."""
    client = connect(path, user)
    client.send({"endpointUpdate": {"cookie": "e", "description": user + "'s phone", "pushToken": token}})
    assert client.answer("e")[-1] == {"endpointUpdateResult": {"cookie": "e", "result": "Success"}}
    client.close()


def test_every_offline_recipient_is_notified_once_through_a_down_slow_failing_server_and_a_kill():
    with tempfile.TemporaryDirectory(prefix="chatcore-notify-") as work:
        secret_path, secret = secret_file(work)
        receiver = Receiver(secret)  # down: nothing listens
        process, path, _ = serve(work, receiver, secret_path, "--notify-preview", "8")
        try:
            register(path, "bob", "bob-token")
            alice = connect(path, "alice")
            dave = connect(path, "dave")  # connected the whole time: never notified
            chat = start_chat(alice, "bob", "carol", "dave")
            ids = {"bob": regid(alice, "bob"), "carol": regid(alice, "carol")}
            sent = {send(alice, chat, f"message number {n}"): f"message number {n}" for n in range(6)}
            time.sleep(1.5)  # tried against nothing: refused connections
            receiver.mode = "slow"
            receiver.start()
            assert receiver.wait_for(lambda r: any(m == "slow" for m, _, _ in r.requests), 30)
            receiver.mode = "500"
            assert receiver.wait_for(lambda r: any(m == "500" for m, _, _ in r.requests), 30)
            sent.update({send(alice, chat, f"later {n}"): f"later {n}" for n in range(4)})
            alice.close()
            dave.close()
            process.send_signal(signal.SIGKILL)
            process.wait()
            receiver.mode = "429"
            process, path, metrics = serve(work, receiver, secret_path, "--notify-preview", "8")
            assert receiver.wait_for(lambda r: any(m == "429" for m, _, _ in r.requests), 30)
            receiver.mode = "200"
            expected = {f"{chat}:{message}:{ids[user]}" for message in sent for user in ("bob", "carol")}
            assert receiver.wait_for(lambda r: set(r.accepted()) >= expected, 60), sorted(set(expected) - set(receiver.accepted()))
            time.sleep(1.5)  # nothing else comes
            accepted = receiver.accepted()
            assert set(accepted) == expected
            assert all(valid for _, valid, _ in receiver.requests), "every request is signed with the secret"
            for notification in accepted.values():
                message = notification["messageId"]
                assert notification["chatId"] == chat and message in sent
                assert notification["senderUserId"] == "alice" and notification["tag"] == "Text"
                assert notification["preview"] == sent[message][:8]
                assert notification["recipientUserId"] in ("bob", "carol") and notification["numUnread"] >= 1
                tokens = [e.get("pushToken") for e in notification["endpoints"]]
                assert tokens == (["bob-token"] if notification["recipientUserId"] == "bob" else [])
            assert metric(metrics, "chatcore_notifications_sent_total") >= 1
            assert metric(metrics, "chatcore_notifications_retried_total") >= 1
            assert metric(metrics, "chatcore_notification_latency_seconds_count") >= 1
        finally:
            process.kill()
            process.wait()
            receiver.stop()


def test_a_connected_recipient_is_notified_only_when_they_have_not_read_it_in_time():
    with tempfile.TemporaryDirectory(prefix="chatcore-notify-") as work:
        secret_path, secret = secret_file(work)
        receiver = Receiver(secret)
        receiver.start()
        process, path, _ = serve(work, receiver, secret_path, "--notify-unread-delay", "1")
        try:
            alice = connect(path, "alice")
            bob = connect(path, "bob")
            # A token given, then taken back (an empty one): the notification names no device.
            for token in ("bob-token", ""):
                bob.send({"endpointUpdate": {"cookie": "e", "description": "bob's phone", "pushToken": token}})
                assert bob.answer("e")[-1] == {"endpointUpdateResult": {"cookie": "e", "result": "Success"}}
            chat = start_chat(alice, "bob")
            bob_regid = regid(alice, "bob")
            read = send(alice, chat, "read at once")
            bob.send({"chatMessageRead": {"chatId": chat, "messageId": read}})
            unread = send(alice, chat, "left unread")
            assert receiver.wait_for(lambda r: r.accepted(), 30)
            time.sleep(1.5)
            assert set(receiver.accepted()) == {f"{chat}:{unread}:{bob_regid}"}
            assert receiver.accepted()[f"{chat}:{unread}:{bob_regid}"]["endpoints"] == []
            # The notifier, waiting for something to send, stops with the service.
            process.terminate()
            assert process.wait(timeout=30) == 0
        finally:
            process.kill()
            process.wait()
            receiver.stop()


def test_a_refused_notification_is_not_sent_again_and_the_next_ones_are():
    with tempfile.TemporaryDirectory(prefix="chatcore-notify-") as work:
        secret_path, secret = secret_file(work)
        receiver = Receiver(secret)
        receiver.mode = "400"
        receiver.start()
        process, path, metrics = serve(work, receiver, secret_path)
        try:
            alice = connect(path, "alice")
            chat = start_chat(alice, "bob")
            send(alice, chat, "refused")
            assert receiver.wait_for(lambda r: len(r.requests) == 1, 30)
            receiver.mode = "200"
            second = send(alice, chat, "accepted")
            assert receiver.wait_for(lambda r: r.accepted(), 30)
            time.sleep(3)  # past the longest retry: the refused one does not come back
            assert [n["messageId"] for _, _, body in receiver.requests for n in body["notifications"]] == [
                str(int(second) - 1), second]
            assert metric(metrics, "chatcore_notifications_dropped_total", reason="refused") == 1
        finally:
            process.kill()
            process.wait()
            receiver.stop()


def test_a_full_outbox_drops_the_oldest_notifications_and_says_so():
    with tempfile.TemporaryDirectory(prefix="chatcore-notify-") as work:
        secret_path, secret = secret_file(work)
        receiver = Receiver(secret)  # down while the messages are sent
        process, path, metrics = serve(work, receiver, secret_path, "--notify-max-queued", "3")
        try:
            alice = connect(path, "alice")
            chat = start_chat(alice, "bob")
            sent = [send(alice, chat, f"m{n}") for n in range(10)]
            full = lambda: metric(metrics, "chatcore_notifications_dropped_total", reason="outbox_full")  # noqa: E731
            assert wait_until(lambda: full() == 7, 30), full()
            receiver.start()
            assert receiver.wait_for(lambda r: len(r.accepted()) == 3, 30)
            time.sleep(1.5)
            assert sorted(int(n["messageId"]) for n in receiver.accepted().values()) == [int(m) for m in sent[-3:]]
        finally:
            process.kill()
            process.wait()
            receiver.stop()


def metric(port, name, **labels):
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample, have), value in scrape(port).items() if sample == name and wanted <= set(have))


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_request_carries_at_most_a_mebibyte_of_notifications():
    with tempfile.TemporaryDirectory(prefix="chatcore-notify-") as work:
        secret_path, secret = secret_file(work)
        receiver = Receiver(secret)
        receiver.start()
        process, path, _ = serve(work, receiver, secret_path)
        try:
            # Twenty devices with the longest tokens: each notification for bob is ~80 KiB.
            for n in range(20):
                register(path, "bob", f"{n:02d}" + "t" * 4094)
            alice = connect(path, "alice")
            chat = start_chat(alice, "bob")
            for n in range(30):
                send(alice, chat, f"m{n}")
            assert receiver.wait_for(lambda r: len(r.accepted()) == 30, 60)
            sizes = [len(json.dumps(body, separators=(",", ":"))) for _, _, body in receiver.requests]
            assert len(sizes) >= 3 and max(sizes) <= 1 << 20, sizes
            assert all(len(n["endpoints"]) == 20 for n in receiver.accepted().values())
        finally:
            process.kill()
            process.wait()
            receiver.stop()


def test_a_message_recalled_before_its_notification_went_is_not_notified():
    with tempfile.TemporaryDirectory(prefix="chatcore-notify-") as work:
        secret_path, secret = secret_file(work)
        receiver = Receiver(secret)  # down until the recall
        process, path, metrics = serve(work, receiver, secret_path)
        try:
            alice = connect(path, "alice")
            chat = start_chat(alice, "bob")
            recalled = send(alice, chat, "sent by mistake")
            kept = send(alice, chat, "meant")
            # Once a try failed (one already under way when the message is recalled may
            # still carry it: nothing calls a request back).
            assert wait_until(lambda: metric(metrics, "chatcore_notifications_retried_total") >= 2, 30)
            alice.send({"chatMessageDestroy": {"chatId": chat, "messageId": recalled}})
            alice.request({"identitiesGet": {"cookie": "recalled", "appUserIds": ["bob"]}})
            receiver.start()
            assert receiver.wait_for(lambda r: r.accepted(), 30)
            time.sleep(3)  # past the longest retry: the recalled one never comes
            assert [n["messageId"] for n in receiver.accepted().values()] == [kept]
        finally:
            process.kill()
            process.wait()
            receiver.stop()
