"""Operators can tell chatcore's threads apart (`top -H`, /proc): each names itself."""
import glob
import os
import tempfile

from chatcore_harness import start_socket_server


def test_the_threads_that_do_the_work_have_their_names():
    with tempfile.TemporaryDirectory() as work:
        server = start_socket_server(os.path.join(work, "d"), os.path.join(work, "s"))
        try:
            names = set()
            for task in glob.glob(f"/proc/{server.pid}/task/*/comm"):
                try:
                    names.add(open(task).read().strip())
                except OSError:
                    pass  # a thread that ended meanwhile
            assert {"engine", "search-index"} <= names, names
        finally:
            server.terminate()
            server.wait()
