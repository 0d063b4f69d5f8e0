"""An asyncio client for chatcore: spawn `chatcore serve --user`, or connect over TCP or a
Unix socket; send requests and await their outcome; iterate over events.

Every request's outcome is found the same way (docs/protocol.md, "Reference"):

- a failure is the `requestFailed` whose `line` is the request's line (the client counts
  the lines it writes), or `chatStartFailed` / `setupError`;
- an answer is the event that carries the request's cookie (the client gives every
  request one): a list answer is its header and every chunk up to `"last": true`, a
  started chat or a sent message is the `listAdd` element carrying the cookie;
- a request that is not answered when it succeeds is followed by a cheap list request
  (the `global` element `authTokenState`): answers keep the order of requests, so once
  that is answered and no failure came, the request succeeded.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import shutil
import sysconfig
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar, overload

from . import protocol

LIST_HEADERS = {"listAll", "listElements", "listMatching"}
STREAM_LIMIT = 256 << 20  # a list chunk of 500 large messages is tens of MB
MAX_BUFFERED_EVENTS = 10_000

Answer = TypeVar("Answer")
Event = tuple[str, dict[str, Any]]


class ChatcoreError(Exception):
    """A request was refused: `error` is the protocol's code, `event` what said so."""

    def __init__(self, event: str, error: str, reason: str, body: dict[str, Any] | None = None):
        super().__init__(f"{event}: {error}: {reason}")
        self.event = event
        self.error = error
        self.reason = reason
        self.body = body or {}


class ChatcoreTimeout(ChatcoreError, TimeoutError):
    def __init__(self, request: str, seconds: float):
        super().__init__("timeout", "Timeout", f"no outcome for {request} within {seconds} s")


class ConnectionClosed(ChatcoreError, ConnectionError):
    def __init__(self, reason: str = "the connection to chatcore closed"):
        super().__init__("closed", "Closed", reason)


class EventsLost(ChatcoreError):
    """An `events()` iterator fell more than its `max_buffered` events behind: the events
    after those it kept were dropped for it (not for the others). Everything before is still
    handed over first; then this is raised, and the iterator ends."""

    def __init__(self, kept: int):
        super().__init__("events", "EventsLost", f"more than {kept} events waited in this iterator unread; later ones were dropped")
        self.kept = kept


class BinaryNotFound(FileNotFoundError):
    pass


class _Closable(Protocol):
    async def __aexit__(self, *exc: object) -> None: ...


Opened = TypeVar("Opened", bound=_Closable)


class Opening(Generic[Opened]):
    """What `Client.spawn`, `Client.connect`, `Server.start` and `Server.connect` return: await
    it for the client or server (`client = await Client.spawn(...)`), or enter it to have it
    closed at the end of the block (`async with Client.spawn(...) as client:`)."""

    def __init__(self, opening: Coroutine[Any, Any, Opened]):
        self._opening = opening
        self._opened: Opened | None = None

    def __await__(self) -> Generator[Any, None, Opened]:
        return self._opening.__await__()

    async def __aenter__(self) -> Opened:
        self._opened = await self._opening
        return self._opened

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        if self._opened is not None:
            await self._opened.__aexit__(kind, error, traceback)


def _host_and_port(address: str) -> tuple[str, int]:
    """"host:port", "tcp://host:port", "[::1]:port" (an IPv6 address in brackets)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if not port.isdigit() or (":" in host and not bracketed):
        raise ValueError(f"{address!r} is not an address: expected unix:/path, host:port or [ipv6]:port")
    return (host[1:-1] if bracketed else host) or "127.0.0.1", int(port)


def _executable(path: str | os.PathLike[str], given_as: str) -> str:
    path = os.path.abspath(path)
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise BinaryNotFound(f"{given_as} is {path}, which is not an executable file: point it at the chatcore binary")
    return path


def find_binary(binary: str | os.PathLike[str] | None = None) -> str:
    """The chatcore executable: `binary`, else $CHATCORE_BINARY, else the one this package was
    installed with (the wheel's `chatcore` command, in the environment's scripts directory),
    else `chatcore` on PATH, else a build in this or an enclosing directory
    (`.build/release/chatcore`, then debug). A `binary` or $CHATCORE_BINARY that is not an
    executable file raises `BinaryNotFound`."""
    if binary:
        return _executable(binary, "binary=")
    if os.environ.get("CHATCORE_BINARY"):
        return _executable(os.environ["CHATCORE_BINARY"], "CHATCORE_BINARY")
    bundled = pathlib.Path(sysconfig.get_path("scripts")) / "chatcore"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    if found := shutil.which("chatcore"):
        return found
    for start in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parent):
        for directory in (start, *start.parents):
            for kind in ("release", "debug"):
                candidate = directory / ".build" / kind / "chatcore"
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
    raise BinaryNotFound(
        "chatcore was not found: build it (`make build`, or `swift build -c release --product chatcore` in the "
        "chatcore repository), then set CHATCORE_BINARY=/path/to/chatcore, put it on PATH, or pass binary=")


class _Subscriber:
    """One `events()` iterator's queue: at most `limit` events, then it is marked lost."""

    def __init__(self, limit: int):
        self.limit = limit
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self.lost = False

    def put(self, event: Event) -> None:
        if self.lost:
            return
        if self.queue.qsize() >= self.limit:
            self.lost = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(event)

    def end(self) -> None:
        if not self.lost:
            self.queue.put_nowait(None)


