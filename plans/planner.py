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

Search: every subset of nodes (exact up to ``EXACT_NODES`` nodes; of a larger swarm the fastest
``EXACT_NODES``), the cheapest order of each subset by a Held-Karp pass over link costs, and a lower
bound on each subset's score: its links, plus the cheapest layer counts (fastest first for latency,
balanced by speed for throughput) where no member holds more than the longest run of layers its
memory fits. Subsets are then taken best bound first, and an exact dynamic programme cuts the real
per-layer sizes into contiguous ranges for each, until no bound is better than the best cut found.
Layers differ in size, so a subset's other orders (up to ``PERMUTED_NODES`` members) are tried the
same way: one whose links cost more may fit memory where the cheapest does not. Ranking subsets by
estimated counts and taking the first that fit, as this did before, chose a worse plan than brute
force on 58 of 400 random small swarms with uneven layers, and refused some that fit.

A larger swarm (thirty GPUs in eight homes) is also planned with every member: sites in their
cheapest order, each site's machines one after another, and an exact programme over that sequence
that may skip members (``search_by_site``); the better of the two plans is taken. The fastest ten
alone often cannot hold such a model, and a token pays most for the links between sites.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .layout import ModelLayout
from .plan import ExpertAssignment, PlanError
from .links import LinkModel
from .nodes import ASKER, NodeDescriptor
from . import units

EXACT_NODES = 10
PERMUTED_NODES = 6  # subsets up to this size may try every order, not only the cheapest path's
SITE_SETS = 64  # search_by_site: at most this many sets of sites, best bound first
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
    expert_calls: int = 0  # expert parallelism: MoE layers whose experts it calls per token
    expert_ms: float = 0.0  # and what waiting for them costs per token
    expert_latency_ms: float = 0.0  # of which round-trip latency (the rest: the rows' bytes)


