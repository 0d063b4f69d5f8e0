"""Every value a request may carry, at the ends of what its schema allows (see
extremes.py): sent by a user with a chat holding a few messages, each must be answered
without the service dying, and never with `Internal` (that would be a fault of chatcore,
not of the request).
"""
import json
import os
import queue
import tempfile

import pytest

from chatcore_harness import Client, auth, start_socket_server
from extremes import sweep


@pytest.mark.parametrize("sender", ["alice", "bob"])
def test_values_at_their_ends_are_answered_and_never_kill_the_service(sender):
    """Sent by the chat's admin (alice) and by a participant who is not (bob)."""
    lines = sweep()
    assert len(lines) > 100, "the sweep lost its requests"
    assert any("window" in json.dumps(line) for line in lines)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "s")
        process = start_socket_server(directory, path)
        try:
            client = Client(path)
            auth(client, "alice")
            client.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "numbers"}})
            for n in range(3):
                client.request({"chatMessageSend": {"cookie": f"m{n}", "chatId": "1", "tag": "Text", "content": f"m{n}"}})
            if sender == "bob":
                client.close()
                client = Client(path)
                auth(client, "bob")
            internal = []
            served = set()
            for number, message in enumerate(lines):
                name = next(iter(message))
                if isinstance(message[name], dict):
                    message[name]["cookie"] = f"x{number}"
                client.send(message)
                # The end marker: answered after everything before it.
                client.send({"requestListAll": {"type": "global", "cookie": f"end{number}"}})
                try:
                    events = client.answer(f"end{number}", timeout=10)
                except queue.Empty:
                    raise AssertionError(f"no answer to {json.dumps(message)} (chatcore: {process.poll()})") from None
                internal += [(message, e) for e in events if "requestFailed" in e and e["requestFailed"]["error"] == "Internal"]
                if not any("requestFailed" in e for e in events):
                    served.add(name)
            assert internal == []
            # The sweep reached the engine, not only the decoder.
            assert {"requestListMatching", "requestListElements", "chatMessageSend", "chatMessageRead", "chatLeave"} <= served, served
            client.close()
        finally:
            process.terminate()
            assert process.wait(timeout=30) == 0
