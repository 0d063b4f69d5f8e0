"""The search index is derived data, kept beside the store and refilled from it.

It may lose its tail in a crash (it is written after the commit, by a thread of its own,
and synced less often than the store): a search must then answer from the store's truth,
never from what the index remembers. And refilling it from a long history of long
messages holds a page of their text at a time, not the history."""
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

from chatcore_harness import Client, auth, line, start_socket_server
from conftest import BOUND_SCALE, chatcore_binary

INDEX_FILES = ("search.sqlite", "search.sqlite-wal", "search.sqlite-shm")


def run(data_dir, *requests):
    """One run of `chatcore serve --user alice` over standard input; its events."""
    given = "".join(json.dumps(request) + "\n" for request in requests)
    done = subprocess.run([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data_dir], input=given.encode(),
                          capture_output=True, timeout=120 * min(BOUND_SCALE, 5))
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return [json.loads(line) for line in done.stdout.splitlines()]


def found(events, cookie):
    result = next(e["searchResult"] for e in events if "searchResult" in e and e["searchResult"]["cookie"] == cookie)
    return [key["messageId"] for key in result["messages"]]


def test_a_recall_the_index_lost_is_still_not_found():
    with tempfile.TemporaryDirectory() as data_dir, tempfile.TemporaryDirectory() as kept:
        events = run(data_dir,
                     {"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "plans"}},
                     {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "the launch code is swordfish", "cookie": "s1"}},
                     {"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "a swordfish for dinner", "cookie": "s2"}},
                     {"search": {"cookie": "before", "text": "swordfish"}})
        assert found(events, "before") == ["3", "2"]
        # The index as it was before the recall: what a crash that lost its tail leaves.
        for name in INDEX_FILES:
            if os.path.exists(os.path.join(data_dir, name)):
                shutil.copy(os.path.join(data_dir, name), kept)
        events = run(data_dir, {"chatMessageDestroy": {"chatId": "1", "messageId": "2"}}, {"search": {"cookie": "after", "text": "swordfish"}})
        assert found(events, "after") == ["3"]
        for name in INDEX_FILES:
            if os.path.exists(os.path.join(data_dir, name)):
                os.unlink(os.path.join(data_dir, name))
            if os.path.exists(os.path.join(kept, name)):
                shutil.copy(os.path.join(kept, name), data_dir)

        events = run(data_dir,
                     {"search": {"cookie": "stale", "text": "swordfish"}},
                     {"search": {"cookie": "words", "text": "launch code"}},
                     {"requestListElements": {"type": "chatMessage", "cookie": "m", "elements": [{"chatId": "1", "messageId": "2"}]}})
        assert found(events, "stale") == ["3"]
        assert found(events, "words") == []
        # The message itself says it was recalled, with nothing of its text.
        message = next(e["listChunk"]["elements"][0] for e in events if "listChunk" in e and e["listChunk"].get("cookie") == "m")
        assert message.get("recall") == "Recalled" and "content" not in message


def remove_index(data_dir):
    for name in INDEX_FILES:
        if os.path.exists(os.path.join(data_dir, name)):
            os.unlink(os.path.join(data_dir, name))


def test_refilling_the_index_holds_a_page_of_text_not_the_history():
    """1,000 messages of 71 KB (71 MB of text), then the index is lost: the next start
    refills it from the store. A page of 10,000 entries was bounded by their number only,
    so the whole history was one page (254 MB peak at 3,000 such messages); now a page is
    8 MB of text at most."""
    text = "lorem ipsum " * 5900  # 70,800 bytes
    with tempfile.TemporaryDirectory() as data_dir:
        run(data_dir, {"chatStart": {"cookie": "start", "invitees": [{"userId": "bob"}], "subject": "long"}},
            *[{"chatMessageSend": {"chatId": "1", "tag": "Text", "content": text + f"tail{n}"}} for n in range(1000)])
        remove_index(data_dir)
        server = subprocess.Popen([chatcore_binary(), "serve", "--user", "alice", "--data-dir", data_dir],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        # A search waits for the refill: once it is answered, the refill is done.
        server.stdin.write(b'{"search":{"cookie":"q","text":"ipsum tail999"}}\n')
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
        peak = next(int(line.split()[1]) // 1024 for line in open(f"/proc/{server.pid}/status") if line.startswith("VmHWM:"))
        server.stdin.close()
        assert server.wait(timeout=60) == 0
        assert [key["messageId"] for key in answer["searchResult"]["messages"]] == ["1001"]
        assert peak < 80 * BOUND_SCALE, f"{peak} MB at the peak of the refill"


def test_a_search_beside_a_session_sending_without_pause_is_answered_while_it_sends():
    """The index is written behind the commits, by a thread of its own. A search waited
    until it had nothing left to write: beside a session sending without pause, that was
    when the sends stopped (here: after the last of them). It waits now for what was
    handed to the index before it, and still finds what was said before it."""
    sends = 20_000
    with tempfile.TemporaryDirectory() as data_dir:
        path = os.path.join(data_dir, "chatcore.sock")
        server = start_socket_server(data_dir, path)
        writer, searcher = Client(path), Client(path)
        try:
            auth(writer, "alice")
            auth(searcher, "bob")
            searcher.request({"chatStart": {"cookie": "start", "invitees": [{"userId": "carol"}], "subject": "plans"}})
            searcher.request({"chatMessageSend": {"chatId": "1", "tag": "Text", "content": "the launch code is swordfish", "cookie": "said"}})
            writer.request({"chatStart": {"cookie": "start", "invitees": [{"userId": "dave"}], "subject": "a flood"}})
            # Texts of 80 words: the index takes longer over each than the send does.
            lines = b"".join(line({"chatMessageSend": {"chatId": "2", "tag": "Text", "content": f"filler {n} " + " ".join(
                f"w{(n * 7919 + k * 104729) % 100_000}" for k in range(80))}}) for n in range(sends))
            threading.Thread(target=writer.sock.sendall, args=(lines,), daemon=True).start()

            counted = {"events": 0, "sent": 0}

            def sent():
                """The writer's messages announced so far (each after its commit, `Sent`)."""
                events = writer.all[counted["events"]:]
                counted["events"] += len(events)
                counted["sent"] += sum(sum(1 for element in event["listAdd"]["elements"] if element.get("tag") == "Text")
                                       for event in events if event.get("listAdd", {}).get("type") == "chatMessage")
                return counted["sent"]

            deadline = time.time() + 120
            while sent() == 0 and time.time() < deadline:
                time.sleep(0.01)
            assert sent() > 0, "the writer's sends were not answered"
            answer = searcher.request({"search": {"cookie": "q", "text": "swordfish"}})
            sent_when_answered = sent()
            result = next(event["searchResult"] for event in answer if "searchResult" in event)
            assert [key["messageId"] for key in result["messages"]] == ["2"]  # after the chat's Join
            assert sent_when_answered < sends, "the search was answered only once the sends stopped"
            writer.next_event(lambda event: "filler %d " % (sends - 1) in json.dumps(event), timeout=300)
        finally:
            writer.close()
            searcher.close()
            server.terminate()
            server.wait(timeout=60)
