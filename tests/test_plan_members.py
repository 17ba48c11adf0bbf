"""Which trunks the host's plan is made over (swarmctl/host/plan_members.py), driven with plain
trunks and times: no sockets, no threads, no keeper."""

from __future__ import annotations

from types import SimpleNamespace

from plans.layout import ModelLayout
from plans.options import PlannerSettings
from plans.plan import Plan
from swarmctl.host.plan_members import PlanMembers
from swarmctl.host.staging import Staging, StagingSettings
from swarmctl.host.trunks import TrunkInfo

GB = 1e9
SMOL = ModelLayout("smol", 30, 576, (4_000_000,) * 30, (1,) * 30, 1024, 0, 0)  # 22 trunk layers
CONFIG = SimpleNamespace(head_layers=4, plan_context=1024, plan_concurrent=4, objective="throughput",
                         plan_max_stages=0, expert_nodes=0, wire_dtype="f32", kernels="plain")
CONSTRAINTS = PlannerSettings.from_config(CONFIG).constraints()


def trunk(i: int, proven: bool = True) -> TrunkInfo:
    conn = SimpleNamespace(is_open=True)
    return TrunkInfo(conn=conn, plan_stream=0, listen=f"127.0.0.1:{i + 1}", memory=int(2 * GB), ms_per_layer_token=1.0,
                     registered_at=float(i), measured_ms_per_layer=1.0 if proven else None)


def members(**trunks: TrunkInfo) -> PlanMembers:
    return PlanMembers(SMOL, CONFIG, trunks, Staging(StagingSettings(missed_hold_s=300.0)))


def planned(choice) -> set[str]:
    return {s.member for s in choice.proposal.stages}


def test_an_unproven_trunk_proves_itself_on_a_trial_while_the_proven_serve():
    m = members(alice=trunk(0), bob=trunk(1), carol=trunk(2, proven=False))
    choice = m.choose(CONSTRAINTS)
    assert not choice.problem and "carol" not in planned(choice) and choice.on_trial == ["carol"]
    plan = Plan(1, "m", 30, 4)
    ranges = m.trials(choice.on_trial, plan, CONSTRAINTS)
    assert list(ranges) == ["carol"] and 4 <= ranges["carol"][0] < ranges["carol"][1] <= 26
    m.trunks["carol"].trial = (2**40 + 1, *ranges["carol"])  # sent: no second trial
    assert m.trials(choice.on_trial, plan, CONSTRAINTS) == {}


def test_unproven_trunks_are_planned_as_they_are_where_the_proven_cannot_serve_alone():
    m = members(carol=trunk(0, proven=False), dave=trunk(1, proven=False))
    m.trunks["carol"].trial = (2**40 + 1, 4, 5)
    choice = m.choose(CONSTRAINTS)
    assert planned(choice) == {"carol", "dave"} and choice.on_trial == [] and m.trunks["carol"].trial is None


def test_a_held_member_stays_out_while_the_others_serve_and_is_planned_where_they_cannot():
    m = members(alice=trunk(0), bob=trunk(1))
    m.refuse("bob", m.staging.miss("bob", "missed its deadline", 0.0))
    assert m.held("bob") and m.trunks["bob"].refused.startswith("missed its deadline")
    choice = m.choose(CONSTRAINTS)
    assert planned(choice) == {"alice"} and m.held("bob")
    assert m.serve_without({"bob"}, CONSTRAINTS) and not m.serve_without({"alice", "bob"}, CONSTRAINTS)
    del m.trunks["alice"]  # the only other one left
    choice = m.choose(CONSTRAINTS)
    assert planned(choice) == {"bob"} and not m.trunks["bob"].refused and "bob" not in m.staging.holds


def test_a_hold_takes_no_other_refusal_and_ends_only_its_own():
    m = members(alice=trunk(0))
    m.trunks["alice"].refused = "failed a layer check"
    m.refuse("alice", m.staging.miss("alice", "missed its deadline", 0.0))
    assert m.trunks["alice"].refused == "failed a layer check" and not m.held("alice")
    assert not m.release(["alice"]) and m.trunks["alice"].refused == "failed a layer check"
    assert not m.release([]) and "alice" not in m.staging.holds
