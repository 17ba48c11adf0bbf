"""When a changed speed figure, or a changed link, is worth a new plan (hysteresis).

A trunk's ms per layer is a measurement, and measurements wobble: the same node, measured again a
minute later on a machine where something else woke up, reads tens of percent off, and a figure
refreshed from the batches it serves carries the serving overhead as well. A re-plan is not free:
every stage whose range moves drops its requests' KV caches (their askers replay them: 5-8 s under
load) and loads, or fetches, other layers. So the host re-plans on a new figure only when
all of these hold:

1. The figure moved by at least ``SPEED_FACTOR`` (1.5×) from the one the host plans with, for a
   figure measured afresh (a claim at join, a probe), or by ``CONVERGE_FACTOR`` (1.1×) for a
   figure the member serves at, which the host takes as the best of its last ``SERVED_REPORTS``
   served reports (``served_figure``: interference only adds time, so a stage whose figures swing
   under load is judged by its good ones, and it takes that many reports, a minute or more
   apart, for a stage to be judged slower). A ±30% wobble of a single measurement is a ratio
   between 0.7 and 1.3, at most 1/0.7 = 1.43× either way, below 1.5×; served figures are many
   batches' best quarter, steady enough that the plan can follow them closely, so the figures
   planned with converge to what members serve (a stage planned with a contended
   start-up 44.6 served at 38.6). A figure inside its band is not adopted at all: the planner
   keeps the old one, so a re-plan for another reason (a trunk joining or leaving) is not
   reshuffled by the wobble either.
2. The plan made with the new figure is materially better than the current assignment under the
   same new figure: its objective (one stream's time per token for "latency", the slowest stage
   for "throughput") lower by ``required_gain``: at least ``MIN_GAIN`` (10%), and more where moving
   costs more than the gain repays within ``PAYBACK_S`` (``move_cost_s``: the moved layers' bytes
   loaded again, at the rate the member fetches them where it has no model file, and the requests
   of the stages that change replayed). A node that got slower but
   would keep its layers anyway (it is alone, or still the best place for them) re-plans nothing.
3. The gain is sustained (``ReplanGate``, applied by the host): it held at every look for
   ``SUSTAIN_S``, and the plan in use has stood for ``SETTLE_S`` (a stage that just moved serves
   cold and replays its requests; its figures are not yet what it serves).
4. The host then re-plans once the stages hold no request, or after ``MAX_DEFER_S`` of a gain
   held under load: a move replays every request in flight, and a figure taken under the swarm's
   own load is the one most likely to mislead, so under steady load nothing moves.

Objective "even" places layers by memory, not speed: speed never re-plans it.

Links get the same treatment (``decide_on_links``). A round trip measured again wobbles by a few
milliseconds on a quiet path and by tens of percent on a busy one, and a re-plan for it would cost
the same reloads. So a new link figure is adopted only when it moved by ``LINK_FACTOR`` (1.5×)
and by more than ``LINK_NOISE_MS`` (5 ms: a 1 ms LAN link read at 2 ms is noise, not a 2× change),
or changed path (direct to relayed, another relay); and the host re-plans on it only when the
plan made with it beats the current assignment, under the same new links, by ``MIN_GAIN``.

Links that moved go through the same ``ReplanGate`` as speeds (the host's ``consider_links``): a
link claimed bad and good by turns (3 plan switches in 11 s, asks slowed to 10-12 s)
never holds its gain for ``SUSTAIN_S``, and a plan in use that has not stood ``SETTLE_S`` is not
left for a link either, so flapping claims cause at most one re-plan per settle period.

Members that come and go are damped too (``Backoff``): a member that rejoins within ``SETTLE_S`` of
leaving a second time in a row (the first, a restart after a crash, costs nothing) is left out of
plans for ``REJOIN_HOLD_S`` before it is planned in again, and a member whose
stage missed its deadline to be ready (``ready_deadline_s``; a staged plan's, or the plan in use's)
is left out for ``MISSED_HOLD_S``; each again within ``FORGET_S`` doubles its wait, up to
``HOLD_MAX_S``. A member the others cannot do without is planned whatever its wait (the host's
``replan``): the damping is never worth a swarm that cannot serve.

Why not treat speeds within a factor as equal inside the planner? Two genuinely different nodes
(1.0 and 1.4 ms per layer) deserve different shares under "throughput", and brute force checks
the planner's answers exactly. Noise is handled where it arises: a robust measurement at join
(``kernels/speed.py``: the best of several short repeats, repeats starved by other processes
discarded), a figure refreshed from the batches served (starved batches discarded), and these
bands on what the planner is told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from .layout import ModelLayout
from .nodes import ASKER, Link, NodeDescriptor
from .plan import PlanError
from .cost import CostModel
from .planner import Constraints, plan_layers

SPEED_FACTOR = 1.5
CONVERGE_FACTOR = 1.1  # a served figure this far from the planned one is adopted
SERVED_REPORTS = 3  # a member's served figure: the best of its last three served reports
MIN_GAIN = 0.10
PAYBACK_S = 120.0  # a move has to repay what it costs within two minutes of serving
RELOAD_MB_S = 200.0  # a stage loading layers it did not hold (read, checked against the hashes, built)
# A member without the model file fetches the layers it is moved to: at the rate it last fetched
# at, and until it fetched anything at a home uplink's 20 Mbit/s (the host's, or a member's).
DEFAULT_FETCH_MB_S = 2.5
REPLAY_S = 5.0  # the requests of a stage that changes are replayed elsewhere (5-8 s under load)
SUSTAIN_S = 90.0  # a re-plan on speed: the gain held at every look for this long (3 served reports)
SETTLE_S = 60.0  # and the plan in use has stood this long
MAX_DEFER_S = 600.0  # the host then waits for the stages to be idle, this long at most (swarmctl/host/planning.py)
LINK_FACTOR = 1.5
LINK_NOISE_MS = 5.0
# A published plan's stage is given this long to get ready, plus its bytes at LOAD_MB_S (a slice
# read from a slow disk or fetched over a home link, checked and built); meanwhile the swarm is
# incomplete (the host's planning.py; a staged plan's deadline is its own: the plan in use serves).
READY_BASE_S = 60.0
LOAD_MB_S = 50.0
REJOIN_HOLD_S = SETTLE_S  # a member that rejoined within SETTLE_S of leaving waits this long first
MISSED_HOLD_S = 300.0  # a member whose stage was not ready by its deadline waits this long first
HOLD_MAX_S = 3600.0
FORGET_S = 6 * 3600.0  # a strike this long after the member's last one counts as its first again


def served_figure(reports: Sequence[float], keep: int = SERVED_REPORTS) -> float | None:
    """A member's served figure: the best of its last ``keep`` served reports (None: none yet)."""
    recent = [r for r in reports[-keep:] if r > 0]
    return min(recent) if recent else None


