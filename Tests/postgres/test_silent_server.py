"""A PostgreSQL that lets a connection in and then never answers it (a server being
restarted can): chatcore gives the connection up after a few seconds and tries again,
instead of waiting for ever. It used to wait for ever on the first statement of a new
connection: after a restart of PostgreSQL the writer's new connection for its lock hung
there, holding the lock's check, and every commit waited behind it (a session through the
relaying node got no answer). No real PostgreSQL here: a Unix socket that speaks the
start of the protocol (authentication ok, ready for a query) and then stays silent."""
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time

from conftest import real_binary


def _read_exactly(connection, count):
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _serve_silently(connection):
    try:
        while True:
            length, = struct.unpack("!i", _read_exactly(connection, 4))
            body = _read_exactly(connection, length - 4)
            if struct.unpack("!i", body[:4])[0] == 80877103:  # SSLRequest: no TLS here
                connection.sendall(b"N")
                continue
            break
        # AuthenticationOk, BackendKeyData, ReadyForQuery (idle): then nothing, ever.
        connection.sendall(b"R" + struct.pack("!ii", 8, 0) + b"K" + struct.pack("!iii", 12, 4242, 1) + b"Z" + struct.pack("!i", 5) + b"I")
        while connection.recv(65536):
            pass
    except (EOFError, OSError):
        pass


def silent_server(directory):
    """Serves `directory`/.s.PGSQL.5432 as above; returns how many connections came and a
    function that stops it."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(directory, ".s.PGSQL.5432"))
    listener.listen(64)
    accepted = []

    def accept():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted.append(connection)
            threading.Thread(target=_serve_silently, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def stop():
        listener.close()
        for connection in accepted:
            connection.close()

    return accepted, stop


def test_a_server_that_lets_a_connection_in_and_never_answers_is_given_up_on():
    with tempfile.TemporaryDirectory() as scratch:
        accepted, stop = silent_server(scratch)
        try:
            started = time.time()
            try:
                result = subprocess.run(
                    [real_binary(), "serve", "--user", "alice", "--data-dir", os.path.join(scratch, "data"),
                     "--store", f"postgres://chatcore@/silent?host={scratch}"],
                    input=b"", capture_output=True, timeout=90)
            except subprocess.TimeoutExpired as expired:
                raise AssertionError("chatcore waited for ever on a server that does not answer:\n"
                                     + (expired.stderr or b"").decode(errors="replace"))
            took = time.time() - started
        finally:
            stop()
        log = result.stderr.decode(errors="replace")
        assert result.returncode == 1, log
        assert "cannot open the store" in log, log
        # Tried again, each attempt bounded, and ended within the opening's patience
        # (15 s) and one attempt's (5 s), with room for a slow machine.
        assert len(accepted) >= 2, log
        assert took < 60, f"{took:.1f} s\n{log}"
