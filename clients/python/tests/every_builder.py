"""Every request builder of `chatcore.protocol`, sent through `Client.request`, with the type
of each outcome asserted: `mypy --strict` checks the types (tests/test_typing.py), and
running it checks that the service answers each as the types say.

    PYTHONPATH=clients/python python3 clients/python/tests/every_builder.py
"""
import asyncio
from typing import Any, assert_type

from chatcore import ChatcoreError, Client, Server, protocol


async def refused(client: Client, message: protocol.RequestLine[Any]) -> str:
    """The error code of a request expected to be refused."""
    try:
        await client.request(message)
    except ChatcoreError as error:
        return error.error
    raise AssertionError(f"{message} was not refused")


async def main() -> None:
    async with Server.start() as server:
        async with Client.connect(server.address) as alice, server.connect("bob") as bob:
            globals_ = assert_type(await alice.request(protocol.auth_token(userId="alice", authToken="any")), dict[str, object])
            me = globals_["localUri"]
            identities = assert_type(await alice.request(protocol.identities_get(appUserIds=["bob"])), protocol.Identities)
            bob_uri = identities["info"][0]["uri"]  # as alice sees bob: uris are each viewer's own

            chat = assert_type(await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="Plans")), protocol.Chat)
            chat_id: str = chat["chatId"]
            sent = assert_type(await alice.request(protocol.chat_message_send(chatId=chat_id, tag="Text", content="hello")), protocol.ChatMessage)
            message_id: str = sent["messageId"]

            chats = assert_type(await alice.request(protocol.request_list_all(type="chat")), protocol.ListAnswer[protocol.Chat])
            assert [c["subject"] for c in chats["elements"]] == ["Plans"]
            users = assert_type(await alice.request(protocol.request_list_all(type="user")), protocol.ListAnswer[protocol.User])
            assert me in [u["uri"] for u in users["elements"]]
            assert_type(await alice.request(protocol.request_list_all(type="global")), protocol.ListAnswer[protocol.Global])
            assert_type(await alice.request(protocol.request_list_all(type="chatParticipant")), protocol.ListAnswer[protocol.ChatParticipant])
            assert_type(await alice.request(protocol.request_list_all(type="typing")), protocol.ListAnswer[protocol.Typing])
            assert await refused(alice, protocol.request_list_all(type="chatMessage")) == "InvalidParameter"

            assert_type(await alice.request(protocol.request_list_elements_global(elements=[{"name": "localUri"}])),
                        protocol.ListAnswer[protocol.Global])
            assert_type(await alice.request(protocol.request_list_elements_user(elements=[{"uri": bob_uri}])), protocol.ListAnswer[protocol.User])
            assert_type(await alice.request(protocol.request_list_elements_chat(elements=[{"chatId": chat_id}])), protocol.ListAnswer[protocol.Chat])
            participants = assert_type(
                await alice.request(protocol.request_list_elements_chat_participant(elements=[{"chatId": chat_id, "userUri": bob_uri}])),
                protocol.ListAnswer[protocol.ChatParticipant])
            assert participants["elements"][0]["state"] == "Joined"
            messages = assert_type(
                await alice.request(protocol.request_list_elements_chat_message(elements=[{"chatId": chat_id, "messageId": message_id}])),
                protocol.ListAnswer[protocol.ChatMessage])
            assert messages["elements"][0].get("content") == "hello"
            assert_type(await alice.request(protocol.request_list_elements_typing(elements=[{"chatId": chat_id, "userUri": bob_uri}])),
                        protocol.ListAnswer[protocol.Typing])

            window = assert_type(
                await alice.request(protocol.request_list_matching_chat_message(criteria={"chatId": chat_id}, window={"messageId": message_id, "before": 5})),
                protocol.ListAnswer[protocol.ChatMessage])
            assert window["elements"][-1]["messageId"] == message_id
            assert_type(await alice.request(protocol.request_list_matching_chat_participant(criteria={"chatId": chat_id})),
                        protocol.ListAnswer[protocol.ChatParticipant])
            assert_type(await alice.request(protocol.request_list_matching_chat(criteria={"keyState": "Synced"})), protocol.ListAnswer[protocol.Chat])
            assert_type(await alice.request(protocol.request_list_matching_user(criteria={"keyState": "Synced"})), protocol.ListAnswer[protocol.User])

            assert_type(await alice.request(protocol.request_list_change_chat(elements=[{"chatId": chat_id, "localData": {"pinned": True}}])), None)
            assert_type(await alice.request(protocol.request_list_change_chat_message(elements=[{"chatId": chat_id, "messageId": message_id,
                                                                                               "localData": {"starred": True}}])), None)
            changes = assert_type(await alice.request(protocol.request_list_changes(type="chatMessage", chatId=chat_id)), protocol.ListChanges)
            assert isinstance(changes["token"], str) and isinstance(changes["changed"], list)

            assert_type(await alice.request(protocol.chat_invite(chatId=chat_id, invitees=[{"userId": "carol"}])), None)
            carol = (await alice.request(protocol.identities_get(appUserIds=["carol"])))["info"][0]["uri"]
            assert_type(await alice.request(protocol.participant_promote(chatId=chat_id, userUri=bob_uri)), None)
            assert_type(await alice.request(protocol.participant_demote(chatId=chat_id, userUri=bob_uri)), None)
            assert_type(await alice.request(protocol.participant_remove(chatId=chat_id, userUri=carol)), None)
            assert_type(await alice.request(protocol.participant_mute(chatId=chat_id, userUri=bob_uri, until=4102444800)), None)
            assert_type(await alice.request(protocol.participant_mute(chatId=chat_id, userUri=bob_uri, unmute=True)), None)
            assert_type(await alice.request(protocol.participant_ban(chatId=chat_id, userUri=carol)), None)
            assert_type(await alice.request(protocol.user_block(userUri=carol)), None)
            assert_type(await alice.request(protocol.user_block(userUri=carol, unblock=True)), None)
            assert_type(await alice.request(protocol.presence_set(watch=True, hidden=False)), None)

            assert_type(await bob.request(protocol.chat_message_read(chatId=chat_id, messageId=message_id)), None)
            state = assert_type(await alice.request(protocol.chat_message_state_get(chatId=chat_id, messageId=message_id)),
                                protocol.ChatMessageStateEvent)
            assert state["states"][0]["state"] in ("Delivered", "Read")
            assert_type(await alice.request(protocol.chat_typing(chatId=chat_id)), None)
            assert_type(await alice.request(protocol.chat_event_send(chatId=chat_id, tag="Nudge")), None)
            found = assert_type(await alice.request(protocol.search(text="hello")), protocol.SearchResult)
            assert [m["messageId"] for m in found["messages"]] == [message_id]

            assert await refused(alice, protocol.chat_message_file_download(chatId=chat_id, messageId=message_id)) == "InvalidParameter"
            assert_type(await alice.request(protocol.chat_message_detach(chatId=chat_id, messageId=message_id, detachFile=True)), None)
            assert_type(await bob.request(protocol.chat_message_react(chatId=chat_id, messageId=message_id, reaction="👍")), None)
            reactions = assert_type(await alice.request(protocol.chat_message_reactions_get(chatId=chat_id, messageId=message_id)),
                                    protocol.ChatMessageReactionsEvent)
            assert [r["reaction"] for r in reactions["reactions"]] == ["👍"]
            mentions = assert_type(await bob.request(protocol.chat_message_mentions_get(limit=10)), protocol.ChatMessageMentionsEvent)
            assert mentions["messages"] == []
            assert_type(await alice.request(protocol.chat_message_pin(chatId=chat_id, messageId=message_id)), None)
            assert_type(await alice.request(protocol.chat_message_delete(chatId=chat_id, id=message_id)), None)
            again = await alice.request(protocol.chat_message_send(chatId=chat_id, tag="Text", content="again"))
            assert_type(await alice.request(protocol.chat_message_destroy(chatId=chat_id, messageId=again["messageId"])), None)

            assert_type(await alice.request(protocol.sync_start(passcode="123456")), None)
            assert_type(await alice.request(protocol.setup_retry()), None)
            assert_type(await alice.request(protocol.retry_server_requests()), None)
            assert_type(await alice.request(protocol.chat_hide(chatIds=[chat_id])), None)
            assert_type(await alice.request(protocol.chat_leave(chatIds=[chat_id])), None)
            # Another session of alice's registers an endpoint and leaves; this one lists and deregisters it.
            async with server.connect("alice") as phone:
                updated = assert_type(await phone.request(protocol.endpoint_update(description="a phone")), protocol.EndpointUpdateResult)
                assert updated["result"] == "Success"
            endpoints = assert_type(await alice.request(protocol.endpoints_get()), protocol.Endpoints)
            phone_endpoint = next(e for e in endpoints["registeredEndpoints"] if e["description"] == "a phone")
            assert_type(await alice.request(protocol.endpoint_deregister(endpointId=phone_endpoint["endpointId"])), protocol.EndpointDeregisterResult)
    print("every builder answered as typed")


if __name__ == "__main__":
    asyncio.run(main())
