"""A userspace UDP relay that impairs a link: delay, jitter, loss, and a switch to cut it.

This machine's kernel has no ``tc netem``, so WAN conditions are emulated here: put a relay in front
of a node's UDP port and advertise the relay's address instead. Every datagram, in both
directions, is held for ``delay ± jitter`` (each one independently, so jitter reorders), dropped
with probability ``loss``, or dropped outright while the link is cut. With ``rate_bps``, each
direction carries at most that many bits per second: a datagram waits for those ahead of it to
be sent (a home uplink with a deep router buffer: queued, not dropped). With ``record=True`` it
also keeps every datagram it is handed, both directions, before any impairment: what an
eavesdropper on that link sees. The tests and the benchmarks share it.

    relay = ImpairedLink(Address("127.0.0.1", 7471), delay_s=0.02, jitter_s=0.005, loss=0.005)
    address = await relay.start()   # where peers should send instead
    relay.cut = True                # the link goes dark (both directions) until set back
    tap = ImpairedLink(Address("127.0.0.1", 7471), record=True)   # unimpaired; tap.recorded: every datagram
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from .endpoint import Address


@dataclass
class LinkStats:
    forwarded: int = 0
    dropped_loss: int = 0
    dropped_cut: int = 0
    dropped_mtu: int = 0
    bytes: int = 0


class _Upstream(asyncio.DatagramProtocol):
    """The relay's socket towards the target, for one downstream peer."""

    def __init__(self, link: "ImpairedLink", peer: tuple) -> None:
        self.link = link
        self.peer = peer
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:  # target → peer
        self.link._schedule(data, lambda d: self.link._listener.sendto(d, self.peer), "to peer")


class _Listener(asyncio.DatagramProtocol):
    def __init__(self, link: "ImpairedLink") -> None:
        self.link = link

    def datagram_received(self, data: bytes, addr) -> None:  # peer → target
        self.link._from_peer(data, addr)


@dataclass
class ImpairedLink:
    target: Address
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    seed: int | None = None
    cut: bool = False
    stats: LinkStats = field(default_factory=LinkStats)
    mtu: int = 0  # datagrams larger than this are dropped, as a path with a smaller MTU does (0: none)
    rate_bps: float = 0.0  # each direction's capacity in bits per second (0: unlimited)
    record: bool = False
    recorded: list[bytes] = field(default_factory=list)  # with record=True: every datagram, in arrival order

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._listener: asyncio.DatagramTransport | None = None
        self._upstreams: dict[tuple, _Upstream] = {}
        self._pending_upstreams: dict[tuple, list[bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free_at: dict[str, float] = {}  # direction → when its last queued datagram has left (rate_bps)
        self.address: Address | None = None

    async def start(self, listen: Address = Address("127.0.0.1", 0)) -> Address:
        self._loop = asyncio.get_running_loop()
        self._listener, _ = await self._loop.create_datagram_endpoint(lambda: _Listener(self),
                                                                      local_addr=(listen.host, listen.port))
        host, port = self._listener.get_extra_info("sockname")[:2]
        self.address = Address(host, port)
        return self.address

    def _from_peer(self, data: bytes, peer: tuple) -> None:
        upstream = self._upstreams.get(peer)
        if upstream is None:
            if peer not in self._pending_upstreams:
                self._pending_upstreams[peer] = []
                self._loop.create_task(self._open_upstream(peer))
            self._pending_upstreams[peer].append(data)
            return
        self._schedule(data, upstream.transport.sendto, "to target")

    async def _open_upstream(self, peer: tuple) -> None:
        _, protocol = await self._loop.create_datagram_endpoint(lambda: _Upstream(self, peer),
                                                                remote_addr=(self.target.host, self.target.port))
        self._upstreams[peer] = protocol
        for data in self._pending_upstreams.pop(peer, []):
            self._schedule(data, protocol.transport.sendto, "to target")

    def _schedule(self, data: bytes, send, direction: str) -> None:
        if self.record:
            self.recorded.append(bytes(data))
        if self.cut:
            self.stats.dropped_cut += 1
            return
        if self.mtu and len(data) > self.mtu:
            self.stats.dropped_mtu += 1
            return
        if self.loss and self._rng.random() < self.loss:
            self.stats.dropped_loss += 1
            return
        delay = max(0.0, self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s))
        if self.rate_bps:
            now = self._loop.time()
            self._free_at[direction] = max(now, self._free_at.get(direction, 0.0)) + len(data) * 8 / self.rate_bps
            delay += self._free_at[direction] - now
        self.stats.forwarded += 1
        self.stats.bytes += len(data)
        if delay:
            self._loop.call_later(delay, self._send_if_open, send, data)
        else:
            send(data)

    def _send_if_open(self, send, data: bytes) -> None:
        if self._listener is not None and not self.cut:
            send(data)

    def close(self) -> None:
        for upstream in self._upstreams.values():
            if upstream.transport is not None:
                upstream.transport.close()
        self._upstreams.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def _serve(links: list[tuple[int, int]], delay_s: float, jitter_s: float, loss: float, seed: int,
                 rate_bps: float = 0.0) -> None:
    relays = []
    for i, (target_port, listen_port) in enumerate(links):
        relay = ImpairedLink(Address("127.0.0.1", target_port), delay_s, jitter_s, loss, seed + i, rate_bps=rate_bps)
        await relay.start(Address("127.0.0.1", listen_port))
        relays.append(relay)
    print("ready", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    """Run impairing relays in a process of their own (so their work does not share a CPU-bound
    process's interpreter): python -m net.relay --link TARGET_PORT:LISTEN_PORT ... [--delay 0.02]"""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--link", action="append", required=True, metavar="TARGET_PORT:LISTEN_PORT")
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--jitter", type=float, default=0.005)
    p.add_argument("--loss", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-mbit", type=float, default=0.0, help="each direction of each link at most this (0: unlimited)")
    args = p.parse_args()
    links = [tuple(int(x) for x in spec.split(":")) for spec in args.link]
    asyncio.run(_serve(links, args.delay, args.jitter, args.loss, args.seed, args.rate_mbit * 1e6))


if __name__ == "__main__":
    main()
