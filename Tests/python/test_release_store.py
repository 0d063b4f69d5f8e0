"""A store written by the release before the store redesign (Tests/StoreFixtures/release-0.2,
made by make_release_store.py with that release's binary) opens with today's chatcore and
answers every read of `answers.ndjson` exactly as that release did: chats, participants,
users, windows, threads, references, attachments, the change feed, states, search,
endpoints and globals."""
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from conftest import chatcore_binary

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "StoreFixtures" / "release-0.2"
spec = importlib.util.spec_from_file_location("make_release_store", FIXTURE.parent / "make_release_store.py")


def load_reads():
    # The maker reads CHATCORE_BINARY and an output path at import: give it harmless ones.
    import sys
    saved = sys.argv, os.environ.get("CHATCORE_BINARY")
    sys.argv = ["make_release_store.py", "/nonexistent"]
    os.environ["CHATCORE_BINARY"] = chatcore_binary()
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.argv = saved[0]
        if saved[1] is None:
            del os.environ["CHATCORE_BINARY"]
        else:
            os.environ["CHATCORE_BINARY"] = saved[1]
    return module


# Fields of list elements added since that release, by list, with the value each element
# of a store written by it has (from the element): checked, then left out of the comparison.
ADDED_SINCE = {
    "chat": {
        "numUnreadMentions": lambda chat: 0,
        # The migration's policy: admins pin in a group, both in a one-to-one chat.
        "pinPolicy": lambda chat: "ParticipantsOnly" if "O" in chat["flags"] else "AdminsOnly",
    },
}


def since_then(event):
    """Checks and removes from `event`'s elements the fields added since the release."""
    name, body = next(iter(event.items()))
    added = ADDED_SINCE.get(body.get("type"), {}) if isinstance(body, dict) else {}
    whole = name in ("listAdd", "listChunk")  # whole elements have every field; changes only what changed
    for element in body.get("elements", []) if added else []:
        for field, value in added.items():
            if whole or field in element:
                assert element.pop(field) == value(element), f"{field} of {element}"


def test_a_store_of_the_previous_release_is_answered_as_that_release_answered():
    maker = load_reads()
    expected = [json.loads(line) for line in (FIXTURE / "answers.ndjson").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "data")
        shutil.copytree(FIXTURE / "data", data)
        files = os.path.join(scratch, "files")
        os.makedirs(files)
        answers = maker.record(data, files)
    assert len(answers) == len(expected)
    for got in answers:
        since_then(got["event"])
    for got, want in zip(answers, expected):
        assert got == want, f"{want['user']} {json.dumps(want['request'])}:\n  expected {json.dumps(want['event'])}\n  got      {json.dumps(got['event'])}"
