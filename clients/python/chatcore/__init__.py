"""chatcore's Python client: typed request builders (`chatcore.protocol`, generated from the
service's schemas) and an asyncio client that correlates every request with its outcome."""
from . import protocol
from .client import BinaryNotFound, ChatcoreError, ChatcoreTimeout, Client, ConnectionClosed, Server, find_binary

__all__ = ["protocol", "Client", "Server", "ChatcoreError", "ChatcoreTimeout", "ConnectionClosed", "BinaryNotFound", "find_binary"]
