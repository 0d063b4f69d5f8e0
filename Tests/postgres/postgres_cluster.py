"""A throwaway PostgreSQL cluster for tests: made with initdb in a temporary directory,
serving a Unix socket there only (with `tcp=True` also loopback TCP on a free port),
stopped and removed at the end.

    with Cluster() as cluster:
        url = cluster.database_url(cluster.create_database("t1"))

Debian's `postgresql` package provides initdb/pg_ctl (in /usr/lib/postgresql/N/bin). They
refuse to run as root: as root the cluster runs as the `postgres` user the package made.
"""
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile


def postgres_bin():
    """The directory of initdb and pg_ctl, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(versions[-1]) if versions else None


def free_port():
    """A loopback TCP port no one listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    USER = "chatcore"

    def __init__(self, settings=("fsync=off",), tcp=False, hba=()):
        """`hba`: pg_hba.conf lines put before initdb's (the first that matches decides)."""
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
        self.settings = settings
        self.tcp = tcp
        self.hba = hba
        self.port = 5432
        self.directory = None

    def _as_owner(self, command):
        if os.geteuid() == 0:
            return ["runuser", "-u", "postgres", "--"] + command
        return command

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        self.directory = tempfile.mkdtemp(prefix="chatcore-pg-")
        os.chmod(self.directory, 0o755)
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.directory, owner.pw_uid, owner.pw_gid)
        data = os.path.join(self.directory, "data")
        subprocess.run(self._as_owner([os.path.join(self.bin, "initdb"), "-D", data, "-U", self.USER, "--auth=trust",
                                       "-E", "UTF8", "--locale=C", "--no-sync"]),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if self.hba:
            path = os.path.join(data, "pg_hba.conf")
            with open(path) as f:
                rules = f.read()
            with open(path, "w") as f:
                f.write("".join(line + "\n" for line in self.hba) + rules)
        listen = "''"
        if self.tcp:
            listen = "127.0.0.1"
            self.port = free_port()
        options = (f"-k {self.directory} -c listen_addresses={listen} -c port={self.port} -c max_connections=400 "
                   + " ".join(f"-c {s}" for s in self.settings))
        subprocess.run(self._as_owner([os.path.join(self.bin, "pg_ctl"), "-D", data, "-o", options,
                                       "-l", os.path.join(self.directory, "log"), "-w", "start"]),
                       check=True, stdout=subprocess.DEVNULL)
        return self

    @property
    def socket_directory(self):
        return self.directory

    def pg_ctl(self, *arguments):
        subprocess.run(self._as_owner([os.path.join(self.bin, "pg_ctl"), "-D", os.path.join(self.directory, "data")] + list(arguments)),
                       check=True, stdout=subprocess.DEVNULL)

    def psql(self, sql, database="postgres"):
        result = subprocess.run(["psql", "-h", self.directory, "-p", str(self.port), "-U", self.USER, "-d", database, "-qAt", "-v", "ON_ERROR_STOP=1", "-c", sql],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"psql: {result.stderr.strip()}")
        return result.stdout

    def create_database(self, name):
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.psql(f'CREATE DATABASE "{name}"')
        return name

    def database_url(self, name):
        assert self.port == 5432, "a TCP cluster's socket is on another port: use tcp_url"
        return f"postgres://{self.USER}@/{name}?host={self.directory}"

    def tcp_url(self, name, host="127.0.0.1", **query):
        """The database over loopback TCP (`tcp=True`); `query`: sslmode, sslrootcert."""
        return f"postgres://{self.USER}@{host}:{self.port}/{name}" + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")

    def stop(self):
        if self.directory is None:
            return
        try:
            self.pg_ctl("-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None


class PsqlSession:
    """A psql process the test keeps open (to hold locks: in a transaction, or advisory
    ones, which last as long as the session): each `run` goes to it at once, in order."""

    def __init__(self, cluster, database, keep_errors=False):
        """`keep_errors`: what the session writes to stderr is kept (`errors`), not shown."""
        self.process = subprocess.Popen(["psql", "-h", cluster.socket_directory, "-p", str(cluster.port), "-U", cluster.USER, "-d", database,
                                         "-qAt", "-v", "ON_ERROR_STOP=1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE if keep_errors else None, text=True)

    def run(self, sql):
        self.process.stdin.write(sql + "\n")
        self.process.stdin.flush()

    def end(self):
        """Ends the session; every statement it ran must have succeeded."""
        self.process.stdin.close()
        assert self.process.wait(timeout=10) == 0

    def errors(self):
        """Ends the session (with `keep_errors`); what it wrote to stderr, and its exit status."""
        self.process.stdin.close()
        errors = self.process.stderr.read()
        return errors, self.process.wait(timeout=10)

    def kill(self):
        self.process.kill()
