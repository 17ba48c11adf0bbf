"""A small HTTP/1.1 server on asyncio streams: enough for a JSON API with streamed responses.

Requests carry their body with Content-Length (no chunked uploads); connections stay open
between requests unless the client says otherwise (the openai client pools them). A handler
answers once, with a whole body or a chunked stream. While it runs, the connection watches for
the client going away and cancels it, so work for a vanished client stops.

Limits, for clients that mean harm: a request head (request line and header fields, through the
blank line) of at most ``max_head_bytes``; a body of at most ``max_body_bytes``, read only after
the ``gate`` (the API key check) has let its head through, so a refused client's body is
discarded as it arrives, never buffered; bodies held at once (read, or their request being
handled) of at most ``max_bodies_bytes`` in all, a request beyond that answered 503; at most
``max_connections`` connections at once, a connection beyond them answered 503 and closed
without reading its request. A refused or
unreadable request closes its connection, after a short, bounded drain of what the client is
still sending so that the answer is not lost to a TCP reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable

log = logging.getLogger("swarmctl.http")

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 64
MAX_BODIES_BYTES = 4 * MAX_BODY_BYTES  # request bodies held at once, all connections together
IDLE_TIMEOUT_S = 75.0  # a kept-alive connection with no new request for this long is closed
READ_TIMEOUT_S = 30.0  # a request that has started must keep arriving at least this often
READ_CHUNK = 64 * 1024
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
LIMIT_LOG_INTERVAL_S = 60.0  # "connection limit reached" is logged at most this often


@dataclass
class Request:
    method: str
    path: str  # without the query string
    query: str
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes
    keep_alive: bool


class ProtocolError(Exception):
    """A request this server cannot read: answered with ``status``, then the connection closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Refusal:
    """The gate's answer to a request it does not let through (its body is never read)."""
    status: int
    body: bytes
    headers: dict[str, str]


class ChunkedBody:
    """A response body sent as it is produced (Transfer-Encoding: chunked)."""

    def __init__(self, writer: asyncio.StreamWriter, responder: "Responder") -> None:
        self._writer = writer
        self._responder = responder

    async def write(self, data: bytes) -> None:
        if data:  # an empty chunk would end the body
            self._writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            await self._writer.drain()

    async def end(self) -> None:
        self._writer.write(b"0\r\n\r\n")
        await self._writer.drain()
        self._responder.complete = True


class Responder:
    """How a handler answers its request: exactly once, whole (``send``) or streamed (``stream``)."""

    def __init__(self, writer: asyncio.StreamWriter, keep_alive: bool) -> None:
        self._writer = writer
        self.keep_alive = keep_alive
        self.started = False  # the status line is out: the status can no longer change
        self.complete = False  # the whole response is out: the connection can carry another

    async def send(self, status: int, body: bytes, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> None:
        self._start(status, {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})})
        self._writer.write(body)
        await self._writer.drain()
        self.complete = True

    async def stream(self, status: int, content_type: str, headers: dict[str, str] | None = None) -> ChunkedBody:
        self._start(status, {"Content-Type": content_type, "Transfer-Encoding": "chunked", **(headers or {})})
        await self._writer.drain()
        return ChunkedBody(self._writer, self)

    def _start(self, status: int, headers: dict[str, str]) -> None:
        if self.started:
            raise RuntimeError("this request has been answered already")
        self.started = True
        headers = {**headers, "Connection": "keep-alive" if self.keep_alive else "close"}
        lines = [f"HTTP/1.1 {status} {_phrase(status)}", *(f"{k}: {v}" for k, v in headers.items())]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))


Handler = Callable[[Request, Responder], Awaitable[None]]
# A request's head (its body still unread, b"") → None to read the body and handle it, or a Refusal.
Gate = Callable[[Request], "Refusal | None"]
# (status, message, code) → the application's error body (JSON)
ErrorBody = Callable[[int, str, "str | None"], bytes]


