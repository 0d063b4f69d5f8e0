"""chatcore's Python client: typed request builders (`chatcore.protocol`, generated from the
service's schemas) and an asyncio client that correlates every request with its outcome."""
from . import protocol
from .client import (MAX_BUFFERED_EVENTS, BinaryNotFound, ChatcoreError, ChatcoreTimeout, Client, ConnectionClosed, EventsLost, Opening,
                     Server, find_binary)

__all__ = ["protocol", "Client", "Server", "ChatcoreError", "ChatcoreTimeout", "ConnectionClosed", "BinaryNotFound", "EventsLost", "Opening",
           "MAX_BUFFERED_EVENTS", "find_binary"]
