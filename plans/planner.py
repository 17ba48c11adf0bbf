"""The topology planner: which members serve which contiguous trunk layers, in which order.

Objective "latency" (default) minimises a single stream's time per token: the stages' compute
(layers × ms per layer) plus the links along asker → stage 1 → … → stage n → asker.
Objective "throughput" minimises the pipeline's bottleneck: the slowest stage (or link) per token,
which bounds tokens per second when many requests are in flight. Objective "even" uses every node
that can hold a layer, with layers in proportion to memory (a local swarm on one machine, where
the point is to exercise every trunk).

Both respect memory: a stage holds its layers' weights plus KV for ``context × max_concurrent``
tokens, within what its node offers less a fixed reserve. The weakest-link rule falls out of
the search: a node is used only where it improves the objective or is needed for memory; any node
left out is named in a warning with the reason.

Links are charged as plans/links.py says: measured, or bounded from the measured ones by the
triangle inequality (never a fixed optimistic default), relayed links both their hops.

Search: every subset of nodes (exact up to ``EXACT_NODES`` nodes; larger swarms take the fastest
nodes that fit), the cheapest order of each subset by a Held-Karp pass over link costs, and a lower
bound on each subset's score: its links, plus the cheapest layer counts (fastest first for latency,
balanced by speed for throughput) where no member holds more than the longest run of layers its
memory fits. Subsets are then taken best bound first, and an exact dynamic programme cuts the real
per-layer sizes into contiguous ranges for each, until no bound is better than the best cut found.
Layers differ in size, so a subset's other orders (up to ``PERMUTED_NODES`` members) are tried the
same way: one whose links cost more may fit memory where the cheapest does not. Ranking subsets by
estimated counts and taking the first that fit, as this did before, chose a worse plan than brute
force on 58 of 400 random small swarms with uneven layers, and refused some that fit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .layout import ModelLayout
from .plan import ExpertAssignment, PlanError
from .links import LinkModel
from .nodes import ASKER, NodeDescriptor

EXACT_NODES = 10
PERMUTED_NODES = 6  # subsets up to this size may try every order, not only the cheapest path's
GB = 1e9


@dataclass(frozen=True)
class Constraints:
    head_layers: int = 4  # the asker keeps [0, K) and [L-K, L)
    context_tokens: int = 4096
    max_concurrent: int = 4  # requests whose KV a stage must hold at once
    objective: str = "latency"  # or "throughput", or "even"
    reserve_bytes: int = 300_000_000  # per node, for the runtime and compute buffers
    max_stages: int = 0  # 0 = no limit; members beyond it stay out as standbys


@dataclass
class StagePlan:
    member: str
    start: int  # layers [start, stop)
    stop: int
    compute_ms: float  # per token
    memory_used: int
    memory_free: int


@dataclass
class Hop:
    """A link the plan uses, as the planner charged it."""

    src: str
    dst: str
    rtt_ms: float
    bandwidth_mb_s: float
    basis: str  # measured, relayed, site (a LAN estimate), bound (from measured links) or unknown
    through: tuple[str, ...] = ()  # the relay, or the machines whose links bound it


@dataclass
class Proposal:
    objective: str
    stages: list[StagePlan]
    ms_per_token: float  # single stream: trunk compute + links (the asker's own head and tail not included)
    tokens_per_s: float  # pipelined bound: 1000 / bottleneck
    bottleneck: str
    warnings: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    hops: list[Hop] = field(default_factory=list)  # asker → stage 1 → … → asker


def plan_layers(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints) -> Proposal:
    k = constraints.head_layers
    start, stop = k, layout.n_layer - k
    if stop < start or k < 0:
        raise PlanError(f"head layers {k} do not fit a model of {layout.n_layer} layers")
    if constraints.objective not in ("latency", "throughput", "even"):
        raise PlanError(f"unknown objective {constraints.objective!r} (latency, throughput or even)")
    if stop == start:
        return Proposal(constraints.objective, [], 0.0, math.inf, "none: the asker runs every layer")
    problem = _Problem(layout, nodes, constraints, start, stop)
    problem.check_capacity()
    problem.rank_subsets()
    best = problem.search()
    if best is None:
        raise PlanError("no member order fits the layers' sizes into the members' memory")
    return problem.proposal(best[1], best[2])


class _Problem:
    def __init__(self, layout: ModelLayout, nodes: list[NodeDescriptor], c: Constraints, start: int, stop: int):
        self.layout, self.nodes, self.c = layout, nodes, c
        self.start, self.stop = start, stop
        self.n = stop - start
        kv_per_layer = layout.kv_bytes_per_token_per_layer * c.context_tokens * c.max_concurrent
        self.need = [layout.layer_bytes[i] + kv_per_layer for i in range(start, stop)]  # per trunk layer
        self.mean_need = sum(self.need) / self.n
        self.usable = {nd.name: max(0, nd.memory_bytes - c.reserve_bytes) for nd in nodes}
        self.cap = {nd.name: min(self.n, int(self.usable[nd.name] // self.mean_need)) for nd in nodes}
        # the most contiguous layers a node could hold anywhere in the trunk: no cut gives it more,
        # so the cheapest counts within these bound every cut's compute from below
        self.room = {nd.name: self._longest_window(self.usable[nd.name]) for nd in nodes}
        self._cuts: dict[tuple[str, ...], list[StagePlan] | None] = {}
        self.by_name = {nd.name: nd for nd in nodes}
        self.act = layout.activation_bytes_per_token
        self.links = LinkModel(nodes)  # measured, or bounded from the measured ones (plans/links.py)

    def _longest_window(self, usable: int) -> int:
        longest, lo, held = 0, 0, 0
        for hi, b in enumerate(self.need):
            held += b
            while held > usable:
                held -= self.need[lo]
                lo += 1
            longest = max(longest, hi + 1 - lo)
        return longest

    def check_capacity(self) -> None:
        needed, offered = sum(self.need), sum(self.usable.values())
        if offered < needed or sum(self.room.values()) < self.n:
            missing = max(needed - offered, self.mean_need)
            raise PlanError(
                f"the swarm cannot hold the model: its trunk layers [{self.start}, {self.stop}) need "
                f"{needed / GB:.1f} GB (weights + KV for {self.c.context_tokens} tokens × "
                f"{self.c.max_concurrent} requests) and the members offer {offered / GB:.1f} GB after a "
                f"{self.c.reserve_bytes / GB:.1f} GB reserve each: {missing / GB:.1f} GB missing")

    # --- subsets and orders ---

    def rank_subsets(self) -> list[tuple[tuple, list[str]]]:
        """Every subset's cheapest order with a lower bound on its score (its links exactly, its
        compute with each member's layers bounded by ``room``), best bound first."""
        names = [nd.name for nd in self.nodes if self.room[nd.name] >= 1]
        if len(names) > EXACT_NODES:  # keep the fastest that can hold the model, plus spares
            names = sorted(names, key=lambda n: self.by_name[n].ms_per_layer_token)[:EXACT_NODES]
        if self.c.objective == "even":  # everyone who can hold a layer, in the order they came
            names = [m for m in names if self.cap[m] >= 1][:min(self.n, self.c.max_stages or self.n)]
            hops = [(ASKER, names[0]), *zip(names, names[1:]), (names[-1], ASKER)] if names else []
            paths = {1: (sum(self._link_ms(a, b) for a, b in hops), names)} if names else {}
        else:
            paths = _best_paths(names, self._link_ms)
        ranked = []
        for mask, (path_ms, order) in paths.items():
            if self.c.max_stages and len(order) > self.c.max_stages:
                continue
            counts = self._counts(order, self.cap if self.c.objective == "even" else self.room)
            if counts is None:
                continue
            compute = [counts[m] * self.by_name[m].ms_per_layer_token for m in order]
            ranked.append((self._score(order, compute, path_ms), order))
        ranked.sort(key=lambda x: x[0])
        self.ranked = ranked
        return ranked

    def search(self, including: str | None = None) -> tuple[tuple, list[str], list[StagePlan]] | None:
        """The best (score, order, stages) by exact cuts, in order of the subsets' lower bounds,
        stopping at the first bound no better than the best found (or None: nothing fits).
        ``including``: only subsets with that member."""
        best = None
        for bound, cheapest in self.ranked:
            if including is not None and including not in cheapest:
                continue
            if best is not None and bound >= best[0]:
                break
            for order_bound, order in self._orders(cheapest, bound):
                if best is not None and order_bound >= best[0]:
                    break
                stages = self.cut(order)
                if stages is None:
                    continue
                score = self._score(order, [s.compute_ms for s in stages])
                if best is None or score < best[0]:
                    best = (score, order, stages)
        return best

    def _orders(self, cheapest: list[str], bound: tuple):
        """A subset's orders, best bound first: the cheapest path, then (up to ``PERMUTED_NODES``
        members) every other. With layers of different sizes an order whose links cost more may fit
        memory where the cheapest does not, or fit more of the model on the fast members."""
        yield bound, cheapest
        if self.c.objective == "even" or len(cheapest) > PERMUTED_NODES or len(cheapest) < 2:
            return
        counts = self._counts(cheapest, self.room)  # (the bound's counts: any order's compute is at least these)
        compute = {m: counts[m] * self.by_name[m].ms_per_layer_token for m in cheapest}
        others = []
        for order in itertools.permutations(cheapest):
            if list(order) != cheapest:
                others.append((self._score(list(order), [compute[m] for m in order]), list(order)))
        others.sort(key=lambda x: x[0])
        yield from others

    def _score(self, order: list[str], compute: list[float], path_ms: float | None = None) -> tuple[float, float]:
        hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
        if path_ms is None:
            path_ms = sum(self._link_ms(a, b) for a, b in hops)
        latency = sum(compute) + path_ms
        bottleneck = max(max(compute), self._max_transfer(order))
        return (bottleneck, latency) if self.c.objective == "throughput" else (latency, bottleneck)

    def _link_ms(self, a: str, b: str) -> float:
        return self.links.link(a, b).link.cost_ms(self.act)

    def _max_transfer(self, order: list[str]) -> float:
        hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
        return max(self._link_ms(a, b) - self._link_latency(a, b) for a, b in hops)

    def _link_latency(self, a: str, b: str) -> float:
        return self.links.link(a, b).link.rtt_ms / 2

    def _counts(self, order: list[str], cap: dict[str, int]) -> dict[str, int] | None:
        """Layers per member, at most ``cap`` each: by memory for "even", fastest first for latency,
        balanced for throughput (the last two the cheapest counts within the caps)."""
        caps = {m: cap[m] for m in order}
        if len(order) > self.n or sum(caps.values()) < self.n:
            return None
        speed = {m: self.by_name[m].ms_per_layer_token for m in order}
        if self.c.objective == "even":
            total = sum(self.usable[m] for m in order)
            counts = {m: max(1, min(caps[m], int(self.n * self.usable[m] / total))) for m in order}
            for m in sorted(order, key=lambda m: -self.usable[m]):  # hand out what rounding left
                while sum(counts.values()) < self.n and counts[m] < caps[m]:
                    counts[m] += 1
            return counts if sum(counts.values()) == self.n else None
        if self.c.objective == "latency":
            counts = {m: 1 for m in order}
            left = self.n - len(order)
            for m in sorted(order, key=lambda m: speed[m]):
                take = min(left, caps[m] - 1)
                counts[m] += take
                left -= take
            return counts
        # throughput: the smallest T such that min(cap, floor(T / speed)) layers per member cover n
        candidates = sorted({c * speed[m] for m in order for c in range(1, caps[m] + 1)})
        for t in candidates:
            counts = {m: min(caps[m], int(t / speed[m] + 1e-9)) for m in order}
            if all(v >= 1 for v in counts.values()) and sum(counts.values()) >= self.n:
                extra = sum(counts.values()) - self.n  # give back surplus from the slowest
                for m in sorted(order, key=lambda m: -speed[m]):
                    give = min(extra, counts[m] - 1)
                    counts[m] -= give
                    extra -= give
                return counts
        return None

    # --- exact cut for one order ---

    def cut(self, order: list[str]) -> list[StagePlan] | None:
        """Contiguous ranges with the real per-layer sizes: minimal sum (latency) or max
        (throughput) of layers × ms, each member at least one layer, within its memory."""
        key = tuple(order)
        if key not in self._cuts:
            self._cuts[key] = self._cut(order)
        return self._cuts[key]

    def _cut(self, order: list[str]) -> list[StagePlan] | None:
        n, k = self.n, len(order)
        prefix = [0]
        for b in self.need:
            prefix.append(prefix[-1] + b)
        if self.c.objective == "even":
            counts = self._counts(order, self.cap)
            stages, p = [], 0
            for m in order:
                q = p + counts[m]
                used = prefix[q] - prefix[p]
                if used > self.usable[m]:
                    return None
                stages.append(StagePlan(m, self.start + p, self.start + q,
                                        (q - p) * self.by_name[m].ms_per_layer_token, used, self.usable[m] - used))
                p = q
            return stages
        inf = math.inf
        best = [[inf] * (n + 1) for _ in range(k + 1)]
        back = [[-1] * (n + 1) for _ in range(k + 1)]
        best[0][0] = 0.0
        for i, m in enumerate(order, start=1):
            speed, usable = self.by_name[m].ms_per_layer_token, self.usable[m]
            for q in range(i, n - (k - i) + 1):
                for p in range(q - 1, i - 2, -1):
                    if prefix[q] - prefix[p] > usable:
                        break
                    if best[i - 1][p] == inf:
                        continue
                    stage = (q - p) * speed
                    value = best[i - 1][p] + stage if self.c.objective == "latency" else max(best[i - 1][p], stage)
                    if value < best[i][q] - 1e-12:
                        best[i][q], back[i][q] = value, p
        if best[k][n] == inf:
            return None
        stages, q = [], n
        for i in range(k, 0, -1):
            p = back[i][q]
            m = order[i - 1]
            used = prefix[q] - prefix[p]
            stages.append(StagePlan(m, self.start + p, self.start + q, (q - p) * self.by_name[m].ms_per_layer_token,
                                    used, self.usable[m] - used))
            q = p
        return stages[::-1]

    # --- the result ---

    def proposal(self, order: list[str], stages: list[StagePlan]) -> Proposal:
        hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
        link_ms = [self._link_ms(a, b) for a, b in hops]
        latency = sum(s.compute_ms for s in stages) + sum(link_ms)
        worst_stage = max(stages, key=lambda s: s.compute_ms)
        worst_link = max(range(len(hops)), key=lambda i: link_ms[i] - self._link_latency(*hops[i]))
        transfer = link_ms[worst_link] - self._link_latency(*hops[worst_link])
        if worst_stage.compute_ms >= transfer:
            bottleneck = (f"stage {worst_stage.member} (layers [{worst_stage.start}, {worst_stage.stop}), "
                          f"{worst_stage.compute_ms:.1f} ms per token)")
            bottleneck_ms = worst_stage.compute_ms
        else:
            a, b = hops[worst_link]
            bottleneck = f"link {a} → {b} ({transfer:.1f} ms per token to move activations)"
            bottleneck_ms = transfer
        result = Proposal(self.c.objective, stages, latency, 1000.0 / bottleneck_ms if bottleneck_ms else math.inf,
                          bottleneck)
        chosen = set(order)
        best_score = self._score(order, [s.compute_ms for s in stages])
        for nd in self.nodes:
            if nd.name in chosen:
                continue
            result.left_out.append(nd.name)
            even = self.c.objective == "even"  # (which places layers by their mean size)
            if self.room[nd.name] < 1 or (even and self.cap[nd.name] < 1):
                result.warnings.append(
                    f"left out {nd.name}: its {self.usable[nd.name] / GB:.1f} GB (after the reserve) is less than "
                    f"one layer needs ({(self.mean_need if even else min(self.need)) / GB:.2f} GB)")
                continue
            found = self.search(including=nd.name) if self.c.objective != "even" else None
            if found is None and self.c.max_stages:
                result.warnings.append(f"{nd.name} stands by: the plan uses at most {self.c.max_stages} stages")
                continue
            if found is None:
                result.warnings.append(f"left out {nd.name}: no plan that includes it fits")
                continue
            alt = found[0]
            unmeasured = "" if self.links.measures(nd.name) else (
                " (none of its links is measured: each is charged as unknown)")
            if self.c.objective != "throughput":
                result.warnings.append(
                    f"left out {nd.name} ({nd.device}, {nd.ms_per_layer_token:.2f} ms per layer): the others hold "
                    f"the model, and using it would make each token {alt[0] - best_score[0]:.1f} ms slower"
                    + unmeasured)
            else:
                result.warnings.append(
                    f"left out {nd.name} ({nd.device}, {nd.ms_per_layer_token:.2f} ms per layer): using it would "
                    f"lower the pipeline's bound from {1000 / best_score[0]:.1f} to {1000 / alt[0]:.1f} tokens/s"
                    + unmeasured)
        for a, b in hops:  # which of the plan's links are estimates, and what they were charged
            estimate = self.links.link(a, b)
            result.hops.append(Hop(a, b, estimate.link.rtt_ms, estimate.link.bandwidth_mb_s, estimate.basis,
                                   estimate.through))
            if estimate.describe(a, b):
                result.warnings.append(estimate.describe(a, b))
        return result


