"""What trunks tell the host about themselves: ``register`` (where it is reached, what it offers),
then ``ready``, ``refuse``, ``speed``, ``fetching`` and ``cached`` as they go. Each updates the
trunk's TrunkInfo (trunks.py) and hands the plan's part on to PlanKeeper (planning.py) and the
checks of its claims to ClaimChecks (checks.py)."""

from __future__ import annotations

import logging

from net import messages as m
from net.endpoint import Address
from net.protocol import SwarmProtocol
from plans.hysteresis import CONVERGE_FACTOR, SERVED_REPORTS, SPEED_FACTOR, served_figure

from .checks import ClaimChecks
from .planning import PlanKeeper
from .replies import error, ok
from .trunks import FetchReport, TrunkInfo, Trunks, held_ranges, observed, reachable_address

log = logging.getLogger("swarmctl.host")


def judged_figure(served: list[float], message: m.Speed) -> tuple[list[float], float, float]:
    """A trunk's new ``speed``: its served reports to keep, the figure it is judged by, and the
    factor that figure must move by to be planned on (plans/hysteresis.py). A served figure is the
    best of the last few served reports, so what the host plans with converges to what the stage
    serves; a fresh measurement stands alone (what it served before says less than it)."""
    if message.serving:
        served = [*served, message.ms_per_layer_token][-SERVED_REPORTS:]
        return served, served_figure(served), CONVERGE_FACTOR
    return [], message.ms_per_layer_token, SPEED_FACTOR


def ram_offer(message: m.Register) -> dict:
    """A trunk's host RAM for routed experts, planned on only with its rate and only beside a device
    (a trunk on the CPU offers its RAM as its memory already)."""
    if not message.ram_bytes or message.ram_gb_s is None or message.device == "cpu":
        return {}
    return {"ram_bytes": message.ram_bytes, "ram_gb_s": message.ram_gb_s}


class TrunkReports:
    def __init__(self, trunks: Trunks, planning: PlanKeeper, checks: ClaimChecks) -> None:
        self.trunks, self.planning, self.checks = trunks, planning, checks

    def register(self, conn: SwarmProtocol, stream_id: int, message: m.Register) -> None:
        stated = Address.parse(message.listen)
        if observed(conn) is None:
            error(conn, stream_id, "the host does not see where your connection comes from")
            return
        # Its stated port at the IP we see: never an IP it names (trunks.reachable_address).
        listen = str(reachable_address(stated, conn))
        if stated.host not in ("0.0.0.0", "::", "") and str(stated) != listen:
            log.info("trunk %s said it is reached at %s; it is reached at %s, where its connection comes "
                     "from (addresses are observed, not claimed)", conn.peer_name, stated, listen)
        speed = message.ms_per_layer_token
        replaced = conn.peer_name in self.trunks
        trunk = self.trunks[conn.peer_name] = TrunkInfo(conn, stream_id, listen, message.memory, speed,
                                                        device=message.device, rtt_ms=message.rtt_ms,
                                                        local=message.local, relay=message.relay,
                                                        datagram_us=message.datagram_us,
                                                        prompt_ms_per_layer_row=message.prompt_ms_per_layer_row,
                                                        holds=held_ranges(message.holds, self.planning.plan.n_layer),
                                                        fetches=message.fetches, **ram_offer(message))
        log.info("trunk %s registered at %s with %.1f GB, %s ms per layer%s", conn.peer_name, listen,
                 message.memory / 1e9, f"{speed:.2f}" if speed is not None else "unmeasured",
                 f", and {trunk.ram_bytes / 1e9:.1f} GB of host RAM for routed experts at {trunk.ram_gb_s:.1f} GB/s"
                 if trunk.ram_bytes else "")
        self.checks.at_registration(conn.peer_name, trunk)
        self.planning.registered(conn.peer_name, replaced=replaced)  # (a plan, sent to it)

    def ready(self, conn: SwarmProtocol, stream_id: int, message: m.Ready) -> None:
        """A trunk says it loaded its layers: it becomes a ready stage once it proved it holds them
        (and, if the host has not timed it yet, once it was timed on one of them)."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            if message.placement != trunk.placement and message.placement not in ("", trunk.device):
                log.info("trunk %s computes its stage on %s", conn.peer_name, message.placement)
            trunk.placement = message.placement
            trunk.holds = held_ranges(message.holds, self.planning.plan.n_layer)
            self.checks.when_ready(conn.peer_name, trunk, message.plan_version)
        ok(conn, stream_id)

    def refuse(self, conn: SwarmProtocol, stream_id: int, message: m.Refuse) -> None:
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.refused = message.reason[:300]
            log.warning("trunk %s cannot serve: %s", conn.peer_name, trunk.refused)
            self.planning.replan()
        ok(conn, stream_id)

    def speed(self, conn: SwarmProtocol, stream_id: int, message: m.Speed) -> None:
        """A trunk has a new figure: measured once its fetched layers arrived, measured again, or
        seen in the batches it serves (``judged_figure``). The host plans with a figure once it
        moved past its band, and re-plans only on a sustained gain worth the move (plans/hysteresis.py)."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.served, claim, factor = judged_figure(trunk.served, message)
            trunk.ms_per_layer_token = claim  # (status shows the latest claim)
            if message.prompt_ms_per_layer_row is not None:
                trunk.prompt_ms_per_layer_row = message.prompt_ms_per_layer_row
            planned = trunk.planning_speed  # never faster than the host timed it
            if planned is None:
                log.debug("speed of %s: %.3f ms claimed, not planned on until the host has timed it",
                          conn.peer_name, claim)
            else:
                self.planning.consider_speed(conn.peer_name, planned, " as served" if message.serving else "",
                                             factor=factor)
            if planned is not None and claim * factor <= planned:  # it says it got faster: look
                self.checks.reprobe(conn.peer_name, trunk)
        ok(conn, stream_id)

    def fetching(self, conn: SwarmProtocol, stream_id: int, message: m.Fetching) -> None:
        """A trunk's fetch, as it goes: for status and top, and its rate for pricing moves to it."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.took_fetch_report(FetchReport(message.what, message.done, message.total, message.bytes_per_s,
                                                message.finished))
            self.planning.fetch_progress(conn.peer_name, message.done)
        ok(conn, stream_id)

    def cached(self, conn: SwarmProtocol, stream_id: int, message: m.Cached) -> None:
        """What a trunk's stage keeps as prefixes for askers' next requests: for status and top."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.cached = (message.tokens, message.kv_bytes)
        ok(conn, stream_id)
