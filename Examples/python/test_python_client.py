"""Drives the Python example against the real binary."""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from chatcore_client import ChatcoreClient  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("CHATCORE_BINARY", str(ROOT / ".build" / "debug" / "chatcore"))


def test_the_python_client_spawns_chatcore_and_talks_to_it():
    client = ChatcoreClient("alice", binary=BINARY)
    identities = client.request("identitiesGet", {"appUserIds": ["alice", "nobody"]})
    assert identities["identities"]["info"][0]["uri"] == "bbmpim://user/id/0"  # yourself, in your own view
    # A list answer opens with its header; the chunks follow, the final one "last".
    assert client.request("requestListAll", {"type": "global"}) == {"listAll": {"type": "global", "cookie": "py2"}}
    chunk = client.receive()["listChunk"]
    assert chunk["last"] is True
    assert [element["name"] for element in chunk["elements"]] == ["authTokenState", "setupState", "localUri", "localRegId", "endpointId"]
    failed = client.request("chatMessageSend", {"chatId": "1", "tag": "Text", "oops": True})
    assert failed["requestFailed"]["reason"] == "unknown field 'oops'"
    assert client.close() == 0
