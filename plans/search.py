"""The planner's search: which members serve, in which order, with which contiguous layers. Every
subset of the fastest EXACT_NODES members by a lower bound, each cut exactly (plans/planner.py's
docstring tells the whole method); for larger swarms also every member in site order. Costs come
from the cost model it extends (plans/cost.py)."""

from __future__ import annotations

import itertools
import math

from .cost import CostModel
from .layout import ModelLayout
from .nodes import ASKER, NodeDescriptor
from .proposal import Constraints, StagePlan

EXACT_NODES = 10
PERMUTED_NODES = 6  # subsets up to this size may try every order, not only the cheapest path's
SITE_SETS = 64  # search_by_site: at most this many sets of sites, best bound first


class Search(CostModel):
    def __init__(self, layout: ModelLayout, nodes: list[NodeDescriptor], c: Constraints, start: int, stop: int):
        super().__init__(layout, nodes, c, start, stop)
        self._cuts: dict[tuple[str, ...], list[StagePlan] | None] = {}
        # more candidates than the exact search takes: search_by_site() plans with all of them too
        self.large = c.objective != "even" and sum(1 for nd in nodes if self.room[nd.name] >= 1) > EXACT_NODES
        self.by_site = False  # the plan came from search_by_site()
        self.exact_names: set[str] = set()  # the members the exact search considers (rank_subsets)

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
            paths = {1: (sum(self.link_ms(a, b) for a, b in hops), names)} if names else {}
        else:
            paths = best_paths(names, self.link_ms)
        ranked = []
        for mask, (path_ms, order) in paths.items():
            if self.c.max_stages and len(order) > self.c.max_stages:
                continue
            compute = self.bound_compute(order, self.cap if self.c.objective == "even" else self.room)
            if compute is None:
                continue
            ranked.append((self.score(order, compute, path_ms), order))
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
                score = self.score(order, [s.compute_ms for s in stages])
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
        # (the bound's compute: any order's is at least this)
        compute = dict(zip(cheapest, self.bound_compute(cheapest, self.room)))
        others = []
        for order in itertools.permutations(cheapest):
            if list(order) != cheapest:
                others.append((self.score(list(order), [compute[m] for m in order]), list(order)))
        others.sort(key=lambda x: x[0])
        yield from others

    def cut(self, order: list[str]) -> list[StagePlan] | None:
        """Contiguous ranges with the real per-layer sizes: minimal sum (latency) or max
        (throughput) of layers × ms, each member at least one layer, within its memory."""
        key = tuple(order)
        if key not in self._cuts:
            self._cuts[key] = self._cut(order)
        return self._cuts[key]

    def _cut(self, order: list[str]) -> list[StagePlan] | None:
        n, k = self.n, len(order)
        if self.c.objective == "even":
            counts = self.counts(order, self.cap)
            stages, p = [], 0
            for m in order:
                q = p + counts[m]
                stage = self.stage_plan(m, p, q)
                if stage is None:
                    return None
                stages.append(stage)
                p = q
            return stages
        inf = math.inf
        best = [[inf] * (n + 1) for _ in range(k + 1)]
        back = [[-1] * (n + 1) for _ in range(k + 1)]
        best[0][0] = 0.0
        need = self.prefix_need
        for i, m in enumerate(order, start=1):
            speed, device, ram = self.by_name[m].ms_per_layer_token, self.device_usable[m], self.offers_ram(m)
            for q in range(i, n - (k - i) + 1):
                for p in range(q - 1, i - 2, -1):
                    if need[q] - need[p] <= device:  # (the common case, inline: the search asks millions)
                        stage = (q - p) * speed
                    elif not ram:
                        break
                    else:
                        memory, stage = self._split_stage(m, p, q)
                        if memory is None:
                            break
                    if best[i - 1][p] == inf:
                        continue
                    value = best[i - 1][p] + stage if self.c.objective == "latency" else max(best[i - 1][p], stage)
                    if value < best[i][q] - 1e-12:
                        best[i][q], back[i][q] = value, p
        if best[k][n] == inf:
            return None
        stages, q = [], n
        for i in range(k, 0, -1):
            p = back[i][q]
            stages.append(self.stage_plan(order[i - 1], p, q))
            q = p
        return stages[::-1]

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
            return self.skip_cut(self._nearest_sites(groups))
        need = sum(self.need)
        cost = self._site_cost(groups)
        candidates = []
        for mask, (tour_ms, sites) in best_paths(keys, cost).items():
            members = [m for site in sites for m in groups[site]]
            if sum(self.usable[m] for m in members) >= need:
                candidates.append((tour_ms + self.compute_floor(members), sites))
        candidates.sort(key=lambda c: c[0])
        best = None
        for evaluated, (bound, sites) in enumerate(candidates):
            if best is not None and (evaluated >= SITE_SETS or (self.c.objective == "latency" and bound >= best[0][0])):
                break
            found = self.skip_cut([m for site in sites for m in groups[site]])
            if found is not None and (not self.c.max_stages or len(found[1]) <= self.c.max_stages):
                if best is None or found[0] < best[0]:
                    best = found
        return best

    def _site_cost(self, groups: dict[str, list[str]]):
        """Between two sites (or a site and the asker): their cheapest pair of members' link."""
        memo: dict[tuple[str, str], float] = {}

        def cost(a: str, b: str) -> float:
            if (a, b) not in memo:
                left, right = groups.get(a, [ASKER]), groups.get(b, [ASKER])
                memo[(a, b)] = min(self.link_ms(x, y) for x in left for y in right)
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

    def skip_cut(self, order: list[str]) -> tuple[tuple, list[str], list[StagePlan]] | None:
        """The best stages along ``order`` where any member may be skipped: a dynamic programme over
        (the last member used, the layers done so far), scored (latency, bottleneck) for objective
        latency and (bottleneck, latency) for throughput."""
        n, k = self.n, len(order)
        throughput = self.c.objective == "throughput"

        def key(v: tuple[float, float]) -> tuple[float, float]:
            return (v[1], v[0]) if throughput else v

        def hop(v: tuple[float, float], a: str, b: str) -> tuple[float, float]:
            ms = self.link_ms(a, b)
            return v[0] + ms, max(v[1], ms - self.link_latency(a, b))

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
            speed, device, ram = self.by_name[m].ms_per_layer_token, self.device_usable[m], self.offers_ram(m)
            for q in range(1, n + 1):
                for p in range(q - 1, -1, -1):
                    if self.prefix_need[q] - self.prefix_need[p] <= device:
                        stage = (q - p) * speed
                    elif not ram:
                        break
                    else:
                        memory, stage = self._split_stage(m, p, q)
                        if memory is None:
                            break
                    if entry[p][0] == math.inf:
                        continue
                    v = (entry[p][0] + stage, max(entry[p][1], stage))
                    if key(v) < key(best[i][q]):
                        best[i][q], back[i][q] = v, (came[p], p)
        ends = [(key(hop(best[i][n], m, ASKER)), i) for i, m in enumerate(order) if best[i][n][0] < math.inf]
        if not ends:
            return None
        i, q, stages = min(ends)[1], n, []
        while i != -1:
            j, p = back[i][q]
            stages.append(self.stage_plan(order[i], p, q))
            i, q = j, p
        stages.reverse()
        used_order = [st.member for st in stages]
        return self.score(used_order, [st.compute_ms for st in stages]), used_order, stages


def best_paths(names: list[str], link_ms) -> dict[int, tuple[float, list[str]]]:
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
