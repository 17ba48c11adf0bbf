"""Polling a live swarm: the host's status, and every trunk's stats and round trip, over QUIC.

The monitor is a member like any other (mutual TLS with the home's identity). It keeps one
connection to the host and one to each trunk the host lists, and asks each once per interval:
``status`` and ``nodes`` from the host, ``stats`` and a QUIC PING from each trunk, all at once.
It reaches trunks as an asker does (swarmctl/reaching/reach.py): its connections leave from one swarm
socket, and the host says how to reach each trunk (direct, or punched or relayed to a trunk
behind a NAT, where the address a trunk registered is no use from outside); mutual TLS runs end
to end on every path, and each node's row says which path it took.
A trunk that cannot be reached is retried in the background, so one dead trunk never holds up
the others' figures; an unreachable host is retried with a growing pause. Every poll becomes a
``SwarmSnapshot`` that views read through ``latest()``; nothing here waits on a view.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from net import messages
from net.messages import GetNodes, GetStats, GetStatus, Message, NodeInfo, Nodes, Stats, Status
from net.ping import ping_ms
from net.protocol import RequestOnlyHandler, SwarmProtocol
from net.wire import WireError
from swarmctl.node.home import SwarmHome
from swarmctl.reaching.host_addresses import host_addresses
from swarmctl.monitor.build import RawPoll, SnapshotBuilder
from swarmctl.monitor.snapshot import SwarmSnapshot, waiting_snapshot
from swarmctl.reaching.reach import DIRECT, Dialer, ask_route

log = logging.getLogger("swarmctl.monitor")

Reply = TypeVar("Reply", bound=Message)

_FAILURES = (ConnectionError, OSError, asyncio.TimeoutError, WireError, KeyError, TypeError, ValueError)


@dataclass(frozen=True)
class MonitorConfig:
    interval_s: float = 0.5  # between polls
    window_s: float = 5.0  # occupancy and rates over this much of each trunk's recent past (≤ 10)
    timeout_s: float = 2.0  # for one answer from a connected node
    max_backoff_s: float = 8.0  # the longest pause between attempts to reach the host
    max_trunk_backoff_s: float = 60.0  # ... to reach a trunk (each attempt may cost a relayed link)


class _Peer:
    """A connection kept to one node, (re)opened by a background task so a poll never waits on it."""

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self.conn: SwarmProtocol | None = None
        self.connecting: asyncio.Task | None = None
        self.error = "connecting"
        self.next_attempt = 0.0  # loop time
        self.failures = 0  # attempts that failed in a row
        self.path = ""  # how the open connection goes: "direct", "punched", "relayed via X"

    @property
    def connected(self) -> bool:
        return self.conn is not None and self.conn.is_open

    def drop(self, error: str, retry_at: float = 0.0) -> None:
        """Forget the connection; the next attempt waits until ``retry_at`` (loop time), so a node
        that keeps failing is not handed a fresh handshake every poll."""
        self.error = error
        self.next_attempt = retry_at
        self.path = ""
        if self.conn is not None:
            _close_now(self.conn)
            self.conn = None

    def retry_pause(self, first_s: float, longest_s: float) -> float:
        """The pause before the next attempt after ``failures`` in a row: doubling from
        ``first_s``, so an unreachable trunk is not asked for a punch or a relay every poll."""
        return min(longest_s, first_s * 2 ** max(0, self.failures - 1))


class Monitor:
    def __init__(self, home: SwarmHome, config: MonitorConfig = MonitorConfig(), *,
                 on_poll: Callable[[RawPoll], None] | None = None) -> None:
        """``on_poll`` (optional) sees every raw poll, e.g. to record it."""
        self.config = config
        self.node_config = home.load_config()
        self.creds = home.credentials()
        self.on_poll = on_poll
        self.builder = SnapshotBuilder(config.window_s)
        self.host_addresses = host_addresses(self.node_config)
        self._dialer: Dialer | None = None  # the swarm socket every connection leaves from
        self._host: SwarmProtocol | None = None
        self._peers: dict[str, _Peer] = {}
        self._failures = 0
        self._latest = waiting_snapshot(f"connecting to the swarm host at {', '.join(self.host_addresses)}")

    def latest(self) -> SwarmSnapshot:
        return self._latest

    async def run(self) -> None:
        """Poll until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                poll = await self.poll_once()
                try:
                    self._latest = self.builder.add(poll)
                except (KeyError, TypeError, ValueError, IndexError) as e:  # a node of another version?
                    self._latest = dataclasses.replace(self._latest, banner=f"cannot read the swarm's answers: "
                                                                            f"{type(e).__name__}: {e}; retrying")
                if self.on_poll is not None:
                    self.on_poll(poll)
                if poll.status is None:
                    await asyncio.sleep(poll.retry_in_s)
                    self._latest = dataclasses.replace(
                        self._latest, banner=f"swarm unreachable: {poll.host_error}, retrying now")
                else:
                    await asyncio.sleep(max(0.0, self.config.interval_s - (loop.time() - started)))
        finally:
            self.close()

    async def poll_once(self) -> RawPoll:
        taken_at, t0 = time.time(), time.perf_counter()
        try:
            host = await self._host_conn()
            status, nodes = await asyncio.gather(self._ask(host, GetStatus(), Status), self._ask_nodes(host))
        except _FAILURES as e:
            self._failures += 1
            if self._host is not None:
                _close_now(self._host)
                self._host = None
            backoff = min(self.config.max_backoff_s, self.config.interval_s * 2 ** self._failures)
            return RawPoll(taken_at, time.perf_counter() - t0, None, host_error=_reason(e), retry_in_s=backoff)
        self._failures = 0
        self._follow_members(status)
        peers = list(self._peers.values())
        answers = await asyncio.gather(*(self._ask_trunk(p) for p in peers))
        stats = {p.name: a[0] for p, a in zip(peers, answers) if a[0] is not None}
        pings = {p.name: a[1] for p, a in zip(peers, answers) if a[1] is not None}
        errors = {p.name: p.error for p in peers if p.name not in stats}
        paths = {p.name: p.path for p in peers if p.name in stats and p.path}
        return RawPoll(taken_at, time.perf_counter() - t0, status, nodes, stats, pings, errors, paths=paths)

    def close(self) -> None:
        for peer in self._peers.values():
            if peer.connecting is not None:
                peer.connecting.cancel()
            peer.drop("closed")
        if self._host is not None:
            _close_now(self._host)
            self._host = None
        if self._dialer is not None:
            self._dialer.close()
            self._dialer = None

    # --- the host ---

    async def _host_conn(self) -> SwarmProtocol:
        if self._host is not None and self._host.is_open:
            return self._host
        dialer = await self._swarm_socket()
        self._host = await dialer.connect_host(self.host_addresses, self.node_config.host_name, RequestOnlyHandler())
        return self._host

    async def _swarm_socket(self) -> Dialer:
        """The dialer whose socket the host connection leaves from, so the host sees where to
        send a trunk's punch (our NAT's mapping of it), and answers our ``reach`` over it."""
        if self._dialer is None:
            self._dialer = await Dialer.open(self.creds, ask_host=lambda message: ask_route(self._host, message))
        return self._dialer

    async def _request(self, conn: SwarmProtocol, request: Message, reply: type[Reply]) -> Reply:
        """The node's answer: messages.Refused when it answers with an error, WireError when the
        answer is not a ``reply``."""
        answer = await conn.request(messages.encode(request), timeout=self.config.timeout_s)
        return messages.decode(answer.body, reply)

    async def _ask(self, conn: SwarmProtocol, request: Message, reply: type[Reply]) -> Reply:
        """The node's answer; a refusal is a ConnectionError (the node counts as unreachable)."""
        try:
            return await self._request(conn, request, reply)
        except messages.Refused as e:
            kind = request.__struct_config__.tag
            raise ConnectionError(f"{conn.peer_name or 'the node'} refused {kind!r}: {e.error.message}") from None

    async def _ask_nodes(self, host: SwarmProtocol) -> list[NodeInfo] | None:
        """Optional extras (device, measured links): a host that refuses them, or answers in a
        shape this version cannot read, gives None, and the view shows less without them."""
        try:
            return (await self._request(host, GetNodes(), Nodes)).nodes
        except (messages.Refused, messages.MalformedMessage) as e:
            log.debug("no nodes from the host: %s", e)
            return None

    def _follow_members(self, status: Status) -> None:
        """Keep a peer for every trunk the host lists, at the address it lists (without a note such
        as "(symmetric)": the host's reach answer says how to get there; the address is the
        fallback for a host that does not answer ``reach``)."""
        trunks = {m.name: m.address.split()[0] for m in status.members if m.role == "trunk" and m.address.strip()}
        for name in list(self._peers):
            if self._peers[name].address != trunks.get(name):
                peer = self._peers.pop(name)
                if peer.connecting is not None:
                    peer.connecting.cancel()
                peer.drop("gone")
        for name, address in trunks.items():
            self._peers.setdefault(name, _Peer(name, address))

    # --- trunks ---

    async def _ask_trunk(self, peer: _Peer) -> tuple[Stats | None, float | None]:
        if not peer.connected:
            self._start_connecting(peer)
            return None, None
        try:
            rtt_ms = await ping_ms(peer.conn, self.config.timeout_s)
            return await self._ask(peer.conn, GetStats(), Stats), rtt_ms
        except _FAILURES as e:
            peer.drop(_reason(e), asyncio.get_running_loop().time() + self.config.max_backoff_s / 2)
            return None, None

    def _start_connecting(self, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        if (peer.connecting is not None and not peer.connecting.done()) or loop.time() < peer.next_attempt:
            return

        async def connect() -> None:
            try:
                dialer = await self._swarm_socket()
                peer.conn = await dialer.connect(peer.name, peer.address, RequestOnlyHandler())
                peer.path, peer.error, peer.failures = str(dialer.paths.get(peer.name, DIRECT)), "", 0
            except _FAILURES as e:
                peer.failures += 1
                peer.error = _reason(e)
                peer.next_attempt = loop.time() + peer.retry_pause(self.config.max_backoff_s / 2,
                                                                   self.config.max_trunk_backoff_s)

        peer.connecting = asyncio.ensure_future(connect())


def _close_now(conn: SwarmProtocol) -> None:
    """Close without waiting for the peer: the CONNECTION_CLOSE goes out before the socket shuts."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - an already broken connection has nothing left to close
        pass
    if conn.owned_transport is not None:
        conn.owned_transport.close()


def _reason(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "no answer in time"
    return " ".join(str(error).split()) or type(error).__name__