def move_cost_s(layout: ModelLayout, current: Sequence[tuple[str, int, int]],
                proposed: Sequence[tuple[str, int, int]], nodes: Sequence[NodeDescriptor] = ()) -> float:
    """Seconds of serving a move from ``current`` to ``proposed`` (member, start, stop) stages
    costs: the layers that change member are loaded again, each at its new member's rate
    (``load_mb_s``: a reload from its own file, or a fetch where it has none), and the requests
    held by the stages that change are replayed (``REPLAY_S``). 0 when nothing moves."""
    holder = {layer: member for member, a, b in current for layer in range(a, b)}
    by_name = {n.name: n for n in nodes}
    moved = [(member, layer) for member, a, b in proposed for layer in range(a, b) if holder.get(layer) != member]
    if not moved:
        return 0.0
    return sum(layout.layer_bytes[layer] / (load_mb_s(by_name.get(member)) * 1e6) for member, layer in moved) \
        + REPLAY_S


def load_mb_s(node: NodeDescriptor | None) -> float:
    """How fast ``node`` gets layers it did not hold: from its own model file at ``RELOAD_MB_S``;
    without one, fetched at the rate it last fetched at (never faster than a reload, which it
    does too), or ``DEFAULT_FETCH_MB_S`` until it fetched anything."""
    if node is None or not node.fetches:
        return RELOAD_MB_S
    return min(RELOAD_MB_S, node.fetch_mb_s or DEFAULT_FETCH_MB_S)


