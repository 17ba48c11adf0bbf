"""The topology planner on synthetic clusters, and against brute force on small ones; the links it
charges (measured, bounded, relayed, within a site); when a changed link is worth a new plan."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.errors import EngineError
from plans.hysteresis import LINK_NOISE_MS, MIN_GAIN, assignment_cost, decide_on_links, link_moved, sticky_links
from plans.layout import ModelLayout, layout_by_name
from plans.links import FALLBACK, LAN, LinkModel
from plans.nodes import ASKER, DEFAULT_DATAGRAM_US, Link, NodeDescriptor, hop_datagrams, load_nodes
from plans.planner import Constraints, PlanError, plan_layers, time_breakdown

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


def test_even_plans_when_one_member_claims_far_more_memory_than_the_rest():
    """Every member gets at least one layer, so one huge memory claim used to hand out more layers
    than there are and leave no plan at all: anyone registering 100 TB broke an "even" swarm."""
    layout = layout_by_name("llama-3-70b-q4_k_m")
    nodes = friends() + [NodeDescriptor("huge", int(1e14), 2.0)]
    p = plan_layers(layout, nodes, Constraints(objective="even"))
    assert p.stages[0].start == 4 and p.stages[-1].stop == 76 and len(p.stages) == 5
    assert all(s.stop - s.start >= 1 for s in p.stages)
    assert max(p.stages, key=lambda s: s.stop - s.start).member == "huge"


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
    # (measured links: with nothing measured every hop is charged the pessimistic fallback, and one
    # stage on the snail alone would be cheaper than a second hop)
    near = {ASKER: Link(20.0, 50.0)}
    tight = [NodeDescriptor("fast", int(1.0 * GB), 1.0, links=near), NodeDescriptor("snail", int(4 * GB), 50.0, links=near)]
    p = plan_layers(layout, tight, Constraints(head_layers=2, context_tokens=16))
    assert {s.member for s in p.stages} == {"fast", "snail"}


# --- brute force on small instances ---

def brute_force(layout: ModelLayout, nodes: list[NodeDescriptor], c: Constraints) -> tuple[float, float]:
    start, stop = c.head_layers, layout.n_layer - c.head_layers
    n = stop - start
    kv = layout.kv_bytes_per_token_per_layer * c.context_tokens * c.max_concurrent
    act = layout.activation_bytes_per_token
    by = {nd.name: nd for nd in nodes}
    model = LinkModel(nodes)  # the planner's own link model: this checks the search, plans/links.py the links

    def link(a: str, b: str) -> Link:
        return model.link(a, b).link

    def packets_ms(a: str, b: str) -> float:  # the hop's datagrams, each end's cost averaged
        us = [by[x].packet_us if x in by else DEFAULT_DATAGRAM_US for x in (a, b)]
        return hop_datagrams(act) * sum(us) / 2 / 1e3

    best = (math.inf, math.inf)
    for k in range(1, len(nodes) + 1):
        for order in itertools.permutations([nd.name for nd in nodes], k):
            hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
            path = sum(link(a, b).cost_ms(act) + packets_ms(a, b) for a, b in hops)
            transfer = max(link(a, b).cost_ms(act) + packets_ms(a, b) - link(a, b).rtt_ms / 2 for a, b in hops)
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


def planned_like_brute_force(layout, nodes, c):
    """The planner's plan, checked against brute force on the objective; None where neither has one."""
    want = brute_force(layout, nodes, c)
    if want[0] == math.inf:
        with pytest.raises(PlanError):
            plan_layers(layout, nodes, c)
        return None
    p = plan_layers(layout, nodes, c)
    got_bottleneck = 1000.0 / p.tokens_per_s
    got = (p.ms_per_token, got_bottleneck) if c.objective == "latency" else (got_bottleneck, p.ms_per_token)
    assert got[0] == pytest.approx(want[0], rel=1e-9, abs=1e-9)
    return p


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
    planned_like_brute_force(layout, nodes, c)