def _best_paths(names: list[str], link_ms) -> dict[int, tuple[float, list[str]]]:
    """For every non-empty subset: the cheapest order asker → … → asker (Held-Karp)."""
    n = len(names)
    dp: dict[tuple[int, int], tuple[float, int]] = {}
    for j in range(n):
        dp[(1 << j, j)] = (link_ms(ASKER, names[j]), -1)
    for size in range(2, n + 1):
        for combo in itertools.combinations(range(n), size):
            mask = sum(1 << j for j in combo)
            for j in combo:
                prev_mask = mask & ~(1 << j)
                best = (math.inf, -1)
                for i in combo:
                    if i == j or (prev_mask, i) not in dp:
                        continue
                    cost = dp[(prev_mask, i)][0] + link_ms(names[i], names[j])
                    if cost < best[0]:
                        best = (cost, i)
                dp[(mask, j)] = best
    paths: dict[int, tuple[float, list[str]]] = {}
    for mask in range(1, 1 << n):
        ends = [(dp[(mask, j)][0] + link_ms(names[j], ASKER), j) for j in range(n) if (mask >> j) & 1]
        cost, j = min(ends)
        order, m = [], mask
        while j != -1:
            order.append(names[j])
            j, m = dp[(m, j)][1], m & ~(1 << j)
        paths[mask] = (cost, order[::-1])
    return paths