def required_gain(cost_s: float, min_gain: float = MIN_GAIN, payback_s: float = PAYBACK_S) -> float:
    """The fraction a new plan must save to be worth ``cost_s`` seconds of moving: a gain g saves
    g × ``payback_s`` seconds of serving over the payback time, which must exceed the cost."""
    return max(min_gain, cost_s / payback_s)


@dataclass
class ReplanGate:
    """The host's third test: a re-plan on speed only once its gain was sustained. Each look
    (a new figure, or the timer the host sets with ``due``) says whether a re-plan is worth it
    now; a look that says no starts the wait again. I/O-free: the caller passes the time."""

    sustain_s: float = SUSTAIN_S
    settle_s: float = SETTLE_S
    worth_since: float | None = None  # the first of the looks in a row that found the gain
    plan_changed_at: float = -math.inf

    def plan_changed(self, now: float) -> None:
        """A new plan is in use (for whatever reason): the gain found before is about another one."""
        self.plan_changed_at = now
        self.worth_since = None

    def look(self, worth: bool, now: float) -> bool:
        """True: re-plan now."""
        if not worth:
            self.worth_since = None
            return False
        if self.worth_since is None:
            self.worth_since = now
        return now >= self.worth_since + self.sustain_s and now >= self.plan_changed_at + self.settle_s

    def due(self) -> float | None:
        """When to look again (the host's timer), or None when nothing waits."""
        if self.worth_since is None:
            return None
        return max(self.worth_since + self.sustain_s, self.plan_changed_at + self.settle_s)


def ready_deadline_s(stage_bytes: int, base_s: float = READY_BASE_S, load_mb_s: float = LOAD_MB_S) -> float:
    """How long a stage of ``stage_bytes`` weight bytes may take to get ready in a published plan."""
    return base_s + max(0, stage_bytes) / (load_mb_s * 1e6)


@dataclass
class Backoff:
    """How long a member is left out after a strike (it missed a deadline, or rejoined right after
    leaving): ``first_s``, twice that after a second strike within ``forget_s`` of the one before,
    and so on up to ``max_s``. I/O-free: the caller passes the time."""

    first_s: float
    max_s: float = HOLD_MAX_S
    forget_s: float = FORGET_S
    free: int = 0  # strikes in a row that cost nothing (a member restarted once after a crash is honest)
    strikes: dict[str, tuple[int, float]] = field(default_factory=dict)  # member → (strikes in a row, the last's)

    def strike(self, member: str, now: float) -> float:
        """A strike against ``member`` now: how long it is left out (0: not at all)."""
        count, last = self.strikes.get(member, (0, -math.inf))
        count = 1 if now - last > self.forget_s else count + 1
        self.strikes[member] = (count, now)
        if count <= self.free:
            return 0.0
        return min(self.max_s, self.first_s * 2.0 ** min(count - 1 - self.free, 40))

    def count(self, member: str) -> int:
        return self.strikes.get(member, (0, 0.0))[0]


def materially_changed(planned: float | None, figure: float | None, factor: float = SPEED_FACTOR) -> bool:
    """True when ``figure`` is outside [planned / factor, planned × factor] (or there was none)."""
    if figure is None or not figure > 0:
        return False
    if planned is None or not planned > 0:
        return True
    ratio = figure / planned
    return ratio >= factor or ratio <= 1 / factor


def sticky_speed(planned: float | None, figure: float | None, factor: float = SPEED_FACTOR) -> float | None:
    """The figure to plan with: the old one while the new one is inside the band."""
    return figure if materially_changed(planned, figure, factor) else planned


def assignment_cost(layout: ModelLayout, nodes: Sequence[NodeDescriptor], constraints: Constraints,
                    stages: Sequence[tuple[str, int, int]]) -> tuple[float, float]:
    """(one stream's ms per token, the pipeline's bottleneck in ms) of ``stages`` (member, start,
    stop) under the nodes' figures, by the planner's own cost model (compute plus links)."""
    start, stop = constraints.head_layers, layout.n_layer - constraints.head_layers
    problem = CostModel(layout, list(nodes), constraints, start, stop)
    order = [m for m, _, _ in stages]
    compute = [(b - a) * problem.by_name[m].ms_per_layer_token for m, a, b in stages]
    hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
    link_ms = [problem.link_ms(a, b) for a, b in hops]
    transfer = max(ms - problem.link_latency(a, b) for ms, (a, b) in zip(link_ms, hops))
    return sum(compute) + sum(link_ms), max(max(compute), transfer)


