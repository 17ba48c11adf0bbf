"""UDP hole punching, from the very socket QUIC then uses.

A NAT lets a datagram in only as the answer to one that went out: the router keeps a mapping
(private ip:port → public ip:port) and lets in datagrams from the address the member sent to.
Two members behind NATs therefore both send at once, each to the other's public address as the
rendezvous saw it; the first datagrams open each side's mapping, the later ones get through.
That only works from the socket whose mapping the rendezvous observed, so the same socket must
carry QUIC afterwards: ``SharedSocket`` is one UDP socket that carries QUIC (a server, client
connections, or both) and, beside it, these small control datagrams.

Opening probes go out with a low TTL (OPENING_TTL): enough to cross our own router, which opens
our mapping, too little to reach the peer's. A router that drops unasked datagrams only when it
would forward them (FORWARD DROP, INPUT ACCEPT: common on Linux-based home routers) takes a
probe that arrives before its member sent anything as meant for itself, answers it and keeps a
conntrack entry for it; that entry holds the member's public port, so the member's own datagrams
to that peer then leave from another port and the punch fails. While the first
probes of both ends die on the way, each end's own mapping is open before the other's full probes
arrive. An end sends full probes once it has heard the peer (its mapping is open) or the opening
time is over. (A peer whose ticket came later than ours by more than that can still hit the
problem: the link is relayed, and the dialer punches again in the background next time, when the
router's entry has expired; swarmctl/reaching/path_memo.py.)

Control datagrams start with a zero byte. Every QUIC packet has its top bit (long header) or its
"fixed bit" 0x40 (short header) set, so no QUIC packet starts with 0x00 and the two never mix.

    shared = await open_shared(sock)                 # sock: bound UDP socket, e.g. port 7471
    public = await observe(shared, host_echo)        # net.rendezvous: how the host sees us
    peer = await punch(shared, ticket)               # ticket from the rendezvous
    server = serve_on(shared, creds, handler, client_check=...)   # and/or
    conn = await connect_on(shared, peer, creds, "bob", handler)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Callable

from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header

from . import batch, clock, endpoint, path_mtu
from .endpoint import QUIC_IDLE_TIMEOUT, Address, AnonymousGuard, close_reason, no_answer, resolve
from .identity import Credentials
from .protocol import ConnectionHandler, SwarmProtocol
from .tls import (ALPN_SWARM, DEFAULT_DATAGRAM_SIZE, CertificateCheck, client_configuration, datagram_size_for,
                  server_configuration)
from .wire import DEFAULT_MAX_FRAME

CONTROL = b"\x00"  # first byte of every non-QUIC datagram on a shared socket
PROBE = b"\x00swP"
NONCE_BYTES = 16
PROBE_INTERVAL = 0.05  # seconds between probes while punching: a few dozen datagrams per second, tiny
PUNCH_TIMEOUT = 3.0
# Hops a probe may cross while both ends open their own mappings: a home router, maybe a
# carrier-grade NAT behind it; two homes are usually ten or more routers apart.
OPENING_TTL = 4
OPENING_S = 0.25  # how long an end sends only low-TTL probes (unless it hears the peer sooner)
# Home routers drop an idle UDP mapping after 30 s or more; a probe this often keeps it open
# when the link is quiet (QUIC itself sends nothing on an idle connection).
KEEPALIVE_INTERVAL = 10.0
CID_LENGTH = 8  # aioquic's default connection ID length (QuicConfiguration.connection_id_length)

log = logging.getLogger("swarmctl.net")

ControlHandler = Callable[[bytes, tuple], None]


class PunchFailed(ConnectionError):
    """No probe from the peer arrived in time: typically a NAT that gives each destination a new
    port (symmetric), or a firewall that drops UDP. The link needs a relay."""


@dataclass(frozen=True)
class PunchTicket:
    """What the rendezvous tells one end of a link: where the other end's probes come from, the
    nonce both ends share (so stray or stale datagrams are ignored) and which end this is."""

    peer: Address
    nonce: bytes
    side: int  # 0 or 1: tells our own probes (reflected back, say) from the peer's


def _key(addr: tuple) -> tuple[str, int]:
    """An address as asyncio reports it, without IPv6's extra fields or v4-mapped prefix."""
    host, port = addr[0], int(addr[1])
    if host.lower().startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, port


