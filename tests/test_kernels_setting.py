"""`kernels` as a planner option: its flag and `config` setting, carried in the plan (no process)."""

from __future__ import annotations

import pytest

from plans.options import BY_KEY, PlannerSettings
from plans.plan import Plan
from swarmctl.commands import config as config_command
from swarmctl.errors import UsageError


def test_kernels_is_a_setting_with_plain_the_default():
    option = BY_KEY["kernels"]
    assert option.default == "plain" and option.choices == ("plain", "repack", "amx") and option.configurable
    assert PlannerSettings().kernels == "plain"
    assert PlannerSettings(kernels="repack").constraints().kernels == "repack"
    assert config_command.parse_pairs(["kernels", "repack"]) == {"kernels": "repack"}


def test_a_kernels_value_config_does_not_know_is_one_line():
    with pytest.raises(UsageError, match=r"^swarmctl config: kernels must be one of plain, repack, amx, not 'fast'$"):
        config_command.parse_pairs(["kernels", "fast"])
    with pytest.raises(UsageError, match="swarmctl config kernels repack"):
        config_command.parse_pairs(["kernels"])


def test_the_plan_carries_the_kernels_and_they_name_the_assignment():
    plan = Plan(version=3, model_name="m", n_layer=8, head_layers=2, kernels="repack")
    again = Plan.from_dict(plan.to_dict())
    assert again.kernels == "repack" and again.assignments() == plan.assignments()
    plain = Plan.from_dict({**plan.to_dict(), "kernels": "plain"})
    assert plain.assignments() != plan.assignments()  # a kernels change alone is a new plan to load
    # a plan from a host that names kernels this version lacks (or none: an older host): plain
    assert Plan.from_dict({**plan.to_dict(), "kernels": "tiles"}).kernels == "plain"
    older = plan.to_dict()
    del older["kernels"]
    assert Plan.from_dict(older).kernels == "plain"
