"""The planner's cost model: what each member can hold (memory less the reserve, the longest run
of layers that fits), what a link costs a token (measured, or bounded from the measured ones:
plans/links.py), and how a member order and its stages' compute score under the objective. The
search (plans/search.py) asks it; it searches nothing itself."""

from __future__ import annotations

import bisect
import heapq
import math

from net.wire import DType

from . import units
from .layout import ModelLayout
from .links import MEASURED, SITE, LinkModel
from .nodes import ASKER, DEFAULT_DATAGRAM_US, NodeDescriptor, hop_datagrams
from .plan import PlanError
from .proposal import Constraints, StagePlan
from .wire import AUTO, Q8_0_BLOCK, SITE_RTT_MS, hop_bytes, hop_dtype


class CostModel:
    def __init__(self, layout: ModelLayout, nodes: list[NodeDescriptor], c: Constraints, start: int, stop: int):
        self.layout, self.nodes, self.c = layout, nodes, c
        self.start, self.stop = start, stop
        self.n = stop - start
        kv_per_layer = layout.kv_bytes_per_token_per_layer * c.context_tokens * c.max_concurrent
        self.need = [layout.layer_bytes[i] + kv_per_layer for i in range(start, stop)]  # per trunk layer
        self.mean_need = sum(self.need) / self.n
        # Members that keep routed experts in host RAM (NodeDescriptor.ram_bytes): their device must
        # hold each layer's dense part and KV cache; ``usable`` counts both memories (for bounds,
        # capacity and caps: never less than a stage can use), ``stage_fits`` says exactly.
        experts = layout.expert_bytes or (0,) * layout.n_layer
        self.prefix_need, self.prefix_experts = _prefix(self.need), _prefix(experts[start:stop])
        self.device_usable = {nd.name: max(0, nd.memory_bytes - c.reserve_bytes) for nd in nodes}
        self.usable = {nd.name: self.device_usable[nd.name] + (nd.ram_bytes if layout.expert_bytes else 0)
                       for nd in nodes}
        self._split: dict[tuple[str, int, int], tuple[tuple[int, int] | None, float]] = {}  # stages using RAM
        self.cap = {nd.name: min(self.n, int(self.usable[nd.name] // self.mean_need)) for nd in nodes}
        # the most contiguous layers a node could hold anywhere in the trunk: no cut gives it more,
        # so the cheapest counts within these bound every cut's compute from below
        self.room = {nd.name: self.longest_window(self.usable[nd.name]) for nd in nodes}
        self.mean_read = sum(layout.read_bytes(il) for il in range(layout.n_layer)) / layout.n_layer
        self.by_name = {nd.name: nd for nd in nodes}
        self.act = layout.activation_bytes_per_token
        self.links = LinkModel(nodes)  # measured, or bounded from the measured ones (plans/links.py)
        self.site = {nd.name: nd.site for nd in nodes if nd.site}
        self._hops: dict[tuple[str, str], float] = {}  # link_ms, once per pair (the searches ask ~10^5 times)
        self._ram_floor = {nd.name: self._ram_floor_of(nd) for nd in nodes if self.offers_ram(nd.name)}

    def stage_memory(self, m: str, p: int, q: int) -> tuple[int, int] | None:
        """(device bytes, host RAM bytes) member ``m`` needs for trunk layers [p, q) (indices from
        the trunk's start), or None where they do not fit: the dense part and KV cache on the
        device, then routed experts layer by layer while they fit (kernels/device_split.py), the
        rest in its RAM."""
        total = self.prefix_need[q] - self.prefix_need[p]
        if total <= self.device_usable[m]:
            return total, 0
        return self._split_stage(m, p, q)[0]

    def offers_ram(self, m: str) -> bool:
        """Member ``m`` keeps routed experts its device cannot hold in host RAM (a model with experts)."""
        return bool(self.by_name[m].ram_bytes and self.layout.expert_bytes)

    def _split_stage(self, m: str, p: int, q: int) -> tuple[tuple[int, int] | None, float]:
        """(stage_memory, stage_ms) of a stage that does not fit its member's device whole,
        computed once (the search asks for the same stages many times)."""
        key = (m, p, q)
        if key not in self._split:
            memory = self._memory_with_ram(m, p, q)
            self._split[key] = (memory, self._ms_with_ram(m, p, q, memory[1]) if memory else math.inf)
        return self._split[key]

    def _memory_with_ram(self, m: str, p: int, q: int) -> tuple[int, int] | None:
        total = self.prefix_need[q] - self.prefix_need[p]
        device = self.device_usable[m]
        ram = self.by_name[m].ram_bytes if self.layout.expert_bytes else 0
        experts = self.prefix_experts[q] - self.prefix_experts[p]
        dense = total - experts
        if not ram or dense > device:
            return None
        on = bisect.bisect_right(self.prefix_experts, self.prefix_experts[p] + device - dense, p, q + 1) - 1
        in_ram = self.prefix_experts[q] - self.prefix_experts[on]
        return (total - in_ram, in_ram) if in_ram <= ram else None

    def stage_plan(self, m: str, p: int, q: int) -> StagePlan | None:
        """Member ``m`` serving trunk layers [p, q) (indices from the trunk's start), or None where
        they do not fit."""
        memory = self.stage_memory(m, p, q)
        if memory is None:
            return None
        return StagePlan(m, self.start + p, self.start + q, self.stage_ms(m, p, q), memory[0],
                         self.device_usable[m] - memory[0], ram_used=memory[1])

    def stage_ms(self, m: str, p: int, q: int) -> float:
        """Member ``m``'s compute for trunk layers [p, q) per token: its measured ms per layer, and
        for a layer whose routed experts are in RAM, the bytes of the experts a token uses read at
        its RAM's rate instead of their share of a layer's time on the device."""
        if self.prefix_need[q] - self.prefix_need[p] <= self.device_usable[m]:
            return (q - p) * self.by_name[m].ms_per_layer_token
        return self._split_stage(m, p, q)[1]

    def _ms_with_ram(self, m: str, p: int, q: int, in_ram: int) -> float:
        node = self.by_name[m]
        ms = (q - p) * node.ms_per_layer_token
        if not in_ram:
            return ms
        on = bisect.bisect_right(self.prefix_experts, self.prefix_experts[q] - in_ram, p, q + 1) - 1
        per_byte = node.ms_per_layer_token / self.mean_read
        share = self.layout.n_expert_used / self.layout.n_expert
        for i in range(on, q):
            active = self.layout.expert_bytes[self.start + i] * share
            ms += active / (node.ram_gb_s * 1e6) - active * per_byte
        return ms

    def _ram_floor_of(self, node: NodeDescriptor) -> tuple[float, float, float, float]:
        """(the least a trunk layer's routed experts in RAM add to its time, the smallest trunk
        layer's need, the largest layer's routed experts, the device's usable bytes): what
        ``least_stage_ms`` bounds a stage with."""
        per_byte = node.ms_per_layer_token / self.mean_read
        share = self.layout.n_expert_used / self.layout.n_expert
        added = [e * share / (node.ram_gb_s * 1e6) - e * share * per_byte
                 for e in self.layout.expert_bytes[self.start:self.stop] if e]
        largest = max((e for e in self.layout.expert_bytes[self.start:self.stop] if e), default=0)
        return (min(added) if added else 0.0), min(self.need), largest, self.device_usable[node.name]

    def least_stage_ms(self, m: str, c: int) -> float:
        """No stage of ``c`` trunk layers on member ``m`` computes faster: ``c`` layers at its
        speed and, for a member keeping routed experts in RAM, the layers whose experts its device
        cannot hold (at least (c × the smallest layer's need − its device's bytes) over the largest
        layer's experts) each adding at least the least a layer's experts in RAM add (stage_ms).
        Convex in ``c``, so the cheapest layer counts follow greedily (``least_compute``)."""
        speed = self.by_name[m].ms_per_layer_token
        floor = self._ram_floor.get(m)
        if floor is None:
            return c * speed
        added, smallest, largest, device = floor
        if added <= 0 or not largest:  # (RAM no slower than the device for a layer's experts)
            return c * (speed + min(0.0, added))
        return c * speed + added * max(0.0, (c * smallest - device) / largest)

    def bound_compute(self, order: list[str], cap: dict[str, int]) -> list[float] | None:
        """Each member's compute in the cheapest layer counts over ``order`` within ``cap`` (a
        lower bound on any cut's; None: no counts fit), as ``counts`` gives them, or by
        ``least_stage_ms`` where a member keeps experts in RAM and the objective is latency."""
        counts = self.counts(order, cap)
        if counts is None:
            return None
        if self.c.objective != "latency" or not any(m in self._ram_floor for m in order):
            return [counts[m] * self.by_name[m].ms_per_layer_token for m in order]
        return self.least_compute(order, cap)

    def least_compute(self, order: list[str], cap: dict[str, int]) -> list[float]:
        """The least sum of ``least_stage_ms`` over ``order`` with every member at least one layer
        and at most its ``cap``, layers handed out one at a time to the cheapest next one (exact
        for convex costs); each member's share of it."""
        counts = {m: 1 for m in order}
        heap = [(self.least_stage_ms(m, 2) - self.least_stage_ms(m, 1), m) for m in order if cap[m] > 1]
        heapq.heapify(heap)
        for _ in range(self.n - len(order)):
            _, m = heapq.heappop(heap)
            counts[m] += 1
            if counts[m] < cap[m]:
                c = counts[m]
                heapq.heappush(heap, (self.least_stage_ms(m, c + 1) - self.least_stage_ms(m, c), m))
        return [self.least_stage_ms(m, counts[m]) for m in order]

    def longest_window(self, usable: int) -> int:
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

    def score(self, order: list[str], compute: list[float], path_ms: float | None = None) -> tuple[float, float]:
        hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
        if path_ms is None:
            path_ms = sum(self.link_ms(a, b) for a, b in hops)
        latency = sum(compute) + path_ms
        bottleneck = max(max(compute), self.max_transfer(order))
        return (bottleneck, latency) if self.c.objective == "throughput" else (latency, bottleneck)

    def link_ms(self, a: str, b: str) -> float:
        """One token's activations from ``a`` to ``b``: the link's time (half the round trip, the
        bytes at its rate) and the CPU both ends spend on its datagrams, in the hop's dtype."""
        ms = self._hops.get((a, b))
        if ms is None:
            ms = self._hops[a, b] = self.links.link(a, b).link.cost_ms(self.hop_bytes(a, b)) + self.packet_ms(a, b)
        return ms

    def hop_dtype(self, a: str, b: str) -> DType:
        """What the hop carries under the swarm's --wire-dtype (plans/wire.py); q8_0 needs rows of
        whole 32-value blocks, and a model whose width is not takes f16 instead."""
        if self.c.wire_dtype == DType.Q8_0.label and self.layout.n_embd % Q8_0_BLOCK:
            return DType.F16
        if self.c.wire_dtype != AUTO:
            return DType.named(self.c.wire_dtype)
        estimate = self.links.link(a, b)
        within = estimate.basis == SITE or (a in self.site and self.site.get(b) == self.site[a]) or \
            (estimate.basis == MEASURED and estimate.link.rtt_ms <= SITE_RTT_MS)
        return hop_dtype(AUTO, within)

    def hop_bytes(self, a: str, b: str) -> float:
        return hop_bytes(self.act, self.hop_dtype(a, b))

    def packet_ms(self, a: str, b: str) -> float:
        """The CPU a hop's datagrams cost: their number at the path's datagram size times what one
        costs, both ends' work together (each member's measurement, averaged over the two ends; the
        asker's side at the default)."""
        us = [self.by_name[x].packet_us if x in self.by_name else DEFAULT_DATAGRAM_US for x in (a, b)]
        return hop_datagrams(int(self.hop_bytes(a, b))) * (us[0] + us[1]) / 2 / 1e3

    def max_transfer(self, order: list[str]) -> float:
        hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
        return max(self.link_ms(a, b) - self.link_latency(a, b) for a, b in hops)

    def link_latency(self, a: str, b: str) -> float:
        return self.links.link(a, b).link.rtt_ms / 2

    def counts(self, order: list[str], cap: dict[str, int]) -> dict[str, int] | None:
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
            # the floor of one layer each can hand out more than there are (one member far larger
            # than the rest): take the surplus back from the largest counts, down to one each
            while sum(counts.values()) > self.n:
                m = max(order, key=lambda m: (counts[m], self.usable[m]))
                if counts[m] <= 1:
                    break
                counts[m] -= 1
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

    def site_of(self, name: str) -> str:
        """A member's site; a member that names none is a site of its own."""
        site = self.by_name[name].site if name in self.by_name else ""
        return site or f"({name})"

    def compute_floor(self, members: list[str]) -> float:
        """No plan over ``members`` computes faster: the fastest hold all they can, in any order."""
        left, ms = self.n, 0.0
        for m in sorted(members, key=lambda m: self.by_name[m].ms_per_layer_token):
            take = min(left, self.room[m])
            ms += take * self.by_name[m].ms_per_layer_token
            left -= take
        return ms if left == 0 else math.inf


def _prefix(values) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
