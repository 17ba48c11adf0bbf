"""The topology planner on synthetic clusters, and against brute force on small ones."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plans.layout import ModelLayout, layout_by_name
from plans.nodes import ASKER, Link, NodeDescriptor, link_between
from plans.planner import Constraints, PlanError, plan_layers

GB = 1e9


def friends() -> list[NodeDescriptor]:
    return [NodeDescriptor("gpu-24", int(24 * GB), 0.4, "cuda"), NodeDescriptor("laptop-16", int(16 * GB), 2.0),
            NodeDescriptor("mini-12", int(12 * GB), 3.0), NodeDescriptor("old-8", int(8 * GB), 9.0)]


def test_llama_3_70b_on_four_heterogeneous_nodes():
    layout = layout_by_name("llama-3-70b-q4_k_m")
    assert 41e9 < layout.total_bytes < 44e9  # the real Q4_K_M file is 42.5 GB
    for objective in ("latency", "throughput"):
        p = plan_layers(layout, friends(), Constraints(objective=objective))
        assert p.stages[0].start == 4 and p.stages[-1].stop == 76
        assert all(a.stop == b.start for a, b in zip(p.stages, p.stages[1:]))  # contiguous, in order
        for s in p.stages:
            assert s.memory_free >= 0 and s.memory_used == pytest.approx(
                layout.range_bytes(s.start, s.stop) + (s.stop - s.start) * 4096 * 4 * 4096, rel=1e-9)
        assert p.ms_per_token > 0 and p.tokens_per_s > 0 and p.bottleneck
    latency = plan_layers(layout, friends(), Constraints())
    assert "old-8" in latency.left_out and any("left out old-8" in w and "slower" in w for w in latency.warnings)
    gpu = next(s for s in latency.stages if s.member == "gpu-24")
    assert gpu.stop - gpu.start == max(s.stop - s.start for s in latency.stages)  # the fast node takes most


def test_a_swarm_too_small_says_how_much_memory_is_missing():
    layout = layout_by_name("llama-3-70b-q4_k_m")
    nodes = friends()[1:3]  # 16 + 12 GB
    with pytest.raises(PlanError) as err:
        plan_layers(layout, nodes, Constraints())
    message = str(err.value)
    missing = float(re.search(r"([\d.]+) GB missing", message).group(1))
    kv = 72 * layout.kv_bytes_per_token_per_layer * 4096 * 4
    expected = (layout.range_bytes(4, 76) + kv - (16 + 12 - 0.6) * GB) / GB
    assert missing == pytest.approx(expected, abs=0.1)


def test_a_very_slow_node_is_left_out_with_a_reason():
    layout = ModelLayout("uniform", 20, 512, (100_000_000,) * 20, (1,) * 20, 1024, 0, 0)
    nodes = [NodeDescriptor("fast", int(4 * GB), 1.0), NodeDescriptor("snail", int(4 * GB), 50.0)]
    for objective in ("latency", "throughput"):
        p = plan_layers(layout, nodes, Constraints(head_layers=2, objective=objective, context_tokens=16))
        assert [s.member for s in p.stages] == ["fast"]
        assert p.left_out == ["snail"] and "left out snail" in p.warnings[0]
    # ... but used when memory requires it
    tight = [NodeDescriptor("fast", int(1.0 * GB), 1.0), NodeDescriptor("snail", int(4 * GB), 50.0)]
    p = plan_layers(layout, tight, Constraints(head_layers=2, context_tokens=16))
    assert {s.member for s in p.stages} == {"fast", "snail"}


# --- brute force on small instances ---

def brute_force(layout: ModelLayout, nodes: list[NodeDescriptor], c: Constraints) -> tuple[float, float]:
    start, stop = c.head_layers, layout.n_layer - c.head_layers
    n = stop - start
    kv = layout.kv_bytes_per_token_per_layer * c.context_tokens * c.max_concurrent
    act = layout.activation_bytes_per_token
    by = {nd.name: nd for nd in nodes}

    def link(a: str, b: str) -> Link:
        if a == ASKER:
            return by[b].link_to(ASKER)
        if b == ASKER:
            return by[a].link_to(ASKER)
        return link_between(by[a], by[b])

    best = (math.inf, math.inf)
    for k in range(1, len(nodes) + 1):
        for order in itertools.permutations([nd.name for nd in nodes], k):
            hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
            path = sum(link(a, b).cost_ms(act) for a, b in hops)
            transfer = max(link(a, b).cost_ms(act) - link(a, b).rtt_ms / 2 for a, b in hops)
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                ok, compute = True, []
                for m, (a, b) in zip(order, zip(bounds, bounds[1:])):
                    used = sum(layout.layer_bytes[start + a:start + b]) + (b - a) * kv
                    if used > by[m].memory_bytes - c.reserve_bytes:
                        ok = False
                        break
                    compute.append((b - a) * by[m].ms_per_layer_token)
                if not ok:
                    continue
                latency, bottleneck = sum(compute) + path, max(max(compute), transfer)
                score = (latency, bottleneck) if c.objective == "latency" else (bottleneck, latency)
                best = min(best, score)
    return best


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_planner_matches_brute_force(data):
    n_layer = data.draw(st.integers(5, 11), label="layers")
    layer = 50_000_000
    layout = ModelLayout("small", n_layer, 256, (layer,) * n_layer, (1,) * n_layer, 1000, 0, 0)
    n_nodes = data.draw(st.integers(1, 4), label="nodes")
    names = [f"n{i}" for i in range(n_nodes)]
    nodes = []
    for name in names:
        memory = data.draw(st.integers(1, 6), label="layers of memory") * layer + 300_000_000 + 10_000_000
        speed = data.draw(st.sampled_from([0.5, 1.0, 2.0, 3.5, 8.0]), label="ms per layer")
        links = {ASKER: Link(data.draw(st.sampled_from([1.0, 10.0, 40.0])), 50.0)}
        for other in names:
            if other != name and data.draw(st.booleans()):
                links[other] = Link(data.draw(st.sampled_from([2.0, 20.0, 60.0])), data.draw(st.sampled_from([5.0, 100.0])))
        nodes.append(NodeDescriptor(name, memory, speed, links=links))
    c = Constraints(head_layers=1, context_tokens=10, max_concurrent=1,
                    objective=data.draw(st.sampled_from(["latency", "throughput"])))
    want = brute_force(layout, nodes, c)
    if want[0] == math.inf:
        with pytest.raises(PlanError):
            plan_layers(layout, nodes, c)
        return
    p = plan_layers(layout, nodes, c)
    got_bottleneck = 1000.0 / p.tokens_per_s
    got = (p.ms_per_token, got_bottleneck) if c.objective == "latency" else (got_bottleneck, p.ms_per_token)
    assert got[0] == pytest.approx(want[0], rel=1e-9, abs=1e-9)