@dataclass(frozen=True)
class SpeedDecision:
    adopt: bool  # plan with the new figure from now on (it moved by its band or more)
    replan: bool  # and a re-plan is worth it (the new plan saves at least the required gain)
    reason: str
    current_ms: float | None = None  # the objective of the current assignment under the new figure
    proposed_ms: float | None = None  # the objective of the plan made with it
    cost_s: float = 0.0  # what moving to it costs (move_cost_s)


def decide_on_speed(layout: ModelLayout, nodes: Sequence[NodeDescriptor], constraints: Constraints,
                    current: Sequence[tuple[str, int, int]], member: str, figure: float, *,
                    factor: float = SPEED_FACTOR, min_gain: float = MIN_GAIN) -> SpeedDecision:
    """``member`` reports ``figure`` ms per layer; ``nodes`` carry the figures the host plans with
    now, ``current`` is the plan's (member, start, stop) stages. Adopt the figure? Re-plan?"""
    by_name = {n.name: n for n in nodes}
    node = by_name.get(member)
    planned = node.ms_per_layer_token if node is not None else None
    if not figure > 0:
        return SpeedDecision(False, False, f"{member}: {figure!r} is not a speed")
    if not materially_changed(planned, figure, factor):
        return SpeedDecision(False, False, f"{member}: {figure:.3g} ms per layer is within {factor}× of the "
                                           f"{planned:.3g} planned with: kept")
    if node is None:
        return SpeedDecision(True, False, f"{member} is not a stage candidate now")
    if constraints.objective == "even":
        return SpeedDecision(True, False, "objective 'even' places layers by memory, not speed")
    if not current or any(m not in by_name for m, _, _ in current):
        return SpeedDecision(True, False, "no current assignment to compare with")
    updated = [replace(n, ms_per_layer_token=figure) if n.name == member else n for n in nodes]
    try:
        gain = replan_gain(layout, updated, constraints, current, min_gain=min_gain)
    except PlanError as e:
        return SpeedDecision(True, False, f"no plan with the new figure: {e}")
    what = f"{member} now {figure:.3g} ms per layer (planned {planned:.3g})"
    return SpeedDecision(True, gain.worth, f"{what}: {gain.describe()}", gain.current_ms, gain.proposed_ms,
                         gain.cost_s)


@dataclass(frozen=True)
class Gain:
    """A fresh plan against the current assignment, both under the same figures."""

    current_ms: float
    proposed_ms: float
    unit: str  # "a token" (latency) or "the slowest stage" (throughput)
    cost_s: float  # of moving to it
    needed: float  # the fraction it must save (required_gain)

    @property
    def worth(self) -> bool:
        return self.proposed_ms <= self.current_ms * (1 - self.needed)

    def describe(self) -> str:
        verdict = "re-plan" if self.worth else "kept"
        return (f"a new plan takes {self.unit} {self.proposed_ms:.1f} ms against {self.current_ms:.1f} now "
                f"(moving costs about {self.cost_s:.1f} s, so it must save {self.needed:.0%}): {verdict}")


def replan_gain(layout: ModelLayout, nodes: Sequence[NodeDescriptor], constraints: Constraints,
                current: Sequence[tuple[str, int, int]], *, min_gain: float = MIN_GAIN) -> Gain:
    """What a fresh plan on ``nodes``' figures would gain over ``current``, and whether that pays
    for the move. Raises PlanError where no plan fits."""
    now, new, unit, proposed = _replanning(layout, nodes, constraints, current)
    cost = move_cost_s(layout, current, proposed, nodes)
    return Gain(now, new, unit, cost, required_gain(cost, min_gain))


