"""A small HTTP/1.1 server on asyncio streams: enough for a JSON API with streamed responses.

Requests carry their body with Content-Length (no chunked uploads); connections stay open
between requests unless the client says otherwise (the openai client pools them). A handler
answers once, with a whole body or a chunked stream. While it runs, the connection watches for
the client going away and cancels it, so work for a vanished client stops.
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
IDLE_TIMEOUT_S = 75.0  # a kept-alive connection with no new request for this long is closed
READ_TIMEOUT_S = 30.0  # a request that has started must keep arriving at least this often
READ_CHUNK = 64 * 1024


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
ErrorBody = Callable[[int, str], bytes]  # (status, message) → the application's error body (JSON)


async def start_server(handler: Handler, *, error_body: ErrorBody, host: str | None = None, port: int | None = None,
                       sock: socket.socket | None = None) -> asyncio.Server:
    """Listen on host:port (or a socket already bound); each connection serves its requests one
    after another."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _Connection(reader, writer, handler, error_body).run()

    return await asyncio.start_server(on_connection, host, port, sock=sock)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler,
                 error_body: ErrorBody) -> None:
        self.reader = reader
        self.writer = writer
        self.handler = handler
        self.error_body = error_body
        self.buffer = bytearray()  # bytes read but not yet parsed (a pipelined next request, say)

    async def run(self) -> None:
        try:
            while True:
                try:
                    request = await self._read_request()
                except ProtocolError as e:
                    await Responder(self.writer, keep_alive=False).send(e.status, self.error_body(e.status, str(e)))
                    break
                if request is None:
                    break
                responder = Responder(self.writer, request.keep_alive)
                if not await self._dispatch(request, responder) or not (responder.keep_alive and responder.complete):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
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
                await responder.send(500, self.error_body(500, "internal server error"))
            return False
        return True

    async def _wait_for_hangup(self) -> None:
        """Returns when the client closes its side; whatever it sends meanwhile is kept for later."""
        while True:
            data = await self.reader.read(READ_CHUNK)
            if not data:
                return
            self.buffer += data
            if len(self.buffer) > MAX_HEAD_BYTES + MAX_BODY_BYTES:
                await asyncio.Event().wait()  # stop reading; TCP pushes back on the client

    async def _fill(self, timeout: float) -> bool:
        """Read more into the buffer; False at end of stream or when nothing came in time."""
        try:
            data = await asyncio.wait_for(self.reader.read(READ_CHUNK), timeout)
        except asyncio.TimeoutError:
            return False
        self.buffer += data
        return bool(data)

    async def _read_request(self) -> Request | None:
        """The next request, or None when the client has closed the connection or gone idle."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise ProtocolError(431, "the request head is too large")
            if not await self._fill(READ_TIMEOUT_S if self.buffer else IDLE_TIMEOUT_S):
                return None
        head = bytes(self.buffer[:end])
        del self.buffer[:end + 4]
        method, path, query, version, headers = parse_head(head)
        length = _content_length(headers)
        if headers.get("expect", "").lower() == "100-continue" and len(self.buffer) < length:
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(self.buffer) < length:
            if not await self._fill(READ_TIMEOUT_S):
                return None
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
        return Request(method, path, query, headers, body, keep_alive)


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


def _content_length(headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise ProtocolError(411, "chunked request bodies are not supported; send Content-Length")
    text = headers.get("content-length", "0")
    if not text.isdigit():
        raise ProtocolError(400, "malformed Content-Length")
    length = int(text)
    if length > MAX_BODY_BYTES:
        raise ProtocolError(413, f"the request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MiB")
    return length


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
