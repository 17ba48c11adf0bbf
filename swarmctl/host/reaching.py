"""How members reach each other and the host: the links trunks measured (``links``: planned with
through the re-plan gate, plans/hysteresis.py), throughput probes of a member's link to the host
(``probe``, net/probe.py), and routes to a trunk (``reach``: direct, punched or relayed, given by
the host as rendezvous, rendezvous.py)."""

from __future__ import annotations

import asyncio

from net import messages as m
from net.probe import ProbeSink
from net.protocol import SwarmProtocol
from plans.nodes import Link

from .planning import PlanKeeper
from .rendezvous import NoRoute, Rendezvous
from .replies import error, ok, reply
from .trunks import TrunkInfo, Trunks


class Reaching:
    def __init__(self, trunks: Trunks, planning: PlanKeeper) -> None:
        self.trunks, self.planning = trunks, planning
        self.probes = ProbeSink()
        # which (trunk, peer) links came with a measured bandwidth, for status (others carry a default)
        self.bandwidth_measured: set[tuple[str, str]] = set()
        self.rendezvous: Rendezvous | None = None  # once the host listens (HostService.start)

    def close(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()

    def links(self, conn: SwarmProtocol, stream_id: int, message: m.Links) -> None:
        """A trunk's measured links: planned with once they move past the noise band, re-planned on
        only when that makes the plan materially better (plans/hysteresis.py). Status says which
        figures came with a measured bandwidth and which are defaults."""
        for peer, claim in message.links.items():
            if claim.bandwidth_mb_s is not None:
                self.bandwidth_measured.add((conn.peer_name, peer))
            else:
                self.bandwidth_measured.discard((conn.peer_name, peer))
        self.planning.consider_links(conn.peer_name, {
            peer: Link(claim.rtt_ms, claim.bandwidth_mb_s or Link().bandwidth_mb_s)
            for peer, claim in message.links.items()})
        ok(conn, stream_id)

    def probe(self, conn: SwarmProtocol, stream_id: int, message: m.Probe) -> None:
        """A member measuring its link to us: answered once its bytes arrived (net/probe.py)."""
        self.probes.start(conn, stream_id, message)

    def reach(self, conn: SwarmProtocol, stream_id: int, message: m.Reach) -> None:
        """How the sender reaches a trunk: direct, punch (the trunk is told too) or relay."""
        trunk = self.trunks.get(message.member)
        if trunk is None or not trunk.conn.is_open or self.rendezvous is None:
            error(conn, stream_id, f"{message.member!r} is not a trunk of this swarm now")
            return
        asyncio.ensure_future(self._send_route(conn, stream_id, message, trunk, self.rendezvous))

    @staticmethod
    async def _send_route(conn: SwarmProtocol, stream_id: int, message: m.Reach, trunk: TrunkInfo,
                          rendezvous: Rendezvous) -> None:
        try:
            route = await rendezvous.route(conn, message.member, trunk, message.relay, message.asking)
        except NoRoute as e:
            error(conn, stream_id, str(e))
            return
        reply(conn, stream_id, route, end=True)
