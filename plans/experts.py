"""Expert parallelism in the plan: which members hold the routed experts of every trunk MoE layer,
and what calling them costs a stage's tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .layout import ModelLayout
from .links import LinkModel
from .nodes import NodeDescriptor
from .plan import ExpertAssignment, PlanError
from .proposal import Constraints, Proposal

GB = 1e9


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
