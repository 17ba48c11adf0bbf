"""A trunk's links to other members: measuring them for the host, and relaying for others.

What to measure, when, and whom to relay for is decided in ``link_survey`` (no I/O); this module
measures (net/probe.py), sleeps between background rounds, tells the host, and allocates relayed
links (net/turn.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterable

from net import clock
from net import messages as m
from net.endpoint import Address, close
from net.probe import LinkMeasure, measure_or_none
from net.protocol import SwarmProtocol
from net.turn import NatRelay, RelayFull
from plans.plan import Plan
from swarmctl.reaching.reach import Dialer
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.host_link import HostLink
from swarmctl.trunk.link_survey import LinkRound, Peer, describe, over_next_stage, refresh_delay, refresh_due, \
    relay_refusal

log = logging.getLogger("swarmctl.trunk")


class TrunkLinks:
    def __init__(self, ctx: TrunkContext, host: HostLink, next_stage: Callable[[], SwarmProtocol | None]) -> None:
        """``next_stage``: the connection to the next stage, if any (measured over, not reopened)."""
        self.name = ctx.name
        self.relay: NatRelay | None = None  # once the trunk listens, with --relay
        self._connect = ctx.connect
        self._handler = ctx.handler
        self._host = host
        self._next_stage = next_stage
        self._measuring = asyncio.Lock()  # one round of link measurements at a time

    async def measure(self, plan: Plan) -> None:
        """Round trip and throughput to the plan's other stages and to the host (which stands in
        for the asker's side), reported to the host for its next plan. Run when a plan is served
        (a new plan may need new pairs) and again while idle (``refresh``)."""
        async with self._measuring:
            survey = LinkRound(plan, self.name)
            while (peer := survey.next_peer()) is not None:
                measure = await self._measure_member(peer)
                survey.measured(peer, measure.claim() if measure is not None else None)
            to_host = await measure_or_none(self._host.conn)
            report = survey.report(to_host.claim() if to_host is not None else None)
            if report is not None:
                log.debug("measured links: %s", describe(report))
                await self._host.tell(report)

    async def _measure_member(self, peer: Peer) -> LinkMeasure | None:
        """Over the connection to the next stage where that is the member, else a fresh one
        (mutually authenticated like every member connection), closed after."""
        conn = self._next_stage()
        if conn is not None and over_next_stage(conn.peer_name, conn.is_open, peer.member):
            return await measure_or_none(conn)
        try:
            conn = await self._connect(peer.member, peer.address, self._handler)
        except (ConnectionError, OSError, ValueError):
            return None
        try:
            return await measure_or_none(conn)
        finally:
            await close(conn)

    async def refresh(self, plan: Callable[[], Plan | None], busy: Callable[[], tuple[int, list[float]]]) -> None:
        """Measure again now and then while the stage is idle; ``busy``: the compute thread's queue
        depth and each route's last step (link_survey.refresh_due)."""
        while True:
            await asyncio.sleep(refresh_delay(random.random()))
            now_plan = plan()
            if refresh_due(now_plan, self.name, clock.now(), *busy()):
                await self.measure(now_plan)

    async def allocate_relay(self, conn: SwarmProtocol, stream_id: int) -> None:
        """A relayed link for two other members; only our host may ask (net/turn.py bounds how many)."""
        reply: m.Message
        refusal = relay_refusal(self._host.is_host(conn), self.relay is not None, self.name)
        if refusal is not None:
            reply = m.Error(message=refusal)
        else:
            try:
                link = await self.relay.allocate()
                reply = m.RelayAllocated(port=link.address.port, token_a=link.token_a.hex(), token_b=link.token_b.hex())
            except (RelayFull, OSError) as e:
                reply = m.Error(message=str(e))
        if conn.is_open:
            conn.send(stream_id, m.encode(reply), end=True)

    @staticmethod
    def peer_coming(dialer: Dialer, message: m.Message, connections: Iterable[SwarmProtocol]) -> None:
        """The host says a member is about to connect: punch towards it, or register at the relay
        its link goes through (and stay registered while a connection through it is open)."""
        def connected_from(address: Address) -> bool:
            return any(c.is_open and c.peer_address == (address.host, address.port) for c in connections)

        try:
            if isinstance(message, m.PunchWith):
                dialer.punch_with(message)
            elif isinstance(message, m.RelayEnd):
                dialer.relay_end(message, connected_from)
        except ValueError as e:  # (an address that does not parse)
            log.error("host sent a malformed %s: %s", type(message).__struct_config__.tag, e)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
