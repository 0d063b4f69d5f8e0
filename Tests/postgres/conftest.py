import contextlib
import os
import socket
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "Tests" / "python"))

from bounds import BOUND_SCALE, SANITIZED  # noqa: E402,F401  (Tests/python's modules import them from "conftest")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test's item (`report_call`...), so that a fixture
    can tell in its teardown whether the test failed."""
    report = (yield).get_result()
    setattr(item, "report_" + report.when, report)


def real_binary():
    """chatcore itself (these tests give it --store themselves)."""
    path = os.environ.get("CHATCORE_REAL_BINARY") or os.environ.get("CHATCORE_BINARY") or str(ROOT / ".build" / "debug" / "chatcore")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no chatcore binary at {path}: run `swift build` (or `make test-postgres`)")
    return path


# Tests/python's helpers start "the binary" through this name.
chatcore_binary = real_binary

_node_key = []


def node_key_file():
    """The key every node of these tests is given (--node-key-file): 32 random bytes,
    made once per run, readable by its owner only."""
    if not _node_key:
        directory = tempfile.mkdtemp(prefix="chatcore-node-key-")
        path = os.path.join(directory, "node.key")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(32))
        _node_key.append(path)
    return _node_key[0]


def start(cluster, database, scratch, *arguments, url=None, environment=None):
    """chatcore on a Unix socket with its store in `database`; returns (process, socket)."""
    socket_path = os.path.join(scratch, f"{database}-{len(os.listdir(scratch))}.sock")
    command = [real_binary(), "serve", "--data-dir", os.path.join(scratch, "data-" + socket_path[-8:-5]), "--listen", "unix:" + socket_path,
               "--insecure-no-auth", "--store", url or cluster.database_url(database), "--node-key-file", node_key_file(), *arguments]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=dict(os.environ, **(environment or {})))
    deadline = time.time() + 60
    while not accepting(socket_path):
        if process.poll() is not None:
            return process, None
        assert time.time() < deadline, "chatcore did not listen"
        time.sleep(0.05)
    return process, socket_path


def accepting(socket_path):
    """Whether something accepts connections on the Unix socket (its file appears when it
    is bound, a moment before it listens: a connection then is refused)."""
    if not os.path.exists(socket_path):
        return False
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(socket_path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


@contextlib.contextmanager
def user_on(cluster, database, scratch, user="alice"):
    """A node on `database` with `user` connected (the client is yielded); at the end the
    client leaves and the node stops cleanly."""
    from chatcore_harness import Client, auth
    process, path = start(cluster, database, scratch)
    assert path is not None, process.stderr.read().decode()
    try:
        client = Client(path)
        auth(client, user)
        yield client
    except BaseException:
        # A failed test leaves no node behind (it would hold the binary and the database).
        process.kill()
        process.wait()
        raise
    client.close()
    assert stop(process) == 0


def started_chat(events):
    """The chatId of the chat a chatStart's answer added (events of an earlier request,
    such as a participant's listAdd, may come before it)."""
    return next(event["listAdd"]["elements"][0]["chatId"] for event in events if event.get("listAdd", {}).get("type") == "chat")


def chat_with_bob(client, subject):
    """The client's user starts a chat with bob; returns its chatId."""
    return started_chat(client.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": subject}}))


def search_ids(client, text, cookie="q"):
    """The ids of the messages a search for `text` finds (its answer is the last event), sorted."""
    from chatcore_harness import body
    answer = client.request({"search": {"cookie": cookie, "text": text}})
    return sorted(key["messageId"] for key in body(answer[-1])["messages"])


def stop(process):
    process.terminate()
    return process.wait(timeout=30)


@pytest.fixture
def cluster():
    """A PostgreSQL cluster of the test's own (initdb in a temporary directory)."""
    from postgres_cluster import Cluster
    with Cluster() as made:
        yield made


@pytest.fixture
def scratch():
    with tempfile.TemporaryDirectory() as directory:
        yield directory
