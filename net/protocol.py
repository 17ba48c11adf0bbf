"""One QUIC connection of the swarm, as an aioquic protocol that reacts to events and nothing else.

Bytes arriving on a stream are buffered by that stream's ``FrameDecoder`` until a frame is
complete; complete frames go to the connection's ``ConnectionHandler`` (the role logic in
``swarmctl``), or to a waiter when this side opened the stream with ``request``. A stream that
carries bytes which are not valid frames is reset and logged in one line; the connection and its
other streams carry on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from typing import Protocol

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from cryptography import x509

from . import batch
from .identity import member_account, member_name, member_role
from .tls import CertificateCheck, peer_certificate, raise_stream_limits, require_client_certificates
from .wire import DEFAULT_MAX_FRAME, Frame, FrameDecoder, WireError

log = logging.getLogger("swarmctl.net")

STREAM_ERROR_BAD_FRAME = 0x101  # application error code for a reset stream
STREAM_ERROR_NOT_WANTED = 0x102  # ... for a stream whose data we no longer want (STOP_SENDING)
# What a peer may make us hold in frames it has not finished sending. aioquic keeps raising its
# flow-control windows as we read, so these are the only bound. A joiner (no certificate yet)
# sends one small CSR; a member's budget leaves room for many large prefills in flight at once.
ANONYMOUS_MAX_FRAME = 64 * 1024
ANONYMOUS_BUFFER_BUDGET = 256 * 1024
MEMBER_BUFFER_BUDGET = 256 * 1024 * 1024  # per account, over all its connections to this process
# Every open connection of each account (a member's invite, identity.member_account), so what one
# person makes us hold is bounded together: two connections of one member with 150 MB each held
# 305 MB, and four names of one invite 960 MB.
_ACCOUNT_CONNECTIONS: dict[str, weakref.WeakSet] = {}


class ConnectionHandler(Protocol):
    """What a role does with a connection. Called on the event loop; must not block."""

    def connection_made(self, conn: "SwarmProtocol") -> None: ...

    def frame_received(self, conn: "SwarmProtocol", stream_id: int, frame: Frame) -> None: ...

    def stream_ended(self, conn: "SwarmProtocol", stream_id: int) -> None: ...

    def connection_lost(self, conn: "SwarmProtocol") -> None: ...


class StreamClosedError(ConnectionResetError):
    """Sending on a stream that is already finished or was reset (by us or the peer)."""


class SwarmProtocol(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, stream_handler=None, *, handler: ConnectionHandler,
                 max_frame: int = DEFAULT_MAX_FRAME, client_check: CertificateCheck | None = None,
                 anonymous_alpns: frozenset[str] = frozenset()) -> None:
        super().__init__(quic, stream_handler)
        self.handler = handler
        self.max_frame = max_frame
        self.peer_cert: x509.Certificate | None = None
        self.peer_name = ""  # the authenticated member at the other end ("" for an anonymous joiner)
        self.peer_role = ""  # what its certificate lets it be: "host", "trunk" or "asker" ("" if anonymous)
        self.peer_account = ""  # whose budget it spends: its invite's, shared by all its names ("" if anonymous)
        self.alpn: str | None = None
        self.is_open = False
        self.close_reason = ""  # what the peer (or we) said when the connection ended
        self._decoders: dict[int, FrameDecoder] = {}
        self._dead_streams: set[int] = set()
        self._waiters: dict[int, asyncio.Future[Frame]] = {}
        self._progress: asyncio.Future[None] | None = None
        self.owned_transport: asyncio.DatagramTransport | None = None  # set when we opened the socket
        self.own_socket: socket.socket | None = None  # that socket, read by the batch (net/batch.py)
        self.last_heard = self._loop.time()  # when the peer last sent anything (liveness checks)
        self.ended = False  # the connection terminated (or never got anywhere)
        raise_stream_limits(quic)
        if not quic.configuration.is_client and client_check is not None:
            require_client_certificates(quic, client_check, anonymous_alpns)

    # --- events ---

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.HandshakeCompleted):
            self._handshake_completed(event)
        elif isinstance(event, events.StreamDataReceived):
            self._stream_data(event)
        elif isinstance(event, events.StreamReset):
            self._forget_stream(event.stream_id)
            self._fail_waiter(event.stream_id, ConnectionResetError("the peer reset the stream"))
        elif isinstance(event, events.StopSendingReceived):
            self._wake_senders()  # a sender waiting in drain() for this stream: nothing more will drain
        elif isinstance(event, events.ConnectionTerminated):
            self.is_open = False
            self.ended = True
            self.close_reason = event.reason_phrase or ""
            self._decoders.clear()  # what a closed connection buffered goes now, not at the next full GC
            for stream_id in list(self._waiters):
                self._fail_waiter(stream_id, ConnectionError(f"connection closed: {event.reason_phrase or 'closed'}"))
            self._wake_senders()
            self.handler.connection_lost(self)

    def _handshake_completed(self, event: events.HandshakeCompleted) -> None:
        self.alpn = event.alpn_protocol
        self.peer_cert = peer_certificate(self._quic)
        self.peer_name = member_name(self.peer_cert) if self.peer_cert is not None else ""
        self.peer_role = member_role(self.peer_cert) if self.peer_cert is not None else ""
        self.peer_account = member_account(self.peer_cert) if self.peer_cert is not None else ""
        self.is_open = True
        if self.peer_name:
            _ACCOUNT_CONNECTIONS.setdefault(self.peer_account, weakref.WeakSet()).add(self)
        self.handler.connection_made(self)

    def _stream_data(self, event: events.StreamDataReceived) -> None:
        stream_id = event.stream_id
        if stream_id in self._dead_streams:
            return
        anonymous = not self.peer_name
        decoder = self._decoders.get(stream_id)
        if decoder is None:
            decoder = self._decoders[stream_id] = FrameDecoder(min(self.max_frame, ANONYMOUS_MAX_FRAME) if anonymous
                                                               else self.max_frame)
        try:
            frames = decoder.feed(event.data) if event.data else []
            if event.end_stream:
                decoder.finish()
        except WireError as e:
            self.reject_stream(stream_id, str(e))
            return
        if decoder.buffered:
            if anonymous:
                budget, held = ANONYMOUS_BUFFER_BUDGET, self.buffered
            else:
                budget = MEMBER_BUFFER_BUDGET
                held = sum(c.buffered for c in _ACCOUNT_CONNECTIONS.get(self.peer_account, ()) if c.is_open)
            if held > budget:
                whose = f"{self.peer_name}" if self.peer_account == self.peer_name else \
                    f"{self.peer_name} and the other names of its invite"
                self.close_with(f"over {budget} bytes of unfinished frames buffered"
                                + ("" if anonymous else f" from {whose} over all their connections"))
                return
        for frame in frames:
            waiter = self._waiters.pop(stream_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(frame)
            else:
                self.handler.frame_received(self, stream_id, frame)
        if event.end_stream:
            self._decoders.pop(stream_id, None)
            self._fail_waiter(stream_id, ConnectionResetError("the peer ended the stream without answering"))
            self.handler.stream_ended(self, stream_id)

    @property
    def buffered(self) -> int:
        """Bytes of frames the peer has begun and not finished, on this connection."""
        return sum(d.buffered for d in self._decoders.values())

    def datagram_received(self, data, addr) -> None:
        if self.own_socket is not None and not batch.active():  # our own socket: read what else waits on it
            batch.drain(self.own_socket, data, addr, self.datagram_received)
            return
        self.last_heard = self._loop.time()
        self._quic.receive_datagram(data, addr, now=self.last_heard)
        self._process_events()
        if not batch.defer(self):  # (net/batch.py: one transmit per batch of datagrams read)
            self.flush()

    def flush(self) -> None:
        """Send what the datagrams received made due, once for all of them."""
        self.transmit()
        self._wake_senders()  # acknowledgements may have freed send buffer space

    async def wait_connected(self) -> None:
        """aioquic's, except that a handshake whose wait was given up (a connect that timed out or
        was cancelled) does not log "Future exception was never retrieved" when the connection
        ends later: aioquic shields its waiter and fails it then (found by harness/sim, seed 28)."""
        if self._connected_waiter is not None:
            raise RuntimeError("Already awaiting connected")
        if not self._connected:
            waiter = self._connected_waiter = self._loop.create_future()
            waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
            await asyncio.shield(waiter)

    # --- sending ---

    async def ping(self) -> None:
        """aioquic's ping, except that a ping whose wait timed out does not log "Future exception
        was never retrieved" when the connection closes later (aioquic fails its waiter then)."""
        waiter = self._loop.create_future()
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._ping_waiters[id(waiter)] = waiter
        self._quic.send_ping(id(waiter))
        self.transmit()
        await asyncio.shield(waiter)

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """The peer's IP and UDP port as this side sees them: the source of its datagrams on the
        connection's current network path (after any NAT between us; it follows a migration).
        None before any datagram. An IPv4 peer reaching a dual-stack socket shows as
        plain IPv4, not ``::ffff:a.b.c.d``."""
        addr = self._quic.get_peer_address()
        return None if addr is None else _plain_address(addr)

    @property
    def validated_peer_address(self) -> tuple[str, int] | None:
        """``peer_address`` on a path the peer proved it receives on (the handshake, or a path
        challenge it answered). QUIC moves a connection to any source address a datagram of it
        comes from at once, and validates that path after; a peer can write someone else's
        address there. So where others are told to send (punching, relays) is this one: the
        newest validated path, which is where QUIC goes back to if the new path fails."""
        for path in self._quic._network_paths:  # (aioquic keeps the current path first)
            if path.is_validated:
                return _plain_address(path.addr)
        return None

    @property
    def open_streams(self) -> int:
        """Streams QUIC still tracks on this connection: one not yet ended on both sides counts
        against the peer's stream limit, so a number that only grows is a leak."""
        return len(self._quic._streams)

    def open_stream(self) -> int:
        """The id of the next new stream: aioquic creates it when data is first sent on it, so
        send before anything else may open one."""
        return self._quic.get_next_available_stream_id()

    def send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        if not self.is_open:
            raise ConnectionError(f"connection to {self.peer_name or 'peer'} is closed")
        try:
            self._quic.send_stream_data(stream_id, data, end_stream=end)
        except (ValueError, RuntimeError, AssertionError) as e:  # aioquic: the stream was finished or reset
            raise StreamClosedError(f"stream {stream_id} to {self.peer_name or 'peer'} is closed: {e}") from None
        self.transmit()

    def finish(self, stream_id: int) -> None:
        """End our side of a stream the peer has ended (or abandoned), if it is still open, so that
        QUIC can forget it: a peer may hold only so many streams at once (128 in aioquic)."""
        stream = self._quic._streams.get(stream_id)
        if not self.is_open or stream is None or stream.sender._buffer_fin is not None \
                or stream.sender._reset_error_code is not None:
            return
        try:
            self.send(stream_id, b"", end=True)
        except ConnectionError:
            pass

    async def drain(self, stream_id: int, limit: int) -> None:
        """Backpressure: wait until at most ``limit`` bytes of this stream are unacknowledged.
        (aioquic buffers whatever it is given; this is where the sender waits instead.)"""
        while self.is_open and self._backlog(stream_id) > limit:
            if self._progress is None or self._progress.done():
                self._progress = self._loop.create_future()
            await self._progress

    def _backlog(self, stream_id: int) -> int:
        stream = self._quic._streams.get(stream_id)
        if stream is None or stream.sender._reset_error_code is not None:
            return 0  # (a reset stream's buffer is never sent nor acknowledged: its next send raises)
        return len(stream.sender._buffer)

    def _wake_senders(self) -> None:
        if self._progress is not None and not self._progress.done():
            self._progress.set_result(None)

    async def request(self, data: bytes, timeout: float = 30.0, stream_id: int | None = None) -> Frame:
        """Send one frame on a new stream (or the given fresh one) and wait for the first frame the
        peer answers on it. Later frames on that stream go to the handler.

        The request ends our side of the stream: QUIC lets a peer open only so many streams (128
        in aioquic) and grants more only as streams finish in both directions, so a long-lived
        connection that made requests without ending them would stall at the 129th."""
        stream_id = self.open_stream() if stream_id is None else stream_id
        waiter: asyncio.Future[Frame] = self._loop.create_future()
        self._waiters[stream_id] = waiter
        self.send(stream_id, data, end=True)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        finally:
            self._waiters.pop(stream_id, None)

    def reject_stream(self, stream_id: int, reason: str) -> None:
        """Reset a stream that carried bad bytes; log one line; keep the connection."""
        log.warning("stream %d from %s rejected: %s", stream_id, self.peer_name or "anonymous peer", reason)
        self._forget_stream(stream_id)
        self._dead_streams.add(stream_id)
        try:
            self._quic.stop_stream(stream_id, STREAM_ERROR_BAD_FRAME)
        except (ValueError, AssertionError):
            pass  # e.g. a unidirectional stream we cannot stop
        try:
            self._quic.reset_stream(stream_id, STREAM_ERROR_BAD_FRAME)
        except (ValueError, AssertionError):
            pass  # e.g. a peer-initiated unidirectional stream we cannot send on
        self.transmit()

    def abandon(self, stream_id: int) -> None:
        """We no longer want what the peer sends on a stream we opened (a fetch's batch whose
        chunks came from elsewhere first): ask it to stop sending, and drop what still arrives."""
        self._forget_stream(stream_id)
        self._dead_streams.add(stream_id)
        try:
            self._quic.stop_stream(stream_id, STREAM_ERROR_NOT_WANTED)
        except (ValueError, AssertionError):
            pass  # (the peer had ended it already)
        self.transmit()

    def _forget_stream(self, stream_id: int) -> None:
        self._decoders.pop(stream_id, None)

    def _fail_waiter(self, stream_id: int, error: Exception) -> None:
        waiter = self._waiters.pop(stream_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close_with(self, reason: str) -> None:
        log.info("closing connection to %s: %s", self.peer_name or "peer", reason)
        self.close(error_code=0x100, reason_phrase=reason[:200])


class RequestOnlyHandler:
    """For connections that only send requests and read replies (a joiner, a status query)."""

    def connection_made(self, conn: SwarmProtocol) -> None:
        pass

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        pass

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        pass

    def connection_lost(self, conn: SwarmProtocol) -> None:
        pass


def _plain_address(addr) -> tuple[str, int]:
    """(ip, port) of an aioquic network address; an IPv4 peer reaching a dual-stack socket shows
    as plain IPv4, not ``::ffff:a.b.c.d``."""
    host, port = addr[:2]
    if host.lower().startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, int(port)
