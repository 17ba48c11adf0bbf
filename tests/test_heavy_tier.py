"""The heavy tier (tests/markers.py): a run of the whole folder leaves it out, `-m` or naming a
file or a test brings it back. Checked on the hook's own inputs, without a second pytest run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import markers

TESTS = str(Path(__file__).parent)


@dataclass
class _Item:
    name: str
    marks: tuple[str, ...] = ()

    def iter_markers(self, name: str):
        return iter([getattr(pytest.mark, m) for m in self.marks if m == name])


@dataclass
class _Hook:
    deselected: list = field(default_factory=list)

    def pytest_deselected(self, items) -> None:
        self.deselected += items


@dataclass
class _Config:
    args: list[str]
    markexpr: str = ""
    hook: _Hook = field(default_factory=_Hook)

    def getoption(self, name: str):
        assert name == "markexpr"
        return self.markexpr


def _run(args: list[str], markexpr: str = "") -> tuple[list[str], list[str]]:
    items = [_Item("fast"), _Item("swarm", ("swarm", "slow")), _Item("soak", ("heavy", "swarm", "slow"))]
    config = _Config(args, markexpr)
    markers.leave_out_heavy(config, items)
    return [i.name for i in items], [i.name for i in config.hook.deselected]


def test_a_run_of_the_folder_leaves_the_heavy_tier_out_and_says_so():
    assert _run([TESTS]) == (["fast", "swarm"], ["soak"])


def test_marks_or_a_named_file_or_test_run_what_they_ask_for():
    assert _run([TESTS], markexpr="heavy") == (["fast", "swarm", "soak"], [])  # -m then selects
    assert _run([f"{TESTS}/test_soak.py"]) == (["fast", "swarm", "soak"], [])
    assert _run([f"{TESTS}::test_x"]) == (["fast", "swarm", "soak"], [])


def test_the_heavy_tier_is_a_registered_mark_and_the_soak_is_in_it():
    import tests.test_soak as soak

    assert soak.pytestmark.name == "heavy"
    text = (Path(TESTS).parent / "pyproject.toml").read_text()
    assert '"heavy: ' in text
