"""HTTP/1.1 (and HTTPS) for `swarmctl serve`, on aiohttp's low-level server.

Why aiohttp: its server is asyncio-native and kept upstream with the parts that used to be
hand-written here: the llhttp request parser (Node.js's), keep-alive with an idle timeout,
chunked responses, a lingering close that reads off a body it will not use so the answer is not
lost to a TCP reset, cancelling a handler whose client went away, and TLS through asyncio. Its
low-level ``web.Server`` takes one handler coroutine and no framework around it, which is all
three routes need. Starlette on uvicorn would be two libraries and an ASGI layer between them,
and would still need a head-size limit and a connection cap of our own.

This module adapts it to what the API needs, in terms of its own small ``Request`` and
``Responder`` (so the routes do not depend on aiohttp), and adds the limits for clients that mean
harm:

- a request head (request line and header fields) of at most ``max_head_bytes``, counted once
  parsed as its lines would be written (431 beyond); no header line may be longer than that
  either (431), and a connection that sends more than twice that without completing a head is
  cut off unanswered;
- a body of at most ``max_body_bytes`` (413 at once when Content-Length says more, or as soon as
  a chunked body passes it), read only after the ``gate`` (the API key check) has let its head
  through: a refused client's body is read off and dropped for at most ``LINGER_S``, never held;
- bodies held at once (read, or their request being handled), all connections together, of at
  most ``max_bodies_bytes``; a request beyond that is answered 503;
- at most ``max_connections`` connections hold a slot at once, and at most ``max_per_address``
  of those not yet trusted come from one client address (an IPv6 /64 counts as one address); a
  connection beyond either gets 503 for its first request and is closed, unless the gate lets
  that request through (below); one address's connections waiting so beyond ``max_connections``
  of them are closed at once, unanswered;
- a connection is trusted once the gate has let one of its requests through (it carried the key;
  with no key set, any complete request); a trusted connection is never refused for lack of
  slots held by connections that are not, nor closed to make room: see ``_Slots``;
- a whole request head must arrive within ``head_timeout`` (``HEAD_TIMEOUT_S``) of the
  connection opening, or of its first byte on a kept-alive connection, however it trickles
  (Slowloris); the connection is closed unanswered past it. A kept-alive connection may wait
  ``idle_timeout`` for that first byte (aiohttp's keep-alive timer). A body must keep arriving
  at least every ``read_timeout`` seconds (408 otherwise).

Every refusal is one JSON body from ``error_body`` and one log line, never a traceback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import ERROR as PARSE_ERROR_MESSAGE  # the head aiohttp gives a request it could not parse

log = logging.getLogger("swarmctl.http")

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 100
MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 64
MAX_BODIES_BYTES = 4 * MAX_BODY_BYTES  # request bodies held at once, all connections together
IDLE_TIMEOUT_S = 75.0  # a kept-alive connection that sends nothing for this long is closed
HEAD_TIMEOUT_S = 10.0  # a whole request head, from the connection opening or from its first byte
PER_ADDRESS_SHARE = 4  # one client address may hold 1/4 of the slots with connections not yet trusted
READ_TIMEOUT_S = 30.0  # a request body that has started must keep arriving at least this often
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped
LIMIT_LOG_INTERVAL_S = 60.0  # "connection limit reached" is logged at most this often
SERVER_HEADER = "swarmctl"  # not aiohttp's default, which names its version and Python's


@dataclass
class Request:
    method: str
    path: str  # as sent, without the query string
    query: str
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes
    keep_alive: bool


@dataclass
class Refusal:
    """The gate's answer to a request it does not let through (its body is never read)."""
    status: int
    body: bytes
    headers: dict[str, str]


class ChunkedBody:
    """A response body sent as it is produced (chunked on HTTP/1.1)."""

    def __init__(self, response: web.StreamResponse, responder: "Responder") -> None:
        self._response = response
        self._responder = responder

    async def write(self, data: bytes) -> None:
        if data:  # an empty chunk would end the body
            await self._response.write(data)

    async def end(self) -> None:
        await self._response.write_eof()
        self._responder.complete = True


