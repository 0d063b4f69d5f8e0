"""A chatcore session from Python, with the client in clients/python installed (`pip
install ./clients/python`, or `PYTHONPATH=clients/python` in the repository):

    python3 Examples/python/chat.py

It spawns `chatcore serve --user alice` on a fresh data directory, starts a chat with bob,
sends a message, reads the chat back, and shows a refused request. The binary is found
through CHATCORE_BINARY, PATH, or a build of this repository (`make build`).
"""
import asyncio
import sys
import tempfile

import chatcore
from chatcore import ChatcoreError, Client, protocol


async def main() -> None:
    with tempfile.TemporaryDirectory() as data:
        async with Client.spawn("alice", data_dir=data) as alice:
            me = await alice.request(protocol.identities_get(appUserIds=["alice"]))
            print("alice is", me["info"][0]["uri"])
            chat = await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="Lunch"))
            print("started chat", chat["chatId"], repr(chat["subject"]))
            sent = await alice.request(protocol.chat_message_send(chatId=chat["chatId"], tag="Text", content="Noon?"))
            print("sent message", sent["messageId"], sent["state"])
            window = await alice.request(protocol.request_list_matching_chat_message(
                criteria={"chatId": chat["chatId"]}, window={"messageId": sent["messageId"], "before": 10}))
            for message in window["elements"]:
                print(" ", message["messageId"], message["tag"], message.get("content", ""))
            try:
                await alice.request({"chatMessageSend": {"chatId": chat["chatId"], "tag": "Text", "misspelled": True}})
            except ChatcoreError as refused:
                print("refused:", refused.error, refused.reason)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except chatcore.BinaryNotFound as missing:
        sys.exit(str(missing))