class SharedSocket:
    """One UDP socket: control datagrams go to the handler registered for their 4-byte prefix;
    QUIC datagrams go to the connection we opened whose connection ID they carry, the rest to our
    QUIC server, if any. Routing by connection ID, not by address, lets two members hold
    connections both ways between the same two sockets, and several to one peer. Closing it
    closes the socket."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.sock: socket.socket | None = None  # the socket itself, for datagrams with a TTL of their own
        self.batch_sock: socket.socket | None = None  # the socket, where the transport reads it (net/batch.py)
        self.server: QuicServer | None = None
        self.clients: dict[bytes, SwarmProtocol] = {}  # connection ID → a connection we opened
        self.handlers: dict[bytes, ControlHandler] = {PROBE: self._probe_received,
                                                      path_mtu.SIZE_PROBE: self._size_probe_received,
                                                      path_mtu.SIZE_ANSWER: self._size_answer_received}
        self.size_waiters: dict[bytes, asyncio.Future[int]] = {}  # nonce → a size probe waiting for its answer
        self._probing = 0  # size probes in progress (Don't Fragment is on meanwhile)
        self.answer_limit = path_mtu.AnswerLimit()  # how many size probes we answer (spoofed ones too)
        self.punches: dict[bytes, ControlHandler] = {}  # nonce → the punch waiting for its peer's probes
        self.dropped = 0  # datagrams nobody wanted (stale probes, strangers)

    # asyncio.DatagramProtocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        if self.batch_sock is not None and not batch.active():  # read what else waits on the socket (net/batch.py)
            batch.drain(self.batch_sock, data, addr, self.datagram_received)
            return
        if data[:1] == CONTROL:
            handler = self.handlers.get(data[:4])
            if handler is None:
                self.dropped += 1
            else:
                handler(data, _key(addr))
            return
        client = self._client_for(data) if self.clients else None
        if client is not None:
            client.datagram_received(data, addr)
        elif self.server is not None:
            self.server.datagram_received(data, addr)
        else:
            self.dropped += 1

    def _client_for(self, data: bytes) -> SwarmProtocol | None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            return None
        return self.clients.get(header.destination_cid)

    def _probe_received(self, data: bytes, addr: tuple) -> None:
        punch = self.punches.get(data[len(PROBE):len(PROBE) + NONCE_BYTES])
        if punch is None:
            self.dropped += 1  # a stale probe, or a stranger's
        else:
            punch(data, addr)

    def _size_probe_received(self, data: bytes, addr: tuple) -> None:
        """Answer a size probe, if it is large enough to be one and within the answer rates: its
        source address may be forged, and the answer goes there (net/path_mtu.py)."""
        if not path_mtu.worth_answering(data) or not self.answer_limit.allow(addr[0], clock.now()):
            self.dropped += 1
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(path_mtu.answer(data), addr)

    def _size_answer_received(self, data: bytes, addr: tuple) -> None:
        nonce = data[len(path_mtu.SIZE_ANSWER):len(path_mtu.SIZE_ANSWER) + path_mtu.NONCE]
        waiter = self.size_waiters.get(nonce)
        size = path_mtu.read_answer(data[len(path_mtu.SIZE_ANSWER):], nonce)
        if waiter is not None and size is not None and not waiter.done():
            waiter.set_result(size)

    async def datagram_size_to(self, address: Address, sizes: list[int] | None = None) -> int:
        """The largest datagram the path to ``address`` carries, of ``sizes`` (default: what the
        kernel says the first hop takes, then Ethernet's), as answered probes show (net/path_mtu.py);
        the Internet-safe default where none is answered, nothing needs probing, or the platform
        cannot set Don't Fragment."""
        sizes = path_mtu.candidates(address.host, address.port) if sizes is None else sizes
        if not sizes or self.sock is None or not path_mtu.set_probing(self.sock, True):
            return datagram_size_for(address.host)
        self._probing += 1
        try:
            for size in sizes:
                if await self._probe_size(address, size):
                    log.debug("the path to %s carries %d-byte datagrams", address, size)
                    return size
        finally:
            self._probing -= 1
            if not self._probing:
                path_mtu.set_probing(self.sock, False)
        log.debug("no size probe to %s answered: %d-byte datagrams", address, DEFAULT_DATAGRAM_SIZE)
        return DEFAULT_DATAGRAM_SIZE

    async def _probe_size(self, address: Address, size: int) -> bool:
        nonce = os.urandom(path_mtu.NONCE)
        waiter = self.size_waiters[nonce] = asyncio.get_running_loop().create_future()
        try:
            for _ in range(path_mtu.PROBE_TRIES):
                self.sendto(path_mtu.probe(nonce, size), address)
                done, _ = await asyncio.wait({waiter}, timeout=path_mtu.PROBE_WAIT_S / path_mtu.PROBE_TRIES)
                if done:
                    return waiter.result() == size
            return False
        finally:
            del self.size_waiters[nonce]
            waiter.cancel()

    def add_client(self, protocol: SwarmProtocol) -> None:
        """Route the connection's datagrams to it: under its first connection ID now, and under
        every one it issues later (a peer may switch to any of them)."""
        for cid, old in list(self.clients.items()):  # forget connections that ended
            if old._closed.is_set():
                del self.clients[cid]
        self.clients[protocol._quic.host_cid] = protocol
        protocol._connection_id_issued_handler = lambda cid: self.clients.__setitem__(cid, protocol)
        protocol._connection_id_retired_handler = lambda cid: self.clients.pop(cid, None)

    def remove_client(self, protocol: SwarmProtocol) -> None:
        for cid in [cid for cid, p in self.clients.items() if p is protocol]:
            del self.clients[cid]

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error for one destination says nothing about the others

    def connection_lost(self, exc: Exception | None) -> None:
        for client in dict.fromkeys(self.clients.values()):  # (each once, in the order they came)
            client.connection_lost(exc)

    @property
    def local_address(self) -> Address:
        host, port = self.transport.get_extra_info("sockname")[:2]
        return Address(host, port)

    def sendto(self, data: bytes, addr: Address, ttl: int | None = None) -> None:
        """Send one datagram; with ``ttl``, that datagram alone leaves with that TTL (hop limit),
        so QUIC packets sent meanwhile on the same socket keep the default."""
        if self.transport is None or self.transport.is_closing():
            return
        if ttl is None or self.sock is None:
            self.transport.sendto(data, (addr.host, addr.port))
            return
        v6 = self.sock.family == socket.AF_INET6
        level, option = (socket.IPPROTO_IPV6, socket.IPV6_HOPLIMIT) if v6 else (socket.IPPROTO_IP, socket.IP_TTL)
        try:
            self.sock.sendmsg([data], [(level, option, struct.pack("i", ttl))], 0, (addr.host, addr.port))
        except (BlockingIOError, InterruptedError):
            pass  # a probe; the next one follows shortly
        except OSError:  # no per-datagram TTL here: the default one (the probe still opens our mapping)
            self.transport.sendto(data, (addr.host, addr.port))

    async def ask(self, request: bytes, to: Address, reply_tag: bytes, accept: Callable[[bytes], object],
                  *, retry: float, timeout: float, who: str):
        """Send ``request`` to ``to`` every ``retry`` seconds until a ``reply_tag`` datagram that
        ``accept`` turns into something other than None arrives (UDP may lose either); returns it.
        One ask per reply tag at a time: it holds that tag's handler while it waits."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def on_reply(data: bytes, addr: tuple) -> None:
            value = accept(data[len(reply_tag):])
            if value is not None and not answer.done():
                answer.set_result(value)

        self.handlers[reply_tag] = on_reply
        try:
            deadline = loop.time() + timeout
            while not answer.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise ConnectionError(f"no answer from {who} at {to} within {timeout:g} s")
                self.sendto(request, to)
                await asyncio.wait({answer}, timeout=min(retry, left))
            return answer.result()
        finally:
            self.handlers.pop(reply_tag, None)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()  # closes its connections and the transport
        if self.transport is not None:
            self.transport.close()


async def open_shared(sock: socket.socket) -> SharedSocket:
    """Wrap a bound UDP socket (made by the caller: its port, its network namespace)."""
    sock.setblocking(False)
    transport, shared = await asyncio.get_running_loop().create_datagram_endpoint(SharedSocket, sock=sock)
    shared.sock = sock
    shared.batch_sock = batch.readable(transport, sock)
    return shared


def serve_on(shared: SharedSocket, creds: Credentials, handler: ConnectionHandler, *,
             client_check: CertificateCheck, max_frame: int = DEFAULT_MAX_FRAME,
             max_datagram_size: int | None = None) -> QuicServer:
    """Accept swarm connections (mTLS) on the shared socket, as net.endpoint.serve_member does on
    a socket of its own."""
    config = server_configuration(creds, alpns=[ALPN_SWARM],
                                  max_datagram_size=max_datagram_size or datagram_size_for(shared.local_address.host))
    create = AnonymousGuard(functools.partial(SwarmProtocol, handler=handler, max_frame=max_frame,
                                              client_check=client_check))
    server = QuicServer(configuration=config, create_protocol=create)
    server.connection_made(shared.transport)
    shared.server = server
    return server


async def connect_on(shared: SharedSocket, address: Address, creds: Credentials, peer_name: str,
                     handler: ConnectionHandler, *, max_frame: int = DEFAULT_MAX_FRAME,
                     max_datagram_size: int | None = None, timeout: float | None = None,
                     probe_size: bool = False) -> SwarmProtocol:
    """A member-to-member connection (mTLS) from the shared socket to ``address`` (an IP
    address: the punched peer, or a relay's port for the link). Close it with net.endpoint.close;
    the socket stays open. ``probe_size``: the peer is another member's shared socket, which
    answers size probes: its datagrams are as large as the path carries (``datagram_size_to``).
    ``timeout`` for the handshake: net.endpoint's CONNECT_TIMEOUT, read at each call as
    net.endpoint.connect reads it, unless given."""
    address = await resolve(address)
    if not max_datagram_size:
        max_datagram_size = await shared.datagram_size_to(address) if probe_size else datagram_size_for(address.host)
    config = client_configuration(creds, peer_name=peer_name, max_datagram_size=max_datagram_size)
    connection = QuicConnection(configuration=config)
    protocol = SwarmProtocol(connection, handler=handler, max_frame=max_frame)
    protocol.connection_made(shared.transport)
    shared.add_client(protocol)
    protocol.connect((address.host, address.port))
    try:
        await asyncio.wait_for(protocol.wait_connected(), endpoint.CONNECT_TIMEOUT if timeout is None else timeout)
    except (ConnectionError, asyncio.TimeoutError) as e:
        reason = close_reason(connection)
        protocol.close()
        shared.remove_client(protocol)
        if isinstance(e, asyncio.TimeoutError) or reason in ("", QUIC_IDLE_TIMEOUT):
            raise ConnectionError(no_answer(address)) from None
        raise ConnectionError(f"cannot connect to {address}: {reason}") from None
    return protocol


# --- punching ---


def _probe(ticket: PunchTicket, heard: bool) -> bytes:
    return PROBE + ticket.nonce + bytes([ticket.side, 1 if heard else 0])


async def punch(shared: SharedSocket, ticket: PunchTicket, *, timeout: float = PUNCH_TIMEOUT,
                interval: float = PROBE_INTERVAL, opening_ttl: int | None = OPENING_TTL,
                opening_s: float = OPENING_S) -> Address:
    """Send probes to ``ticket.peer`` until we have heard the peer's probe and the peer says it
    has heard ours, or ``timeout`` passes (PunchFailed). Returns the address the peer's probes
    came from: where to reach it (its NAT may show a different port than the rendezvous saw).
    For ``opening_s``, until the peer is heard, probes leave with ``opening_ttl`` (None: never)."""
    loop = asyncio.get_running_loop()
    heard: asyncio.Future[Address] = loop.create_future()
    acked: asyncio.Future[None] = loop.create_future()

    def on_probe(data: bytes, addr: tuple) -> None:
        if len(data) != len(PROBE) + NONCE_BYTES + 2 or data[4:4 + NONCE_BYTES] != ticket.nonce:
            shared.dropped += 1
            return
        side, peer_heard = data[-2], data[-1]
        if side == ticket.side:
            return  # our own probe, reflected
        if not heard.done():
            heard.set_result(Address(*addr))
        if peer_heard and not acked.done():
            acked.set_result(None)

    if ticket.nonce in shared.punches:
        raise PunchFailed(f"hole punching with {ticket.peer}: this socket already punches with that nonce")
    shared.punches[ticket.nonce] = on_probe
    start = clock.now()  # (the loop's clock, net/clock.py)
    try:
        while not (heard.done() and acked.done()):
            target = heard.result() if heard.done() else ticket.peer
            opening = not heard.done() and clock.now() - start < opening_s
            shared.sendto(_probe(ticket, heard.done()), target, ttl=opening_ttl if opening else None)
            left = timeout - (clock.now() - start)
            if left <= 0:
                raise PunchFailed(_failure(ticket, heard.done(), timeout))
            # Wake early when the peer is first heard: the next probe tells it so at once.
            pending = {f for f in (heard, acked) if not f.done()}
            await asyncio.wait(pending, timeout=min(interval, left), return_when=asyncio.FIRST_COMPLETED)
        # The peer may still wait for a probe that says we heard it: a few more, in case one is lost.
        for _ in range(3):
            shared.sendto(_probe(ticket, True), heard.result())
            await asyncio.sleep(interval / 2)
        return heard.result()
    finally:
        del shared.punches[ticket.nonce]


def _failure(ticket: PunchTicket, heard: bool, timeout: float) -> str:
    if heard:
        return (f"hole punching with {ticket.peer}: its probes arrive but it does not hear ours after "
                f"{timeout:g} s (a one-way path: its NAT or firewall drops our datagrams); use a relay")
    return (f"hole punching with {ticket.peer}: no probe from it within {timeout:g} s (a NAT that maps each "
            f"destination to a new port, or a firewall that drops UDP); use a relay")


async def keep_open(shared: SharedSocket, peer: Address, ticket: PunchTicket,
                    interval: float = KEEPALIVE_INTERVAL) -> None:
    """Keep the NAT mappings of a punched link open while it is quiet: one probe per interval
    (the peer drops it unless it is punching again). Run as a task; cancel to stop."""
    while True:
        shared.sendto(_probe(ticket, True), peer)
        await asyncio.sleep(interval)