@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_planner_matches_brute_force_with_unmeasured_relayed_and_site_links(data):
    """Layers of different sizes (an order that costs more in links may fit memory where the
    cheapest does not), links missing (the asker's too), relayed, or within a site."""
    n_layer = data.draw(st.integers(4, 9), label="layers")
    sizes = tuple(data.draw(st.sampled_from([30, 50, 70, 90]), label="layer MB") * 1_000_000 for _ in range(n_layer))
    layout = ModelLayout("uneven", n_layer, 256, sizes, (1,) * n_layer, 1000, 0, 0)
    names = [f"n{i}" for i in range(data.draw(st.integers(1, 4), label="nodes"))]
    nodes = []
    for name in names:
        links = {}
        if data.draw(st.booleans(), label="asker measured"):
            links[ASKER] = Link(data.draw(st.sampled_from([1.0, 10.0, 40.0, 400.0])), 50.0)
        for other in names:
            if other != name and data.draw(st.booleans()):
                via = data.draw(st.sampled_from(["", "", ASKER, *[x for x in names if x not in (name, other)]]))
                links[other] = Link(data.draw(st.sampled_from([0.0, 2.0, 20.0, 60.0])),
                                    data.draw(st.sampled_from([5.0, 100.0])), via)
        memory = 300_000_000 + data.draw(st.integers(40, 400), label="MB offered") * 1_000_000
        nodes.append(NodeDescriptor(name, memory, data.draw(st.sampled_from([0.5, 1.0, 2.0, 3.5, 8.0, 20.0])),
                                    links=links, site=data.draw(st.sampled_from(["", "home", "lab"]))))
    c = Constraints(head_layers=1, context_tokens=10, max_concurrent=1,
                    objective=data.draw(st.sampled_from(["latency", "throughput"])))
    p = planned_like_brute_force(layout, nodes, c)
    if p is None:
        return
    # a hop nobody measured is never charged less than the triangle inequality allows
    model = LinkModel(nodes)
    for hop in p.hops:
        assert (hop.basis in ("measured", "relayed")) == model.link(hop.src, hop.dst).measured
        if not model.link(hop.src, hop.dst).measured:
            assert hop.rtt_ms >= model.lower_bound(hop.src, hop.dst)


# --- the far node (issue 17): an unmeasured link is not a 20 ms link ---

EXAMPLES = Path(__file__).resolve().parent.parent / "plans" / "examples"
L70 = layout_by_name("llama-3-70b-q4_k_m")


def test_the_far_node_is_no_bridge_and_the_slow_node_no_stage():
    """far is 400 ms from everything it measured and measured nothing to desktop and old-laptop.
    Planned at a 20 ms default, the route was asker → old-laptop → far → desktop → gpu at 101.9 ms
    a token (old-laptop, 20 ms per layer, got a layer; mini-pc, 1.5 ms per layer, none). Bounded
    by the triangle inequality, that route costs 488 ms, and the plan leaves far and old-laptop out."""
    nodes = load_nodes(EXAMPLES / "far-node.json")
    model = LinkModel(nodes)
    for a, b in (("old-laptop", "far"), ("far", "desktop")):
        estimate = model.link(a, b)
        assert not estimate.measured and estimate.basis == "bound"
        assert estimate.link.rtt_ms >= estimate.low_ms >= 390  # at least |400 − a few ms|
    assert model.link("old-laptop", "far").link.rtt_ms == 403.0  # 400 + 3 through the asker
    assert model.link("far", "desktop").link.rtt_ms == 406.0  # 400 + 6 through gpu, tighter than 408
    assert model.link("far", "desktop").low_ms == 394.0
    p = plan_layers(L70, nodes, Constraints())
    members = [s.member for s in p.stages]
    assert "far" not in members and "old-laptop" not in members and "mini-pc" in members
    assert all(h.basis == "measured" for h in p.hops)
    old_route = [("old-laptop", 4, 5), ("far", 5, 34), ("desktop", 34, 35), ("gpu", 35, 76)]
    assert assignment_cost(L70, nodes, Constraints(), old_route)[0] > 4 * p.ms_per_token
    assert any(w.startswith("left out far") for w in p.warnings)


