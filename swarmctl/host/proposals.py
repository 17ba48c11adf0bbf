"""A plan from the planner's answer, with no I/O: what the planner proposes over some trunks, and
what of it goes into the plan (the keeper, planning.py, decides which trunks and when)."""

from __future__ import annotations

from plans.layout import ModelLayout
from plans.nodes import NodeDescriptor
from plans.plan import ExpertAssignment, Plan
from plans.planner import Constraints, add_expert_calls, place_experts, plan_layers


def propose(layout: ModelLayout, every_node: list[NodeDescriptor], constraints: Constraints, expert_nodes: int):
    """(proposal or None for no trunks, placement) over ``every_node``; PlanError if they cannot."""
    placement = place_experts(layout, every_node, constraints, expert_nodes)
    proposal = plan_layers(placement.stage_layout, placement.stage_nodes, constraints) \
        if placement.stage_nodes else None
    if proposal is not None:
        add_expert_calls(proposal, placement, every_node, layout)
    return proposal, placement


def apply_proposal(plan: Plan, proposal, placement, constraints: Constraints) -> bool:
    """Put a planner's proposal (None: no plan) into ``plan``; True (and a new version) if who
    serves what changed."""
    # (stages bound each member's KV by what the plan reserves there: swarmctl/trunk/budget.py)
    plan.context_tokens = constraints.context_tokens
    plan.max_concurrent = constraints.max_concurrent
    nodes = placement.stage_nodes if placement is not None else []
    experts: list[ExpertAssignment] = placement.experts if placement is not None else []
    if proposal is None:
        changed = bool(plan.stages)
        if changed:
            plan.version += 1
            plan.stages = []
    else:
        changed = plan.apply(proposal, {n.name: n.address for n in nodes})
        plan.warnings += placement.warnings
    if [(e.member, e.start, e.stop) for e in experts] != [(e.member, e.start, e.stop) for e in plan.experts]:
        if not changed:
            plan.version += 1
            for s in plan.stages:
                s.ready = False
        plan.experts = experts
        plan.check_experts()
        changed = True
    if plan.kernels != constraints.kernels:  # every member reloads its weights under the new kernels
        plan.kernels = constraints.kernels
        if not changed:
            plan.version += 1
            for s in plan.stages:
                s.ready = False
        for e in plan.experts:
            e.ready = False
        changed = True
    if plan.attention != constraints.attention:  # every stage builds its engine again (the KV layout
        plan.attention = constraints.attention  # differs); expert nodes compute no attention and stay
        if not changed:
            plan.version += 1
            for s in plan.stages:
                s.ready = False
        changed = True
    return changed


def trial_ranges(waiting: list[str], plan: Plan, would_be: Plan | None) -> dict[str, tuple[int, int]]:
    """The layers each of the ``waiting`` unproven trunks proves on its trial: those the planner
    would give it (``would_be``: its plan with them too), or, where it would leave it out, the
    first trunk layer of ``plan`` (proving it makes it a standby)."""
    lo, _ = plan.trunk_range
    ranges = {name: (lo, lo + 1) for name in waiting}
    ranges.update({s.member: (s.start, s.stop) for s in (would_be.stages if would_be else []) if s.member in ranges})
    return ranges