@dataclass
class Hop:
    """A link the plan uses, as the planner charged it."""

    src: str
    dst: str
    rtt_ms: float
    bandwidth_mb_s: float
    basis: str  # measured, relayed, site (a LAN estimate), bound (from measured links) or unknown
    through: tuple[str, ...] = ()  # the relay, or the machines whose links bound it
    ms: float = 0.0  # what one token's activations cost on it, one way: half the round trip plus the bytes


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
    search: str = "exact"  # "exact" (subsets of the fastest EXACT_NODES), or "by site" (every member)


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
    if problem.large:  # the exact search saw only the fastest EXACT_NODES: also try every member
        by_site = problem.search_by_site()
        if by_site is not None and (best is None or by_site[0] < best[0]):
            best, problem.by_site = by_site, True
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
        # more candidates than the exact search takes: search_by_site() plans with all of them too
        self.large = c.objective != "even" and sum(1 for nd in nodes if self.room[nd.name] >= 1) > EXACT_NODES
        self.by_site = False  # the plan came from search_by_site()
        self.exact_names: set[str] = set()  # the members the exact search considers (rank_subsets)

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
                f"{units.size(needed)} (weights + KV for {self.c.context_tokens} tokens × "
                f"{self.c.max_concurrent} requests) and the members offer {units.size(offered)} after a "
                f"{units.size(self.c.reserve_bytes)} reserve each: {units.size(missing)} missing")

    # --- subsets and orders ---

    def rank_subsets(self) -> list[tuple[tuple, list[str]]]:
        """Every subset's cheapest order with a lower bound on its score (its links exactly, its
        compute with each member's layers bounded by ``room``), best bound first."""
        names = [nd.name for nd in self.nodes if self.room[nd.name] >= 1]
        if len(names) > EXACT_NODES:  # keep the fastest (search_by_site() plans with every member)
            names = sorted(names, key=lambda n: self.by_name[n].ms_per_layer_token)[:EXACT_NODES]
        self.exact_names = set(names)
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

    # --- large swarms: every member, each site's machines one after another ---

    def search_by_site(self) -> tuple[tuple, list[str], list[StagePlan]] | None:
        """For swarms larger than the exact search takes. Thirty GPUs in eight homes cannot be held
        by the fastest ten, and a token pays most for the links between homes, so a plan visits
        each site once: for each set of sites that offers the memory, the cheapest order of its
        sites (Held-Karp, the asker at both ends) with each site's machines fastest first, and an
        exact programme over that sequence that picks which members serve and which contiguous
        layers each holds (any member may be skipped). Sets are taken by a lower bound (their
        sites' cheapest links, plus their fastest members' compute) until none can beat the best
        found. Exact for each sequence; visiting sites whole is the heuristic."""
        names = [nd.name for nd in self.nodes if self.room[nd.name] >= 1]
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(self.site_of(name), []).append(name)
        for members in groups.values():
            members.sort(key=lambda m: (self.by_name[m].ms_per_layer_token, m))
        keys = sorted(groups)
        if len(keys) > EXACT_NODES:  # too many sites for Held-Karp: nearest site next, from the asker on
            return self._skip_cut(self._nearest_sites(groups))
        need = sum(self.need)
        cost = self._site_cost(groups)
        candidates = []
        for mask, (tour_ms, sites) in _best_paths(keys, cost).items():
            members = [m for site in sites for m in groups[site]]
            if sum(self.usable[m] for m in members) >= need:
                candidates.append((tour_ms + self._compute_floor(members), sites))
        candidates.sort(key=lambda c: c[0])
        best = None
        for evaluated, (bound, sites) in enumerate(candidates):
            if best is not None and (evaluated >= SITE_SETS or (self.c.objective == "latency" and bound >= best[0][0])):
                break
            found = self._skip_cut([m for site in sites for m in groups[site]])
            if found is not None and (not self.c.max_stages or len(found[1]) <= self.c.max_stages):
                if best is None or found[0] < best[0]:
                    best = found
        return best

    def site_of(self, name: str) -> str:
        """A member's site; a member that names none is a site of its own."""
        site = self.by_name[name].site if name in self.by_name else ""
        return site or f"({name})"

    def _site_cost(self, groups: dict[str, list[str]]):
        """Between two sites (or a site and the asker): their cheapest pair of members' link."""
        memo: dict[tuple[str, str], float] = {}

        def cost(a: str, b: str) -> float:
            if (a, b) not in memo:
                left, right = groups.get(a, [ASKER]), groups.get(b, [ASKER])
                memo[(a, b)] = min(self._link_ms(x, y) for x in left for y in right)
            return memo[(a, b)]
        return cost

    def _nearest_sites(self, groups: dict[str, list[str]]) -> list[str]:
        cost = self._site_cost(groups)
        sites, here, left = [], ASKER, set(groups)
        while left:
            here = min(sorted(left), key=lambda k: cost(here, k))
            sites.append(here)
            left.remove(here)
        return [m for site in sites for m in groups[site]]

    def _compute_floor(self, members: list[str]) -> float:
        """No plan over ``members`` computes faster: the fastest hold all they can, in any order."""
        left, ms = self.n, 0.0
        for m in sorted(members, key=lambda m: self.by_name[m].ms_per_layer_token):
            take = min(left, self.room[m])
            ms += take * self.by_name[m].ms_per_layer_token
            left -= take
        return ms if left == 0 else math.inf

    def _skip_cut(self, order: list[str]) -> tuple[tuple, list[str], list[StagePlan]] | None:
        """The best stages along ``order`` where any member may be skipped: a dynamic programme over
        (the last member used, the layers done so far), scored (latency, bottleneck) for objective
        latency and (bottleneck, latency) for throughput."""
        n, k = self.n, len(order)
        prefix = [0]
        for b in self.need:
            prefix.append(prefix[-1] + b)
        throughput = self.c.objective == "throughput"

        def key(v: tuple[float, float]) -> tuple[float, float]:
            return (v[1], v[0]) if throughput else v

        def hop(v: tuple[float, float], a: str, b: str) -> tuple[float, float]:
            ms = self._link_ms(a, b)
            return v[0] + ms, max(v[1], ms - self._link_latency(a, b))

        none = (math.inf, math.inf)
        best = [[none] * (n + 1) for _ in range(k)]  # best[i][q]: order[i] ends the trunk's first q layers
        back: list[list[tuple[int, int]]] = [[(-1, -1)] * (n + 1) for _ in range(k)]
        for i, m in enumerate(order):
            entry, came = [none] * n, [-1] * n  # arriving at m with p layers done, from order[came]
            entry[0] = hop((0.0, 0.0), ASKER, m)
            for j in range(i):
                for p in range(1, n):
                    if best[j][p][0] < math.inf:
                        v = hop(best[j][p], order[j], m)
                        if key(v) < key(entry[p]):
                            entry[p], came[p] = v, j
            speed, usable = self.by_name[m].ms_per_layer_token, self.usable[m]
            for q in range(1, n + 1):
                for p in range(q - 1, -1, -1):
                    if prefix[q] - prefix[p] > usable:
                        break
                    if entry[p][0] == math.inf:
                        continue
                    stage = (q - p) * speed
                    v = (entry[p][0] + stage, max(entry[p][1], stage))
                    if key(v) < key(best[i][q]):
                        best[i][q], back[i][q] = v, (came[p], p)
        ends = [(key(hop(best[i][n], m, ASKER)), i) for i, m in enumerate(order) if best[i][n][0] < math.inf]
        if not ends:
            return None
        i, q, stages = min(ends)[1], n, []
        while i != -1:
            j, p = back[i][q]
            m = order[i]
            used = prefix[q] - prefix[p]
            stages.append(StagePlan(m, self.start + p, self.start + q, (q - p) * self.by_name[m].ms_per_layer_token,
                                    used, self.usable[m] - used))
            i, q = j, p
        stages.reverse()
        used_order = [st.member for st in stages]
        return self._score(used_order, [st.compute_ms for st in stages]), used_order, stages

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
                          bottleneck, search="by site" if self.by_site else "exact")
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
            if self.by_site or (self.large and nd.name not in self.exact_names):
                # (the exact search's comparison covers only the fastest EXACT_NODES)
                result.warnings.append(
                    f"left out {nd.name} ({nd.device}, {nd.ms_per_layer_token:.2f} ms per layer): the others hold "
                    f"the model, and neither the exact search over the {EXACT_NODES} fastest members nor the "
                    f"search over every member in site order found a better plan with it")
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
        for (a, b), ms in zip(hops, link_ms):  # which of the plan's links are estimates, and what they cost
            estimate = self.links.link(a, b)
            result.hops.append(Hop(a, b, estimate.link.rtt_ms, estimate.link.bandwidth_mb_s, estimate.basis,
                                   estimate.through, ms))
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
    stage runs waits for its slowest expert node, once per token. A stage sends each node only the
    rows routed to the experts it holds (swarmctl/trunk/experts.py), so a node is charged its share
    of the ``n_expert_used`` rows, rounded up: all of them where one node holds every expert."""
    if not placement.experts:
        return
    links = LinkModel(nodes)
    extra, busiest, slowest_stage = 0.0, 0.0, None
    moe = layout.expert_bytes or (0,) * layout.n_layer  # (dense layers call no experts)
    for stage in proposal.stages:
        calls = sum(1 for il in range(stage.start, stage.stop) if moe[il] > 0)
        ms, latency = max(_expert_call(links, layout, stage.member, e) for e in placement.experts)
        stage.expert_calls, stage.expert_ms, stage.expert_latency_ms = calls, calls * ms, calls * latency
        extra += stage.expert_ms
        if stage.compute_ms + stage.expert_ms > busiest:  # a stage waits for its experts before the next token
            busiest, slowest_stage = stage.compute_ms + stage.expert_ms, stage
    proposal.ms_per_token += extra
    if busiest > 0 and 1000 / busiest < proposal.tokens_per_s:
        proposal.tokens_per_s = 1000 / busiest
        s = slowest_stage
        proposal.bottleneck = (f"stage {s.member} (layers [{s.start}, {s.stop}), {s.compute_ms:.1f} ms compute and "
                               f"{s.expert_ms:.1f} ms waiting for expert calls per token)")
    proposal.warnings.append(f"expert calls add about {extra:.1f} ms per token (a round trip per MoE layer, "
                             "to the slowest expert node)")


def _expert_call(links: LinkModel, layout: ModelLayout, stage: str, e: ExpertAssignment) -> tuple[float, float]:
    """(ms, of which round-trip latency) of one token's call from ``stage`` to expert node ``e``."""
    row = layout.activation_bytes_per_token
    rows = min(layout.n_expert_used, max(1, math.ceil(layout.n_expert_used * (e.stop - e.start) / layout.n_expert)))
    out, back = links.link(stage, e.member).link, links.link(e.member, stage).link
    return out.cost_ms(rows * (row + 4)) + back.cost_ms(rows * row), (out.rtt_ms + back.rtt_ms) / 2


