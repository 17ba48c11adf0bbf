"""The figures a plan is made with, and when a change in them re-plans: the planner's view of the
trunks (``PlanInputs``: the speed each is planned with, memory, links) and the watch over new
speed and link figures (``FigureWatch``: adopted past their band, re-planned on through the
keeper's sustain-and-settle gate once the stages are idle; the decisions are plans/hysteresis.py's,
this only feeds them the keeper's clock and sets its timer)."""

from __future__ import annotations

import asyncio
import logging
import statistics
from typing import TYPE_CHECKING, Callable

from net import messages as m
from plans.hysteresis import MAX_DEFER_S, SPEED_FACTOR, SpeedDecision, decide_on_links, decide_on_speed, \
    replan_gain, sticky_links, sticky_speed
from plans.nodes import Link, NodeDescriptor
from plans.planner import PlanError, place_experts

from .alarm import Alarm
from .trunks import Trunks

if TYPE_CHECKING:
    from .planning import PlanKeeper

log = logging.getLogger("swarmctl.host")

DEFAULT_MS_PER_LAYER = 1.0  # for a trunk that could not measure yet (it has no model file)
IDLE_RECHECK_S = 10.0  # a re-plan on speed waiting for the stages to be idle asks them again this often


class PlanInputs:
    """The trunks as the planner sees them."""

    def __init__(self, trunks: Trunks, held: Callable[[str], bool]) -> None:
        """``held``: whether a member is refused only by a hold of the keeper's (staging.py)."""
        self.trunks = trunks
        self.held = held
        # The speed each member is planned with: a new figure replaces it only when it moved past
        # its band (plans/hysteresis.py), so a wobble reshuffles no plan. Only ``FigureWatch.adopt``
        # and ``rebase`` change it: a decision must compare the new figure with the one planned with.
        self.speed_basis: dict[str, float] = {}
        # Trunks that proved nothing are planned only while the proven ones cannot hold the model
        # (a swarm starting up); otherwise each is sent a trial plan of its own to prove itself on.
        self.with_unproven = False

    def descriptors(self, unproven: bool | None = None, held: bool = False) -> list[NodeDescriptor]:
        """The planner's view of the trunks that can serve: speed (its claim, never faster than the
        host timed it; the others' median until the host could time it), memory, and links (to the
        host standing in for the asker). A trunk whose claims are being checked is not planned yet,
        and one that proved nothing (TrunkInfo.proven) only while the proven ones cannot hold the
        model (``unproven``: include them or not; None: as the last re-plan had to). ``held``: with
        the members left out for a while (the keeper's holds), as if their wait were over."""
        if unproven is None:
            unproven = self.with_unproven
        ready = [(name, t) for name, t in sorted(self.trunks.items(), key=lambda kv: kv[1].registered_at)
                 if (not t.refused or (held and self.held(name))) and not t.checking and (unproven or t.proven)]
        for name, t in ready:  # a member's first figure; later ones come through adopt or rebase
            if name not in self.speed_basis and t.planning_speed is not None:
                self.speed_basis[name] = t.planning_speed
        known = [self.speed_basis[name] for name, t in ready if t.planning_speed]
        fallback = statistics.median(known) if known else DEFAULT_MS_PER_LAYER
        nodes = []
        for name, t in ready:
            speed = self.speed_basis[name] if t.planning_speed else fallback
            nodes.append(NodeDescriptor(name, t.memory, speed, t.device, t.listen, t.planned_links(),
                                        datagram_us=t.datagram_us, ram_bytes=t.ram_bytes, ram_gb_s=t.ram_gb_s,
                                        prompt_ms_per_layer_row=t.prompt_ms_per_layer_row,
                                        fetches=t.fetches or t.fetch is not None,  # (a trunk too old to say)
                                        fetch_mb_s=t.fetch_bytes_per_s / 1e6 if t.fetch_bytes_per_s else None))
        return nodes

    def describe_nodes(self) -> list[m.NodeInfo]:
        """The descriptors in wire form (the answer to ``nodes``)."""
        return [m.NodeInfo(name=n.name, memory_bytes=n.memory_bytes, ms_per_layer_token=n.ms_per_layer_token,
                           device=n.device, address=n.address,
                           links={k: m.LinkInfo(rtt_ms=v.rtt_ms, bandwidth_mb_s=v.bandwidth_mb_s)
                                  for k, v in n.links.items()}, datagram_us=n.datagram_us,
                           ram_bytes=n.ram_bytes, ram_gb_s=n.ram_gb_s, prompt_ms_per_layer_row=n.prompt_ms_per_layer_row)
                for n in self.descriptors()]

    def rebase(self, name: str) -> None:
        """A member (re)joined or was timed at joining: plan with the figure it brings, unless it is
        within the band of the one it was planned with before (no decision: a re-plan follows)."""
        trunk = self.trunks.get(name)
        if trunk is not None and trunk.planning_speed is not None:
            self.speed_basis[name] = sticky_speed(self.speed_basis.get(name), trunk.planning_speed)


