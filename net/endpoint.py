"""Opening QUIC endpoints: a member's server, member-to-member client connections, a joiner's
pinned connection to the host. Configuration is built once and passed in."""

from __future__ import annotations

import asyncio
import functools
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, TypeVar

from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from . import batch
from .identity import Credentials, IdentityError
from .protocol import ConnectionHandler, RequestOnlyHandler, SwarmProtocol
from .tls import (ALPN_JOIN, ALPN_SWARM, CertificateCheck, check_pinned_host, client_configuration,
                  datagram_size_for, join_configuration, server_configuration)
from .wire import DEFAULT_MAX_FRAME, decode_control, encode_control

CONNECT_TIMEOUT = 10.0
# Connections a server holds that are not (yet) a member's: handshakes in progress and joiners.
# Each costs a QUIC connection and TLS state (200 of them added 63 MB to a host) and may buffer
# up to ANONYMOUS_BUFFER_BUDGET; beyond this many the oldest is closed. A
# member's handshake takes a round trip, so a flood must open this many within it to stop one.
MAX_ANONYMOUS_CONNECTIONS = 64
QUIC_IDLE_TIMEOUT = "Idle timeout"  # aioquic's reason when a connection heard nothing for idle_timeout

T = TypeVar("T")


class AddressError(ValueError):
    pass


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, default_port: int | None = None) -> "Address":
        text = text.strip()
        if text.startswith("["):  # [IPv6]:port
            host, _, rest = text[1:].partition("]")
            port_text = rest.removeprefix(":")
        elif text.count(":") == 1:
            host, port_text = text.split(":")
        else:
            host, port_text = text, ""
        if not port_text:
            if default_port is None:
                raise AddressError(f"address {text!r} needs a port (HOST:PORT)")
            port_text = str(default_port)
        if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise AddressError(f"invalid address {text!r} (expected HOST:PORT)")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class AnonymousGuard:
    """A server's protocol factory that keeps at most ``limit`` connections not yet known to be a
    member's (no certificate checked yet, or a joiner's) by closing the oldest of them."""

    def __init__(self, create: Callable[..., SwarmProtocol], limit: int = MAX_ANONYMOUS_CONNECTIONS) -> None:
        self.create, self.limit = create, limit
        self.waiting: list[SwarmProtocol] = []  # oldest first
        self.closed = 0

    def __call__(self, *args, **kwargs) -> SwarmProtocol:
        protocol = self.create(*args, **kwargs)
        self.waiting = [p for p in self.waiting if not p.peer_name and not p.ended]
        while len(self.waiting) >= self.limit:
            self.waiting.pop(0).close(error_code=0x100, reason_phrase="too many connections without a member's "
                                                                       "certificate; try again")
            self.closed += 1
        self.waiting.append(protocol)
        return protocol


