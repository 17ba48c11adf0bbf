"""`attention plain|flash` as a planner option: its flag and `config` setting, carried in the plan,
a new plan version every stage loads again, the stage engine a trunk holds compared with it (no
process). The bits of each choice against llama.cpp: tests/test_flash_attention.py; a swarm:
tests/test_attention_swarm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plans.options import BY_KEY, PlannerSettings
from plans.plan import ExpertAssignment, Plan, StageAssignment
from swarmctl.commands import config as config_command
from swarmctl.errors import UsageError
from swarmctl.host.proposals import apply_proposal
from swarmctl.host.service import HostService
from swarmctl.node.home import SwarmHome
from swarmctl.node.membership import create_swarm
from swarmctl.trunk.assignment_core import AssignmentCore, HeldLayers


def test_attention_is_a_setting_with_plain_the_default():
    option = BY_KEY["attention"]
    assert option.default == "plain" and option.choices == ("plain", "flash") and option.configurable
    assert PlannerSettings().attention == "plain"
    assert PlannerSettings(attention="flash").constraints().attention == "flash"
    assert config_command.parse_pairs(["attention", "flash"]) == {"attention": "flash"}
    with pytest.raises(UsageError, match=r"^swarmctl config: attention must be one of plain, flash, not 'fast'$"):
        config_command.parse_pairs(["attention", "fast"])


def test_the_plan_carries_the_attention_and_it_names_the_assignment():
    plan = Plan(version=3, model_name="m", n_layer=8, head_layers=2, attention="flash")
    again = Plan.from_dict(plan.to_dict())
    assert again.attention == "flash" and again.assignments() == plan.assignments()
    assert Plan.from_dict({**plan.to_dict(), "attention": "plain"}).assignments() != plan.assignments()
    # a plan from a host that names an attention this version lacks (or none: an older host): plain
    assert Plan.from_dict({**plan.to_dict(), "attention": "paged"}).attention == "plain"
    older = plan.to_dict()
    del older["attention"]
    assert Plan.from_dict(older).attention == "plain"


def _plan() -> Plan:
    plan = Plan(version=3, model_name="m", n_layer=8, head_layers=2, n_expert=4)
    plan.stages = [StageAssignment("t", "addr", 2, 6, ready=True)]
    plan.experts = [ExpertAssignment("e", "addr", 0, 4, ready=True)]
    return plan


def test_the_host_applies_a_new_attention_as_a_new_plan_version(monkeypatch):
    plan = _plan()
    monkeypatch.setattr(Plan, "apply", lambda self, proposal, addresses: False)  # (who serves what: unchanged)
    placement = SimpleNamespace(stage_nodes=[], experts=[ExpertAssignment("e", "addr", 0, 4)], warnings=[])
    assert not apply_proposal(plan, object(), placement, PlannerSettings().constraints())
    assert plan.version == 3
    assert apply_proposal(plan, object(), placement, PlannerSettings(attention="flash").constraints())
    assert plan.version == 4 and plan.attention == "flash"
    assert [s.ready for s in plan.stages] == [False], "every stage loads again"
    assert [e.ready for e in plan.experts] == [True], "expert nodes compute no attention: they stay"


def test_a_trunk_holding_the_other_attention_loads_its_stage_again():
    plan = _plan()
    plan.attention = "flash"
    core = AssignmentCore("t")
    assert not core.accept(plan).refusal
    stage = plan.stages[0]
    assert not core.start_stage_load(stage, HeldLayers(2, 6, True, "plain", "flash"), None).replaces
    assert core.start_stage_load(stage, HeldLayers(2, 6, True, "plain", "plain"), None).replaces
    # a staged plan with the other attention: an engine loads beside the one in use
    assert AssignmentCore.serves_already(HeldLayers(2, 6, False, "plain", "flash"), stage, plan)
    assert not AssignmentCore.serves_already(HeldLayers(2, 6, False, "plain", "plain"), stage, plan)


def test_the_hosts_first_plan_already_names_the_swarms_kernels_and_attention(tmp_path, bundled_model):
    """Plan version 0, before any trunk: an asker watching from the start (a local swarm, `serve`
    started with the swarm) took its plain default for the swarm's setting and, at the first real
    plan, warned that its head and tail keep plain, before it had loaded them."""
    home = SwarmHome(tmp_path / "host")
    create_swarm(home, swarm_name="s", host_name="host", listen="127.0.0.1:0", advertise=["127.0.0.1:7470"],
                 model=str(bundled_model), planner=PlannerSettings(kernels="repack", attention="flash"))
    service = HostService(home)
    try:
        plan = service.plan
        assert (plan.version, plan.stages, plan.kernels, plan.attention) == (0, [], "repack", "flash")
    finally:
        service.close()
