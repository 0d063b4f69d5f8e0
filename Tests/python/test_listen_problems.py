"""An address that cannot be listened on stops the start before the store is opened: exit
1, one line saying what to do, and no store made or touched."""
import os
import socket
import subprocess
import tempfile

from conftest import chatcore_binary


def untouched(data):
    """No store was made: nothing in the data directory but what the PostgreSQL run's
    wrapper puts there to name its database (Tests/postgres/chatcore-on-postgres)."""
    return not os.path.exists(data) or set(os.listdir(data)) <= {"postgres-database"}


def start(data, *listen):
    arguments = [chatcore_binary(), "serve", "--insecure-no-auth", "--data-dir", data]
    for address in listen:
        arguments += ["--listen", address]
    return subprocess.run(arguments, input=b"", capture_output=True, timeout=60)


def test_a_port_in_use_stops_the_start_before_the_store_is_opened():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "data")
        done = start(data, f"127.0.0.1:{port}")
        assert done.returncode == 1
        lines = done.stderr.decode().strip().splitlines()
        assert lines[-1] == f"chatcore: cannot listen on 127.0.0.1:{port}: the port is in use (another chatcore, or another program): stop it, or choose another --listen"
        assert untouched(data), "the store was made before the listener was known to fail"
    holder.close()


def test_a_socket_path_that_cannot_be_made_or_is_served_says_what_to_do():
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "data")
        done = start(data, "unix:" + os.path.join(work, "missing", "chatcore.sock"))
        assert done.returncode == 1 and b"does not exist; make it, or choose another path" in done.stderr
        served = os.path.join(work, "served.sock")
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(served)
        holder.listen()
        done = start(data, "unix:" + served)
        assert done.returncode == 1 and b"another process serves this socket" in done.stderr
        holder.close()
        plain = os.path.join(work, "plain")
        open(plain, "w").close()
        done = start(data, "unix:" + plain)
        assert done.returncode == 1 and b"the path exists and is not a socket" in done.stderr
        assert untouched(data)
