"""When a changed speed figure, or a changed link, is worth a new plan (hysteresis).

A trunk's ms per layer is a measurement, and measurements wobble: the same node, measured again a
minute later on a machine where something else woke up, reads tens of percent off, and a figure
refreshed from the batches it serves carries the serving overhead as well. A re-plan is not free:
every stage whose range moves drops its requests' KV caches (their askers replay them) and loads,
or fetches, other layers. So the host re-plans on a new figure only when both hold:

1. The figure moved by at least ``SPEED_FACTOR`` (1.5×) from the one the host plans with.
   A ±30% wobble is a ratio between 0.7 and 1.3, at most 1/0.7 = 1.43× either way, below 1.5×;
   the changes worth reacting to (another heavy program on the machine, thermal throttling, a
   figure taken under load at join and re-measured idle) are 2× and more. A figure inside the
   band is not adopted at all: the planner keeps the old one, so a re-plan for another reason (a
   trunk joining or leaving) is not reshuffled by the wobble either.
2. The plan made with the new figure is materially better than the current assignment under the
   same new figure: its objective (one stream's time per token for "latency", the slowest stage
   for "throughput") lower by at least ``MIN_GAIN`` (10%). A node that got slower but would keep
   its layers anyway (it is alone, or still the best place for them) re-plans nothing.

Objective "even" places layers by memory, not speed: speed never re-plans it.

Links get the same treatment (``decide_on_links``). A round trip measured again wobbles by a few
milliseconds on a quiet path and by tens of percent on a busy one, and a re-plan for it would cost
the same reloads. So a new link figure is adopted only when it moved by ``LINK_FACTOR`` (1.5×)
and by more than ``LINK_NOISE_MS`` (5 ms: a 1 ms LAN link read at 2 ms is noise, not a 2× change),
or changed path (direct to relayed, another relay); and the host re-plans on it only when the
plan made with it beats the current assignment, under the same new links, by ``MIN_GAIN``.

Why not treat speeds within a factor as equal inside the planner? Two genuinely different nodes
(1.0 and 1.4 ms per layer) deserve different shares under "throughput", and brute force checks
the planner's answers exactly. Noise is handled where it arises: a robust measurement at join
(``kernels/speed.py``: repeats, a low quantile, repeats starved by other processes discarded),
a figure refreshed from serving, and this band on what the planner is told.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .layout import ModelLayout
from .nodes import ASKER, Link, NodeDescriptor
from .plan import PlanError
from .planner import Constraints, _Problem, plan_layers

SPEED_FACTOR = 1.5
MIN_GAIN = 0.10
LINK_FACTOR = 1.5
LINK_NOISE_MS = 5.0


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
    problem = _Problem(layout, list(nodes), constraints, start, stop)
    order = [m for m, _, _ in stages]
    compute = [(b - a) * problem.by_name[m].ms_per_layer_token for m, a, b in stages]
    hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
    link_ms = [problem._link_ms(a, b) for a, b in hops]
    transfer = max(ms - problem._link_latency(a, b) for ms, (a, b) in zip(link_ms, hops))
    return sum(compute) + sum(link_ms), max(max(compute), transfer)


@dataclass(frozen=True)
class SpeedDecision:
    adopt: bool  # plan with the new figure from now on (it moved by SPEED_FACTOR or more)
    replan: bool  # and re-plan now (the new plan is at least MIN_GAIN better)
    reason: str
    current_ms: float | None = None  # the objective of the current assignment under the new figure
    proposed_ms: float | None = None  # the objective of the plan made with it


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
        now, new, what = _replanning(layout, updated, constraints, current)
    except PlanError as e:
        return SpeedDecision(True, False, f"no plan with the new figure: {e}")
    if new <= now * (1 - min_gain):
        return SpeedDecision(True, True, f"{member} now {figure:.3g} ms per layer (planned {planned:.3g}): a new "
                                         f"plan takes {what} {new:.1f} ms instead of {now:.1f}", now, new)
    return SpeedDecision(True, False, f"{member} now {figure:.3g} ms per layer (planned {planned:.3g}), but a new "
                                      f"plan would take {what} {new:.1f} ms against {now:.1f} now: kept", now, new)


def _replanning(layout: ModelLayout, nodes: Sequence[NodeDescriptor], constraints: Constraints,
                current: Sequence[tuple[str, int, int]]) -> tuple[float, float, str]:
    """The objective's cost of the current assignment and of a fresh plan, both on ``nodes``'
    figures, and its unit. Raises PlanError where no plan fits."""
    proposal = plan_layers(layout, nodes, constraints)
    pick = 1 if constraints.objective == "throughput" else 0
    now = assignment_cost(layout, nodes, constraints, current)[pick]
    new = assignment_cost(layout, nodes, constraints, [(s.member, s.start, s.stop) for s in proposal.stages])[pick]
    return now, new, "the slowest stage" if pick else "a token"


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
        return LinkDecision(links, False, f"{what}; objective 'even' keeps its order")
    if not current or any(m not in by_name for m, _, _ in current):
        return LinkDecision(links, False, f"{what}; no current assignment to compare with")
    updated = [replace(n, links={**n.links, **links}) if n.name == member else n for n in nodes]
    try:
        now, new, unit = _replanning(layout, updated, constraints, current)
    except PlanError as e:
        return LinkDecision(links, False, f"{what}; no plan with them: {e}")
    if new <= now * (1 - min_gain):
        return LinkDecision(links, True, f"{what}: a new plan takes {unit} {new:.1f} ms instead of {now:.1f}",
                            now, new)
    return LinkDecision(links, False, f"{what}, but a new plan would take {unit} {new:.1f} ms against "
                                      f"{now:.1f} now: kept", now, new)
