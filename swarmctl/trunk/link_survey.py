"""What a trunk measures of its links, when, and whom it relays for, with no I/O.

The host plans with the round trip and throughput between members (``links``). A trunk measures
its links to the plan's other stages, and to the host (standing in for the asker's side,
``ASKER``), when a plan it serves is confirmed and again in the background: every LINK_REFRESH_S,
jittered so that trunks started together do not probe together, and only while its stage is idle
(a probe competes with activations for the same uplink). A trunk started with ``--relay`` carries
relayed links for members that cannot punch one, allocated only when its host asks.

Every decision here is a function of what it is given (the plan, ``now``, a uniform draw); the
trunk's ``TrunkLinks`` (swarmctl/trunk/links.py) does the measuring, the sleeping and the sending.
Tests drive these directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from net import messages as m
from plans.nodes import ASKER
from plans.plan import Plan

LINK_REFRESH_S = 180.0  # the background round's period (jittered by REFRESH_JITTER either way)
REFRESH_JITTER = 0.25
IDLE_BEFORE_PROBE_S = 10.0  # no step arrived for this long: the stage is idle enough to probe


@dataclass(frozen=True)
class Peer:
    """A member to measure the link to, at the address the plan gives."""

    member: str
    address: str


class LinkRound:
    """One round of measurements: the plan's stages other than ``me``, in the plan's order, each
    member measured once (a member holding two stages whose first measurement failed is tried at
    its second); then the host, as ASKER, over the host link."""

    def __init__(self, plan: Plan, me: str) -> None:
        self._peers = [Peer(s.member, s.address) for s in plan.stages if s.member != me]
        self._next = 0
        self.claims: dict[str, m.LinkClaim] = {}  # member → its link, measured

    def next_peer(self) -> Peer | None:
        """The next member to measure, or None when the stages are done."""
        while self._next < len(self._peers):
            peer = self._peers[self._next]
            self._next += 1
            if peer.member not in self.claims:
                return peer
        return None

    def measured(self, peer: Peer, claim: m.LinkClaim | None) -> None:
        """``claim``: the link measured, or None where the member could not be reached or measured
        (left out of the report, not guessed)."""
        if claim is not None:
            self.claims[peer.member] = claim

    def report(self, to_host: m.LinkClaim | None) -> m.Links | None:
        """What the host hears: the stages' links, then the host's as ASKER's; None when nothing
        was measured."""
        links = dict(self.claims)
        if to_host is not None:
            links[ASKER] = to_host
        return m.Links(links=links) if links else None


def over_next_stage(next_member: str | None, next_open: bool, member: str) -> bool:
    """Whether to measure ``member`` over the connection to the next stage (open, and to that
    member) rather than over a fresh one closed after."""
    return next_open and next_member == member


def refresh_delay(draw: float) -> float:
    """Seconds until the next background round, for ``draw`` uniform in [0, 1)."""
    return LINK_REFRESH_S * (1.0 - REFRESH_JITTER + 2 * REFRESH_JITTER * draw)


def stage_idle(now: float, queue_depth: int, last_active: Iterable[float]) -> bool:
    """No request's step arrived within IDLE_BEFORE_PROBE_S of ``now`` (``last_active``: each
    route's last), and nothing waits for the compute thread."""
    return queue_depth == 0 and all(now - t > IDLE_BEFORE_PROBE_S for t in last_active)


def refresh_due(plan: Plan | None, me: str, now: float, queue_depth: int, last_active: Iterable[float]) -> bool:
    """A background round is due: the plan gives ``me`` a stage (an expert node or an idle trunk
    sends no activations), and that stage is idle."""
    return plan is not None and plan.stage_for(me) is not None and stage_idle(now, queue_depth, last_active)


def describe(links: m.Links) -> str:
    return ", ".join(f"{peer} {c.rtt_ms:.1f} ms {c.bandwidth_mb_s:.0f} MB/s" for peer, c in links.links.items())


def relay_refusal(asked_by_host: bool, relays: bool, name: str) -> str | None:
    """Why this trunk does not allocate a relayed link (None: it does): only its host may ask
    (anyone else could spend its bandwidth), and only a trunk started with --relay relays."""
    if not asked_by_host:
        return "only the host allocates relayed links"
    if not relays:
        return f"{name} does not relay (run --relay)"
    return None
