"""Presence, moderation and blocking over real sockets, as users see them: presence only
for chat peers, hidden when asked, and not flooded by a connection that comes and goes; a
mute that ends while the service is down ends when it is back; a ban and a block that hold
across a SIGKILL. (The transcripts identity/presence, identity/blocking and
chats/mute-and-ban show every event of the ordinary cases.)"""
import os
import signal
import tempfile
import time

from chatcore_harness import Client, auth, body, start_socket_server
from test_quotas import failure


def chat_with(client, invitees, subject="s"):
    answer = client.request({"chatStart": {"cookie": "start", "invitees": [{"userId": u} for u in invitees], "subject": subject}})
    return next(body(e) for e in answer if "listAdd" in e)["elements"][0]["chatId"]


def uri_of(client, user):
    answer = client.request({"identitiesGet": {"cookie": "who", "appUserIds": [user]}})
    return next(body(e) for e in answer if "identities" in e)["info"][0]["uri"]


def presence_changes(client, uri):
    """What `client` was told of `uri`'s presence so far, in order."""
    return [(element.get("online"), element.get("lastActive")) for event in client.all
            if event.get("listChange", {}).get("type") == "user"
            for element in event["listChange"]["elements"] if element["uri"] == uri and "online" in element]


def act(client, request):
    """Sends a request that is answered only by events (or a failure), then a sync: the
    events up to the sync."""
    client.send(request, {"identitiesGet": {"cookie": "sync", "appUserIds": ["x"]}})
    return client.answer("sync")[:-1]


def connected(path, user):
    client = Client(path)
    auth(client, user)
    return client


def participants_of(client):
    listed = client.request({"requestListAll": {"cookie": "p", "type": "chatParticipant"}})
    return [element for e in listed if "listChunk" in e for element in body(e)["elements"]]


def test_presence_is_seen_only_by_chat_peers_and_not_when_hidden():
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "s")
        process = start_socket_server(os.path.join(work, "d"), path)
        try:
            alice, bob, carol = connected(path, "alice"), connected(path, "bob"), connected(path, "carol")
            chat_with(alice, ["bob"])
            bob_uri = uri_of(carol, "bob")  # carol knows bob by id, shares no chat with him
            time.sleep(1.5)  # everyone connected is shown so
            for client in (alice, carol):
                act(client, {"presenceSet": {"cookie": "w", "watch": True}})
            assert [online for online, _ in presence_changes(alice, bob_uri)] == [True]
            bob.close()
            deadline = time.time() + 15
            while len(presence_changes(alice, bob_uri)) < 2 and time.time() < deadline:
                time.sleep(0.1)
            assert [online for online, _ in presence_changes(alice, bob_uri)] == [True, False]
            listed = carol.request({"requestListElements": {"cookie": "u", "type": "user", "elements": [{"uri": bob_uri}]}})
            element = next(body(e) for e in listed if "listChunk" in e)["elements"][0]
            assert "online" not in element and "lastActive" not in element, "a user known only by id is not a peer"
            assert presence_changes(carol, bob_uri) == []
            # alice hides: dave, her peer, no longer sees her; she sees nobody's.
            dave = connected(path, "dave")
            chat_with(dave, ["alice"])
            act(dave, {"presenceSet": {"cookie": "w", "watch": True}})
            alice_uri = uri_of(dave, "alice")
            assert presence_changes(dave, alice_uri)[-1][0] is True
            act(alice, {"presenceSet": {"cookie": "h", "hidden": True}})
            dave.request({"identitiesGet": {"cookie": "sync", "appUserIds": ["alice"]}})
            assert presence_changes(dave, alice_uri)[-1] == (None, None)
            # Her own watching session is told at once that she sees nobody's: bob's too, who
            # is connected nowhere.
            assert presence_changes(alice, bob_uri)[-1] == (None, None)
            listed = alice.request({"requestListAll": {"cookie": "all", "type": "user"}})
            elements = [element for e in listed if "listChunk" in e for element in body(e)["elements"]]
            assert len(elements) == 3 and not any("online" in element for element in elements)
            # Kept: after a restart she is still hidden.
            for client in (carol, dave, alice):
                client.close()
            process.send_signal(signal.SIGKILL)
            process.wait()
            process = start_socket_server(os.path.join(work, "d"), path)
            dave = connected(path, "dave")
            answer = act(dave, {"presenceSet": {"cookie": "w", "watch": True}})
            assert presence_changes(dave, alice_uri) == [(None, None)], answer
        finally:
            process.kill()
            process.wait()