async def start_server(handler: Handler, *, error_body: ErrorBody, gate: Gate | None = None,
                       host: str | None = None, port: int | None = None, sock: socket.socket | None = None,
                       max_connections: int = DEFAULT_MAX_CONNECTIONS, max_head_bytes: int = MAX_HEAD_BYTES,
                       max_body_bytes: int = MAX_BODY_BYTES, max_bodies_bytes: int = MAX_BODIES_BYTES,
                       ) -> asyncio.Server:
    """Listen on host:port (or a socket already bound); each connection serves its requests one
    after another."""
    limits = _Limits(max_head_bytes, max_body_bytes, max(max_bodies_bytes, max_body_bytes))
    open_connections = 0
    last_limit_log = -LIMIT_LOG_INTERVAL_S

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_connections, last_limit_log
        connection = _Connection(reader, writer, handler, error_body, gate, limits)
        if open_connections >= max_connections:
            now = asyncio.get_running_loop().time()
            if now - last_limit_log >= LIMIT_LOG_INTERVAL_S:
                last_limit_log = now
                log.warning("%d connections open, the most allowed: answering new ones 503 (logged at most "
                            "once a minute)", open_connections)
            await connection.refuse(503, f"the server has too many connections open ({max_connections}); "
                                         f"retry shortly", code="too_many_connections", headers={"Retry-After": "1"})
            return
        open_connections += 1
        try:
            await connection.run()
        finally:
            open_connections -= 1

    return await asyncio.start_server(on_connection, host, port, sock=sock)


