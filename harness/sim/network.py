"""An in-memory datagram network for the simulator: every UDP endpoint a node opens through its
event loop (``loop.create_datagram_endpoint``) is bound here instead of to the kernel, and each
datagram is delivered, late or never, as a seeded random stream decides: delay with jitter, loss,
duplication, reordering (a datagram held back behind later ones), and partitions between nodes.

The payloads are the nodes' real QUIC datagrams (aioquic, TLS 1.3 with both certificates); the
network never looks inside them. A node is whoever opened the endpoint: the simulator runs each
node's code in a context naming it (``CURRENT_NODE``), so its sockets carry its address and a
fault can cut it off or kill it.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import socket
from dataclasses import dataclass, field
from typing import Callable

CURRENT_NODE: contextvars.ContextVar[str] = contextvars.ContextVar("sim_node", default="")
# Datagrams a stopped node's sockets hold until it goes on; later ones are dropped, as a full
# receive buffer drops them (Linux's default 208 KiB holds about this many full-size datagrams).
RECEIVE_BUFFER_DATAGRAMS = 128


@dataclass
class Conditions:
    """What the links do to each datagram (the same for every pair of nodes)."""

    delay_s: float = 0.002  # one way
    jitter_s: float = 0.001  # uniform, added to the delay
    loss: float = 0.0  # chance a datagram is dropped
    duplicate: float = 0.0  # chance it arrives twice
    reorder: float = 0.0  # chance it is held back (10x the delay) so later ones overtake it

    def describe(self) -> str:
        return (f"delay {self.delay_s * 1e3:.1f}±{self.jitter_s * 1e3:.1f} ms, loss {self.loss:.1%}, "
                f"dup {self.duplicate:.1%}, reorder {self.reorder:.1%}")


@dataclass
class NetStats:
    sent: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    cut: int = 0  # dropped by a partition or a dead or frozen node
    overflowed: int = 0  # dropped at a stopped node whose receive buffer was full
    unbound: int = 0  # nobody listening at the address


class SimTransport(asyncio.DatagramTransport):
    """One bound endpoint: what asyncio's datagram transport offers the protocols using it."""

    def __init__(self, network: "SimNetwork", address: tuple[str, int], node: str,
                 protocol: asyncio.DatagramProtocol, sock: socket.socket | None) -> None:
        super().__init__()
        self.network, self.address, self.node, self.protocol = network, address, node, protocol
        self._sock = sock  # the real socket the node bound (kept so its port stays unique), never used
        self._closing = False

    def sendto(self, data, addr=None) -> None:
        if not self._closing:
            self.network.send(self, bytes(data), (addr[0], addr[1]))

    def get_extra_info(self, name, default=None):
        if name == "sockname":
            return self.address
        if name == "socket":
            return None
        return default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.network.unbind(self)
        if self._sock is not None:
            self._sock.close()
        self.network.loop.call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def kill(self) -> None:
        """Gone with its process: no connection_lost (nobody is left to hear it)."""
        self._closing = True
        self.network.unbind(self)
        if self._sock is not None:
            self._sock.close()

    def get_write_buffer_size(self) -> int:
        return 0