async def serve_member(address: Address, creds: Credentials, handler: ConnectionHandler, *,
                       client_check: CertificateCheck, accept_joins: bool = False,
                       max_frame: int = DEFAULT_MAX_FRAME, max_datagram_size: int | None = None) -> QuicServer:
    """Listen for swarm connections (mTLS required) and, on the host, for joiners."""
    alpns = [ALPN_SWARM, ALPN_JOIN] if accept_joins else [ALPN_SWARM]
    config = server_configuration(creds, alpns=alpns,
                                  max_datagram_size=max_datagram_size or datagram_size_for(address.host))
    loop = asyncio.get_running_loop()
    try:
        family, _, _, _, addr = (await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_DGRAM,
                                                        flags=socket.AI_PASSIVE))[0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {address}: {e.strerror}") from None
    sock = _bound_socket(family, addr)
    create = AnonymousGuard(functools.partial(SwarmProtocol, handler=handler, max_frame=max_frame,
                                              client_check=client_check,
                                              anonymous_alpns=frozenset({ALPN_JOIN}) if accept_joins else frozenset()))
    _, server = await loop.create_datagram_endpoint(
        lambda: DrainingServer(sock, configuration=config, create_protocol=create), sock=sock)
    return server


class DrainingServer(QuicServer):
    """aioquic's server, reading its socket a batch at a time (net/batch.py)."""

    def __init__(self, sock: socket.socket, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sock: socket.socket | None = sock

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.sock = batch.readable(transport, self.sock)

    def datagram_received(self, data, addr) -> None:
        if batch.active() or self.sock is None:
            super().datagram_received(data, addr)
        else:
            batch.drain(self.sock, data, addr, super().datagram_received)


def _bound_socket(family: int, addr: tuple) -> socket.socket:
    """A non-blocking UDP socket bound to ``addr``, as asyncio makes one (we keep it to read it in
    batches)."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def connect_member(address: Address, creds: Credentials, peer_name: str, handler: ConnectionHandler, *,
                         max_frame: int = DEFAULT_MAX_FRAME, max_datagram_size: int | None = None) -> SwarmProtocol:
    config = client_configuration(creds, peer_name=peer_name,
                                  max_datagram_size=max_datagram_size or datagram_size_for(address.host))
    return await _connect(address, config, handler, max_frame)


async def connect_pinned_host(address: Address, ca_fingerprint: str, handler: ConnectionHandler):
    """A joiner's connection: refuses (closes) unless the host proves it holds the pinned CA's chain."""
    conn = await _connect(address, join_configuration(datagram_size_for(address.host)), handler, DEFAULT_MAX_FRAME)
    try:
        ca_cert = check_pinned_host(conn._quic, ca_fingerprint)
    except IdentityError:
        await close(conn)
        raise
    return conn, ca_cert


class NoAddressAnswered(ConnectionError):
    """None of a node's addresses could be connected to. ``failures``: each address tried, in
    order, with what went wrong there; the message joins those errors."""

    def __init__(self, failures: list[tuple[str, Exception]]) -> None:
        super().__init__("; ".join(str(e) for _, e in failures) or "no host address")
        self.failures = failures


async def connect_first(addresses: Iterable[str], connect: Callable[[Address], Awaitable[T]], *,
                        failures: tuple[type[Exception], ...] = (ConnectionError, OSError)) -> T:
    """``connect`` to each "HOST:PORT" in turn and return the first connection made (a host
    advertises several addresses; not every one is reachable from everywhere). The ``failures``
    move on to the next address; any other error, a malformed address included, is raised."""
    tried: list[tuple[str, Exception]] = []
    for text in addresses:
        try:
            return await connect(Address.parse(text))
        except failures as e:
            tried.append((text, e))
    raise NoAddressAnswered(tried)


async def resolve(address: Address) -> Address:
    """The address with its host name resolved to an IP address (the first the resolver gives)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(address.host, address.port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConnectionError(f"cannot resolve {address}: {e.strerror}") from None
    host, port = infos[0][4][:2]
    return Address(host, port)


async def _connect(address: Address, config: QuicConfiguration, handler: ConnectionHandler,
                   max_frame: int) -> SwarmProtocol:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConnectionError(f"cannot resolve {address}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    connection = QuicConnection(configuration=config)
    sock = _bound_socket(family, ("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: SwarmProtocol(connection, handler=handler, max_frame=max_frame), sock=sock)
    protocol.own_socket = batch.readable(transport, sock)
    protocol.connect(addr)
    try:
        await asyncio.wait_for(protocol.wait_connected(), CONNECT_TIMEOUT)
    except (ConnectionError, asyncio.TimeoutError) as e:
        reason = close_reason(connection)
        transport.close()
        if isinstance(e, asyncio.TimeoutError) or reason == QUIC_IDLE_TIMEOUT:
            raise ConnectionError(no_answer(address)) from None
        raise ConnectionError(f"cannot connect to {address}: {reason or 'refused'}") from None
    protocol.owned_transport = transport  # closed by close()
    return protocol


def no_answer(address: Address) -> str:
    """What a handshake that got no reply means, in the user's words rather than QUIC's ("Idle
    timeout"): nothing listens there, or a firewall drops UDP on the way."""
    return f"no answer from {address} (is it running, and is UDP port {address.port} reachable?)"


def close_reason(connection: QuicConnection) -> str:
    """Why a connection closed, as the peer or aioquic said ("" if it did not say)."""
    event = getattr(connection, "_close_event", None)
    return getattr(event, "reason_phrase", "") or ""


async def close(conn: SwarmProtocol, reason: str = "") -> None:
    """Close a connection we opened and release its socket."""
    conn.close(reason_phrase=reason)
    try:
        await asyncio.wait_for(conn.wait_closed(), 2.0)
    except asyncio.TimeoutError:
        pass
    if conn.owned_transport is not None:
        conn.owned_transport.close()


async def close_all(conns: Iterable[SwarmProtocol], reason: str = "") -> None:
    """``close`` several connections at once: each waits out QUIC's closing period (about three
    probe timeouts, 0.1 s a connection on loopback, measured), so one after another that adds up
    (an asker's three connections at the end of every ask)."""
    await asyncio.gather(*(close(conn, reason) for conn in conns))


async def ask_member(address: Address, creds: Credentials, member: str, message: dict) -> dict:
    """One control request to a member over a connection of its own (a status view, a test)."""
    conn = await connect_member(address, creds, member, RequestOnlyHandler())
    try:
        return decode_control((await conn.request(encode_control(message))).body)
    finally:
        await close(conn)
