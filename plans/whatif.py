"""What-ifs on a plan, by the planner's own cost model (nothing here is measured): the floor that
the links' round trips set under a single stream, what speculative multi-token steps would buy,
and what visiting each site once buys over an order that ignores sites.

    python -m plans.whatif --layout kimi-k2 --nodes plans/examples/kimi-thirty-gpus.json --head-layers 1

Assumptions, stated where they are used:
- decoding is bound by memory bandwidth, so a stage's time for r rows (a checked step of k drafts
  has r = k + 1) is the bytes those rows read: attention, router and shared expert once, and the
  routed experts the rows pick between them. Rows pick experts independently and uniformly, so r
  rows read n_expert × (1 − (1 − used / n_expert)^r) distinct experts (real routers correlate
  neighbouring tokens, which reads fewer);
- a link carries r rows at its bandwidth and adds half its round trip once;
- an expert call's latency is paid once per step and its bytes grow with r;
- the asker's own layers and LM head are read at ASKER_GB_S (plans/proposal.py AskerModel).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from .layout import ModelLayout
from .nodes import ASKER, NodeDescriptor
from .options import HEAD_LAYERS, head_layers_arg
from .plan import PlanError
from .planner import Constraints, Proposal, add_expert_calls, describe, place_experts, plan_layers, time_breakdown
from .search import Search, best_paths


def distinct_experts(layout: ModelLayout, rows: int) -> float:
    """Expected distinct routed experts ``rows`` tokens read in one MoE layer (uniform, independent)."""
    if not layout.n_expert:
        return 0.0
    return layout.n_expert * (1 - (1 - layout.n_expert_used / layout.n_expert) ** rows)


def row_factor(layout: ModelLayout, il: int, rows: int, same_experts: bool = False) -> float:
    """A layer's time for ``rows`` rows over its time for one, when reading weights is the cost.
    ``same_experts``: the rows all pick the same experts (the best case; a dense layer's rows)."""
    if same_experts or not layout.expert_bytes or not layout.expert_bytes[il]:
        return 1.0
    per_expert = layout.expert_bytes[il] / layout.n_expert
    one_row = layout.layer_bytes[il] - layout.expert_bytes[il] + per_expert * layout.n_expert_used
    rest = one_row - per_expert * layout.n_expert_used
    return (rest + per_expert * distinct_experts(layout, rows)) / one_row


def asker_step_ms(proposal: Proposal, layout: ModelLayout, rows: int = 1, same_experts: bool = False) -> float:
    """The asker's own part of a step of ``rows`` rows: its layers' rows read their experts as a
    stage's do; the LM head is read once for all of them."""
    if not proposal.asker_ms:
        return 0.0
    k = proposal.stages[0].start if proposal.stages else layout.n_layer // 2
    own = [*range(k), *range(layout.n_layer - k, layout.n_layer)]
    one = layout.asker_read_bytes(k)
    more = sum(layout.read_bytes(il) * (row_factor(layout, il, rows, same_experts) - 1) for il in own)
    return proposal.asker_ms * (one + more) / one


def trip_ms(proposal: Proposal, layout: ModelLayout, rows: int = 1, same_experts: bool = False) -> float:
    """One step's trip through the plan carrying ``rows`` rows, the asker's own part included (1:
    the planner's whole ms per token)."""
    ms = asker_step_ms(proposal, layout, rows, same_experts)
    for s in proposal.stages:
        per_layer = s.compute_ms / (s.stop - s.start)
        ms += sum(per_layer * row_factor(layout, il, rows, same_experts) for il in range(s.start, s.stop))
        ms += s.expert_latency_ms + (s.expert_ms - s.expert_latency_ms) * rows
    for h in proposal.hops:
        ms += h.rtt_ms / 2 + (h.ms - h.rtt_ms / 2) * rows
    return ms


def tokens_per_trip(k: int, acceptance: float) -> float:
    """Expected tokens one checked step yields with ``k`` drafts each kept with probability
    ``acceptance`` until the first miss: (1 − a^(k+1)) / (1 − a)."""
    if acceptance >= 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass(frozen=True)
class Speculation:
    routing: str  # "independent" (each row picks its own experts) or "same experts" (the best case)
    acceptance: float
    drafts: int  # k
    tokens_per_trip: float
    trip_ms: float
    tokens_per_s: float
    speedup: float  # over plain single-token steps


def speculation(proposal: Proposal, layout: ModelLayout, acceptances=(0.5, 0.7, 0.8, 0.9),
                drafts=(1, 2, 3, 4, 6, 8)) -> list[Speculation]:
    plain = 1000 / trip_ms(proposal, layout, 1)
    out = []
    for same in (False, True):
        for a in acceptances:
            for k in drafts:
                t = trip_ms(proposal, layout, k + 1, same)
                n = tokens_per_trip(k, a)
                out.append(Speculation("same experts" if same else "independent", a, k, n, t, 1000 * n / t,
                                       1000 * n / t / plain))
    return out


def bottleneck_ms(proposal: Proposal, layout: ModelLayout, rows: int = 1, same_experts: bool = False) -> float:
    """The slowest part a step of ``rows`` rows passes through (the asker's own layers, a stage's
    compute, or a hop's bytes and packets): how often the pipeline can take the next one."""
    worst = asker_step_ms(proposal, layout, rows, same_experts)
    for s in proposal.stages:
        per_layer = s.compute_ms / (s.stop - s.start)
        stage_ms = sum(per_layer * row_factor(layout, il, rows, same_experts) for il in range(s.start, s.stop))
        worst = max(worst, stage_ms + s.expert_latency_ms + (s.expert_ms - s.expert_latency_ms) * rows)
    for h in proposal.hops:
        worst = max(worst, (h.ms - h.rtt_ms / 2) * rows)
    return worst


@dataclass(frozen=True)
class WindowsInFlight:
    """Speculative windows sent before the previous one's verdict, as modelled
    here; the asker keeps up to MAX_WINDOWS out where what it measures says they pay."""

    routing: str
    acceptance: float
    drafts: int  # k per window
    windows: int  # in flight at most
    tokens_per_s: float
    one_window_tokens_per_s: float  # the same drafts, one window per round trip
    gain: float  # over one window per round trip


def windows_in_flight(proposal: Proposal, layout: ModelLayout, acceptance: float, k: int, windows: int,
                      same_experts: bool = False) -> WindowsInFlight:
    """Tokens/s of one stream that keeps up to ``windows`` windows of ``k`` drafts in flight. Window
    n + 1 is drafted on the guess that window n keeps its k drafts and that the token after them is
    the one guessed: with probability a^(k+1) it holds and the window yields k + 1 tokens one
    pipeline slot after the previous one; else later windows are dropped and the next verdict costs
    a whole round trip again (a renewal process: expected tokens over expected time per burst)."""
    trip = trip_ms(proposal, layout, k + 1, same_experts)
    slot = max(bottleneck_ms(proposal, layout, k + 1, same_experts), trip / max(1, windows))
    one = tokens_per_trip(k, acceptance)
    valid = acceptance ** (k + 1)
    if valid >= 1:
        tokens_per_s = 1000 * (k + 1) / slot
    else:
        kept_windows = valid / (1 - valid)  # whole windows before the one that breaks the chain
        tokens = (k + 1) * kept_windows + (one - (k + 1) * valid) / (1 - valid)
        tokens_per_s = 1000 * tokens / (trip + slot * kept_windows)
    single = 1000 * one / trip
    return WindowsInFlight("same experts" if same_experts else "independent", acceptance, k, windows, tokens_per_s,
                           single, tokens_per_s / single)


MAX_WINDOWS = 6  # speculative windows one request keeps out at most: the asker's cap (DraftLength.max_windows)


def best_windows(proposal: Proposal, layout: ModelLayout, acceptance: float, drafts=(1, 2, 3, 4, 6, 8),
                 same_experts: bool = False) -> WindowsInFlight:
    """The draft count that does best with windows in flight, with as many windows as fill the trip
    (at most the asker's MAX_WINDOWS)."""
    best = None
    for k in drafts:
        trip = trip_ms(proposal, layout, k + 1, same_experts)
        slot = bottleneck_ms(proposal, layout, k + 1, same_experts)
        windows = min(MAX_WINDOWS, max(1, math.ceil(trip / slot)) if slot else 1)
        w = windows_in_flight(proposal, layout, acceptance, k, windows, same_experts)
        if best is None or w.tokens_per_s > best.tokens_per_s:
            best = w
    return best


def best_speculation(specs: list[Speculation]) -> list[Speculation]:
    """Per routing assumption and acceptance, the draft count that gives the most tokens/s."""
    best: dict[tuple[str, float], Speculation] = {}
    for sp in specs:
        key = (sp.routing, sp.acceptance)
        if key not in best or sp.tokens_per_s > best[key].tokens_per_s:
            best[key] = sp
    return list(best.values())


@dataclass(frozen=True)
class Floor:
    sites: tuple[str, ...]  # the cheapest tour that can hold the trunk, asker first and last
    latency_ms: float  # its half round trips: no bandwidth or compute buys this back


def latency_floor(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints) -> Floor:
    """The least half-round-trip latency of any trip asker → sites → asker whose sites offer the
    memory the trunk needs (memory summed per site: necessary, so the figure is a floor)."""
    problem = Search(layout, nodes, constraints, constraints.head_layers, layout.n_layer - constraints.head_layers)
    sites: dict[str, list[str]] = {}
    for n in nodes:
        sites.setdefault(problem.site_of(n.name), []).append(n.name)
    keys = sorted(sites)

    def half_rtt(a: str, b: str) -> float:
        left, right = sites.get(a, [ASKER]), sites.get(b, [ASKER])
        return min(problem.link_latency(x, y) for x in left for y in right)

    need = sum(problem.need)
    best = Floor((), math.inf)
    for mask, (ms, order) in best_paths(keys, half_rtt).items():
        held = sum(problem.usable[m] for site in order for m in sites[site])
        if held >= need and ms < best.latency_ms:
            best = Floor(tuple(order), ms)
    return best


@dataclass(frozen=True)
class OrderedPlan:
    label: str
    ms_per_token: float
    tokens_per_s: float  # pipelined bound
    stages: int
    site_changes: int  # stage to stage hops between sites


def plan_in_order(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints, order: list[str],
                  label: str) -> OrderedPlan:
    """The best stages along a fixed member order (any member may be skipped), as search_by_site
    picks them along its site order: to compare orders."""
    problem = Search(layout, nodes, constraints, constraints.head_layers, layout.n_layer - constraints.head_layers)
    found = problem.skip_cut([m for m in order if problem.room[m] >= 1])
    if found is None:
        return OrderedPlan(label, math.inf, 0.0, 0, 0)
    members = found[1]
    proposal = describe(problem, members, found[2])
    visits = [problem.site_of(m) for m in members]
    changes = sum(1 for a, b in zip(visits, visits[1:]) if a != b)
    return OrderedPlan(label, proposal.ms_per_token, proposal.tokens_per_s, len(members), changes)


def _plan(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints,
          expert_nodes: int = 0) -> Proposal:
    placement = place_experts(layout, nodes, constraints, expert_nodes)
    proposal = plan_layers(placement.stage_layout, placement.stage_nodes, constraints)
    add_expert_calls(proposal, placement, nodes, layout)
    return proposal


def report(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints,
           expert_nodes: int = 8) -> dict:
    """The numbers for a plan on paper, as a dict (printed as JSON by ``main``)."""
    plan = _plan(layout, nodes, constraints)

    parts = time_breakdown(plan, nodes)
    latency = sum(t.latency_ms for t in parts)
    floor = latency_floor(layout, nodes, constraints)
    specs = speculation(plan, layout)
    fastest_first = sorted(nodes, key=lambda n: (n.ms_per_layer_token, n.name))
    by_file_site: dict[str, list[str]] = {}
    for n in nodes:
        by_file_site.setdefault(n.site or n.name, []).append(n.name)
    orders = [plan_in_order(layout, nodes, constraints, [n.name for n in fastest_first],
                            "fastest members first, sites ignored"),
              plan_in_order(layout, nodes, constraints, [m for ms in by_file_site.values() for m in ms],
                            "each site's machines together, sites in the nodes file's order")]
    problem = Search(layout, nodes, constraints, constraints.head_layers, layout.n_layer - constraints.head_layers)
    compute_floor = problem.compute_floor([n.name for n in nodes])
    out = {
        "plan": {"ms_per_token": plan.ms_per_token, "tokens_per_s_single": 1000 / plan.ms_per_token,
                 "tokens_per_s_pipelined": plan.tokens_per_s, "stages": len(plan.stages),
                 "sites_visited": len({_site(nodes, s.member) for s in plan.stages}),
                 "time": [asdict(t) for t in parts], "latency_ms": latency,
                 "wan_hops": sum(t.count for t in parts if t.part == "links between sites")
                 + sum(1 for h in plan.hops if ASKER in (h.src, h.dst) and h.rtt_ms / 2 > 1.0)},
        "asker": {"gb_s": constraints.asker.gb_s, "basis": plan.asker_basis, "ms": plan.asker_ms,
                  "ms_per_token_with_it": plan.whole_ms_per_token},
        "floor": {"sites": list(floor.sites), "latency_ms": floor.latency_ms,
                  "tokens_per_s_at_latency_alone": 1000 / floor.latency_ms if floor.latency_ms else math.inf,
                  "compute_ms": compute_floor},
        "speculation_best_k": [asdict(s) for s in best_speculation(specs)],
        "windows_in_flight": [asdict(best_windows(plan, layout, a, same_experts=same))
                              for same in (False, True) for a in (0.5, 0.7, 0.8, 0.9)],
        "speculation": [asdict(s) for s in specs],
        "orders": [asdict(o) for o in orders],
    }
    if layout.n_expert and expert_nodes:
        try:
            ep = _plan(layout, nodes, constraints, expert_nodes)
        except PlanError as e:
            out["expert_parallel"] = {"expert_nodes": expert_nodes, "error": str(e)}
            return out
        out["expert_parallel"] = {"expert_nodes": expert_nodes, "ms_per_token": ep.ms_per_token,
                                  "tokens_per_s_single": 1000 / ep.ms_per_token,
                                  "tokens_per_s_pipelined": ep.tokens_per_s,
                                  "time": [asdict(t) for t in time_breakdown(ep, nodes)]}
    return out


def _site(nodes: list[NodeDescriptor], name: str) -> str:
    return next((n.site or n.name for n in nodes if n.name == name), name)


def main(argv: list[str] | None = None) -> int:
    from kernels.errors import EngineError
    from .layout import layout_by_name
    from .nodes import load_nodes

    p = argparse.ArgumentParser(prog="python -m plans.whatif", description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", required=True)
    p.add_argument("--nodes", required=True)
    p.add_argument("--head-layers", type=head_layers_arg, default=HEAD_LAYERS)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("--objective", default="latency")
    p.add_argument("--expert-nodes", type=int, default=8, help="also plan with N expert nodes, to compare")
    args = p.parse_args(argv)
    try:
        out = report(layout_by_name(args.layout), load_nodes(args.nodes),
                     Constraints(args.head_layers, args.context, args.concurrent, args.objective), args.expert_nodes)
    except EngineError as e:
        print(f"whatif: {e}")
        return 1
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