@dataclass
class SimNetwork:
    loop: asyncio.AbstractEventLoop
    rng: random.Random
    conditions: Conditions = field(default_factory=Conditions)
    log: Callable[[str], None] = lambda line: None
    endpoints: dict[tuple[str, int], SimTransport] = field(default_factory=dict)
    ips: dict[str, str] = field(default_factory=dict)  # node → its address
    cut_off: set[frozenset[str]] = field(default_factory=set)  # pairs of nodes that cannot reach each other
    down: set[str] = field(default_factory=set)  # nodes whose datagrams go nowhere (dead, frozen)
    slow: dict[str, float] = field(default_factory=dict)  # node → seconds added to each datagram to or from it
    # stopped node → the datagrams its sockets received meanwhile, unread
    stopped: dict[str, list[tuple[str, tuple[str, int], tuple[str, int], bytes]]] = field(default_factory=dict)
    stats: NetStats = field(default_factory=NetStats)

    def ip_of(self, node: str) -> str:
        return self.ips.setdefault(node, f"127.0.{len(self.ips) // 250}.{len(self.ips) % 250 + 2}")

    def bind(self, protocol: asyncio.DatagramProtocol, sock: socket.socket | None,
             local_addr: tuple[str, int] | None) -> SimTransport:
        node = CURRENT_NODE.get()
        host, port = sock.getsockname()[:2] if sock is not None else (local_addr or ("0.0.0.0", 0))
        if host in ("0.0.0.0", "::"):
            host = self.ip_of(node)
        address = (host, port)
        if address in self.endpoints or not port:
            raise OSError(f"[sim] address {address} in use or not bound")
        transport = SimTransport(self, address, node, protocol, sock)
        self.endpoints[address] = transport
        return transport

    def unbind(self, transport: SimTransport) -> None:
        if self.endpoints.get(transport.address) is transport:
            del self.endpoints[transport.address]

    # --- faults ---

    def partition(self, a: str, b: str) -> None:
        self.cut_off.add(frozenset((a, b)))

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        if a is None:
            self.cut_off.clear()
        else:
            self.cut_off.discard(frozenset((a, b)))

    def stop(self, node: str) -> None:
        """What arrives for ``node`` waits in its sockets, unread, until ``go_on``."""
        self.stopped.setdefault(node, [])

    def go_on(self, node: str, *, read: bool = True) -> None:
        """The node reads what waited (``read=False``: it never will, killed while stopped)."""
        unread = self.stopped.pop(node, [])
        if read:
            for datagram in unread:
                self.loop.call_soon(self._deliver, *datagram)

    def endpoints_of(self, node: str) -> list[SimTransport]:
        return [t for t in self.endpoints.values() if t.node == node]

    # --- carrying datagrams ---

    def send(self, source: SimTransport, data: bytes, destination: tuple[str, int]) -> None:
        self.stats.sent += 1
        c, draw = self.conditions, self.rng.random
        # Every draw is made whatever happens to the datagram, so one fault does not shift the
        # randomness of every later datagram (a shrunk schedule stays close to the original).
        lost, dup, held = draw() < c.loss, draw() < c.duplicate, draw() < c.reorder
        first, second = c.delay_s + draw() * c.jitter_s, c.delay_s + draw() * c.jitter_s
        if lost:
            self.stats.lost += 1
            return
        if held:
            first *= 10
        if self.slow:
            target = self.endpoints.get(destination)
            extra = self.slow.get(source.node, 0.0) + (self.slow.get(target.node, 0.0) if target else 0.0)
            first, second = first + extra, second + extra
        now = self.loop.time()
        self.loop.call_at(now + first, self._deliver, source.node, source.address, destination, data)
        if dup:
            self.loop.call_at(now + second, self._deliver, source.node, source.address, destination, data)
            self.stats.duplicated += 1

    def _deliver(self, node: str, source: tuple[str, int], destination: tuple[str, int], data: bytes) -> None:
        target = self.endpoints.get(destination)
        if target is None:
            self.stats.unbound += 1
            return
        if self.down and (node in self.down or target.node in self.down) \
                or self.cut_off and frozenset((node, target.node)) in self.cut_off:
            self.stats.cut += 1
            return
        if target.node in self.stopped:
            unread = self.stopped[target.node]
            if len(unread) < RECEIVE_BUFFER_DATAGRAMS:
                unread.append((node, source, destination, data))
            else:
                self.stats.overflowed += 1
            return
        self.stats.delivered += 1
        token = CURRENT_NODE.set(target.node)  # what the receiver starts from here runs as the receiver
        try:
            target.protocol.datagram_received(data, source)
        finally:
            CURRENT_NODE.reset(token)