class FigureWatch:
    """New speed and link figures for the keeper's plan: each is adopted once it moved past its
    band, and re-planned on once the gain is sustained and the plan in use settled (the keeper's
    ``gate``), and the stages hold no request (the keeper's ``stage_requests``)."""

    def __init__(self, keeper: PlanKeeper) -> None:
        self.keeper = keeper
        self._look_again = Alarm(lambda: keeper.clock(), self.reconsider)
        self._asking: asyncio.Task | None = None

    def _placement(self, nodes: list[NodeDescriptor] | None = None):
        k = self.keeper
        nodes = k.descriptors() if nodes is None else nodes
        return place_experts(k.layout, nodes, k.constraints, k.config.expert_nodes)

    def _current(self) -> list[tuple[str, int, int]]:
        return [(s.member, s.start, s.stop) for s in self.keeper.latest.stages]

    def speed_decision(self, name: str, figure: float, factor: float = SPEED_FACTOR) -> SpeedDecision:
        try:
            placement = self._placement()
        except PlanError as e:
            return SpeedDecision(True, False, f"no plan to compare with: {e}")
        return decide_on_speed(placement.stage_layout, placement.stage_nodes, self.keeper.constraints,
                               self._current(), name, figure, factor=factor)

    def consider_speed(self, name: str, figure: float, source: str = "", factor: float = SPEED_FACTOR) -> None:
        """A new planning figure for ``name`` (claimed, served, or timed by the host): adopted if
        it moved past its band (``factor``), re-planned on only once that makes the plan better by
        more than moving costs, sustained (plans/hysteresis.py)."""
        self.adopt_speed(name, figure, self.speed_decision(name, figure, factor), source)

    def adopt_speed(self, name: str, figure: float, decision: SpeedDecision, source: str = "") -> None:
        basis = self.keeper.speed_basis
        if decision.adopt or name not in basis:
            basis[name] = figure
        (log.info if decision.adopt else log.debug)("speed of %s%s: %s", name, source, decision.reason)
        if decision.adopt:
            self.look(decision.replan)

    def consider_links(self, name: str, claims: dict[str, Link]) -> None:
        """``name`` reports its measured links: each is planned with once it moved past the noise
        band, and the host re-plans on them only if that makes the plan materially better, and
        through the same gate as speeds: the gain sustained, the plan in use settled, so links
        claimed bad and good by turns re-plan nothing."""
        trunk = self.keeper.trunks.get(name)
        if trunk is None:
            return
        try:
            placement = self._placement()
        except PlanError:
            trunk.links = sticky_links(trunk.links, claims)
            return
        decision = decide_on_links(placement.stage_layout, placement.stage_nodes, self.keeper.constraints,
                                   self._current(), name, claims)
        trunk.links = {peer: decision.links[peer] for peer in claims}
        (log.info if decision.replan else log.debug)("links of %s: %s", name, decision.reason)
        if decision.changed:
            self.look(decision.replan)

    def reconsider(self) -> None:
        """Look again at whether a re-plan on the figures planned with now is worth it (the gate's
        timer): the gain must still be there, or the wait starts over."""
        nodes, current, worth = self.keeper.descriptors(), self._current(), False
        if current and self.keeper.constraints.objective != "even":
            try:
                placement = self._placement(nodes)
                stage_nodes = {n.name for n in placement.stage_nodes}
                if all(member in stage_nodes for member, _, _ in current):
                    gain = replan_gain(placement.stage_layout, placement.stage_nodes, self.keeper.constraints,
                                       current)
                    worth = gain.worth
                    log.debug("looking again at the speeds: %s", gain.describe())
            except PlanError:
                worth = False
        self.look(worth)

    def look(self, worth: bool) -> None:
        """One look through the gate: re-plan (once the stages are idle), or look again when the
        gain may be sustained."""
        k = self.keeper
        if k.gate.look(worth, k.clock()):
            if k.stage_requests is None:
                log.info("the gain held for %.0f s: re-planning", k.gate.sustain_s)
                k.replan()
            elif self._asking is None or self._asking.done():
                self._asking = asyncio.ensure_future(self._replan_when_idle())
            return
        self._look_again.set(k.gate.due())  # (no loop: a test drives ``reconsider`` itself)

    async def _replan_when_idle(self) -> None:
        """The gain held: re-plan now if the stages hold no request; else look again in a while,
        for at most MAX_DEFER_S of a gain held under load (moving replays every request in
        flight: under steady load the swarm serves on, where it is)."""
        k = self.keeper
        try:
            held = await k.stage_requests()
        except Exception as e:  # noqa: BLE001 - a stage that cannot say: it may be busy, look again
            log.debug("asking the stages what they hold failed: %r", e)
            held = -1
        since = k.gate.worth_since
        if since is None:  # the gain went away (or the plan changed) while the stages answered
            return
        if held and k.clock() - since < MAX_DEFER_S:
            log.info("the gain held for %.0f s, but the stages hold %s requests: re-planning once "
                     "they are idle", k.clock() - since, held if held > 0 else "unknown")
            self._look_again.set(k.clock() + IDLE_RECHECK_S)
            return
        log.info("the gain held for %.0f s: re-planning", k.clock() - since)
        k.replan()

    def close(self) -> None:
        self._look_again.cancel()
        if self._asking is not None:
            self._asking.cancel()