def _replanning(layout: ModelLayout, nodes: Sequence[NodeDescriptor], constraints: Constraints,
                current: Sequence[tuple[str, int, int]]) -> tuple[float, float, str, list[tuple[str, int, int]]]:
    """The objective's cost of the current assignment and of a fresh plan, both on ``nodes``'
    figures, its unit, and the fresh plan's stages. Raises PlanError where no plan fits."""
    proposal = plan_layers(layout, nodes, constraints)
    stages = [(s.member, s.start, s.stop) for s in proposal.stages]
    pick = 1 if constraints.objective == "throughput" else 0
    now = assignment_cost(layout, nodes, constraints, current)[pick]
    new = assignment_cost(layout, nodes, constraints, stages)[pick]
    return now, new, "the slowest stage" if pick else "a token", stages


def link_moved(planned: Link | None, measured: Link, factor: float = LINK_FACTOR,
               noise_ms: float = LINK_NOISE_MS) -> bool:
    """True when ``measured`` is a different link from ``planned`` rather than the same one read
    again: another path, a round trip off by ``factor`` and more than ``noise_ms``, or a bandwidth
    off by ``factor``."""
    if planned is None or planned.via != measured.via:
        return True
    rtt_moved = abs(measured.rtt_ms - planned.rtt_ms) > noise_ms and materially_changed(
        planned.rtt_ms, measured.rtt_ms, factor)
    return rtt_moved or materially_changed(planned.bandwidth_mb_s, measured.bandwidth_mb_s, factor)


def sticky_links(planned: dict[str, Link], measured: dict[str, Link]) -> dict[str, Link]:
    """The links to plan with for the peers in ``measured``: the planned one while the new
    measurement is within the band, the new one otherwise."""
    return {peer: planned[peer] if peer in planned and not link_moved(planned[peer], link) else link
            for peer, link in measured.items()}


@dataclass(frozen=True)
class LinkDecision:
    links: dict[str, Link]  # the member's links to plan with from now on (those it reported, banded)
    replan: bool  # re-plan now: the plan made with them is at least MIN_GAIN better
    reason: str
    current_ms: float | None = None  # the objective of the current assignment under the new links
    proposed_ms: float | None = None  # the objective of the plan made with them
    changed: bool = False  # a link moved past its band: the planner is told (and the gate looks)


def decide_on_links(layout: ModelLayout, nodes: Sequence[NodeDescriptor], constraints: Constraints,
                    current: Sequence[tuple[str, int, int]], member: str, measured: dict[str, Link], *,
                    min_gain: float = MIN_GAIN) -> LinkDecision:
    """``member`` reports ``measured`` links (peer → Link); ``nodes`` carry the links the host plans
    with now, ``current`` is the plan's (member, start, stop) stages. Which links to keep? Re-plan?"""
    by_name = {n.name: n for n in nodes}
    node = by_name.get(member)
    if node is None:
        return LinkDecision(dict(measured), False, f"{member} is not a stage candidate now")
    links = sticky_links(node.links, measured)
    moved = sorted(peer for peer, link in links.items() if link is not node.links.get(peer))
    if not moved:
        return LinkDecision(links, False, f"{member}: links within the noise band of those planned with: kept")
    what = f"{member}'s links to {', '.join(moved)} changed"
    if constraints.objective == "even":
        return LinkDecision(links, False, f"{what}; objective 'even' keeps its order", changed=True)
    if not current or any(m not in by_name for m, _, _ in current):
        return LinkDecision(links, False, f"{what}; no current assignment to compare with", changed=True)
    updated = [replace(n, links={**n.links, **links}) if n.name == member else n for n in nodes]
    try:
        now, new, unit, _ = _replanning(layout, updated, constraints, current)
    except PlanError as e:
        return LinkDecision(links, False, f"{what}; no plan with them: {e}", changed=True)
    if new <= now * (1 - min_gain):
        return LinkDecision(links, True, f"{what}: a new plan takes {unit} {new:.1f} ms instead of {now:.1f}",
                            now, new, changed=True)
    return LinkDecision(links, False, f"{what}, but a new plan would take {unit} {new:.1f} ms against "
                                      f"{now:.1f} now: kept", now, new, changed=True)
