"""The README's commands work as written: the first minute's lines get the answers it shows,
the server's three commands sign a client in, the Python snippet runs, every option it
names exists, and it stays short."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, chatcore_binary

README = (ROOT / "README.md").read_text()


def blocks(language=""):
    """The README's fenced blocks in `language` ("": the bare ones), in order."""
    fenced = re.findall(r"^```(\w*)\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
    return [body for tag, body in fenced if tag == language]


def environment(tmp_path):
    """A newcomer's machine: chatcore on PATH, nothing in their home yet."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "PATH": f"{os.path.dirname(os.environ.get('CHATCORE_REAL_BINARY') or chatcore_binary())}:{os.environ['PATH']}",
            "HOME": str(home), "XDG_DATA_HOME": str(home / ".local" / "share"), "PYTHONPATH": str(ROOT / "clients" / "python")}


def test_the_readme_is_short_and_starts_with_the_two_commands():
    assert len(README.splitlines()) <= 250
    first = blocks("sh")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, re.MULTILINE), ".ci/run does not run the README's test command"


def test_the_first_minute_gets_the_answers_shown(tmp_path):
    command = next(line for line in blocks("sh")[2].splitlines() if line.startswith("chatcore serve --user alice"))
    command = command.replace("/tmp/first-minute", str(tmp_path / "first-minute"))
    lines = [block.strip() for block in blocks() if block.lstrip().startswith("{")]
    start, shown, send = lines[0], lines[1].splitlines(), lines[2]
    done = subprocess.run(command, shell=True, input=f"{start}\n{send}\n", capture_output=True, text=True, timeout=60, env=environment(tmp_path))
    assert done.returncode == 0, done.stderr
    answers = done.stdout.splitlines()
    for expected, got in zip(shown, answers):
        if "..." in expected:
            assert got.startswith(expected.split("...")[0]), (expected, got)
        else:
            assert json.loads(got) == json.loads(expected)
    sent = [json.loads(line)["listAdd"]["elements"][0] for line in answers if '"cookie":"m1"' in line]
    assert sent and sent[0]["state"] == "Sent" and sent[0]["content"] == "Noon at the usual place?"
    assert (tmp_path / "first-minute").is_dir(), "the store is not where the README says it stays"


def test_the_three_server_commands_sign_a_client_in(tmp_path):
    commands = [line.split("  #")[0].strip() for line in blocks("sh")[3].splitlines() if line.strip()]
    assert commands[1].startswith("chatcore serve --listen")
    make_key, serve, token = commands
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = environment(tmp_path)
    subprocess.run(make_key, shell=True, cwd=tmp_path, check=True, env=env)
    assert oct((tmp_path / "secret").stat().st_mode & 0o777) == "0o600"
    # `exec`: the shell becomes chatcore, so that terminating it stops chatcore (a shell
    # that forked it left it running after every run of the suite).
    server = subprocess.Popen("exec " + serve.replace("127.0.0.1:7400", f"127.0.0.1:{port}") + f" --data-dir {tmp_path / 'data'}", shell=True,
                              cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            if "listening" in line:
                break
        jwt = subprocess.run(token, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
        first_line = re.search(r"The first line a client sends is `(.*?)`", README).group(1).replace("<token>", jwt)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(first_line.encode() + b"\n")
            assert b'"authTokenState","value":"Ok"' in client.makefile("rb").readline()
    finally:
        server.terminate()
        server.wait(timeout=30)
    # Stopping the command stopped chatcore: nothing listens there any more.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_python_snippet_runs(tmp_path):
    snippet = blocks("python")[0]
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60, env=environment(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_every_option_the_readme_names_is_an_option_of_serve():
    help_text = subprocess.run([chatcore_binary(), "serve", "--help"], capture_output=True, text=True, check=True).stdout
    named = set(re.findall(r"`(--[a-z-]+)", README))
    assert len(named) > 8
    assert [option for option in sorted(named) if option not in help_text] == []
