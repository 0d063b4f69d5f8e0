"""The Debian package installs the binary, a system user, its state directory and a
hardened unit that `systemd-analyze verify` accepts; the service started as the unit says
reads its options from the package's configuration file. Installs on this machine (root)
and removes itself."""
import json
import os
import pathlib
import pwd
import shlex
import socket
import stat
import subprocess
import time

import pytest

from conftest import ROOT
from test_dist import dist_binary

UNIT = pathlib.Path("/lib/systemd/system/chatcore.service")
OPTIONS = pathlib.Path("/etc/chatcore/chatcore.yaml")


@pytest.fixture
def installed(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("installing the package needs root (dpkg -i)")
    version = subprocess.run([str(dist_binary()), "--version"], capture_output=True, text=True).stdout.strip()
    package = subprocess.run([str(ROOT / "packaging" / "build_deb.sh"), str(dist_binary()), version, str(tmp_path)],
                             capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["dpkg", "-i", package], capture_output=True, check=True)
    try:
        yield version
    finally:
        subprocess.run(["dpkg", "--purge", "chatcore"], capture_output=True)


def test_the_package_installs_a_user_a_directory_and_a_unit_systemd_accepts(installed):
    assert subprocess.run(["/usr/bin/chatcore", "--version"], capture_output=True, text=True).stdout.strip() == installed
    user = pwd.getpwnam("chatcore")
    state = os.stat("/var/lib/chatcore")
    assert state.st_uid == user.pw_uid and stat.S_IMODE(state.st_mode) == 0o700
    verified = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True)
    assert verified.returncode == 0 and verified.stderr.strip() == "", verified.stderr
    unit = UNIT.read_text()
    for hardening in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "CapabilityBoundingSet=\n"):
        assert hardening in unit, hardening


def test_the_service_reads_its_options_from_the_configuration_file(installed, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    secret = pathlib.Path("/etc/chatcore/secret")
    secret.write_bytes(os.urandom(32))
    os.chown(secret, pwd.getpwnam("chatcore").pw_uid, -1)
    secret.chmod(0o400)
    # The packaged file, its listener moved to a free port, as the operator would edit it.
    packaged = OPTIONS.read_text()
    assert "listen:\n  - 127.0.0.1:7400\n" in packaged and "data-dir: /var/lib/chatcore" in packaged
    OPTIONS.write_text(packaged.replace("127.0.0.1:7400", f"127.0.0.1:{port}").replace("metrics: 127.0.0.1:9400\n", ""))
    # As the unit starts it: its user, its command line.
    unit = UNIT.read_text()
    command = next(line for line in unit.splitlines() if line.startswith("ExecStart=")).removeprefix("ExecStart=")
    server = subprocess.Popen(["runuser", "-u", "chatcore", "--"] + shlex.split(command), stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            if "listening" in line:
                break
        token = subprocess.run(["/usr/bin/chatcore", "token", "--user", "alice", "--auth-secret-file", str(secret)],
                               capture_output=True, text=True, check=True).stdout.strip()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(json.dumps({"authToken": {"userId": "alice", "authToken": token}}).encode() + b"\n")
            answer = client.makefile("rb").readline()
        assert b'"authTokenState","value":"Ok"' in answer, answer
        assert any(p.name.startswith("chatcore") for p in pathlib.Path("/var/lib/chatcore").iterdir())
    finally:
        server.terminate()
        server.wait(timeout=30)
        secret.unlink()