@dataclass(frozen=True)
class TimePart:
    """One line of where a single stream's token spends its time (``time_breakdown``)."""

    part: str
    count: int  # stages, link crossings or expert calls
    ms: float  # per token
    latency_ms: float = 0.0  # of which half round trips: what no bandwidth buys back


def time_breakdown(proposal: Proposal, nodes: list[NodeDescriptor]) -> list[TimePart]:
    """The proposal's ms per token, split into compute, link crossings (to and from the asker,
    within a site, between sites) and expert calls. The parts add up to ``proposal.ms_per_token``."""
    site = {n.name: n.site for n in nodes if n.site}
    crossings: dict[str, list[Hop]] = {"links to and from the asker": [], "links within a site": [],
                                       "links between sites": []}
    for h in proposal.hops:
        if ASKER in (h.src, h.dst):
            crossings["links to and from the asker"].append(h)
        elif h.src in site and site.get(h.dst) == site[h.src]:
            crossings["links within a site"].append(h)
        else:
            crossings["links between sites"].append(h)
    parts = [TimePart("compute on the stages", len(proposal.stages), sum(s.compute_ms for s in proposal.stages))]
    parts += [TimePart(what, len(hops), sum(h.ms for h in hops), sum(h.rtt_ms / 2 for h in hops))
              for what, hops in crossings.items()]
    parts.append(TimePart("expert calls (round trips)", sum(s.expert_calls for s in proposal.stages),
                          sum(s.expert_ms for s in proposal.stages),
                          sum(s.expert_latency_ms for s in proposal.stages)))
    return parts
