"""Every error text the documentation quotes is what the binary says.

- Each `requestFailed` / `setupError` / `chatStartFailed` line in a document's examples is
  checked by sending the request shown before it to the binary: same error, same reason.
- Each error phrase quoted in prose ("already recalled", "the store is damaged (quick_check:
  …)") is a text the service's sources write (… stands for what varies).
"""
import json
import pathlib
import re
import subprocess
import tempfile

import pytest

from conftest import ROOT, chatcore_binary

DOCUMENTS = [ROOT / "README.md", ROOT / "Examples" / "netcat.md", ROOT / "Schemas" / "protocol.md",
             ROOT / "clients" / "python" / "README.md", ROOT / "clients" / "typescript" / "README.md"] + sorted(
    page for page in (ROOT / "docs").glob("*.md") if page.name != "protocol.md")
FAILURES = ("requestFailed", "setupError", "chatStartFailed")


def documented_failures():
    """(document, request line, failure event) for each failure shown after its request."""
    found = []
    for document in DOCUMENTS:
        last_request = None
        for line in document.read_text().splitlines():
            match = re.match(r"^\s*(?:\w+)?([<>]) (.*?)\s*$", line)
            if not match:
                continue
            direction, text = match.groups()
            if direction == ">":
                last_request = text
                continue
            if not text.startswith("{"):
                continue
            event = json.loads(text)
            name = next(iter(event))
            if name in FAILURES and last_request is not None and "authToken" not in last_request:
                found.append(pytest.param(last_request, event, id=f"{document.name}:{name}:{len(found)}"))
    return found


@pytest.mark.parametrize("request_line,expected", documented_failures())
def test_a_documented_failure_is_what_the_binary_answers(request_line, expected):
    with tempfile.TemporaryDirectory() as data:
        # The request in a session where chat 1 exists, as in the documents' examples.
        setup = json.dumps({"chatStart": {"cookie": "setup", "invitees": [{"userId": "bob"}], "subject": "s"}})
        done = subprocess.run([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                              input=(setup + "\n" + request_line + "\n").encode(), capture_output=True, timeout=60)
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    name = next(iter(expected))
    got = [a[name] for a in answers if name in a]
    assert got, f"no {name} for {request_line}: {answers}"
    for field in ("error", "reason", "detail", "request"):
        assert got[-1].get(field) == expected[name].get(field), field


def quoted_phrases():
    phrases = []
    for document in DOCUMENTS + [ROOT / "docs" / "protocol.md"]:
        text = re.sub(r"\s*\n\s*", " ", document.read_text())
        for pattern in (r'`\w+` \("([^"]+)"\)', r'exits? 1 with "([^"]+)"', r'\(exit 1, "([^"]+)"\)', r'refused: "([^"]+)"'):
            phrases += [pytest.param(p, id=p[:40]) for p in re.findall(pattern, text)]
    return phrases


SOURCES = "\n".join(path.read_text() for path in (ROOT / "Sources").rglob("*.swift"))


def test_the_documents_quote_error_phrases():
    assert len(quoted_phrases()) >= 4


@pytest.mark.parametrize("phrase", quoted_phrases())
def test_a_quoted_error_phrase_is_written_by_the_service(phrase):
    parts = [part.strip() for part in phrase.split("…") if part.strip()]
    for part in parts:
        assert part in SOURCES, f"'{part}' is not a text the service writes"
