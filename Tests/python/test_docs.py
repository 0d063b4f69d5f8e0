"""The protocol reference is in the repository, covers every message, and nothing points outside."""
import re
import subprocess

import pytest

import schemas
from conftest import ROOT

DOCS = schemas.load_all()
REFERENCE = ROOT / "docs" / "protocol.md"


def tracked_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


@pytest.mark.parametrize("kind,message", [("request", m) for m in DOCS["request.json"]["properties"]]
                         + [("event", m) for m in DOCS["event.json"]["properties"]])
def test_every_message_is_in_the_reference(kind, message):
    text = REFERENCE.read_text()
    assert f'<a id="{kind}-{message.lower()}"></a>' in text
    section = text.split(f'<a id="{kind}-{message.lower()}"></a>', 1)[1].split("<a id=", 1)[0]
    assert f"### `{message}`" in section
    for field in DOCS[f"{kind}s/{message}.json"].get("properties", {}):
        assert f"| `{field}` |" in section, f"{message}.{field} is not documented"


def test_every_list_element_is_in_the_reference():
    text = REFERENCE.read_text()
    for name in sorted(n for n in DOCS if n.startswith("elements/")):
        assert f"### `{name[len('elements/'):-len('.json')]}`" in text


def test_nothing_in_the_repository_points_outside_it():
    outside = []
    for path in tracked_files():
        if path.suffix not in {".md", ".swift", ".py", ".json", ".mjs", ".ts", ".js", ".transcript", ".txt", ""} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if "../" + "shared" in text:
            outside.append(f"{path.relative_to(ROOT)}: a path into the directory beside the repository")
        if path.suffix == ".md":
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                    continue
                resolved = (path.parent / target.split("#")[0]).resolve()
                if not resolved.is_relative_to(ROOT.resolve()) or not resolved.exists():
                    outside.append(f"{path.relative_to(ROOT)}: {target}")
    assert outside == []
