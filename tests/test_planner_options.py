"""The planner's options are written once (plans/options.py) and `init`, `plan`, `config` and the
host all derive theirs from it (issue 31 item 4): the same flags, defaults, bounds and names."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from plans import options
from plans.options import OPTIONS, PlannerSettings
from swarmctl.cli import _parser_for
from swarmctl.commands.config import SETTINGS, parse_pairs
from swarmctl.errors import UsageError
from swarmctl.node.home import NodeConfig


def _flags(command: str) -> dict[str, argparse.Action]:
    parser, _ = _parser_for(command)
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings}


def test_init_and_plan_take_the_same_planner_flags_init_with_the_defaults_plan_inheriting():
    init, plan = _flags("init"), _flags("plan")
    for o in OPTIONS:
        flag = f"--{o.key}"
        assert init[flag].default == o.default and plan[flag].default is None, flag
        assert init[flag].choices == plan[flag].choices and init[flag].metavar == plan[flag].metavar
    parser, _ = _parser_for("init")
    assert PlannerSettings(**options.given(parser.parse_args([]))) == PlannerSettings()


def test_the_host_config_and_its_settings_agree_on_every_default_and_name():
    config = NodeConfig(**{f.name: "x" for f in dataclasses.fields(NodeConfig)
                           if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})
    assert PlannerSettings.from_config(config) == PlannerSettings()
    assert {k: s.field for k, s in SETTINGS.items()} == {o.key: o.config_field for o in OPTIONS if o.configurable}
    assert PlannerSettings(context=8192).constraints().context_tokens == 8192


@pytest.mark.parametrize("command, argv", [("init", ["--context", "0"]), ("plan", ["--max-stages", "-1"]),
                                           ("init", ["--objective", "fastest"])])
def test_a_value_out_of_bounds_is_refused_the_same_way_everywhere(command, argv):
    parser, _ = _parser_for(command)
    key, value = argv[0][2:], argv[1]
    with pytest.raises(UsageError, match=f"swarmctl {command}: argument --{key}: .*{value}"):
        parser.parse_args(argv)
    if options.BY_KEY[key].configurable:
        with pytest.raises(UsageError, match=f"{key} must be"):
            parse_pairs([key, value])
