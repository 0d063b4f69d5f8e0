"""One version: the binary's, the clients', and the changelog's newest."""
import json
import re
import subprocess
import tomllib

from conftest import ROOT, chatcore_binary


def test_the_binary_the_clients_and_the_changelog_agree_on_the_version():
    binary = subprocess.run([chatcore_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    python = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())["project"]["version"]
    node = json.loads((ROOT / "clients" / "typescript" / "package.json").read_text())["version"]
    changelog = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert binary == python == node == changelog, (binary, python, node, changelog)