def test_a_far_node_needed_for_memory_is_charged_its_distance():
    """Without desktop the others cannot hold the model without far: it serves, and every hop to
    or from it is charged at least the triangle bound, measured or not."""
    nodes = [n for n in load_nodes(EXAMPLES / "far-node.json") if n.name != "desktop"]
    p = plan_layers(L70, nodes, Constraints())
    assert "far" in [s.member for s in p.stages]
    far_hops = [h for h in p.hops if "far" in (h.src, h.dst)]
    assert len(far_hops) == 2 and all(h.rtt_ms >= 390 for h in far_hops)
    assert p.ms_per_token >= sum(s.compute_ms for s in p.stages) + 390


def test_swarmctl_plan_on_the_far_node_example():
    r = subprocess.run([sys.executable, "-m", "swarmctl", "plan", "--layout", "llama-3-70b-q4_k_m", "--nodes",
                        str(EXAMPLES / "far-node.json"), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [s["member"] for s in plan["stages"]] == ["desktop", "gpu", "mini-pc"]
    assert [h["basis"] for h in plan["hops"]] == ["measured"] * 4


# --- the link model's numbers ---

def test_triangle_bounds_through_the_asker_and_a_common_peer():
    a = NodeDescriptor("a", int(GB), 1.0, links={ASKER: Link(10.0, 80.0), "c": Link(5.0, 30.0)})
    b = NodeDescriptor("b", int(GB), 1.0, links={ASKER: Link(50.0, 60.0)})
    c = NodeDescriptor("c", int(GB), 1.0, links={"b": Link(40.0, 100.0)})
    model = LinkModel([a, b, c])
    # through the asker: [40, 60]; through c: [35, 45]; so [40, 45], planned at 45 through c
    e = model.link("a", "b")
    assert (e.low_ms, e.high_ms, e.link.rtt_ms, e.through) == (40.0, 45.0, 45.0, ("c",))
    assert e.link.bandwidth_mb_s == 30.0  # no better than the weaker leg of the chain it was bounded by
    assert model.link("b", "a") == e and not e.measured
    assert "not measured" in e.describe("a", "b") and "40.0–45.0 ms" in e.describe("a", "b")
    # the asker's side is bounded the same way: c → asker through a ([5, 15]) or b ([10, 90])
    assert (model.link("c", ASKER).low_ms, model.link("c", ASKER).link.rtt_ms) == (10.0, 15.0)
    # measurements that break the triangle inequality: planned at the larger (lower) bound
    d = NodeDescriptor("d", int(GB), 1.0, links={"p": Link(400.0), "q": Link(1.0)})
    e2 = NodeDescriptor("e", int(GB), 1.0, links={"p": Link(10.0), "q": Link(1.0)})
    odd = LinkModel([d, e2]).link("d", "e")
    assert odd.low_ms == 390.0 and odd.high_ms == 2.0 and odd.link.rtt_ms == 390.0


def test_no_measured_path_is_a_pessimistic_fallback_named_in_the_plan():
    layout = ModelLayout("uniform", 20, 512, (100_000_000,) * 20, (1,) * 20, 1024, 0, 0)
    near = NodeDescriptor("near", int(1.0 * GB), 1.0, links={ASKER: Link(10.0, 50.0)})
    alone = NodeDescriptor("alone", int(1.5 * GB), 1.0)  # measured nothing, and nothing measured it
    model = LinkModel([near, alone])
    assert model.link("near", "alone").basis == "unknown" and model.link("near", "alone").link == FALLBACK
    assert model.link("alone", ASKER).link == FALLBACK
    p = plan_layers(layout, [near, alone], Constraints(head_layers=2, context_tokens=16))  # neither holds it alone
    assert {s.member for s in p.stages} == {"near", "alone"}
    assert p.ms_per_token >= 2 * FALLBACK.rtt_ms / 2  # two of its three hops touch alone
    unknown = [w for w in p.warnings if "no measured link joins its ends" in w]
    assert len(unknown) == 2 and all("alone" in w and "measure it" in w for w in unknown)


def test_a_relayed_link_is_charged_both_hops():
    a = NodeDescriptor("a", int(GB), 1.0, links={"r": Link(30.0, 80.0), "b": Link(0.0, math.inf, "r")})
    b = NodeDescriptor("b", int(GB), 1.0)
    r = NodeDescriptor("r", int(GB), 1.0, links={"b": Link(50.0, 20.0)})
    e = LinkModel([a, b, r]).link("a", "b")
    assert e.measured and e.basis == "relayed" and e.through == ("r",)
    assert (e.link.rtt_ms, e.link.bandwidth_mb_s) == (80.0, 20.0)
    assert "relayed through r" in e.describe("a", "b")
    # its own end-to-end measurement where that is worse; the relay's hops where they are
    slow = NodeDescriptor("a", int(GB), 1.0, links={"r": Link(30.0, 80.0), "b": Link(120.0, 50.0, "r")})
    assert LinkModel([slow, b, r]).link("a", "b").link.rtt_ms == 120.0
    # through the host (the asker's side), whose hops are the members' own round trips to it
    x = NodeDescriptor("x", int(GB), 1.0, links={ASKER: Link(20.0), "y": Link(25.0, 50.0, ASKER)})
    y = NodeDescriptor("y", int(GB), 1.0, links={ASKER: Link(35.0)})
    assert LinkModel([x, y]).link("y", "x").link.rtt_ms == 55.0  # 20 + 35, measured from x's end
    # a relay no one measured a hop to: both hops unknown, charged as such
    lost = NodeDescriptor("a", int(GB), 1.0, links={"b": Link(0.0, math.inf, "nowhere")})
    assert LinkModel([lost, b]).link("a", "b").link.rtt_ms == 2 * FALLBACK.rtt_ms


def test_sites_are_lan_links_and_plans_visit_each_site_once():
    """Three houses, two machines each; every machine measured its round trip to the asker only,
    and the model needs all six. Within a house, a LAN link; across, the bound through the asker."""
    layout = ModelLayout("uniform", 20, 512, (100_000_000,) * 20, (1,) * 20, 1024, 0, 0)
    rtt = {"a": 20.0, "b": 60.0, "c": 100.0}
    nodes = [NodeDescriptor(f"{site}{i}", int(0.62 * GB), 1.0, links={ASKER: Link(rtt[site] + i, 50.0)}, site=site)
             for i in (1, 2) for site in "cab"]  # (listed interleaved)
    model = LinkModel(nodes)
    assert model.link("a1", "a2").basis == "site" and model.link("a1", "a2").link.rtt_ms == LAN.rtt_ms
    assert model.link("a1", "b1").basis == "bound" and model.link("a1", "b1").link.rtt_ms == 82.0
    p = plan_layers(layout, nodes, Constraints(head_layers=2, context_tokens=16))
    order = [s.member[0] for s in p.stages]
    assert len(order) == 6 and sum(1 for _ in itertools.groupby(order)) == 3  # each site's stages consecutive
    assert any("LAN link within their site" in w for w in p.warnings)
    # without the sites every order costs the same, and the plan expects far more
    flat = plan_layers(layout, [NodeDescriptor(n.name, n.memory_bytes, 1.0, links=n.links) for n in nodes],
                       Constraints(head_layers=2, context_tokens=16))
    assert flat.ms_per_token > p.ms_per_token + 100
    # a measured link within a site is the measurement, and the triangle bound still holds
    slow_lan = [n if n.name != "a1" else NodeDescriptor("a1", n.memory_bytes, 1.0, links={**n.links, "a2": Link(7.0)},
                                                        site="a") for n in nodes]
    assert LinkModel(slow_lan).link("a2", "a1").link.rtt_ms == 7.0
    far_apart = [NodeDescriptor("p", int(GB), 1.0, links={ASKER: Link(10.0)}, site="s"),
                 NodeDescriptor("q", int(GB), 1.0, links={ASKER: Link(200.0)}, site="s")]
    assert LinkModel(far_apart).link("p", "q").link.rtt_ms == 190.0  # the site says LAN, the measurements say no
    # the example: three houses, a relayed link, the 70B model
    houses = load_nodes(EXAMPLES / "three-houses.json")
    site = {n.name: n.site for n in houses}
    for objective in ("latency", "throughput"):
        visits = [site[s.member] for s in plan_layers(L70, houses, Constraints(objective=objective)).stages]
        assert len(visits) >= 3 and sum(1 for _ in itertools.groupby(visits)) == len(set(visits))


def test_nodes_files_take_sites_and_relays_and_refuse_bad_links(tmp_path):
    good = tmp_path / "nodes.json"
    good.write_text(json.dumps([
        {"name": "a", "memory_gb": 8, "ms_per_layer_token": 1.0, "site": "home",
         "links": {"asker": {"rtt_ms": 10}, "b": {"via": "asker"}}},
        {"name": "b", "memory_gb": 8, "ms_per_layer_token": 1.0, "links": {"asker": {"rtt_ms": 30, "bandwidth_mb_s": 5}}},
    ]))
    a, b = load_nodes(good)
    assert a.site == "home" and b.site == ""
    assert a.links["b"] == Link(0.0, math.inf, ASKER) and a.links[ASKER] == Link(10.0, 50.0)
    assert LinkModel([a, b]).link("a", "b").link == Link(40.0, 5.0, ASKER)
    for links, message in (({"b": {"rtt_ms": -1}}, "rtt_ms must be 0 or more"),
                           ({"b": {"bandwidth_mb_s": 10}}, "has no rtt_ms"),
                           ({"b": {"rtt_ms": 5, "delay": 3}}, "unknown keys"),
                           ({"b": {"rtt_ms": 5, "via": "a"}}, "through one of its own ends")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps([{"name": "a", "memory_gb": 8, "ms_per_layer_token": 1.0, "links": links}]))
        with pytest.raises(EngineError, match=message):
            load_nodes(bad)
    bad.write_text(json.dumps([{"name": "a", "memory_gb": 8, "ms_per_layer_token": 1.0}] * 2))
    with pytest.raises(EngineError, match="names a more than once"):
        load_nodes(bad)


# --- hysteresis on links ---

SMALL = ModelLayout("small", 30, 576, (4_000_000,) * 30, (1,) * 30, 1024, 0, 0)
HALF = 300_000_000 + 12 * 4_000_000 + 2_000_000  # room for 12 of the 22 trunk layers, KV included


def trio(ab: float) -> list[NodeDescriptor]:
    """a must pair with b or c (neither holds the model alone); a measured both links."""
    return [NodeDescriptor("a", HALF, 1.0, links={ASKER: Link(2.0, 100.0), "b": Link(ab, 100.0), "c": Link(4.0, 100.0)}),
            NodeDescriptor("b", HALF, 1.0, links={ASKER: Link(2.0, 100.0)}),
            NodeDescriptor("c", HALF, 1.0, links={ASKER: Link(2.0, 100.0)})]


def test_a_link_that_got_much_worse_replans_and_noise_does_not():
    c = Constraints(head_layers=4, context_tokens=256, max_concurrent=2)
    nodes = trio(1.0)
    current = [(s.member, s.start, s.stop) for s in plan_layers(SMALL, nodes, c).stages]
    assert {m for m, _, _ in current} == {"a", "b"}
    # noise: 1 → 3 ms is 3×, but within LINK_NOISE_MS; 30 % on a long link: neither adopted nor re-planned
    quiet = decide_on_links(SMALL, nodes, c, current, "a", {"b": Link(3.0, 100.0), "c": Link(4.0, 100.0)})
    assert not quiet.replan and quiet.links["b"] == Link(1.0, 100.0), quiet.reason
    assert not link_moved(Link(100.0, 50.0), Link(130.0, 40.0)) and not link_moved(Link(1.0), Link(1.0 + LINK_NOISE_MS))
    # a change past the band that moves the best plan by less than MIN_GAIN: adopted, not re-planned
    small = decide_on_links(SMALL, nodes, c, current, "a", {"b": Link(8.0, 100.0), "c": Link(4.0, 100.0)})
    assert small.links["b"] == Link(8.0, 100.0) and not small.replan, small.reason
    assert 0 < 1 - small.proposed_ms / small.current_ms < MIN_GAIN
    # the link to b went bad (a new route, a congested uplink): a with c is much better now
    bad = decide_on_links(SMALL, nodes, c, current, "a", {"b": Link(300.0, 100.0), "c": Link(4.0, 100.0)})
    assert bad.replan and bad.proposed_ms < (1 - MIN_GAIN) * bad.current_ms, bad.reason
    # a path change (now relayed) is never noise
    assert link_moved(Link(1.0, 100.0), Link(1.0, 100.0, "r"))
    assert sticky_links({"b": Link(1.0)}, {"b": Link(2.0), "c": Link(9.0)}) == {"b": Link(1.0), "c": Link(9.0)}


def test_a_link_that_got_better_replans_only_when_it_pays():
    c = Constraints(head_layers=4, context_tokens=256, max_concurrent=2)
    nodes = trio(60.0)  # a–b is long: the plan pairs a with c
    current = [(s.member, s.start, s.stop) for s in plan_layers(SMALL, nodes, c).stages]
    assert {m for m, _, _ in current} == {"a", "c"}
    for ab, replans in ((50.0, False), (1.0, False)):  # within the band; 1 ms: better, but only by 3 ms
        decision = decide_on_links(SMALL, nodes, c, current, "a", {"b": Link(ab, 100.0), "c": Link(4.0, 100.0)})
        assert decision.replan == replans, decision.reason
    worse_c = decide_on_links(SMALL, nodes, c, current, "a", {"b": Link(1.0, 100.0), "c": Link(90.0, 100.0)})
    assert worse_c.replan, worse_c.reason


# --- the CPU a hop's datagrams cost (issue 32 item 4) ---

def test_a_hop_is_charged_its_datagrams_and_a_member_with_costly_packets_stays_out():
    """A Kimi-width row (7168 floats: 23 datagrams at 1350 bytes) per hop, at each end's measured
    cost; the plan needs two of three equal members, and the one whose packets cost 40x the others'
    is the one left out although it is listed first and computes a little faster."""
    layout = ModelLayout("wide", 20, 7168, (1_000_000_000,) * 20, (1,) * 20, 1024, 0, 0)
    near = {ASKER: Link(2.0, 1000.0)}
    nodes = [NodeDescriptor("costly", int(10 * GB), 0.99, links=near, datagram_us=3000.0),
             NodeDescriptor("a", int(10 * GB), 1.0, links=near, datagram_us=75.0),
             NodeDescriptor("b", int(10 * GB), 1.0, links=near)]  # (not measured: the default)
    c = Constraints(head_layers=2, context_tokens=16)
    p = plan_layers(layout, nodes, c)
    assert sorted(s.member for s in p.stages) == ["a", "b"] and "costly" in p.left_out
    datagrams = hop_datagrams(7168 * 4)
    assert datagrams == 23
    first = p.hops[0]  # asker (the default) → the first stage
    us = {"a": 75.0, "b": DEFAULT_DATAGRAM_US}
    assert first.packet_ms == pytest.approx(datagrams * (DEFAULT_DATAGRAM_US + us[first.dst]) / 2 / 1e3)
    parts = {t.part: t for t in time_breakdown(p, nodes)}
    packets = parts["packets (CPU per datagram, both ends)"]
    assert packets.count == 3 and packets.ms == pytest.approx(sum(h.packet_ms for h in p.hops)) and packets.ms > 4.5
    assert sum(t.ms for t in parts.values()) == pytest.approx(p.whole_ms_per_token)
    # without the charge, the slightly faster member would have been planned
    free = [NodeDescriptor(n.name, n.memory_bytes, n.ms_per_layer_token, links=near, datagram_us=0.001) for n in nodes]
    assert "costly" in {s.member for s in plan_layers(layout, free, c).stages}


def test_a_nodes_file_may_give_each_member_its_datagram_cost(tmp_path):
    f = tmp_path / "nodes.json"
    f.write_text('[{"name": "a", "memory_gb": 8, "ms_per_layer_token": 1, "datagram_us": 30}]')
    assert load_nodes(f)[0].packet_us == 30
    f.write_text('[{"name": "a", "memory_gb": 8, "ms_per_layer_token": 1, "datagram_us": -1}]')
    with pytest.raises(EngineError, match="datagram_us must be more than 0"):
        load_nodes(f)


def test_a_gpu_member_keeps_routed_experts_in_its_ram_and_pays_their_bytes_at_its_rate(tmp_path):
    """The planner's side of placement by tensor kind (issue 33 item 1): a member whose device
    holds each layer's dense part and KV cache, not its routed experts, keeps those in the host
    RAM it offers (ram_gb) and reads a token's share of them at its RAM's rate (ram_gb_s) instead
    of their share of a layer's time on the device. Without the RAM the same trunk does not fit."""
    from plans.cost import CostModel
    from plans.nodes import load_nodes

    layout = ModelLayout(name="moe", n_layer=6, n_embd=1024, layer_bytes=(int(10 * GB),) * 6, layer_flops=(1,) * 6,
                         kv_bytes_per_token_per_layer=0, embedding_bytes=0, lm_head_bytes=0,
                         expert_bytes=(0,) + (int(8 * GB),) * 5, n_expert=8, n_expert_used=2)
    nodes_file = tmp_path / "nodes.json"
    nodes_file.write_text(json.dumps([{"name": "gpu", "memory_gb": 12.3, "ms_per_layer_token": 1.0, "device": "cuda",
                                       "ram_gb": 40, "ram_gb_s": 20}]))
    (gpu,) = load_nodes(nodes_file)
    assert gpu.ram_bytes == int(40 * GB) and gpu.ram_gb_s == 20.0
    c = Constraints(head_layers=1, context_tokens=16)
    cost = CostModel(layout, [gpu], c, 1, 5)
    # the device holds the 4 layers' dense parts (8 GB) and no layer's experts (8 GB each): 32 GB in RAM
    assert cost.stage_memory("gpu", 0, 4) == (int(8 * GB), int(32 * GB))
    # each layer: 1 ms on the device, less its experts' share (2 GB of the 5 GB a mean layer reads:
    # 0.4 ms), plus 2 GB at 20 GB/s (100 ms)
    assert cost.stage_ms("gpu", 0, 4) == pytest.approx(4 * (1.0 - 0.4 + 100.0))
    p = plan_layers(layout, [gpu], c)
    (stage,) = p.stages
    assert (stage.start, stage.stop, stage.ram_used) == (1, 5, int(32 * GB))
    assert stage.compute_ms == pytest.approx(402.4) and stage.memory_used == int(8 * GB)
    # more device memory: the first layer's experts move onto it
    roomy = NodeDescriptor("gpu", int(20.3 * GB), 1.0, device="cuda", ram_bytes=int(40 * GB), ram_gb_s=20.0)
    assert CostModel(layout, [roomy], c, 1, 5).stage_memory("gpu", 0, 4) == (int(16 * GB), int(24 * GB))
    # without RAM for the experts it cannot hold the trunk
    with pytest.raises(PlanError, match="cannot hold the model"):
        plan_layers(layout, [NodeDescriptor("gpu", int(12.3 * GB), 1.0, device="cuda")], c)
    nodes_file.write_text(json.dumps([{"name": "gpu", "memory_gb": 12, "ms_per_layer_token": 1.0, "ram_gb": 40}]))
    with pytest.raises(EngineError, match="ram_gb and ram_gb_s come together"):
        load_nodes(nodes_file)


def test_the_search_is_exact_with_members_keeping_experts_in_ram():
    """Members that keep routed experts in RAM cost more per layer beyond what their device holds,
    and the search's lower bound says so (CostModel.least_stage_ms: the Kimi example with RAM beside
    its GPUs planned in 17 s with the device-only bound, under 1 s with it, the same plan). Checked
    against every order and every cut, each stage priced by the cost model itself (its stage
    memory and time are checked above): the bound must never prune the best plan. 300 seeded
    swarms (a bound 10x too high missed the best plan in 8 of them; hypothesis's simpler draws
    found none), half of whose plans keep experts in RAM."""
    import random

    from plans.cost import CostModel

    rng = random.Random(7)
    with_ram = 0
    for _ in range(300):
        n_layer = rng.randint(4, 8)
        experts = tuple(0 if il == 0 else rng.choice([3, 6, 9]) * 100_000_000 for il in range(n_layer))
        layout = ModelLayout("moe", n_layer, 256, tuple(200_000_000 + e for e in experts), (1,) * n_layer, 1000, 0, 0,
                             expert_bytes=experts, n_expert=8, n_expert_used=2)
        nodes = []
        for i in range(rng.randint(1, 4)):
            ram = rng.choice([0, 1, 3]) * 1_000_000_000
            links = {ASKER: Link(rng.choice([1.0, 10.0, 40.0]), 50.0)}
            links.update((f"n{j}", Link(rng.choice([2.0, 20.0]), 100.0)) for j in range(i))
            nodes.append(NodeDescriptor(f"n{i}", 300_000_000 + rng.randint(1, 10) * 150_000_000,
                                        rng.choice([0.5, 1.0, 2.0, 4.0]), device="cuda", links=links, ram_bytes=ram,
                                        ram_gb_s=rng.choice([0.5, 5.0, 500.0]) if ram else 0.0))
        c = Constraints(head_layers=1, context_tokens=10, max_concurrent=1)
        model = CostModel(layout, nodes, c, 1, n_layer - 1)
        best = math.inf
        for k in range(1, len(nodes) + 1):
            for order in itertools.permutations([nd.name for nd in nodes], k):
                hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
                path = sum(model.link_ms(a, b) for a, b in hops)
                for cuts in itertools.combinations(range(1, model.n), k - 1):
                    bounds = [0, *cuts, model.n]
                    stages = [model.stage_plan(m, p, q) for m, (p, q) in zip(order, zip(bounds, bounds[1:]))]
                    if all(stages):
                        best = min(best, path + sum(s.compute_ms for s in stages))
        if best == math.inf:
            with pytest.raises(PlanError):
                plan_layers(layout, nodes, c)
            continue
        plan = plan_layers(layout, nodes, c)
        with_ram += any(s.ram_used for s in plan.stages)
        assert plan.ms_per_token == pytest.approx(best, rel=1e-9), (layout, nodes)
    assert with_ram >= 100

