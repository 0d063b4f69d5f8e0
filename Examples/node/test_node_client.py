"""Runs the Node.js example against the real binary (skipped where node is missing)."""
import pathlib
import shutil
import subprocess

import pytest


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_example_chats_through_the_client():
    result = subprocess.run(["node", str(pathlib.Path(__file__).with_name("client.mjs"))], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "alice is bbmpim://user/id/0",
        'started chat 1 "Lunch"',
        "sent message 2 Sent",
        "  1 Join ",
        "  2 Text Noon?",
        "refused: InvalidParameter unknown field 'misspelled'",
    ]
