"""A commit that loses to another node's. Each chat has a version in the database
(`chat_version`); every commit moves on the versions of the chats it changes from the ones
its decisions were made on, and a commit that finds one moved on is decided again on what
the database has then, instead of being answered Internal. "Another node" here is SQL run
beside the node, committing what a second deciding node would."""
import pytest

from conftest import chat_with_bob, user_on
from postgres_cluster import postgres_bin

pytestmark = pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")


def send(client, chat, content, cookie):
    """chatMessageSend; returns (the message ids of the chatMessage listAdds, the requestFailed answers)."""
    events = client.request({"chatMessageSend": {"chatId": chat, "tag": "Text", "content": content, "cookie": cookie}})
    added = [element["messageId"] for event in events if "listAdd" in event and event["listAdd"]["type"] == "chatMessage"
             for element in event["listAdd"]["elements"] if element["tag"] == "Text"]
    return added, [event for event in events if "requestFailed" in event]


def chat_element(client, chat):
    events = client.request({"requestListElements": {"type": "chat", "cookie": "e", "elements": [{"chatId": chat}]}})
    return next(event["listChunk"]["elements"][0] for event in events if "listChunk" in event)


def texts(client, chat):
    events = client.request({"requestListMatching": {"type": "chatMessage", "cookie": "w", "criteria": {"chatId": chat},
                                                     "window": {"messageId": 1, "before": 0, "after": 20}}})
    return [(element["messageId"], element.get("content")) for event in events if "listChunk" in event
            for element in event["listChunk"]["elements"] if element["tag"] == "Text"]


def test_a_send_into_a_chat_another_node_moved_on_is_decided_again_on_what_the_database_has(cluster, scratch):
    cluster.create_database("v")
    with user_on(cluster, "v", scratch) as alice:
        chat = chat_with_bob(alice, "versions")
        assert send(alice, chat, "one", "1") == (["2"], [])

        # Another node commits message 3 (and with it the chat's last message and version).
        cluster.psql(f"""
            BEGIN;
            INSERT INTO message (chat, id, sender, tag, content, "timestamp", "isControl", "neverCountsUnread", "isRecalled", "changeSeq", "searchRow")
                SELECT chat, 3, sender, tag, 'from another node', "timestamp", false, false, false, "changeSeq", 0 FROM message WHERE chat = {chat} AND id = 2;
            UPDATE chat SET "lastMessage" = 3 WHERE "number" = {chat};
            UPDATE chat_version SET version = version + 1 WHERE chat = {chat};
            COMMIT;
            """, database="v")
        # This node decided id 3 on what it had: its commit conflicts, and the send is
        # decided again, taking 4. Not Internal, not a duplicate key.
        assert send(alice, chat, "two", "2") == (["4"], [])
        assert texts(alice, chat) == [("2", "one"), ("3", "from another node"), ("4", "two")]

        # Another node renames the chat: no key of this node's next commit collides, only
        # the chat's version tells. The send is decided again on the chat as the database
        # has it.
        cluster.psql(f"""
            BEGIN;
            UPDATE chat SET subject = 'renamed on another node' WHERE "number" = {chat};
            UPDATE chat_version SET version = version + 1 WHERE chat = {chat};
            COMMIT;
            """, database="v")
        assert send(alice, chat, "three", "3") == (["5"], [])
        assert chat_element(alice, chat)["subject"] == "renamed on another node"
        # Made (1), "one", the other node's message, "two" (once: its conflicting commit
        # applied nothing), the rename, "three".
        assert cluster.psql(f"SELECT version FROM chat_version WHERE chat = {chat}", database="v").strip() == "6"


def test_a_store_from_before_chat_versions_gets_them(cluster, scratch):
    """The migration gives every chat a version: a node started on an older store decides on them."""
    cluster.create_database("m")
    with user_on(cluster, "m", scratch) as alice:
        chat = chat_with_bob(alice, "before")
    cluster.psql("""
        DROP TABLE chat_version; DROP FUNCTION chatcore_claim(bigint[], bigint[]);
        DELETE FROM chatcore_migration WHERE name = 'v6-chat-versions';
        """, database="m")
    with user_on(cluster, "m", scratch) as alice:
        assert cluster.psql(f"SELECT version FROM chat_version WHERE chat = {chat}", database="m").strip() == "1"
        assert send(alice, chat, "after the migration", "1") == (["2"], [])
        assert cluster.psql(f"SELECT version FROM chat_version WHERE chat = {chat}", database="m").strip() == "2"
