"""How a trunk applies the host's plans (swarmctl/trunk/assignment_core.py), driven directly: a
trunk's life of plans with no model, thread or socket. Each test plays the part of the trunk's
``Assignment`` (which calls these in this order) and checks what the core decides."""

from __future__ import annotations

from plans.plan import ExpertAssignment, Plan, StageAssignment
from swarmctl.trunk.assignment_core import (AssignmentCore, Confirmed, HeldExperts, HeldLayers, LoadKind,
                                            room_for_both)

ME = "trunk-a"


def plan(version: int, start: int = 4, stop: int = 10, member: str = ME, **kw) -> Plan:
    stages = [StageAssignment(member, "10.0.0.1:7471", start, stop)] if member else []
    return Plan(version=version, model_name="m", n_layer=30, head_layers=4, stages=stages, **kw)


def loaded(core: AssignmentCore, held: HeldLayers | None = None) -> tuple[bool, object]:
    """One stage load of the plan taken, as the trunk runs it: whether it replaced the layers held,
    and what follows it."""
    load = core.next_load(loading_elsewhere=False)
    assert load.kind == LoadKind.STAGE
    started = core.start_stage_load(load.stage, held, None)
    assert core.swapping == started.replaces  # steps are refused only while layers are replaced
    core.load_ended()
    assert not core.swapping
    return started.replaces, core.after_load(load.stage)


def test_a_plan_that_leaves_experts_unplaced_is_refused_and_the_one_served_stays():
    core = AssignmentCore(ME)
    good = plan(1)
    assert core.accept(good).refusal == ""
    bad = plan(2, experts=[ExpertAssignment("e1", "x:1", 0, 3)], n_expert=8)
    assert core.accept(bad).refusal == "the plan leaves experts [3, 8) unplaced"
    assert core.plan is good


def test_a_first_plan_replaces_nothing_held_and_is_confirmed_once():
    core = AssignmentCore(ME)
    core.accept(plan(1))
    replaced, after = loaded(core)
    assert replaced and not after.again
    assert after.confirmed == Confirmed(1, "stage", 4, 10)
    assert core.confirm(after.confirmed)
    assert not core.confirm(after.confirmed)  # the host hears ready once per version and assignment
    core.host_reconnected()
    assert core.confirm(after.confirmed)  # ... and again after it reconnected


def test_a_plan_that_keeps_the_layers_re_confirms_them_without_swapping():
    core = AssignmentCore(ME)
    core.accept(plan(2))
    replaced, after = loaded(core, HeldLayers(4, 10, remote_experts=False))
    assert not replaced  # steps run on through it
    assert after.confirmed == Confirmed(2, "stage", 4, 10) and core.confirm(after.confirmed)


def test_other_layers_or_experts_moving_off_the_stage_replace_what_is_held():
    core = AssignmentCore(ME)
    core.accept(plan(3, 4, 12))
    assert loaded(core, HeldLayers(4, 10, remote_experts=False))[0]
    core.accept(plan(4, 4, 12, experts=[ExpertAssignment("e1", "x:1", 0, 8)], n_expert=8))
    assert loaded(core, HeldLayers(4, 12, remote_experts=False))[0]  # an engine built to run its own experts


def test_a_load_under_way_re_reads_the_plan_instead_of_a_second_load():
    core = AssignmentCore(ME)
    core.accept(plan(1))
    assert core.next_load(loading_elsewhere=True).kind == LoadKind.WAIT


def test_a_plan_that_moved_while_loading_is_loaded_again_not_confirmed():
    core = AssignmentCore(ME)
    core.accept(plan(1))
    load = core.next_load(loading_elsewhere=False)
    core.start_stage_load(load.stage, None, None)
    core.accept(plan(2, 4, 14))  # arrives mid-load
    core.load_ended()
    after = core.after_load(load.stage)
    assert after.again and after.confirmed is None
    assert core.next_load(loading_elsewhere=False).stage.stop == 14


def test_the_layers_are_served_as_the_newest_plan_has_them():
    core = AssignmentCore(ME)
    core.accept(plan(1))
    load = core.next_load(loading_elsewhere=False)
    newer = plan(2)  # the same layers; how their output travels may differ
    core.accept(newer)
    after = core.after_load(load.stage)
    assert not after.again and after.latest is newer.stages[0] and after.plan is newer
    assert after.confirmed == Confirmed(2, "stage", 4, 10)


