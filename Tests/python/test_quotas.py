"""What one user may cost the others, tried over the wire: chats started, users made by
invitations, chat events, requests per second and searches are bounded per user; each
refusal is a requestFailed RateLimited that names the limit (and its flag) and says when
to retry, counted in the metrics; a search that would cost more than its bound answers
what it found, marked incomplete; another user's sends go on meanwhile."""
import json
import os
import re
import subprocess
import tempfile
import threading
import time

from chatcore_harness import Client, auth, scrape
from conftest import BOUND_SCALE, chatcore_binary


def serve(work, *arguments):
    path = os.path.join(work, "s")
    process = subprocess.Popen([chatcore_binary(), "serve", "--data-dir", os.path.join(work, "d"), "--listen", "unix:" + path,
                                "--insecure-no-auth", "--metrics", "127.0.0.1:0", *arguments],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    for line in process.stderr:
        if "serving metrics" in line:
            port = int(re.search(r"port=(\d+)", line).group(1))
        if "listening" in line:
            break
    threading.Thread(target=process.stderr.read, daemon=True).start()
    return process, path, port


def failure(events):
    return next((e["requestFailed"] for e in events if "requestFailed" in e), None)


def refusals_of(client, requests):
    """Sends `requests` at once; the requestFailed answers they got."""
    client.send(*requests, {"identitiesGet": {"cookie": "end", "appUserIds": ["x"]}})
    return [e["requestFailed"] for e in client.answer("end") if "requestFailed" in e]


def started(events):
    return next((e["listAdd"]["elements"][0]["chatId"] for e in events if e.get("listAdd", {}).get("type") == "chat"), None)


def test_a_user_starting_chats_and_making_users_without_end_is_refused_and_others_go_on():
    with tempfile.TemporaryDirectory() as work:
        process, path, port = serve(work)
        try:
            bob = Client(path)
            auth(bob, "bob")
            carol = Client(path)
            auth(carol, "carol")
            chat = started(bob.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "carol"}], "subject": "ours"}}))
            mallory = Client(path)
            auth(mallory, "mallory")
            # 249 new invitees a request: four fit the minute's 1,000 new users.
            refused = None
            for n in range(10):
                invitees = [{"userId": f"made-{n}-{i}"} for i in range(249)]
                answer = mallory.request({"chatStart": {"cookie": f"m{n}", "invitees": invitees, "subject": "spam"}})
                refused = failure(answer)
                if refused:
                    break
            assert refused and refused["error"] == "RateLimited", refused
            assert "--max-new-users-per-minute" in refused["reason"] and refused["retryAfterMs"] > 0, refused
            assert n == 4, f"refused after {n} requests"
            # Chats with users that exist: the minute's 60 chats, then refused.
            for n in range(70):
                answer = mallory.request({"chatStart": {"cookie": f"k{n}", "invitees": [{"userId": "bob"}], "subject": "again"}})
                refused = failure(answer)
                if refused:
                    break
            assert refused["error"] == "RateLimited" and "--max-chats-per-minute" in refused["reason"], refused
            assert 50 <= n <= 61, n
            # Bob's sends go on, answered at once.
            for n in range(20):
                started_at = time.monotonic()
                sent = bob.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": f"hi {n}", "cookie": f"s{n}"}})
                assert failure(sent) is None
                assert time.monotonic() - started_at < 1
            metrics = scrape(port)
            assert metrics[("chatcore_quota_refusals_total", frozenset({("quota", "newUsers")}))] >= 1
            assert metrics[("chatcore_quota_refusals_total", frozenset({("quota", "chats")}))] >= 1
        finally:
            process.terminate()
            process.wait(timeout=60)


def test_typing_and_chat_events_without_end_are_refused():
    with tempfile.TemporaryDirectory() as work:
        process, path, _ = serve(work, "--max-events-per-second", "5")
        try:
            alice = Client(path)
            auth(alice, "alice")
            chat = started(alice.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "t"}}))
            refusals = refusals_of(alice, [{"chatTyping": {"chatId": chat, "cookie": f"t{n}"}} for n in range(60)])
            assert len(refusals) == 10, len(refusals)  # a burst of ten seconds' worth passes
            assert all(r["error"] == "RateLimited" and "--max-events-per-second" in r["reason"] for r in refusals)
        finally:
            process.terminate()
            process.wait(timeout=60)


def test_requests_past_the_rate_of_one_user_are_refused_and_another_user_is_served():
    with tempfile.TemporaryDirectory() as work:
        process, path, _ = serve(work, "--max-requests-per-second", "20")
        try:
            alice = Client(path)
            auth(alice, "alice")
            refusals = refusals_of(alice, [{"identitiesGet": {"cookie": f"i{n}", "appUserIds": ["alice"]}} for n in range(400)])
            assert 150 < len(refusals) < 400, len(refusals)
            assert "--max-requests-per-second" in refusals[0]["reason"]
            bob = Client(path)
            auth(bob, "bob")
            assert "identities" in bob.request({"identitiesGet": {"cookie": "b", "appUserIds": ["bob"]}})[-1]
        finally:
            process.terminate()
            process.wait(timeout=60)


def test_a_search_that_would_cost_more_than_its_bound_answers_what_it_found():
    """A query of 1,022 `a` and `bb` over messages of 70,000 `a` compared at every start
    (1.56 s of CPU for 20 messages in a release build); now matching is linear and each
    search checks at most --max-search-candidates and --max-search-bytes."""
    with tempfile.TemporaryDirectory() as work:
        process, path, _ = serve(work, "--max-search-bytes", str(1 << 20))
        try:
            alice = Client(path)
            auth(alice, "alice")
            chat = started(alice.request({"chatStart": {"cookie": "c", "invitees": [{"userId": "bob"}], "subject": "long"}}))
            long = "abb" + "a" * 70_000
            alice.send(*[{"chatMessageSend": {"chatId": chat, "tag": "Text", "content": long, "cookie": f"l{n}"}} for n in range(40)])
            alice.answer("l39")
            started_at = time.monotonic()
            found = alice.request({"search": {"cookie": "q", "text": "a" * 1022 + "bb"}})[-1]["searchResult"]
            took = time.monotonic() - started_at
            # 40 candidates of 70 KB: past the 1 MiB bound after 14 of them.
            assert found["messages"] == [] and found.get("incomplete") is True, found
            # Under a sanitizer everything is slower (BOUND_SCALE): TSan took 6.7 s.
            assert took < 5 * BOUND_SCALE, took
            found = alice.request({"search": {"cookie": "r", "text": "abba"}})[-1]["searchResult"]
            assert found.get("incomplete") is True
            # A search within its bound says nothing of the kind.
            alice.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": "a short one", "cookie": "s"}})
            found = alice.request({"search": {"cookie": "t", "text": "short one"}})[-1]["searchResult"]
            assert len(found["messages"]) == 1 and "incomplete" not in found, found
        finally:
            process.terminate()
            process.wait(timeout=60)
