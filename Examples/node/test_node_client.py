"""Runs the Node.js example against the real binary (skipped where node is missing)."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("CHATCORE_BINARY", str(ROOT / ".build" / "debug" / "chatcore"))


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_client_spawns_chatcore_and_talks_to_it():
    result = subprocess.run(["node", str(pathlib.Path(__file__).with_name("client.mjs"))],
                            env=dict(os.environ, CHATCORE_BINARY=BINARY), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert '"uri":"bbmpim://user/id/0"' in result.stdout  # alice, in her own view
    assert "requestFailed: unknown field 'misspelled'" in result.stdout
    assert "exit code 0" in result.stdout