class Responder:
    """How a handler answers its request: exactly once, whole (``send``) or streamed (``stream``)."""

    def __init__(self, raw: web.BaseRequest, keep_alive: bool) -> None:
        self._raw = raw
        self.keep_alive = keep_alive
        self.response: web.StreamResponse | None = None
        self.started = False  # the status line is out: the status can no longer change
        self.complete = False  # the whole response is out: the connection can carry another

    async def send(self, status: int, body: bytes, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> None:
        response = self._start(web.Response(status=status, body=body, headers=self._headers(
            {"Content-Type": content_type, **(headers or {})})))
        await response.prepare(self._raw)
        await response.write_eof()
        self.complete = True

    async def stream(self, status: int, content_type: str, headers: dict[str, str] | None = None) -> ChunkedBody:
        response = self._start(web.StreamResponse(status=status, headers=self._headers(
            {"Content-Type": content_type, **(headers or {})})))
        await response.prepare(self._raw)
        return ChunkedBody(response, self)

    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        # Said on HTTP/1.1 too (aiohttp leaves it implicit): clients and tests can see the choice.
        return {"X-Content-Type-Options": "nosniff", **headers,
                "Connection": "keep-alive" if self.keep_alive else "close", "Server": SERVER_HEADER}

    def _start(self, response: web.StreamResponse) -> web.StreamResponse:
        if self.started:
            raise RuntimeError("this request has been answered already")
        self.started = True
        if not self.keep_alive:
            response.force_close()
        self.response = response
        return response


Handler = Callable[[Request, Responder], Awaitable[None]]
# A request's head (its body still unread, b"") → None to read the body and handle it (and trust
# its connection from then on: see _Slots), or a Refusal.
Gate = Callable[[Request], "Refusal | None"]
# (status, message, code, path) → the application's error body (JSON) for a request to that path
# ("" when no path could be read)
ErrorBody = Callable[[int, str, "str | None", str], bytes]


@dataclass
class Limits:
    max_head_bytes: int = MAX_HEAD_BYTES
    max_body_bytes: int = MAX_BODY_BYTES
    max_bodies_bytes: int = MAX_BODIES_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout: float = IDLE_TIMEOUT_S
    read_timeout: float = READ_TIMEOUT_S
    head_timeout: float = HEAD_TIMEOUT_S
    max_per_address: int | None = None  # None: max(1, max_connections // PER_ADDRESS_SHARE)

    @property
    def per_address(self) -> int:
        if self.max_per_address is not None:
            return max(1, self.max_per_address)
        return max(1, self.max_connections // PER_ADDRESS_SHARE)


@dataclass
class _Counters:
    """What all connections hold together."""
    bodies_bytes: int = 0  # bodies being read or held by a request being handled
    last_log: dict[str, float] = field(default_factory=dict)  # a warning's kind → when last logged

    def warn_at_most_once_a_minute(self, kind: str, message: str, *args: object) -> None:
        """For warnings a hostile client can cause at will: the log must not be its megaphone."""
        now = asyncio.get_running_loop().time()
        if now - self.last_log.get(kind, -LIMIT_LOG_INTERVAL_S) >= LIMIT_LOG_INTERVAL_S:
            self.last_log[kind] = now
            log.warning(message + " (logged at most once a minute)", *args)


class _Slots:
    """Who holds the ``max_connections`` connection slots.

    A connection is trusted once the gate has let one of its requests through: it showed the
    key, or, on a server with no key (where anyone who can connect may ask anything), it sent a
    complete request. A trickler is never trusted.

    A connection takes a free slot when it opens, if its address holds fewer than
    ``per_address`` slots with connections not trusted (trusted ones do not count against their
    address: several clients behind one NAT, or one client with a pool of connections, are not
    the attack). A connection that gets no slot ("waiting") may still send one head: if the gate
    lets it through, the connection is admitted (``admit``), otherwise it is answered 503 and
    closed. One address may have at most ``max_connections`` connections waiting (closed at once
    beyond), so that a client's burst of new connections is served while a flood from one
    address stays bounded; each waits at most ``head_timeout`` unless its head completes.

    Why evict rather than reserve: a connection cannot say whether it has the key until its head
    has arrived, so slots reserved for keyed clients would have to be taken at connect time by
    anyone, and a reserve of N is filled by N+1 attackers. Eviction needs no guess. A head let
    through that finds every slot taken closes one connection that is not trusted and is
    between requests (its head still incomplete, or idle in keep-alive after a refusal; never
    one whose head has ended), from the address holding the most such slots, the oldest first,
    and takes its slot. Only a trusted head evicts, so untrusted connections cannot evict each
    other, and a trusted connection is never evicted: it is refused only when every slot is
    trusted or busy.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.held: dict["_Connection", None] = {}  # insertion order: the oldest first
        self.unproven: Counter[str] = Counter()  # address → slots held by connections not trusted
        self.waiting: Counter[str] = Counter()  # address → connections without a slot

    def open(self, connection: "_Connection") -> str:
        """A new connection: "slot", "waiting" (no slot; its first head decides) or "closed"."""
        address = connection.address
        per_address = self.limits.per_address
        if len(self.held) < self.limits.max_connections and self.unproven[address] < per_address:
            self.held[connection] = None
            self.unproven[address] += 1
            return "slot"
        if self.waiting[address] >= self.limits.max_connections:
            return "closed"
        self.waiting[address] += 1
        return "waiting"

    def prove(self, connection: "_Connection") -> None:
        """A connection holding a slot is trusted now: it no longer counts against its address."""
        _decrement(self.unproven, connection.address)

    def admit(self, connection: "_Connection") -> bool:
        """A waiting connection whose head the gate let through: a free slot, or one taken from a
        connection not trusted; False when every slot is trusted or busy."""
        if len(self.held) >= self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                return False
            victim.evict()
        _decrement(self.waiting, connection.address)
        self.held[connection] = None
        return True

    def release(self, connection: "_Connection", state: str, trusted: bool) -> None:
        if state == "slot":
            del self.held[connection]
            if not trusted:
                _decrement(self.unproven, connection.address)
        elif state == "waiting":
            _decrement(self.waiting, connection.address)

    def _victim(self) -> "_Connection | None":
        candidates = [c for c in self.held if not c.trusted and c.between_requests]
        if not candidates:
            return None
        most = max(self.unproven[c.address] for c in candidates)
        return next(c for c in candidates if self.unproven[c.address] == most)  # the oldest of that address


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # no entry per address ever seen: the map stays as small as the connections


def client_address(peername: object) -> str:
    """The address a connection is counted against: its IP, or its /64 for IPv6 (one host is
    usually given a whole /64, so counting single IPv6 addresses would cap nothing)."""
    if not isinstance(peername, tuple) or not peername:
        return ""  # a Unix socket, or a transport that cannot say: one shared address
    try:
        ip = ipaddress.ip_address(str(peername[0]).partition("%")[0])
    except ValueError:
        return str(peername[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _RequestTooLarge(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


async def start_server(handler: Handler, *, error_body: ErrorBody, gate: Gate | None = None,
                       host: str | None = None, port: int | None = None, sock: socket.socket | None = None,
                       tls: ssl.SSLContext | None = None, limits: Limits | None = None) -> asyncio.Server:
    """Listen on host:port (or a socket already bound), over TLS when given a context; each
    connection serves its requests one after another."""
    exchange = _Exchange(handler, error_body, gate, limits or Limits())
    server = _Server(exchange)
    return await asyncio.get_running_loop().create_server(server, host, port, sock=sock, ssl=tls)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server TLS context from PEM files; a file that cannot be used raises OSError with one
    line that says which and why."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as e:
        raise OSError(f"TLS: no such file: {e.filename or cert}") from None
    except (ssl.SSLError, ValueError) as e:
        raise OSError(f"TLS: cannot use certificate {cert} with key {key}: {getattr(e, 'reason', None) or e}") \
            from None
    return context


class _Exchange:
    """One request on one connection: limits, gate, body, handler; the aiohttp handler."""

    def __init__(self, handler: Handler, error_body: ErrorBody, gate: Gate | None, limits: Limits) -> None:
        self.handler = handler
        self.error_body = error_body
        self.gate = gate
        self.limits = limits
        self.counters = _Counters()
        self.slots = _Slots(limits)

    async def __call__(self, raw: web.BaseRequest) -> web.StreamResponse:
        connection: _Connection = raw.protocol  # type: ignore[assignment]
        connection.request_started()
        try:
            return await self._answer(raw, connection)
        finally:
            connection.request_finished(body_read=raw.content.is_eof())

    async def _answer(self, raw: web.BaseRequest, connection: "_Connection") -> web.StreamResponse:
        request = _request(raw)
        waiting = connection.state == "waiting"
        if waiting:
            # No slot: only a request the gate lets through gets one (from an untrusted connection).
            verdict = self._judge(request)
            if not (verdict is None and connection.admit()):
                return self._error(raw, 503, f"the server has too many connections open "
                                             f"({self.limits.max_connections}, at most "
                                             f"{self.limits.per_address} from one address before a request "
                                             f"is let through); "
                                             f"retry shortly", "too_many_connections", {"Retry-After": "1"})
        try:
            length = self._check_head(raw)
        except _RequestTooLarge as e:
            return self._error(raw, e.status, str(e), e.code)
        if not waiting:
            verdict = self._judge(request)
            if verdict is None:
                connection.prove()
        if verdict is not None:
            refusal = verdict
            keep_alive = request.keep_alive and raw.content.is_eof()  # a body still coming is not read: close
            return json_response(refusal.status, refusal.body, refusal.headers, keep_alive)
        if self.counters.bodies_bytes + length > self.limits.max_bodies_bytes:
            # Authorized clients too: so many large bodies at once could exhaust memory.
            return self._error(raw, 503, "the server is holding too many large request bodies; retry shortly",
                               "too_many_large_requests", {"Retry-After": "1"})
        self.counters.bodies_bytes += length
        try:
            try:
                request.body = await self._read_body(raw)
            except _RequestTooLarge as e:
                return self._error(raw, e.status, str(e), e.code)
            responder = Responder(raw, request.keep_alive)
            await self._run_handler(request, responder)
            if responder.response is None:
                return self._error(raw, 500, "internal server error")
            return responder.response
        finally:
            self.counters.bodies_bytes -= length

    def _judge(self, request: Request) -> Refusal | None:
        return self.gate(request) if self.gate is not None else None

    def _check_head(self, raw: web.BaseRequest) -> int:
        """The head's size, and the body's length to reserve (the most allowed when it comes
        chunked, its length unknown)."""
        head = (len(raw.method) + len(raw.raw_path) + len("  HTTP/1.1\r\n\r\n")
                + sum(len(name) + len(value) + 4 for name, value in raw.raw_headers))  # "name: value\r\n"
        if head > self.limits.max_head_bytes:
            raise _RequestTooLarge(431, f"the request head is larger than {self.limits.max_head_bytes} bytes")
        length = raw.content_length
        if length is None:
            return self.limits.max_body_bytes if raw.body_exists else 0
        if length > self.limits.max_body_bytes:
            raise _RequestTooLarge(413, f"the request body is larger than {self.limits.max_body_bytes} bytes")
        return length

    async def _read_body(self, raw: web.BaseRequest) -> bytes:
        if raw.headers.get("Expect", "").lower() == "100-continue" and not raw.content.is_eof():
            await raw.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        while True:
            try:
                chunk = await asyncio.wait_for(raw.content.readany(), self.limits.read_timeout)
            except asyncio.TimeoutError:
                raise _RequestTooLarge(408, f"the request body stopped arriving (nothing for "
                                            f"{self.limits.read_timeout:g} s)") from None
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > self.limits.max_body_bytes:
                raise _RequestTooLarge(413, f"the request body is larger than {self.limits.max_body_bytes} bytes")

    async def _run_handler(self, request: Request, responder: Responder) -> None:
        """A fault below the routes' own error handling: one log line, a 500 if nothing has been
        sent yet, and the connection closes."""
        try:
            await self.handler(request, responder)
        except ConnectionError:
            raise  # the client went away; aiohttp ends the connection
        except Exception as error:  # noqa: BLE001 - never a traceback to the client or the log
            log.error("%s %s: internal error: %s: %s", request.method, request.path, type(error).__name__, error)
            if not responder.started:
                responder.keep_alive = False
                await responder.send(500, self.error_body(500, "internal server error", None, request.path))
            elif responder.response is not None:
                responder.response.force_close()

    def _error(self, raw: web.BaseRequest, status: int, message: str, code: str | None = None,
               headers: dict[str, str] | None = None) -> web.StreamResponse:
        """A refusal below the routes: the connection closes after it (a body not read is dropped)."""
        path = raw.raw_path.partition("?")[0]
        log.warning("%s %s -> %d %s", raw.method, path[:200], status, message)
        return json_response(status, self.error_body(status, message, code, path), headers or {}, keep_alive=False)


def json_response(status: int, body: bytes, headers: dict[str, str], keep_alive: bool) -> web.Response:
    response = web.Response(status=status, body=body, headers={
        "Content-Type": "application/json", "X-Content-Type-Options": "nosniff", **headers,
        "Server": SERVER_HEADER,
        "Connection": "keep-alive" if keep_alive else "close"})
    if not keep_alive:
        response.force_close()
    return response


def _request(raw: web.BaseRequest) -> Request:
    path, _, query = raw.raw_path.partition("?")
    return Request(raw.method, path, query, {k.lower(): v for k, v in raw.headers.items()}, b"", raw.keep_alive)


class _Connection(web.RequestHandler):
    """aiohttp's connection, plus its connection slot (``_Slots``), the head deadline, an error
    body in the API's shape for requests that cannot be parsed, and a bound on bytes sent while
    no head has completed."""

    def __init__(self, server: "_Server", **kwargs) -> None:
        super().__init__(server, **kwargs)
        self.exchange = server.exchange
        self.address = ""
        self.state = "new"  # "slot", "waiting" (no slot yet), "closed" (refused) or "gone"
        self.trusted = False  # the gate has let one of its requests through: never evicted
        self.in_request = False
        self.draining = False  # the last request's body was not read: what comes is not a head
        self.idle_bytes = 0  # bytes of a head still incomplete
        self.tail = b""  # the last 3 bytes seen, for a blank line split across reads
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.address = client_address(transport.get_extra_info("peername"))
        slots = self.exchange.slots
        self.state = slots.open(self)
        if self.state != "slot":
            if len(slots.held) >= self.exchange.limits.max_connections:
                self.exchange.counters.warn_at_most_once_a_minute(
                    "limit", "%d connections open, the most allowed: answering new ones 503 unless they show the "
                    "key (none is set: unless they send a complete request)", len(slots.held))
            else:
                self.exchange.counters.warn_at_most_once_a_minute(
                    "address limit", "%s holds %d connections that have not shown the key, the most one address "
                    "may: answering its new ones 503 unless they do", self.address, self.exchange.limits.per_address)
        super().connection_made(transport)
        if self.state == "closed":
            self.force_close()  # this address already has as many waiting as it may: not even a 503
            return
        self._start_head_clock()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._release()
        super().connection_lost(exc)

    def _release(self) -> None:
        self._stop_head_clock()
        if self.state in ("slot", "waiting"):
            self.exchange.slots.release(self, self.state, self.trusted)
        self.state = "gone"

    @property
    def between_requests(self) -> bool:
        """Idle, or its head still incomplete: a head that has ended (its request perhaps not yet
        started, a loop turn later) is a request, and may be the one that shows the key."""
        return not self.in_request and self.idle_bytes >= 0

    def admit(self) -> bool:
        """A waiting connection whose head the gate let through: a slot, if one can be had."""
        if not self.exchange.slots.admit(self):
            return False
        self.state, self.trusted = "slot", True
        return True

    def prove(self) -> None:
        if not self.trusted and self.state == "slot":
            self.exchange.slots.prove(self)
        self.trusted = True

    def evict(self) -> None:
        """Give this connection's slot to a trusted one: released at once (connection_lost comes
        a loop turn later), and closed unanswered, as a kept-alive connection may be at any time."""
        self.exchange.counters.warn_at_most_once_a_minute(
            "evict", "every connection slot is taken: closing one that has not shown the key (from %s) for one that has",
            self.address)
        self._release()
        self.force_close()

    def _start_head_clock(self) -> None:
        if self.head_timer is None:
            self.head_timer = asyncio.get_running_loop().call_later(self.exchange.limits.head_timeout,
                                                                    self._head_too_slow)

    def _stop_head_clock(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.in_request:
            return
        self.exchange.counters.warn_at_most_once_a_minute(
            "slow head", "a client (%s) did not complete a request head within %g s; closed", self.address,
            self.exchange.limits.head_timeout)
        self.force_close()

    def data_received(self, data: bytes) -> None:
        if not (self.in_request or self.draining) and self.idle_bytes >= 0:
            if data:
                self._start_head_clock()  # the first byte of a kept-alive connection's next head
            if b"\r\n\r\n" in data or b"\r\n\r\n" in self.tail + data[:3]:
                self.idle_bytes = -1  # the head is complete; the parser takes it from here
            else:
                self.idle_bytes += len(data)
                self.tail = (self.tail + data[-3:])[-3:]
                if self.idle_bytes > 2 * self.exchange.limits.max_head_bytes:
                    log.warning("a client sent %d bytes without ending a request head; closed", self.idle_bytes)
                    self.force_close()
                    return
        super().data_received(data)

    def request_started(self) -> None:
        self.in_request = True
        self._stop_head_clock()

    def request_finished(self, body_read: bool) -> None:
        self.in_request, self.draining = False, not body_read
        self.idle_bytes, self.tail = 0, b""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse (or a failure it caught): one log line and the API's
        error body, and the connection closes. A client that went away before its answer (one
        that gave up while the server started, say) is no fault: nothing is logged above debug."""
        if isinstance(exc, ConnectionError):
            log.debug("%s %s: the client went away before its answer", request.method, request.path[:200])
            return json_response(499, self.exchange.error_body(499, "client closed request", None, ""), {},
                                 keep_alive=False)
        if isinstance(exc, LineTooLong):
            status, text = 431, f"a request header line is longer than {self.exchange.limits.max_head_bytes} bytes"
        elif status < 500:
            text = f"malformed request: {' '.join(str(message or exc or 'unreadable').split())[:200]}"
        else:
            text = "internal server error"
        log.warning("unreadable request -> %d %s", status, text)
        return json_response(status, self.exchange.error_body(status, text, None, ""), {}, keep_alive=False)


class _Server(web.Server):
    """aiohttp's low-level server making our connections. Requests it cannot parse are answered
    as HTTP/1.1 (aiohttp answers them as 1.0; this server speaks 1.1)."""

    def __init__(self, exchange: _Exchange) -> None:
        super().__init__(exchange, request_factory=self._request, handler_cancellation=True)
        self.exchange = exchange
        self.loop = asyncio.get_running_loop()
        limits = exchange.limits
        self.connection_options = dict(
            keepalive_timeout=limits.idle_timeout, lingering_time=LINGER_S, max_line_size=limits.max_head_bytes,
            max_field_size=limits.max_head_bytes, max_headers=MAX_HEADER_FIELDS, access_log=None)

    def _request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        if message is PARSE_ERROR_MESSAGE:
            message = message._replace(version=HttpVersion11)
        return web.BaseRequest(message, payload, protocol, writer, task, self.loop)

    def __call__(self) -> _Connection:
        return _Connection(self, loop=self.loop, **self.connection_options)
