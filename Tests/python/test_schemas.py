"""Schemas/ is valid JSON Schema 2020-12 and agrees with the service."""
import json
import pathlib
import re
import subprocess
import tempfile

import pytest
from jsonschema import Draft202012Validator

import schemas
from conftest import ROOT, chatcore_binary

DOCS = schemas.load_all()


@pytest.mark.parametrize("name", sorted(DOCS))
def test_schema_is_valid_2020_12(name):
    doc = DOCS[name]
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(doc)


def test_the_message_sets_are_complete():
    assert len(DOCS["request.json"]["properties"]) == 38
    # endpointDeregistered is chatcore's word for the session whose endpoint was removed.
    assert len(DOCS["event.json"]["properties"]) == 21


def placeholder_error(error):
    """True when the error is about a fixture placeholder ("$any", "${...}"), not a real value."""
    return isinstance(error.instance, str) and error.instance.startswith("$")


FIXTURES = sorted((ROOT / "Tests" / "Fixtures").rglob("*.transcript"))


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_every_expected_event_matches_the_event_schema(fixture):
    validator = schemas.validator("event.json", DOCS)
    checked = 0
    for number, line in enumerate(fixture.read_text().splitlines(), 1):
        match = re.match(r"^(\S+)< (.*)$", line)
        if not match:
            continue
        event = json.loads(match.group(2))
        errors = [e for e in validator.iter_errors(event) if not placeholder_error(e)]
        # oneOf failures report on the whole list; look inside them for real problems.
        real = [e for e in errors if not (e.validator == "oneOf" and all(placeholder_error(c) for c in e.context if c.validator != "const"))]
        assert not real, f"{fixture.name}:{number}: {real[0].message}"
        checked += 1
    if checked == 0:
        assert "!fails" in fixture.read_text(), "a transcript with nothing to check"


def test_what_the_service_writes_matches_the_event_schema():
    validator = schemas.validator("event.json", DOCS)
    requests = [
        {"identitiesGet": {"cookie": "1", "appUserIds": ["alice"]}},
        {"requestListAll": {"type": "global", "cookie": "2"}},
        {"requestListAll": {"type": "user"}},
        {"requestListElements": {"type": "user", "elements": [{"uri": "bbmpim://user/id/1"}, {"uri": "x"}]}},
        {"chatMessageSend": {"chatId": "1", "tag": "Text", "bogus": 1}},
        "not json",
    ]
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in requests) + "\n"
    with tempfile.TemporaryDirectory() as data:
        out = subprocess.run([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data],
                             input=text.encode(), capture_output=True, timeout=60, check=True).stdout.decode()
    lines = out.splitlines()
    assert len(lines) >= len(requests)
    for line in lines:
        errors = list(validator.iter_errors(json.loads(line)))
        assert not errors, f"{line}: {errors[0].message}"


def test_generated_code_is_up_to_date():
    # A tree built only for a sanitizer (.build-tsan) has no codegen here; `make test`
    # checks the generated files itself (check-generated) before any of this runs.
    if not (ROOT / ".build" / "debug" / "chatcore-codegen").exists():
        pytest.skip("chatcore-codegen is not built in .build")
    result = subprocess.run(["swift", "run", "--skip-build", "chatcore-codegen", "--check", "Schemas", "Sources/ChatProtocol/Generated"],
                            cwd=ROOT, capture_output=True, text=True)
    if "error: no executable product" in result.stderr or "--skip-build" in result.stderr:
        pytest.skip("chatcore-codegen is not built")
    assert result.returncode == 0, result.stdout + result.stderr