def test_a_plan_that_arrived_while_ready_was_sent_is_applied_after_it():
    core = AssignmentCore(ME)
    core.accept(plan(1))
    _, after = loaded(core)
    assert not core.moved_since(after.plan)
    core.accept(plan(2))  # while the ready message was on its way (the load left it to itself)
    assert core.moved_since(after.plan)
    _, again = loaded(core, HeldLayers(4, 10, remote_experts=False))
    assert core.confirm(again.confirmed) and again.confirmed.plan_version == 2


def test_a_plan_with_no_layers_here_or_experts_here_says_so():
    core = AssignmentCore(ME)
    core.accept(plan(1, member="trunk-b"))
    assert core.next_load(loading_elsewhere=False).kind == LoadKind.NOTHING
    experts = plan(2, member="trunk-b", experts=[ExpertAssignment(ME, "x:1", 0, 8)], n_expert=8)
    core.accept(experts)
    load = core.next_load(loading_elsewhere=False)
    assert load.kind == LoadKind.EXPERTS and load.expert.member == ME
    assert core.holds_experts(HeldExperts(0, 8, range(4, 26)), load.expert, experts.trunk_range)
    assert not core.holds_experts(HeldExperts(0, 8, range(4, 20)), load.expert, experts.trunk_range)
    assert not core.holds_experts(None, load.expert, experts.trunk_range)
    after = core.after_load(load.expert)
    assert after.confirmed == Confirmed(2, "experts", 0, 8)


def test_a_staged_plan_is_prepared_once_and_its_standby_taken_over_when_published():
    core = AssignmentCore(ME)
    core.accept(plan(1, next_version=2))
    staged = plan(2, 4, 16, staged=True)
    stage = core.prepare(staged)
    assert stage is not None and (stage.start, stage.stop) == (4, 16)
    assert core.prepare(staged) is None  # being prepared already
    assert core.staged_wanted(2)
    assert not core.accept(plan(1, next_version=2)).give_up_staged  # the plan in use, still pointing at it
    published = plan(2, 4, 16)
    assert not core.accept(published).give_up_staged
    assert not core.staged_wanted(2)  # published before this trunk was ready: its standby is not kept
    load = core.next_load(loading_elsewhere=False)
    started = core.start_stage_load(load.stage, HeldLayers(4, 10, False), (2, stage))
    assert started.replaces and started.take_standby
    core.load_ended()


def test_a_standby_for_another_version_or_other_layers_is_not_taken_over():
    core = AssignmentCore(ME)
    core.accept(plan(3, 4, 16))
    stage = core.plan.stages[0]
    assert not core.start_stage_load(stage, None, (2, stage)).take_standby
    assert not core.start_stage_load(stage, None, (3, StageAssignment(ME, "x", 4, 14))).take_standby
    assert core.start_stage_load(stage, None, (3, StageAssignment(ME, "x", 4, 16))).take_standby


def test_a_staged_plan_the_host_gave_up_is_dropped_and_an_old_one_never_prepared():
    core = AssignmentCore(ME)
    core.accept(plan(5))
    assert core.prepare(plan(5, 4, 16, staged=True)) is None  # no newer than the plan taken
    assert core.prepare(plan(6, member="trunk-b", staged=True)) is None  # nothing here for us
    assert core.prepare(plan(6, 4, 16, staged=True)) is not None
    assert core.still_preparing(6)
    assert core.accept(plan(7)).give_up_staged  # the host planned past it
    assert not core.still_preparing(6) and not core.staged_wanted(6)


def test_a_staged_stage_the_engine_serves_as_it_is_needs_no_load():
    stage = StageAssignment(ME, "x", 4, 10)
    assert AssignmentCore.serves_already(HeldLayers(4, 10, False), stage)
    assert not AssignmentCore.serves_already(HeldLayers(4, 10, True), stage)
    assert not AssignmentCore.serves_already(HeldLayers(4, 12, False), stage)
    assert not AssignmentCore.serves_already(None, stage)


def test_a_standby_engine_is_built_only_where_both_fit():
    assert room_for_both(held_bytes=600, needed_bytes=300, reserve_bytes=100, memory=1000)
    assert not room_for_both(held_bytes=600, needed_bytes=301, reserve_bytes=100, memory=1000)
