"""Runs the Node.js example as its README says (`npm install`, then `node client.mjs`), in a
copy of this directory whose package.json points at the repository's client (skipped where
node is missing)."""
import json
import pathlib
import shutil
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
CLIENT = HERE.parents[1] / "clients" / "typescript"


def installed_copy(directory):
    """This example in `directory`, its dependency installed by npm (offline: a local package)."""
    shutil.copy(HERE / "client.mjs", directory)
    package = json.loads((HERE / "package.json").read_text())
    package["dependencies"]["chatcore-client"] = f"file:{CLIENT}"
    (directory / "package.json").write_text(json.dumps(package))
    subprocess.run(["npm", "install", "--offline", "--no-audit", "--no-fund", "--silent"], cwd=directory, check=True, timeout=120)
    return directory


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_example_chats_through_the_client(tmp_path):
    example = installed_copy(tmp_path)
    result = subprocess.run(["node", "client.mjs"], cwd=example, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "alice is bbmpim://user/id/0",
        'started chat 1 "Lunch"',
        "sent message 2 Sent",
        "  1 Join ",
        "  2 Text Noon?",
        "refused: InvalidParameter unknown field 'misspelled'",
    ]