@dataclass
class _Limits:
    max_head_bytes: int
    max_body_bytes: int
    max_bodies_bytes: int
    bodies_bytes: int = 0  # bodies being read or held by a request being handled, all connections


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler,
                 error_body: ErrorBody, gate: Gate | None, limits: _Limits) -> None:
        self.reader = reader
        self.writer = writer
        self.handler = handler
        self.error_body = error_body
        self.gate = gate
        self.limits = limits
        self.buffer = bytearray()  # bytes read but not yet parsed (a pipelined next request, say)

    async def run(self) -> None:
        try:
            while True:
                try:
                    head = await self._read_head()
                except ProtocolError as e:
                    await self.refuse(e.status, str(e))
                    return
                if head is None:
                    break
                request, length = head
                refusal = self.gate(request) if self.gate is not None else None
                if refusal is not None:
                    if len(self.buffer) < length:  # the body is still coming: it is not read, so close
                        await self._answer_and_close(refusal.status, refusal.body, refusal.headers)
                        return
                    self._take(length)  # small and here already: drop it, keep the connection
                    responder = Responder(self.writer, request.keep_alive)
                    await responder.send(refusal.status, refusal.body, headers=refusal.headers)
                    if not request.keep_alive:
                        break
                    continue
                if self.limits.bodies_bytes + length > self.limits.max_bodies_bytes:
                    # Authorized clients too: so many large bodies at once could exhaust memory.
                    await self._answer_and_close(503, self.error_body(
                        503, "the server is holding too many large request bodies; retry shortly",
                        "too_many_large_requests"), {"Retry-After": "1"})
                    return
                self.limits.bodies_bytes += length
                try:
                    if not await self._read_and_dispatch(request, length):
                        break
                finally:
                    self.limits.bodies_bytes -= length
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except Exception as e:  # noqa: BLE001 - a fault below the handler: one log line; the connection closes
            log.error("connection: internal error: %s: %s", type(e).__name__, e)
        finally:
            await self._close()

    async def _read_and_dispatch(self, request: Request, length: int) -> bool:
        """Read the body and handle the request; False: close the connection."""
        body = await self._read_body(request, length)
        if body is None:
            return False
        request.body = body
        responder = Responder(self.writer, request.keep_alive)
        return await self._dispatch(request, responder) and responder.keep_alive and responder.complete

    async def refuse(self, status: int, message: str, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
        """Answer with an error and close, reading nothing more of the request than was read."""
        try:
            await self._answer_and_close(status, self.error_body(status, message, code), headers or {})
        except ConnectionError:
            pass
        finally:
            await self._close()

    async def _answer_and_close(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        await Responder(self.writer, keep_alive=False).send(status, body, headers=headers)
        await self._drain_input()

    async def _drain_input(self) -> None:
        """Half-close, then read and drop what the client still sends (a request body this server
        will not read), for at most LINGER_S and the largest request: closing with unread input
        would reset the connection, and the client could lose the answer just sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_S
        budget = self.limits.max_head_bytes + self.limits.max_body_bytes
        self.buffer = bytearray()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError, asyncio.TimeoutError):
            if self.writer.can_write_eof():
                self.writer.write_eof()
            while budget > 0 and (left := deadline - loop.time()) > 0:
                data = await asyncio.wait_for(self.reader.read(READ_CHUNK), left)
                if not data:
                    break
                budget -= len(data)

    async def _close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()

    async def _dispatch(self, request: Request, responder: Responder) -> bool:
        """Run the handler; cancel it if the client hangs up. False: close the connection."""
        handling = asyncio.create_task(self.handler(request, responder))
        watching = asyncio.create_task(self._wait_for_hangup())
        try:
            await asyncio.wait({handling, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this connection itself is cancelled (the server shutting down)
            for task in (handling, watching):
                task.cancel()
            await asyncio.gather(handling, watching, return_exceptions=True)
        if watching.done() and not watching.cancelled():
            return False  # the client hung up: the handler was cancelled and has cleaned up
        error = None if handling.cancelled() else handling.exception()
        if isinstance(error, ConnectionError):
            return False
        if error is not None:
            log.error("%s %s: internal error: %s: %s", request.method, request.path, type(error).__name__, error)
            if not responder.started:
                await responder.send(500, self.error_body(500, "internal server error", None))
            return False
        return True

    async def _wait_for_hangup(self) -> None:
        """Returns when the client closes its side; whatever it sends meanwhile is kept for later."""
        while True:
            data = await self.reader.read(READ_CHUNK)
            if not data:
                return
            self.buffer += data
            if len(self.buffer) >= self.limits.max_head_bytes:
                # Stop reading: what is pipelined behind this request waits in TCP, unbuffered,
                # until the request is done and its head can be checked.
                await asyncio.Event().wait()

    async def _fill(self, timeout: float) -> bool:
        """Read more into the buffer; False at end of stream or when nothing came in time."""
        try:
            data = await asyncio.wait_for(self.reader.read(READ_CHUNK), timeout)
        except asyncio.TimeoutError:
            return False
        self.buffer += data
        return bool(data)

    def _take(self, n: int) -> bytes:
        """The buffer's first n bytes, removed from it (copying only what stays, usually little)."""
        with memoryview(self.buffer) as view:
            taken = bytes(view[:n])
        self.buffer = self.buffer[n:]
        return taken

    async def _read_head(self) -> tuple[Request, int] | None:
        """The next request without its body, and the body's length; None when the client has
        closed the connection or gone idle. The head, through its blank line, is at most
        max_head_bytes."""
        limit = self.limits.max_head_bytes
        while (end := self.buffer.find(b"\r\n\r\n", 0, limit)) < 0:
            if len(self.buffer) >= limit:
                raise ProtocolError(431, f"the request head is larger than {limit} bytes")
            if not await self._fill(READ_TIMEOUT_S if self.buffer else IDLE_TIMEOUT_S):
                return None
        head = self._take(end + 4)[:end]
        method, path, query, version, headers = parse_head(head)
        length = _content_length(headers, self.limits.max_body_bytes)
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
        return Request(method, path, query, headers, b"", keep_alive), length

    async def _read_body(self, request: Request, length: int) -> bytes | None:
        """The body of a request the gate let through; None if the client stopped sending it."""
        if request.headers.get("expect", "").lower() == "100-continue" and len(self.buffer) < length:
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(self.buffer) < length:
            if not await self._fill(READ_TIMEOUT_S):
                return None
        return self._take(length)


def parse_head(head: bytes) -> tuple[str, str, str, str, dict[str, str]]:
    """Request line and header fields → (method, path, query, version, headers)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
        raise ProtocolError(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise ProtocolError(505, f"unsupported protocol version {version!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise ProtocolError(400, "malformed header field")
        headers[name.lower()] = value.strip()
    path, _, query = target.partition("?")
    return method, path, query, version, headers


def _content_length(headers: dict[str, str], limit: int) -> int:
    if "transfer-encoding" in headers:
        raise ProtocolError(411, "chunked request bodies are not supported; send Content-Length")
    text = headers.get("content-length", "0")
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise ProtocolError(400, "malformed Content-Length")
    length = int(text)
    if length > limit:
        raise ProtocolError(413, f"the request body is larger than {limit} bytes")
    return length


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
