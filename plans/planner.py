"""The topology planner: which members serve which contiguous trunk layers, in which order.

Objective "latency" (default) minimises a single stream's time per token: the stages' compute
(layers × ms per layer) plus the links along asker → stage 1 → … → stage n → asker. The asker's
own part (its head and tail layers and the LM head, ``Constraints.asker``) is the same for every
member order, so it is reported (``Proposal.asker_ms``, in ``whole_ms_per_token``) and not searched.
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
memory fits; a member that keeps routed experts in host RAM is charged, beyond what its device
holds, at least the least a layer's experts in RAM add (CostModel.least_stage_ms: without it the
thirty-GPU example with RAM beside its GPUs tried 9,815 cuts and took 17 s, with it under 1 s). Subsets are then taken best bound first, and an exact dynamic programme cuts the real
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

import math

from .experts import ExpertPlacement, add_expert_calls, place_experts  # noqa: F401 (the planner's API)
from .layout import ModelLayout
from .nodes import ASKER, NodeDescriptor
from .plan import PlanError
from .proposal import Constraints, Hop, Proposal, StagePlan, TimePart, time_breakdown  # noqa: F401
from .search import EXACT_NODES, Search

GB = 1e9


def plan_layers(layout: ModelLayout, nodes: list[NodeDescriptor], constraints: Constraints) -> Proposal:
    k = constraints.head_layers
    start, stop = k, layout.n_layer - k
    if stop < start or k < 0:
        raise PlanError(f"head layers {k} do not fit a model of {layout.n_layer} layers")
    if constraints.objective not in ("latency", "throughput", "even"):
        raise PlanError(f"unknown objective {constraints.objective!r} (latency, throughput or even)")
    if stop == start:
        return Proposal(constraints.objective, [], 0.0, math.inf, "none: the asker runs every layer",
                        asker_ms=constraints.asker.ms(layout, k), asker_basis=constraints.asker.basis)
    problem = Search(layout, nodes, constraints, start, stop)
    problem.check_capacity()
    problem.rank_subsets()
    best = problem.search()
    if problem.large:  # the exact search saw only the fastest EXACT_NODES: also try every member
        by_site = problem.search_by_site()
        if by_site is not None and (best is None or by_site[0] < best[0]):
            best, problem.by_site = by_site, True
    if best is None:
        raise PlanError("no member order fits the layers' sizes into the members' memory")
    return describe(problem, best[1], best[2])


def describe(search: Search, order: list[str], stages: list[StagePlan]) -> Proposal:
    hops = [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]
    link_ms = [search.link_ms(a, b) for a, b in hops]
    latency = sum(s.compute_ms for s in stages) + sum(link_ms)
    worst_stage = max(stages, key=lambda s: s.compute_ms)
    worst_link = max(range(len(hops)), key=lambda i: link_ms[i] - search.link_latency(*hops[i]))
    transfer = link_ms[worst_link] - search.link_latency(*hops[worst_link])
    if worst_stage.compute_ms >= transfer:
        bottleneck = (f"stage {worst_stage.member} (layers [{worst_stage.start}, {worst_stage.stop}), "
                      f"{worst_stage.compute_ms:.1f} ms per token)")
        bottleneck_ms = worst_stage.compute_ms
    else:
        a, b = hops[worst_link]
        bottleneck = f"link {a} → {b} ({transfer:.1f} ms per token to move activations)"
        bottleneck_ms = transfer
    result = Proposal(search.c.objective, stages, latency, 1000.0 / bottleneck_ms if bottleneck_ms else math.inf,
                      bottleneck, search="by site" if search.by_site else "exact",
                      asker_ms=search.c.asker.ms(search.layout, search.c.head_layers), asker_basis=search.c.asker.basis)
    chosen = set(order)
    best_score = search.score(order, [s.compute_ms for s in stages])
    for nd in search.nodes:
        if nd.name in chosen:
            continue
        result.left_out.append(nd.name)
        even = search.c.objective == "even"  # (which places layers by their mean size)
        if search.room[nd.name] < 1 or (even and search.cap[nd.name] < 1):
            result.warnings.append(
                f"left out {nd.name}: its {search.usable[nd.name] / GB:.1f} GB (after the reserve) is less than "
                f"one layer needs ({(search.mean_need if even else min(search.need)) / GB:.2f} GB)")
            continue
        if search.by_site or (search.large and nd.name not in search.exact_names):
            # (the exact search's comparison covers only the fastest EXACT_NODES)
            result.warnings.append(
                f"left out {nd.name} ({nd.device}, {nd.ms_per_layer_token:.2f} ms per layer): the others hold "
                f"the model, and neither the exact search over the {EXACT_NODES} fastest members nor the "
                f"search over every member in site order found a better plan with it")
            continue
        found = search.search(including=nd.name) if search.c.objective != "even" else None
        if found is None and search.c.max_stages:
            result.warnings.append(f"{nd.name} stands by: the plan uses at most {search.c.max_stages} stages")
            continue
        if found is None:
            result.warnings.append(f"left out {nd.name}: no plan that includes it fits")
            continue
        alt = found[0]
        unmeasured = "" if search.links.measures(nd.name) else (
            " (none of its links is measured: each is charged as unknown)")
        if search.c.objective != "throughput":
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
        estimate = search.links.link(a, b)
        result.hops.append(Hop(a, b, estimate.link.rtt_ms, estimate.link.bandwidth_mb_s, estimate.basis,
                               estimate.through, ms, search.packet_ms(a, b), search.hop_dtype(a, b)))
        if estimate.describe(a, b):
            result.warnings.append(estimate.describe(a, b))
    return result
