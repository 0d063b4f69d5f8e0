"""Operators can tell chatcore's threads apart (`top -H`, /proc): each names itself."""
import glob
import os
import tempfile
import time

from chatcore_harness import start_socket_server


def thread_names(pid):
    names = set()
    for task in glob.glob(f"/proc/{pid}/task/*/comm"):
        try:
            names.add(open(task).read().strip())
        except OSError:
            pass  # a thread that ended meanwhile
    return names


def test_the_threads_that_do_the_work_have_their_names():
    # On PostgreSQL (Tests/postgres/run.py) the search index is the database's: no thread.
    expected = {"engine"} if os.environ.get("CHATCORE_TEST_POSTGRES") else {"engine", "search-index"}
    with tempfile.TemporaryDirectory() as work:
        server = start_socket_server(os.path.join(work, "d"), os.path.join(work, "s"))
        try:
            # Each thread names itself first thing once it runs: give a loaded machine a moment.
            deadline = time.time() + 5
            while not expected <= thread_names(server.pid) and time.time() < deadline:
                time.sleep(0.05)
            names = thread_names(server.pid)
            assert expected <= names, names
        finally:
            server.terminate()
            server.wait()