class _Pending:
    def __init__(self, name: str, cookie: str | None, future: asyncio.Future[Any]):
        self.name = name
        self.cookie = cookie
        self.future = future
        self.header: dict[str, Any] | None = None
        self.elements: list[Any] = []
        self.barrier_for: _Pending | None = None


class Client:
    """One session of chatcore. Use `Client.spawn`, `Client.connect` or `Server.connect`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | asyncio.StreamWriter,
                 process: asyncio.subprocess.Process | None = None):
        self._reader = reader
        self._writer = writer
        self._process = process
        self._lines = 0
        self._cookies = (f"py{n}" for n in itertools.count(1))
        self._by_line: dict[int, _Pending] = {}
        self._by_cookie: dict[str, _Pending] = {}
        self._auth: _Pending | None = None
        self._subscribers: list[_Subscriber] = []
        self._closed: ConnectionClosed | None = None
        self._write_lock = asyncio.Lock()
        self.globals: dict[str, Any] = {}
        self._task = asyncio.get_running_loop().create_task(self._read())

    # MARK: opening

    @classmethod
    def spawn(cls, user: str, *, data_dir: str | os.PathLike[str] | None = None,
              binary: str | os.PathLike[str] | None = None, args: tuple[str, ...] = ()) -> Opening[Client]:
        """Starts `chatcore serve --user USER` as a child process and talks over its
        standard input/output (the session is that user from the start)."""
        return Opening(cls._spawn(user, data_dir, binary, args))

    @classmethod
    async def _spawn(cls, user: str, data_dir: str | os.PathLike[str] | None, binary: str | os.PathLike[str] | None,
                     args: tuple[str, ...]) -> Client:
        quiet = () if "--log-level" in args else ("--log-level", "warning")
        command = [find_binary(binary), "serve", "--user", user, *quiet, *args]
        if data_dir is not None:
            command += ["--data-dir", str(data_dir)]
        process = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE,
                                                       stdout=asyncio.subprocess.PIPE, limit=STREAM_LIMIT)
        assert process.stdout and process.stdin
        return cls(process.stdout, process.stdin, process)

    @classmethod
    def connect(cls, address: str) -> Opening[Client]:
        """Connects to a serving chatcore: "unix:/path", "host:port", "tcp://host:port" or
        "[::1]:port"."""
        return Opening(cls._connect(address))

    @classmethod
    async def _connect(cls, address: str) -> Client:
        if address.startswith("unix:"):
            reader, writer = await asyncio.open_unix_connection(address[len("unix:"):], limit=STREAM_LIMIT)
        else:
            host, port = _host_and_port(address)
            reader, writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
        return cls(reader, writer)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the session: no more input; waits for the service to answer what was sent."""
        if not self._writer.is_closing():
            try:
                if self._writer.can_write_eof():
                    self._writer.write_eof()
                else:
                    self._writer.close()
            except (OSError, RuntimeError):
                pass
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 10)
        except (asyncio.TimeoutError, ConnectionError):
            self._task.cancel()
        self._writer.close()
        if self._process is not None:
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except asyncio.TimeoutError:
                self._process.kill()
                await self._process.wait()

    # MARK: requests

    async def authenticate(self, user_id: str, token: str = "any", *, timeout: float = 10.0) -> dict[str, Any]:
        """Sends `authToken` and waits until setup says `Success` (or `Full`); returns the
        `global` values. A refused token raises ChatcoreError from `setupError`."""
        await self.request(protocol.auth_token(userId=user_id, authToken=token), timeout=timeout)
        return dict(self.globals)

    async def send(self, message: dict[str, Any]) -> int:
        """Writes one request without waiting; returns its line number."""
        return await self._write(message)

    @overload
    async def request(self, message: protocol.RequestLine[Answer], *, timeout: float = 10.0) -> Answer: ...

    @overload
    async def request(self, message: dict[str, Any], *, timeout: float = 10.0) -> Any: ...

    async def request(self, message: dict[str, Any], *, timeout: float = 10.0) -> Any:
        """Sends one request (built with `chatcore.protocol`) and waits for its outcome, typed
        by the builder (`protocol.RequestLine[Answer]`):

        - a list request: `{"header": <listAll/listElements/listMatching>, "elements": [...]}`
          (`protocol.ListAnswer` of the list's element type);
        - `chatStart`: the new chat element; `chatMessageSend`: the sent message element;
        - `authToken`: the `global` values once set up;
        - an answered request (`identitiesGet`, `search`, ...): the answer's fields;
        - a request answered only when it fails: None.

        A failure raises ChatcoreError; no outcome in `timeout` seconds raises ChatcoreTimeout.
        A plain `{name: {fields}}` dict is sent as it is, its outcome untyped.
        """
        ((name, body),) = message.items()
        body = dict(body)
        if name in protocol.TAKES_COOKIE and "cookie" not in body:
            body["cookie"] = next(self._cookies)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        cookie = body.get("cookie")
        pending = _Pending(name, cookie if isinstance(cookie, str) else None, future)
        if pending.cookie is not None:
            if pending.cookie in self._by_cookie:
                raise ValueError(f"cookie {pending.cookie!r} is already waiting for an answer")
            self._by_cookie[pending.cookie] = pending
        if name == "authToken":
            self._auth = pending
        async with self._write_lock:
            line = await self._write({name: body})
            self._by_line[line] = pending
            if not protocol.ANSWERS.get(name) and name != "authToken":
                barrier_cookie = next(self._cookies)
                barrier = _Pending("requestListElements", barrier_cookie, asyncio.get_running_loop().create_future())
                barrier.barrier_for = pending
                self._by_cookie[barrier_cookie] = barrier
                barrier_line = await self._write(protocol.request_list_elements_global(
                    elements=[{"name": "authTokenState"}], cookie=barrier_cookie))
                self._by_line[barrier_line] = barrier
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise ChatcoreTimeout(name, timeout) from None
        finally:
            self._forget(pending)

    async def _write(self, message: dict[str, Any]) -> int:
        if self._closed:
            raise self._closed
        self._writer.write(json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")
        self._lines += 1
        line = self._lines
        try:
            await self._writer.drain()
        except (ConnectionError, BrokenPipeError) as error:
            raise ConnectionClosed(str(error)) from error
        return line

    def _forget(self, pending: _Pending) -> None:
        for line in [k for k, v in self._by_line.items() if v is pending or v.barrier_for is pending]:
            del self._by_line[line]
        for cookie in [k for k, v in self._by_cookie.items() if v is pending or v.barrier_for is pending]:
            del self._by_cookie[cookie]
        if self._auth is pending:
            self._auth = None

    # MARK: events

    def events(self, *, max_buffered: int = MAX_BUFFERED_EVENTS) -> AsyncIterator[Event]:
        """Every event from now on, as (name, fields), answers included; ends when the
        connection closes. Events wait in the iterator until read: past `max_buffered`
        unread ones, later events are dropped for this iterator alone, and once it has handed
        over those it kept it raises `EventsLost` and ends (the session and other iterators go
        on). Close an iterator you stop reading (`aclose()`, or leave its `async for`)."""
        subscriber = _Subscriber(max_buffered)
        self._subscribers.append(subscriber)

        async def iterate() -> AsyncIterator[Event]:
            try:
                while (item := await subscriber.queue.get()) is not None:
                    yield item
                if subscriber.lost:
                    raise EventsLost(subscriber.limit)
            finally:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)
        return iterate()

    def wait_for(self, predicate: Callable[[str, dict[str, Any]], bool], *, timeout: float = 10.0,
                 events: AsyncIterator[Event] | None = None) -> Awaitable[Event]:
        """The first event (from `events`, or from the moment of this call) for which
        predicate(name, fields) holds. It listens from the call, not from the await: an
        event that arrives before the returned awaitable is awaited is not missed."""
        source = events or self.events()

        async def first() -> Event:
            async for name, body in source:
                if predicate(name, body):
                    return name, body
            raise self._closed or ConnectionClosed()

        async def waiting() -> Event:
            try:
                return await asyncio.wait_for(first(), timeout)
            except asyncio.TimeoutError:
                raise ChatcoreTimeout("an event", timeout) from None
            finally:
                if events is None:
                    # The iterator opened here stops taking events (it would buffer every later one).
                    await source.aclose()  # type: ignore[attr-defined]
        return waiting()

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                if not line.endswith(b"\n"):
                    break
                ((name, body),) = json.loads(line).items()
                self._dispatch(name, body)
                for subscriber in list(self._subscribers):
                    subscriber.put((name, body))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as error:
            self._closed = ConnectionClosed(f"the connection to chatcore failed: {error}")
        finally:
            self._closed = self._closed or ConnectionClosed()
            for pending in {*self._by_line.values(), *self._by_cookie.values()}:
                self._settle(pending, error=self._closed)
            for subscriber in self._subscribers:
                subscriber.end()

    def _settle(self, pending: _Pending, value: Any = None, error: Exception | None = None) -> None:
        target = pending.barrier_for or pending
        if target.future.done():
            return
        if error is not None:
            target.future.set_exception(error)
        else:
            target.future.set_result(None if pending.barrier_for else value)

    def _dispatch(self, name: str, body: dict[str, Any]) -> None:
        if name == "requestFailed":
            pending = self._by_line.get(body.get("line", 0))
            if pending:
                self._settle(pending, error=ChatcoreError(name, body["error"], body["reason"], body))
            return
        if name == "listChange" and body.get("type") == "global":
            for element in body.get("elements", []):
                self.globals[element["name"]] = element.get("value")
            auth = self._auth
            if auth and not auth.future.done():
                state = (self.globals.get("setupState") or {}).get("state")
                if self.globals.get("authTokenState") == "Ok" and state in ("Success", "Full"):
                    auth.future.set_result(dict(self.globals))
            return
        if name == "setupError" and self._auth:
            self._settle(self._auth, error=ChatcoreError(name, body.get("error", ""), body.get("error", ""), body))
            return
        cookie = body.get("cookie")
        pending = self._by_cookie.get(cookie) if cookie is not None else None
        if pending is None:
            return
        if name in LIST_HEADERS:
            pending.header = body
        elif name == "listChunk":
            pending.elements.extend(body.get("elements", []))
            if body.get("last"):
                self._settle(pending, {"header": pending.header, "elements": pending.elements})
        elif name == "listAdd":
            elements = body.get("elements", [])
            self._settle(pending, elements[0] if elements else None)
        elif name == "chatStartFailed":
            self._settle(pending, error=ChatcoreError(name, body.get("reason", ""), body.get("detail", ""), body))
        elif name in protocol.ANSWERS.get(pending.name, ()):
            self._settle(pending, body)


