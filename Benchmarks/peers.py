"""chatcore beside the servers people would deploy instead (issue 44), each driven by a
client of its own protocol, in one run, alternating: `python3 Benchmarks/run.py peers`.

- ejabberd and Prosody (Debian's packages): XMPP, one-to-one `chat` messages archived by
  XEP-0313 (MAM) in SQLite, each acknowledged by XEP-0198 (stream management: `<r/>`,
  `<a h=…/>`).
- Matrix Synapse (PyPI, in a virtual environment of its own): a room of two, messages sent
  by `PUT /rooms/…/send` (answered once the event is persisted) and received by `/sync`.
- chatcore: `chatMessageSend` on a Unix socket, answered `Sent` after the commit's fsync.

What is measured, for each, from one sender to one recipient online:
- durable messages/s: the sender sends N messages without waiting, timed until the last
  is acknowledged (Synapse: 16 requests in flight, its client's way of pipelining);
- one at a time: request → acknowledgement p50 / p99, and request → the recipient has it;
- RSS of the server idle after start, and after the run;
- bytes on disk per stored message (the database files' growth);
- fsyncs per message (fsync + fdatasync, counted by strace on every thread of the server
  during a run of its own, not the timed one).

Nothing is installed here: `make bench-setup` installs the servers. A server that is not
installed is left out of the table, saying so.
"""
import base64
import copy
import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHATCORE = pathlib.Path(os.environ.get("PEERS_CHATCORE") or ROOT / ".build" / "release" / "chatcore")
SYNAPSE_VENV = ROOT / ".build" / "peers" / "synapse"
PIPELINED = 5000
# chatcore's 5,000 take a sixth of a second: it pipelines ten times as many.
CHATCORE_PIPELINED = 50_000
ONE_AT_A_TIME = 400
FSYNC_RUN = 500


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_mb(pid):
    """Resident memory of `pid` and its children (a server may be several processes)."""
    total = 0
    for each in [pid] + children(pid):
        try:
            with open(f"/proc/{each}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def children(pid):
    try:
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        return []
    return [int(each) for each in found] + [grandchild for each in found for grandchild in children(int(each))]


def percentile(values, share):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def wait_port(port, process, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def own_by(user, path):
    """Run as root, prosodyctl and ejabberdctl become their packages' users: the
    server's directory is made theirs."""
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", user, str(path)], check=True)


def count_rows(database, query, *parameters):
    """A count from a server's SQLite database (read after the server is gone)."""
    import sqlite3
    with sqlite3.connect(str(database)) as connection:
        return connection.execute(query, parameters).fetchone()[0]


def checkpoint(path):
    """Moves what SQLite databases under `path` hold in write-ahead logs into the databases
    (a stopped server may leave one), so that their sizes say what is stored."""
    import sqlite3
    for log in pathlib.Path(path).rglob("*-wal"):
        with sqlite3.connect(str(log)[:-4]) as connection:
            connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def kill_all(pid):
    for each in [pid] + children(pid):
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def directory_bytes(path, matching=lambda name: True):
    """The files' bytes, without SQLite's write-ahead logs and journals (measured while a
    server runs, they hold what a clean stop moves into the database)."""
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*")
               if f.is_file() and matching(f.name) and not f.name.endswith(("-wal", "-shm", "-journal")))


class FsyncCounter:
    """strace on every thread of `pid`, counting fsync and fdatasync until `stop`."""

    def __init__(self, pid):
        self.output = tempfile.NamedTemporaryFile(prefix="strace-", suffix=".txt", delete=False).name
        pids = [pid] + children(pid)
        arguments = ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", self.output]
        for each in pids:
            arguments += ["-p", str(each)]
        self.process = subprocess.Popen(arguments, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread

    def stop(self):
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=30)
        counts = 0
        with open(self.output) as f:
            if os.environ.get("PEERS_DEBUG"):
                print(f.read())
                f.seek(0)
            for line in f:
                fields = line.split()
                if fields and fields[-1] in ("fsync", "fdatasync"):
                    counts += int(fields[3]) if len(fields) >= 5 else 0
        os.unlink(self.output)
        return counts


# --- XMPP -----------------------------------------------------------------------------

STREAM = ("<?xml version='1.0'?><stream:stream to='localhost' xmlns='jabber:client' "
          "xmlns:stream='http://etherx.jabber.org/streams' version='1.0'>")
SM = "urn:xmpp:sm:3"


class XMPP:
    """A client of one account: SASL PLAIN, a bound resource, stream management on,
    available. A thread reads stanzas: acknowledgements (`acked`) and message bodies
    (`arrived`, with when)."""

    def __init__(self, port, user, password="bench-password"):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Condition()
        self.acked = 0
        self.arrived = {}
        self._open()
        features = self._until(lambda e: e.tag.endswith("features"))
        mechanisms = [m.text for m in features.iter() if m.tag.endswith("mechanism")]
        assert "PLAIN" in mechanisms, f"no SASL PLAIN offered: {mechanisms}"
        token = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
        self.sock.sendall(f"<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{token}</auth>".encode())
        outcome = self._until(lambda e: e.tag.endswith("success") or e.tag.endswith("failure"))
        assert outcome.tag.endswith("success"), f"{user} was not signed in"
        self._open()
        self._until(lambda e: e.tag.endswith("features"))
        self.sock.sendall(b"<iq type='set' id='bind'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'><resource>bench</resource></bind></iq>")
        self._until(lambda e: e.tag.endswith("iq") and e.get("id") == "bind")
        self.sock.sendall(b"<iq type='set' id='sess'><session xmlns='urn:ietf:params:xml:ns:xmpp-session'/></iq>")
        self._until(lambda e: e.tag.endswith("iq") and e.get("id") == "sess")
        self.sock.sendall(f"<enable xmlns='{SM}'/>".encode())
        enabled = self._until(lambda e: e.tag.endswith("enabled") or e.tag.endswith("failed"))
        assert enabled.tag.endswith("enabled"), "stream management refused"
        self.sock.sendall(b"<presence/>")
        self.received = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _open(self):
        self.parser = ET.XMLPullParser(events=("start", "end"))
        self.depth = 0
        self.sock.sendall(STREAM.encode())

    def _elements(self, data):
        """Top-level stanzas completed by `data`."""
        self.parser.feed(data)
        for event, element in self.parser.read_events():
            if event == "start":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 1:
                    yield element
                    element.clear()

    def _until(self, matching):
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("the server closed the stream")
            found = None
            for element in self._elements(data):
                if found is None and matching(element):
                    found = copy.deepcopy(element)  # the parser clears it next
            if found is not None:
                return found

    def _read(self):
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            now = time.perf_counter()
            for element in self._elements(data):
                tag = element.tag.rsplit("}", 1)[-1]
                with self.lock:
                    if tag == "a":
                        self.acked = int(element.get("h"))
                    elif tag == "r":
                        self.sock.sendall(f"<a xmlns='{SM}' h='{self.received}'/>".encode())
                    elif tag == "message":
                        self.received += 1
                        body = next((child.text for child in element if child.tag.endswith("body")), None)
                        if body is not None:
                            self.arrived[body] = now
                    self.lock.notify_all()

    def send(self, to, body, request_ack=True):
        stanza = f"<message to='{to}@localhost' type='chat' id='{uuid.uuid4().hex[:12]}'><body>{body}</body></message>"
        self.sock.sendall((stanza + (f"<r xmlns='{SM}'/>" if request_ack else "")).encode())

    def send_many(self, to, bodies):
        chunk = []
        for body in bodies:
            chunk.append(f"<message to='{to}@localhost' type='chat' id='{uuid.uuid4().hex[:12]}'><body>{body}</body></message>")
            if len(chunk) == 100:
                self.sock.sendall(("".join(chunk) + f"<r xmlns='{SM}'/>").encode())
                chunk = []
        if chunk:
            self.sock.sendall(("".join(chunk) + f"<r xmlns='{SM}'/>").encode())

    def wait_acked(self, count, timeout=600):
        with self.lock:
            assert self.lock.wait_for(lambda: self.acked >= count, timeout), f"acknowledged {self.acked} of {count}"

    def wait_arrived(self, body, timeout=60):
        with self.lock:
            assert self.lock.wait_for(lambda: body in self.arrived, timeout), f"{body} did not arrive"
            return self.arrived[body]

    def close(self):
        try:
            self.sock.sendall(b"</stream:stream>")
            self.sock.close()
        except OSError:
            pass


class XMPPServer:
    name = "?"

    def client(self, user):
        return XMPP(self.port, user)

    def pair(self):
        return self.client("alice"), self.client("bob")


class Prosody(XMPPServer):
    """Prosody with mod_mam and mod_smacks, everything in SQLite (LuaDBI)."""
    name = "Prosody"

    @staticmethod
    def available():
        return shutil.which("prosody") is not None and shutil.which("prosodyctl") is not None

    def start(self, work):
        self.work = pathlib.Path(work) / "prosody"
        (self.work / "data").mkdir(parents=True)
        self.port = free_port()
        config = self.work / "prosody.cfg.lua"
        config.write_text(f"""
pidfile = "{self.work}/prosody.pid"
data_path = "{self.work}/data"
daemonize = false
log = {{ error = "{self.work}/error.log" }}
c2s_ports = {{ {self.port} }}
c2s_interfaces = {{ "127.0.0.1" }}
s2s_ports = {{ }}
component_ports = {{ }}
http_ports = {{ }}
https_ports = {{ }}
c2s_require_encryption = false
allow_unencrypted_plain_auth = true
authentication = "internal_plain"
storage = "sql"
sql = {{ driver = "SQLite3", database = "prosody.sqlite" }}
default_archive_policy = true
archive_expires_after = "never"
limits = {{ c2s = {{ rate = "100mb/s" }} }}
modules_enabled = {{ "roster", "saslauth", "disco", "carbons", "mam", "smacks", "ping", "posix" }}
modules_disabled = {{ "s2s", "tls" }}
VirtualHost "localhost"
""")
        environment = dict(os.environ, PROSODY_CONFIG=str(config))
        own_by("prosody", self.work)
        for user in ("alice", "bob"):
            subprocess.run(["prosodyctl", "--config", str(config), "register", user, "localhost", "bench-password"], check=True,
                           capture_output=True, env=environment)
        # Not as root: mod_posix refuses it, and not always the same way.
        as_user = ["runuser", "-u", "prosody", "--"] if os.geteuid() == 0 else []
        self.process = subprocess.Popen(as_user + ["prosody", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=environment)
        try:
            wait_port(self.port, self.process)
        except RuntimeError as error:
            log = self.work / "error.log"
            raise RuntimeError(f"{error}: {log.read_text()[-2000:] if log.exists() else ''}") from None
        # Prosody itself, not runuser.
        self.pid = (children(self.process.pid) or [self.process.pid])[0] if as_user else self.process.pid

    def stored_bytes(self):
        return directory_bytes(self.work / "data", lambda name: "sqlite" in name)

    def stop(self):
        for each in {self.pid, self.process.pid}:
            try:
                os.kill(each, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)

    guarantee = "`<a h>`: the stanza was handled; mod_mam archives it (LuaDBI, SQLite) in the same handler"

    def stored(self, prefix):
        return count_rows(self.work / "data" / "prosody.sqlite",
                          "SELECT count(*) FROM prosodyarchive WHERE user = 'alice' AND store = 'archive' AND value LIKE ?", f"%{prefix}-%")


class Ejabberd(XMPPServer):
    """ejabberd with mod_mam and mod_stream_mgmt, everything in SQLite."""
    name = "ejabberd"

    @staticmethod
    def available():
        return shutil.which("ejabberdctl") is not None or os.path.exists("/usr/sbin/ejabberdctl")

    def start(self, work):
        self.work = pathlib.Path(work) / "ejabberd"
        for each in ("config", "database", "logs"):
            (self.work / each).mkdir(parents=True)
        self.port = free_port()
        self.database = self.work / "database" / "ejabberd.db"
        schema = next((p for p in ("/usr/share/ejabberd/sql/lite.sql",
                                   "/usr/lib/ejabberd/priv/sql/lite.sql") if os.path.exists(p)), None)
        if schema:
            subprocess.run(["sqlite3", str(self.database)], stdin=open(schema), check=True, capture_output=True)
        (self.work / "config" / "ejabberd.yml").write_text(f"""
hosts: ["localhost"]
loglevel: warning
listen:
  - port: {self.port}
    ip: "127.0.0.1"
    module: ejabberd_c2s
    starttls_required: false
    max_stanza_size: 262144
sql_type: sqlite
sql_database: "{self.database}"
default_db: sql
auth_method: sql
auth_password_format: plain
acl:
  local:
    user_regexp: ""
access_rules:
  local:
    allow: local
  c2s:
    allow: all
modules:
  mod_disco: {{}}
  mod_roster: {{}}
  mod_stream_mgmt:
    resend_on_timeout: if_offline
  mod_mam:
    db_type: sql
    default: always
  mod_offline:
    db_type: sql
""")
        self.environment = dict(os.environ, EJABBERD_CONFIG_PATH=str(self.work / "config" / "ejabberd.yml"),
                                CONFIG_DIR=str(self.work / "config"), LOGS_DIR=str(self.work / "logs"),
                                SPOOL_DIR=str(self.work / "database"), EJABBERD_LOG_PATH=str(self.work / "logs" / "ejabberd.log"),
                                ERL_EPMD_ADDRESS="127.0.0.1")
        own_by("ejabberd", self.work)
        self.node = f"bench{self.port}@localhost"
        ctl = shutil.which("ejabberdctl") or "/usr/sbin/ejabberdctl"
        self.ctl = [ctl, "--no-timeout", "--config-dir", str(self.work / "config"), "--logs", str(self.work / "logs"),
                    "--spool", str(self.work / "database"), "--node", self.node]
        self.process = subprocess.Popen(self.ctl + ["foreground"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=self.environment)
        wait_port(self.port, self.process, timeout=120)
        subprocess.run(self.ctl + ["started"], env=self.environment, capture_output=True, timeout=120)
        for user in ("alice", "bob"):
            subprocess.run(self.ctl + ["register", user, "localhost", "bench-password"], env=self.environment, capture_output=True,
                           timeout=60)
        beam = subprocess.run(["pgrep", "-f", f"beam.*{self.node}"], capture_output=True, text=True).stdout.split()
        self.pid = int(beam[0]) if beam else self.process.pid

    def stored_bytes(self):
        return directory_bytes(self.work / "database", lambda name: name.startswith("ejabberd.db"))

    def stop(self):
        subprocess.run(self.ctl + ["stop"], env=self.environment, capture_output=True, timeout=60)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        subprocess.run(["pkill", "-f", f"beam.*{self.node}"], capture_output=True)

    guarantee = "`<a h>`: the c2s process handled the stanza; mod_mam archives it on the way (SQL, SQLite)"

    def stored(self, prefix):
        return count_rows(self.database, "SELECT count(*) FROM archive WHERE username = 'alice' AND txt LIKE ?", f"{prefix}-%")


# --- Matrix ----------------------------------------------------------------------------

class MatrixClient:
    """One account on Synapse: keep-alive HTTP; `send` waits for the event's id; a /sync
    thread notes when each body arrives."""

    def __init__(self, port, user):
        self.port = port
        self.connection = http.client.HTTPConnection("127.0.0.1", port)
        answer = self.call("POST", "/_matrix/client/v3/register", {"username": user, "password": "bench-password-1",
                                                                    "auth": {"type": "m.login.dummy"}, "inhibit_login": False})
        self.token = answer["access_token"]
        self.user_id = answer["user_id"]
        self.arrived = {}
        self.lock = threading.Condition()
        self.since = None

    def call(self, method, path, body=None, connection=None, token=True):
        connection = connection or self.connection
        headers = {"Content-Type": "application/json"}
        if token and getattr(self, "token", None):
            headers["Authorization"] = f"Bearer {self.token}"
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        return json.loads(data)

    def follow(self, room):
        self.room = room
        connection = http.client.HTTPConnection("127.0.0.1", self.port)
        self.since = self.call("GET", "/_matrix/client/v3/sync?timeout=0", connection=connection)["next_batch"]

        def run():
            while True:
                try:
                    answer = self.call("GET", f"/_matrix/client/v3/sync?timeout=30000&since={self.since}", connection=connection)
                except Exception:
                    return
                now = time.perf_counter()
                self.since = answer["next_batch"]
                events = answer.get("rooms", {}).get("join", {}).get(room, {}).get("timeline", {}).get("events", [])
                with self.lock:
                    for event in events:
                        body = event.get("content", {}).get("body")
                        if body is not None:
                            self.arrived[body] = now
                    self.lock.notify_all()

        threading.Thread(target=run, daemon=True).start()

    def send(self, room, body, connection=None):
        transaction = uuid.uuid4().hex
        return self.call("PUT", f"/_matrix/client/v3/rooms/{room}/send/m.room.message/{transaction}", {"msgtype": "m.text", "body": body},
                         connection=connection)

    def wait_arrived(self, body, timeout=60):
        with self.lock:
            assert self.lock.wait_for(lambda: body in self.arrived, timeout), f"{body} did not arrive"
            return self.arrived[body]


class Synapse:
    """Matrix Synapse on SQLite, registration open (dummy auth), rate limits off."""
    name = "Synapse"

    @staticmethod
    def available():
        return (SYNAPSE_VENV / "bin" / "python").exists()

    def start(self, work):
        self.work = pathlib.Path(work) / "synapse"
        self.work.mkdir(parents=True)
        self.port = free_port()
        python = str(SYNAPSE_VENV / "bin" / "python")
        config = self.work / "homeserver.yaml"
        subprocess.run([python, "-m", "synapse.app.homeserver", "--server-name", "localhost", "--config-path", str(config),
                        "--data-directory", str(self.work), "--generate-config", "--report-stats=no"], check=True, capture_output=True,
                       cwd=self.work)
        text = config.read_text()
        text = re.sub(r"(?m)^listeners:.*?(?=^\S)", f"""listeners:
  - port: {self.port}
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
""", text, flags=re.S)
        limited = {"per_second": 100000, "burst_count": 100000}
        text += "\nenable_registration: true\nenable_registration_without_verification: true\n"
        for limit in ("rc_message", "rc_registration", "rc_login", "rc_joins", "rc_invites"):
            body = json.dumps(limited) if limit != "rc_login" else json.dumps({"address": limited, "account": limited, "failed_attempts": limited})
            if limit == "rc_joins":
                body = json.dumps({"local": limited, "remote": limited})
            if limit == "rc_invites":
                body = json.dumps({"per_room": limited, "per_user": limited, "per_issuer": limited})
            text += f"{limit}: {body}\n"
        text += "presence:\n  enabled: false\n"
        config.write_text(text)
        self.process = subprocess.Popen([python, "-m", "synapse.app.homeserver", "--config-path", str(config)], cwd=self.work,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, self.process, timeout=180)
        self.pid = self.process.pid

    def pair(self):
        alice = MatrixClient(self.port, "alice")
        bob = MatrixClient(self.port, "bob")
        room = alice.call("POST", "/_matrix/client/v3/createRoom", {"invite": [bob.user_id], "is_direct": True, "preset": "trusted_private_chat"})["room_id"]
        bob.call("POST", f"/_matrix/client/v3/join/{room}", {})
        bob.follow(room)
        alice.room = room
        return alice, bob

    def stored_bytes(self):
        return directory_bytes(self.work, lambda name: name.startswith("homeserver.db"))

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    guarantee = "the `PUT …/send` answer: the event was persisted (SQLite)"

    def stored(self, prefix):
        return count_rows(self.work / "homeserver.db", "SELECT count(*) FROM event_json WHERE json LIKE ?", f"%{prefix}-%")


# --- chatcore --------------------------------------------------------------------------

class ChatcoreClient:
    """A Unix socket session; a thread notes `Sent` answers and arriving messages."""

    def __init__(self, path, user):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.lock = threading.Condition()
        self.sent = 0
        self.arrived = {}
        self.chat = None
        self.sock.sendall(b'{"authToken":{"userId":"%s","authToken":"-"}}\n' % user.encode())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.sock.makefile("rb"):
            now = time.perf_counter()
            with self.lock:
                if line.startswith(b'{"listAdd":{"type":"chatMessage"'):
                    self.sent += line.count(b'"state":"Sent"')
                    for body in re.findall(rb'"content":"(peer-[^"]*)"', line):
                        self.arrived.setdefault(body.decode(), now)
                elif line.startswith(b'{"listAdd":{"type":"chat","cookie":"s"'):
                    self.chat = json.loads(line)["listAdd"]["elements"][0]["chatId"]
                self.lock.notify_all()

    def start_chat(self, other):
        self.sock.sendall(b'{"chatStart":{"cookie":"s","invitees":[{"userId":"%s"}],"isOneToOne":true}}\n' % other.encode())
        with self.lock:
            self.lock.wait_for(lambda: self.chat is not None, 60)

    def wait_arrived(self, body, timeout=60):
        with self.lock:
            assert self.lock.wait_for(lambda: body in self.arrived, timeout), f"{body} did not arrive"
            return self.arrived[body]

    def line(self, body):
        return b'{"chatMessageSend":{"chatId":"%s","tag":"Text","content":"%s"}}\n' % (self.chat.encode(), body.encode())


class Chatcore:
    name = "chatcore"
    guarantee = "`Sent`: the commit that holds the message was fsynced (group commit)"

    def stored(self, prefix):
        return count_rows(self.work / "data" / "chatcore.sqlite", "SELECT count(*) FROM message WHERE content LIKE ?", f"{prefix}-%")

    @staticmethod
    def available():
        return CHATCORE.exists()

    def start(self, work):
        self.work = pathlib.Path(work) / "chatcore"
        self.work.mkdir(parents=True)
        self.path = str(self.work / "chatcore.sock")
        self.process = subprocess.Popen([str(CHATCORE), "serve", "--data-dir", str(self.work / "data"), "--listen", "unix:" + self.path,
                                         "--insecure-no-auth", "--log-level", "error"], stdin=subprocess.DEVNULL)
        deadline = time.time() + 60
        while True:
            try:
                probe = socket.socket(socket.AF_UNIX)
                probe.connect(self.path)
                probe.close()
                break
            except OSError:
                assert time.time() < deadline, "chatcore did not listen"
                time.sleep(0.05)
        self.pid = self.process.pid

    def pair(self):
        alice, bob = ChatcoreClient(self.path, "alice"), ChatcoreClient(self.path, "bob")
        alice.start_chat("bob")
        return alice, bob

    def stored_bytes(self):
        return directory_bytes(self.work / "data")

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)


# --- the measurements, one protocol's way each -------------------------------------------

def pipelined(server, sender, count, prefix):
    bodies = [f"peer-{prefix}-{n}" for n in range(count)]
    start = time.perf_counter()
    if isinstance(server, Chatcore):
        before = sender.sent
        sender.sock.sendall(b"".join(sender.line(body) for body in bodies))
        with sender.lock:
            assert sender.lock.wait_for(lambda: sender.sent >= before + count, 600)
    elif isinstance(server, Synapse):
        queue = list(bodies)
        lock = threading.Lock()

        def worker():
            connection = http.client.HTTPConnection("127.0.0.1", server.port)
            while True:
                with lock:
                    if not queue:
                        return
                    body = queue.pop()
                sender.send(sender.room, body, connection=connection)

        workers = [threading.Thread(target=worker) for _ in range(16)]
        for each in workers:
            each.start()
        for each in workers:
            each.join()
    else:
        before = sender.acked
        sender.send_many("bob", bodies)
        sender.wait_acked(before + count)
    return count / (time.perf_counter() - start)


def one_at_a_time(server, sender, receiver, count, prefix):
    acked, delivered = [], []
    for n in range(count):
        body = f"peer-{prefix}-{n}"
        start = time.perf_counter()
        if isinstance(server, Chatcore):
            target = sender.sent + 1
            sender.sock.sendall(sender.line(body))
            with sender.lock:
                sender.lock.wait_for(lambda: sender.sent >= target, 60)
        elif isinstance(server, Synapse):
            sender.send(sender.room, body)
        else:
            target = sender.acked + 1
            sender.send("bob", body)
            sender.wait_acked(target)
        acked.append(time.perf_counter() - start)
        delivered.append(receiver.wait_arrived(body) - start)
    return acked, delivered


def measure(server_class, work):
    os.chmod(work, 0o755)  # a server run as its package's user reaches its directory in it
    server = server_class()
    stopped = False
    try:
        server.start(work)
        time.sleep(2)
        idle = rss_mb(server.pid)
        sender, receiver = server.pair()
        base = server.stored_bytes()
        pipelined(server, sender, 200, "warm")
        count = CHATCORE_PIPELINED if isinstance(server, Chatcore) else PIPELINED
        rate = pipelined(server, sender, count, "p")
        acked, delivered = one_at_a_time(server, sender, receiver, ONE_AT_A_TIME, "o")
        counter = FsyncCounter(server.pid)
        pipelined(server, sender, FSYNC_RUN, "f")
        time.sleep(1)
        fsyncs = counter.stop() / FSYNC_RUN
        after = rss_mb(server.pid)
        server.stop()
        stopped = True
        # What the messages took once the server has stopped (and written what it kept
        # aside, such as a write-ahead log).
        checkpoint(server.work)
        stored = (server.stored_bytes() - base) / (200 + count + ONE_AT_A_TIME + FSYNC_RUN)
        return {"rate": rate, "ack": (percentile(acked, 0.5), percentile(acked, 0.99)),
                "delivery": (percentile(delivered, 0.5), percentile(delivered, 0.99)), "idle": idle, "after": after,
                "bytes": stored, "fsyncs": fsyncs}
    finally:
        if not stopped and hasattr(server, "process"):
            server.stop()


KILLED = 2000


def acknowledged_then_killed(server_class, work):
    """Sends KILLED messages, and SIGKILLs the server the moment the last is acknowledged:
    how many of them it had stored. Not a power cut (what was written but not fsynced
    survives a process's death): whether an acknowledgement comes after the message is
    stored at all."""
    os.chmod(work, 0o755)
    server = server_class()
    try:
        server.start(work)
        sender, _ = server.pair()
        pipelined(server, sender, KILLED, "k")
        kill_all(server.pid)
        if hasattr(server, "process"):
            kill_all(server.process.pid)
        time.sleep(1)
        return server.stored("peer-k")
    finally:
        if hasattr(server, "process"):
            server.stop()


SERVERS = [Chatcore, Ejabberd, Prosody, Synapse]


def run(rounds=2):
    present = [each for each in SERVERS if each.available()]
    missing = [each.name for each in SERVERS if not each.available()]
    results = {each.name: [] for each in present}
    killed = {}
    for round in range(rounds):
        for each in present:
            with tempfile.TemporaryDirectory(prefix="peers-") as work:
                try:
                    results[each.name].append(measure(each, work))
                except Exception as error:  # one server failing leaves the others' rows
                    print(f"{each.name}: {error}")
            if round == 0:
                with tempfile.TemporaryDirectory(prefix="peers-") as work:
                    try:
                        killed[each.name] = acknowledged_then_killed(each, work)
                    except Exception as error:
                        print(f"{each.name}, killed: {error}")
    return present, missing, results, killed


def print_table(rounds=2):
    present, missing, results, killed = run(rounds)
    if missing:
        print(f"not installed (make bench-setup): {', '.join(missing)}")
    print(f"\n{'server':<9} {'durable msgs/s':>14} {'of chatcore':>11} {'ack p50 / p99 ms':>17} {'delivery p50 / p99 ms':>22} "
          f"{'RSS idle / after MB':>20} {'bytes/msg':>9} {'fsyncs/msg':>10} {'acked, SIGKILL: stored':>22}")
    base = statistics.median(r["rate"] for r in results["chatcore"]) if results.get("chatcore") else None
    for each in present:
        rows = results[each.name]
        if not rows:
            continue

        def middle(key, index=None):
            return statistics.median(r[key] if index is None else r[key][index] for r in rows)

        rate = middle("rate")
        ratio = f"{rate / base:.4f}×" if base else "-"
        stored = f"{killed[each.name]:,} of {KILLED:,}" if each.name in killed else "-"
        print(f"{each.name:<9} {rate:>14,.0f} {ratio:>11} {middle('ack', 0) * 1000:>8.2f} / {middle('ack', 1) * 1000:<6.2f} "
              f"{middle('delivery', 0) * 1000:>11.2f} / {middle('delivery', 1) * 1000:<8.2f} {middle('idle'):>9.1f} / {middle('after'):<8.1f} "
              f"{middle('bytes'):>9,.0f} {middle('fsyncs'):>10.2f} {stored:>22}")
    print(f"\n{PIPELINED:,} messages pipelined ({CHATCORE_PIPELINED:,} to chatcore), {ONE_AT_A_TIME} one at a time (medians of {rounds} alternated rounds); fsyncs "
          f"counted by strace over {FSYNC_RUN} more. What each acknowledgement says:")
    for each in present:
        print(f"- {each.name}: {each.guarantee}")


if __name__ == "__main__":
    print_table()
