"""The command synopses of README and docs/, and README's `status` sample, against the code (issue
29, item 17: `ask`'s synopsis lacked --trace, --device and --uplink-noise; the status sample lacked
DEVICE and the hop table). A synopsis is a plain ``` block whose first line is `swarmctl COMMAND
... [--flag]`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmctl.cli import COMMANDS, _parser_for

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # README and the pages it points to
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
CHOICES = re.compile(r"(--[\w-]+) ([\w.:]+(?:\|[\w.:]+)+)")


@dataclass
class Synopsis:
    command: str
    text: str
    line: int  # where it starts in its page, for the failure message
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def synopses(markdown: str, page: str = "README.md") -> list[Synopsis]:
    found, block, start, fenced = [], [], 0, None  # fenced: the open fence's language ("" for none)
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            if fenced is None:
                fenced, block, start = line[3:].strip(), [], number + 1
            else:
                if fenced == "" and block and block[0].startswith("swarmctl ") and "[-" in block[0]:
                    found.append(Synopsis(block[0].split()[1], "\n".join(block), start, page))
                fenced = None
        elif fenced is not None:
            block.append(line)
    return found


def visible_actions(command: str) -> list[argparse.Action]:
    parser, _ = _parser_for(command)
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


SYNOPSES = [s for page in PAGES for s in synopses(page.read_text(), str(page.relative_to(ROOT)))]


def test_the_commands_with_options_worth_a_synopsis_have_one():
    assert {"ask", "serve", "top", "plan"} <= {s.command for s in SYNOPSES}
    assert "ask" in {s.command for s in SYNOPSES if s.page == "README.md"}  # the main job's, on the first page


@pytest.mark.parametrize("synopsis", SYNOPSES, ids=lambda s: f"{s.command}@{s.where}")
def test_a_synopsis_names_every_option_of_its_command_and_no_other(synopsis):
    assert synopsis.command in COMMANDS, f"{synopsis.where}: no command '{synopsis.command}'"
    written = set(FLAG.findall(synopsis.text))
    actions = visible_actions(synopsis.command)
    missing = [a.option_strings[-1] for a in actions if not written & set(a.option_strings)]
    known = {flag for a in actions for flag in a.option_strings} | {"-h", "--help"}
    assert not missing, f"{synopsis.where}: swarmctl {synopsis.command}'s synopsis lacks {missing}"
    assert written <= known, f"{synopsis.where}: no such option of swarmctl {synopsis.command}: " \
                             f"{sorted(written - known)}"
    by_flag = {flag: a for a in actions for flag in a.option_strings}
    for flag, shown in CHOICES.findall(synopsis.text):  # `--transport swarm|inproc`: the parser's choices
        assert set(shown.split("|")) == set(by_flag[flag].choices or ()), \
            f"{synopsis.where}: {flag} {shown}, but the parser takes {by_flag[flag].choices}"


def test_the_synopsis_reader_finds_what_is_missing_and_what_is_unknown():
    """The check above, on a synopsis that has drifted as `ask`'s had."""
    drifted = synopses("```\nswarmctl ask \"PROMPT\" [--transport swarm|inproc] [--colour C]\n```\n")
    assert [s.command for s in drifted] == ["ask"]
    written = set(FLAG.findall(drifted[0].text))
    flags = {a.option_strings[-1] for a in visible_actions("ask")}
    assert {"--trace", "--device", "--uplink-noise"} <= flags - written and "--colour" in written - flags


def test_the_status_sample_has_the_columns_status_prints():
    from net.messages import LinkStatus, MemberStatus, RecoveryStatus, Status
    from swarmctl.commands.status import format_table

    status = Status(swarm="s", model="m", n_layer=30, head_layers=4, plan_version=1, complete=True,
                    missing_layers=[], members=[MemberStatus(name="a", role="trunk", address="", health="up")],
                    objective="latency", expected_ms_per_token=0.0, expected_tokens_per_s=0.0, bottleneck="",
                    warnings=[], recovery=RecoveryStatus(), links=[LinkStatus(source="asker", target="a")])
    printed = format_table(status).splitlines()
    headers = {line.split()[0]: line.split() for line in printed if line.split()[:1] in (["NAME"], ["HOP"])}
    sample = [line[2:].strip() for line in README.read_text().splitlines() if line.startswith("#  ")]
    shown = {line.split()[0]: line.split() for line in sample if line.split()[:1] in (["NAME"], ["HOP"])}
    assert shown == headers, f"README's status sample shows {shown}; status prints {headers}"