class Server:
    """A chatcore serving a Unix socket in a directory of its own, for scripts and tests that
    need several users at once. By default any token is accepted (`--insecure-no-auth`)."""

    def __init__(self, process: asyncio.subprocess.Process, socket_path: str, directory: tempfile.TemporaryDirectory[str] | None):
        self.process = process
        self.address = "unix:" + socket_path
        self._directory = directory

    @classmethod
    def start(cls, *, data_dir: str | os.PathLike[str] | None = None, binary: str | os.PathLike[str] | None = None,
              args: tuple[str, ...] = ("--insecure-no-auth", "--log-level", "warning"), timeout: float = 30.0) -> Opening[Server]:
        """Starts chatcore on a Unix socket in a new temporary directory; await it, or use it
        in `async with` to have it stopped at the end."""
        return Opening(cls._start(data_dir, binary, args, timeout))

    @classmethod
    async def _start(cls, data_dir: str | os.PathLike[str] | None, binary: str | os.PathLike[str] | None,
                     args: tuple[str, ...], timeout: float) -> Server:
        directory = tempfile.TemporaryDirectory(prefix="chatcore-")
        socket_path = os.path.join(directory.name, "chatcore.sock")
        data = str(data_dir) if data_dir is not None else os.path.join(directory.name, "data")
        process = await asyncio.create_subprocess_exec(
            find_binary(binary), "serve", "--listen", "unix:" + socket_path, "--data-dir", data, *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL)
        deadline = asyncio.get_running_loop().time() + timeout
        # The socket file appears when chatcore binds it, a moment before it listens: it
        # is ready once a connection is accepted.
        while True:
            if process.returncode is not None or asyncio.get_running_loop().time() > deadline:
                raise ConnectionClosed(f"chatcore did not start serving {socket_path} (exit {process.returncode})")
            try:
                _, probe = await asyncio.open_unix_connection(socket_path)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            probe.close()
            await probe.wait_closed()
            return cls(process, socket_path, directory)

    def connect(self, user: str | None = None, token: str = "any") -> Opening[Client]:
        """A new session; authenticated as `user` when given."""
        return Opening(self._connect(user, token))

    async def _connect(self, user: str | None, token: str) -> Client:
        client = await Client.connect(self.address)
        if user is not None:
            await client.authenticate(user, token)
        return client

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._directory:
            self._directory.cleanup()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
