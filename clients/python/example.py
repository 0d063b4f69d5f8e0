"""Two users chat: alice starts a chat with bob, bob sees the message, alice sees it
Delivered and then Read. Run: python3 example.py (with chatcore built, or CHATCORE_BINARY set)."""
import asyncio

from chatcore import Server, protocol


async def main() -> None:
    async with Server.start() as server:
        alice = await server.connect("alice")
        bob = await server.connect("bob")
        bob_events = bob.events()

        chat = await alice.request(protocol.chat_start(invitees=[{"userId": "bob"}], subject="Lunch"))
        print("alice started chat", chat["chatId"])
        alice_events = alice.events()
        sent = await alice.request(protocol.chat_message_send(chatId=chat["chatId"], tag="Text", content="Noon?"))
        print("alice sent message", sent["messageId"], sent["state"])

        _, added = await bob.wait_for(lambda name, body: name == "listAdd" and body["type"] == "chatMessage"
                                      and body["elements"][0].get("content") == "Noon?", events=bob_events)
        message = added["elements"][0]
        print("bob received:", message["content"])
        await bob.request(protocol.chat_message_read(chatId=message["chatId"], messageId=message["messageId"]))

        async for name, body in alice_events:
            if name == "listChange" and body["type"] == "chatMessage":
                states = [e["state"] for e in body["elements"] if e.get("messageId") == sent["messageId"] and "state" in e]
                for state in states:
                    print("alice sees", state)
                if "Read" in states:
                    break
        await alice.close()
        await bob.close()


if __name__ == "__main__":
    asyncio.run(main())
