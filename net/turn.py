"""A relay for links that hole punching cannot open (a symmetric NAT, a strict firewall).

The relay gives each link a UDP port of its own and two tokens, one per end. Each end registers
from its QUIC socket (net.punch.SharedSocket) by sending its token to that port; the relay learns
the address the datagram came from, which is also what opens and then keeps open the end's NAT
mapping towards the relay. From then on a datagram from one registered end is sent, unchanged,
to the other; anything else is dropped. The relay never parses what it forwards: QUIC's mutual
TLS runs end to end between the members, so it cannot read or alter activations.

Ends re-register every KEEPALIVE_INTERVAL, well inside the 30 s after which many routers drop an
idle UDP mapping; a re-registration from a new address (a router that rebooted and mapped the
socket to a new port) moves that end there. Bounded: at most ``max_links`` links, each forwarding
at most ``max_bytes_per_s`` (a token bucket, one second deep; excess datagrams are dropped, and
QUIC's congestion control backs off as it does on any lossy path); a link silent for
``idle_timeout`` seconds is closed.

    relay = NatRelay("198.51.100.1")                 # on the host or a reachable member
    link = await relay.allocate()                    # the host tells each end link.address + its token
    await register(shared, link.address, link.token_a)   # on member a; b likewise with token_b
    keepalive = asyncio.create_task(keep_registered(shared, link.address, link.token_a))
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from dataclasses import dataclass, field
from typing import Callable

from . import clock
from .endpoint import Address
from .punch import CONTROL, KEEPALIVE_INTERVAL, SharedSocket

REGISTER = b"\x00swR"
REGISTERED = b"\x00swK"
TOKEN_BYTES = 16
REGISTER_TIMEOUT = 3.0
REGISTER_RETRY = 0.2
MAX_LINKS = 64
MAX_BYTES_PER_S = 32 * 1024 * 1024  # per link: more than a home uplink, less than a relay's whole NIC
IDLE_TIMEOUT = 3 * KEEPALIVE_INTERVAL  # a link whose ends stopped re-registering is gone


class RelayFull(RuntimeError):
    """The relay already carries its maximum number of links."""


@dataclass
class RelayLinkStats:
    forwarded: int = 0  # datagrams
    bytes: int = 0
    dropped_stranger: int = 0  # from an address that is neither registered end
    dropped_rate: int = 0  # over the link's bytes/s
    dropped_unpaired: int = 0  # from one end before the other registered
    registrations: int = 0


@dataclass
class RelayLink:
    """One link through the relay: where both ends send, and the token each registers with."""

    address: Address
    token_a: bytes
    token_b: bytes
    stats: RelayLinkStats = field(default_factory=RelayLinkStats)
    record: bool = False
    recorded: list[bytes] = field(default_factory=list)  # with record=True: every datagram forwarded


class _LinkPort:
    """The link's UDP socket: registrations, and forwarding between the two registered ends."""

    def __init__(self, relay: "NatRelay", link: RelayLink) -> None:
        self.relay, self.link = relay, link
        self.ends: dict[bytes, tuple[str, int]] = {}  # token → the address it registered from
        self.transport: asyncio.DatagramTransport | None = None
        self.allowance = float(relay.max_bytes_per_s)
        self.refilled = clock.now()
        self.last_heard = clock.now()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        addr = (addr[0], int(addr[1]))
        if data[:1] == CONTROL:
            self._control(data, addr)
            return
        a, b = self.ends.get(self.link.token_a), self.ends.get(self.link.token_b)
        if addr == a:
            other = b
        elif addr == b:
            other = a
        else:
            self.link.stats.dropped_stranger += 1
            return
        if other is None:
            self.link.stats.dropped_unpaired += 1
            return
        if not self._spend(len(data)):
            self.link.stats.dropped_rate += 1
            return
        self.last_heard = clock.now()
        self.link.stats.forwarded += 1
        self.link.stats.bytes += len(data)
        if self.link.record:
            self.link.recorded.append(bytes(data))
        self.transport.sendto(data, other)

    def _control(self, data: bytes, addr: tuple[str, int]) -> None:
        token = data[len(REGISTER):]
        if not data.startswith(REGISTER) or token not in (self.link.token_a, self.link.token_b):
            self.link.stats.dropped_stranger += 1
            return
        self.ends[token] = addr  # a new address replaces the old: the end's NAT mapping changed
        self.last_heard = clock.now()
        self.link.stats.registrations += 1
        self.transport.sendto(REGISTERED + token, addr)

    def _spend(self, n: int) -> bool:
        now = clock.now()
        cap = float(self.relay.max_bytes_per_s)
        self.allowance = min(cap, self.allowance + (now - self.refilled) * cap)
        self.refilled = now
        if self.allowance < n:
            return False
        self.allowance -= n
        return True

    def error_received(self, exc: Exception) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        pass


def udp_socket(host: str, port: int) -> socket.socket:
    """A UDP socket bound to host:port (port 0: any free one), in this process's namespace."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, port))
    return sock


class NatRelay:
    """Allocates relayed links on ``host`` (an address the members can reach). ``make_socket(host,
    port)`` returns a bound UDP socket; the default binds one in this process's namespace."""

    def __init__(self, host: str, *, max_links: int = MAX_LINKS, max_bytes_per_s: int = MAX_BYTES_PER_S,
                 idle_timeout: float = IDLE_TIMEOUT,
                 make_socket: Callable[[str, int], socket.socket] = udp_socket) -> None:
        self.host = host
        self.max_links = max_links
        self.max_bytes_per_s = max_bytes_per_s
        self.idle_timeout = idle_timeout
        self.make_socket = make_socket
        self.ports: dict[Address, _LinkPort] = {}
        self._sweeper: asyncio.Task | None = None

    async def allocate(self, *, record: bool = False) -> RelayLink:
        if len(self.ports) >= self.max_links:
            raise RelayFull(f"the relay at {self.host} already carries {self.max_links} links")
        sock = self.make_socket(self.host, 0)
        sock.setblocking(False)
        host, port = sock.getsockname()[:2]
        link = RelayLink(Address(host, port), secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES),
                         record=record)
        link_port = _LinkPort(self, link)
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: link_port, sock=sock)
        self.ports[link.address] = link_port
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return link

    def release(self, link: RelayLink) -> None:
        link_port = self.ports.pop(link.address, None)
        if link_port is not None and link_port.transport is not None:
            link_port.transport.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_timeout, KEEPALIVE_INTERVAL) / 2)
            now = clock.now()
            for link_port in [p for p in self.ports.values() if now - p.last_heard > self.idle_timeout]:
                self.release(link_port.link)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for link_port in list(self.ports.values()):
            self.release(link_port.link)


# --- the members' side ---


async def register(shared: SharedSocket, relay: Address, token: bytes, timeout: float = REGISTER_TIMEOUT) -> None:
    """Register this end of a relayed link from its QUIC socket; returns once the relay confirms."""
    await shared.ask(REGISTER + token, relay, REGISTERED, lambda body: True if body == token else None,
                     retry=REGISTER_RETRY, timeout=timeout, who="the relay")


async def keep_registered(shared: SharedSocket, relay: Address, token: bytes,
                          interval: float = KEEPALIVE_INTERVAL) -> None:
    """Re-register every ``interval``: keeps the NAT mapping to the relay open and moves this end
    at the relay if the mapping changed. Run as a task; cancel to stop."""
    while True:
        await asyncio.sleep(interval)
        shared.sendto(REGISTER + token, relay)