@dataclass
class ExpertPlacement:
    """Expert parallelism: which nodes hold which experts, and what is left for the stages."""

    stage_nodes: list[NodeDescriptor]
    experts: list[ExpertAssignment]  # (member, address, [start, stop)) of every trunk MoE layer
    stage_layout: ModelLayout  # the model as the stages see it: their layers without the experts
    warnings: list[str] = field(default_factory=list)


def place_experts(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints,
                  n_expert_nodes: int) -> ExpertPlacement:
    """Pick ``n_expert_nodes`` nodes to hold the experts of every trunk MoE layer, in contiguous
    ranges in proportion to their memory; the others run attention and the routers as stages.

    Expert nodes are the ones with the most memory (the experts are most of an MoE model's bytes),
    ties broken by name so the choice does not depend on who registered first. With too few nodes,
    or a dense model, nothing is placed and the stages hold their own experts."""
    if not n_expert_nodes or not layout.n_expert:
        return ExpertPlacement(nodes, [], layout)
    if len(nodes) <= n_expert_nodes:
        return ExpertPlacement(nodes, [], layout, [f"expert parallelism waits for {n_expert_nodes + 1} trunks "
                                                   f"({len(nodes)} so far): the stages hold their own experts"])
    k = min(n_expert_nodes, layout.n_expert)
    chosen = sorted(sorted(nodes, key=lambda n: (-n.memory_bytes, n.name))[:k], key=lambda n: n.name)
    start, stop = constraints.head_layers, layout.n_layer - constraints.head_layers
    experts_bytes = sum(layout.expert_bytes[start:stop])
    weights = [max(1, n.memory_bytes) for n in chosen]
    bounds, acc = [0], 0
    for i, w in enumerate(weights[:-1]):  # cumulative memory share, at least one expert each
        acc += w
        cut = round(layout.n_expert * acc / sum(weights))
        bounds.append(min(max(cut, bounds[-1] + 1), layout.n_expert - (k - 1 - i)))
    bounds.append(layout.n_expert)
    experts = []
    for node, lo, hi in zip(chosen, bounds, bounds[1:]):
        need = experts_bytes * (hi - lo) // layout.n_expert
        if need > node.memory_bytes - constraints.reserve_bytes:
            raise PlanError(f"{node.name} cannot hold experts [{lo}, {hi}): {need / GB:.2f} GB of weights, "
                            f"{max(0, node.memory_bytes - constraints.reserve_bytes) / GB:.2f} GB offered")
        experts.append(ExpertAssignment(node.name, node.address, lo, hi))
    stage_layout = replace(layout, layer_bytes=tuple(b - e for b, e in zip(layout.layer_bytes, layout.expert_bytes)))
    chosen_names = {n.name for n in chosen}
    return ExpertPlacement([n for n in nodes if n.name not in chosen_names], experts, stage_layout)


def add_expert_calls(proposal: Proposal, placement: ExpertPlacement, nodes: list[NodeDescriptor],
                     layout: ModelLayout) -> None:
    """Charge the expert round trips to a proposal planned for the stages alone: each MoE layer a
    stage runs waits for its slowest expert node (rows out, outputs back), once per token."""
    if not placement.experts:
        return
    links = LinkModel(nodes)
    row = layout.activation_bytes_per_token
    rows = layout.n_expert_used
    extra, busiest = 0.0, 0.0
    for stage in proposal.stages:
        slowest = max(links.link(stage.member, e.member).link.cost_ms(rows * (row + 4))
                      + links.link(e.member, stage.member).link.cost_ms(rows * row)
                      for e in placement.experts)
        waits = (stage.stop - stage.start) * slowest
        extra += waits
        busiest = max(busiest, stage.compute_ms + waits)  # a stage waits for its experts before the next token
    proposal.ms_per_token += extra
    if busiest > 0:
        proposal.tokens_per_s = min(proposal.tokens_per_s, 1000 / busiest)
    proposal.warnings.append(f"expert calls add about {extra:.1f} ms per token (a round trip per MoE layer, "
                             "to the slowest expert node)")