def test_a_connection_that_comes_and_goes_does_not_flood_its_peers():
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "s")
        process = start_socket_server(os.path.join(work, "d"), path)
        try:
            alice, bob = connected(path, "alice"), connected(path, "bob")
            chat_with(alice, ["bob"])
            bob_uri = uri_of(alice, "bob")
            time.sleep(1.5)
            act(alice, {"presenceSet": {"cookie": "w", "watch": True}})
            bob.close()
            # 40 connections of bob's, each gone at once, for two seconds.
            for _ in range(40):
                flapping = connected(path, "bob")
                flapping.close()
                time.sleep(0.05)
            time.sleep(5)
            changes = presence_changes(alice, bob_uri)
            assert len(changes) <= 3, changes
            assert changes[-1][0] is False, "he is gone at the end, and shown so"
        finally:
            process.kill()
            process.wait()


def test_a_mute_that_ended_while_the_service_was_down_ends_when_it_is_back_and_a_ban_holds():
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "s")
        process = start_socket_server(os.path.join(work, "d"), path)
        try:
            alice, bob, carol = connected(path, "alice"), connected(path, "bob"), connected(path, "carol")
            chat = chat_with(alice, ["bob", "carol"])
            bob_uri, carol_uri = uri_of(alice, "bob"), uri_of(alice, "carol")
            until = int(time.time()) + 2
            assert failure(act(alice, {"participantMute": {"cookie": "m", "chatId": chat, "userUri": bob_uri, "until": until}})) is None
            assert failure(act(alice, {"participantBan": {"cookie": "b", "chatId": chat, "userUri": carol_uri}})) is None
            refused = failure(act(bob, {"chatMessageSend": {"cookie": "s1", "chatId": chat, "tag": "Text", "content": "x"}}))
            assert refused["error"] == "NotPermitted" and "muted" in refused["reason"]
            process.send_signal(signal.SIGKILL)
            process.wait()
            time.sleep(3)
            process = start_socket_server(os.path.join(work, "d"), path)
            alice, bob = connected(path, "alice"), connected(path, "bob")
            participants = participants_of(alice)
            assert [p["userUri"] for p in participants] == [bob_uri], "carol is banned: gone"
            deadline = time.time() + 10
            while "muted" in participants[0] and time.time() < deadline:
                time.sleep(0.1)
                participants = participants_of(alice)
            assert "muted" not in participants[0], participants
            assert failure(bob.request({"chatMessageSend": {"cookie": "s2", "chatId": chat, "tag": "Text", "content": "free"}})) is None
            refused = failure(act(bob, {"chatInvite": {"cookie": "i", "chatId": chat, "invitees": [{"userId": "carol"}]}}))
            assert refused["error"] == "NotPermitted" and "banned" in refused["reason"]
        finally:
            process.kill()
            process.wait()


def test_a_block_holds_across_a_kill_and_is_the_blockers_alone():
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "s")
        process = start_socket_server(os.path.join(work, "d"), path)
        try:
            alice, bob, carol = connected(path, "alice"), connected(path, "bob"), connected(path, "carol")
            chat = chat_with(alice, ["bob", "carol"])
            alice_uri = uri_of(bob, "alice")
            assert failure(act(bob, {"userBlock": {"cookie": "k", "userUri": alice_uri}})) is None
            process.send_signal(signal.SIGKILL)
            process.wait()
            process = start_socket_server(os.path.join(work, "d"), path)
            alice, bob, carol = connected(path, "alice"), connected(path, "bob"), connected(path, "carol")
            alice.request({"chatMessageSend": {"cookie": "a", "chatId": chat, "tag": "Text", "content": "hi"}})
            seen = {}
            for name, client in (("bob", bob), ("carol", carol)):
                added = client.next_event(lambda e: e.get("listAdd", {}).get("type") == "chatMessage")
                seen[name] = body(added)["elements"][0]
            assert seen["bob"].get("senderBlocked") is True and "senderBlocked" not in seen["carol"]
            answer = alice.request({"chatStart": {"cookie": "o", "invitees": [{"userId": "bob"}], "isOneToOne": True}})
            failed = next(body(e) for e in answer if "chatStartFailed" in e)
            assert failed["reason"] == "Blocked"
        finally:
            process.kill()
            process.wait()
