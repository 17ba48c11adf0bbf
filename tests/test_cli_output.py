"""What the CLI prints, as people see it (issue 29, items 11 and 13): output into a pipe whose
reader has gone (`swarmctl --help | head`), and the status table's words and units."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swarmctl.cli import COMMANDS

EXAMPLE_NODES = "plans/examples/four-friends.json"


def swarmctl_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with its stdout on a pipe nobody reads: the read end is closed before the
    process starts, so every write meets EPIPE, as the last write does behind `| head` (which,
    with `head`, depends on timing; this does not)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "swarmctl", *args], stdout=write_end, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["--help"], ["--version"], *([name, "--help"] for name in COMMANDS),
                                  ["plan", "--layout", "llama-3-70b-q4_k_m", "--nodes", EXAMPLE_NODES],
                                  ["ask", "--transport", "inproc", "--raw", "--max-tokens", "8", "Once upon a time"]],
                         ids=lambda args: " ".join(args[:2]))
def test_a_reader_that_went_away_ends_the_command_quietly(args):
    r = swarmctl_into_closed_pipe(*args)
    assert r.stderr == "", r.stderr  # before: "BrokenPipeError" tracebacks, or "Exception ignored in ..."
    assert r.returncode == 0


def test_a_broken_pipe_that_is_not_the_output_is_still_an_error(monkeypatch, capsys):
    """A socket of the command's own that breaks (not its reader) is reported, not swallowed."""
    from swarmctl import cli
    from swarmctl.commands import devices

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(devices, "run", broken)
    assert cli.main(["devices"]) == cli.EXIT_ERROR
    assert "swarmctl: error: [Errno 32] Broken pipe" in capsys.readouterr().err


# --- the status table's words and units (item 11) ---

def _status(members, links=()):
    from net.messages import RecoveryStatus, Status

    return Status(swarm="s", model="m.gguf", n_layer=30, head_layers=4, plan_version=2, complete=True,
                  missing_layers=[], members=list(members), objective="latency", expected_ms_per_token=0.0,
                  expected_tokens_per_s=0.0, bottleneck="", warnings=[], recovery=RecoveryStatus(),
                  links=list(links))


def _rows(table: str) -> dict[str, str]:
    lines = table.splitlines()[2:]
    return {line.split()[0]: line for line in lines[:lines.index("")] if line} if "" in lines else \
        {line.split()[0]: line for line in lines}


def test_an_asker_is_an_asker_with_when_it_was_last_seen():
    from net.messages import MemberStatus
    from swarmctl.commands.status import format_table

    members = [MemberStatus(name="carol", role="member", may="asker", address="", health="down", last_seen_s=130.0),
               MemberStatus(name="dave", role="member", may="asker", address="", health="up"),
               MemberStatus(name="erin", role="member", may="asker", address="", health="down"),
               MemberStatus(name="bob", role="member", may="trunk", address="", health="down", last_seen_s=7300.0),
               MemberStatus(name="revoked", role="member", may="asker", address="", health="revoked",
                            last_seen_s=5.0)]
    rows = _rows(format_table(_status(members)))
    assert rows["carol"].endswith("asker, seen 2m ago"), rows  # before: "down", as if it should be serving
    assert rows["dave"].endswith("asker, connected")
    assert rows["erin"].endswith("asker, not seen since the host started")
    assert rows["bob"].endswith("down, seen 2h ago")
    assert rows["revoked"].endswith("revoked")


@pytest.mark.parametrize("seconds, text", [(0.4, "just now"), (40, "40s ago"), (130, "2m ago"), (3599, "59m ago"),
                                           (7300, "2h ago"), (3 * 86400 + 5, "3d ago")])
def test_ago(seconds, text):
    from swarmctl.commands.status import ago

    assert ago(seconds) == text


def test_with_article():
    from swarmctl.commands.status import with_article

    assert [with_article(w) for w in ("asker", "trunk", "host", "expert node")] == \
        ["an asker", "a trunk", "a host", "an expert node"]


@pytest.mark.parametrize("n, text", [(12e9, "12.0 GB"), (4e9, "4.00 GB"), (578e9, "578 GB"), (1.5e12, "1.50 TB"),
                                     (340e6, "340 MB"), (35.4e6, "35.4 MB"), (5200, "5.20 KB"), (512, "512 B"),
                                     (0, "0 B"), (999.7e6, "1.00 GB"), (-2e6, "-2.00 MB")])
def test_sizes_in_units_that_fit_the_number(n, text):
    from plans.units import size

    assert size(n) == text


@pytest.mark.parametrize("mb_s, text", [(2.56404, "2.56 MB/s"), (80, "80.0 MB/s"), (25.649, "25.6 MB/s"),
                                        (512, "512 MB/s"), (1280, "1.28 GB/s"), (0.4, "400 KB/s"),
                                        (0.0001, "100 B/s")])
def test_rates_to_three_significant_figures(mb_s, text):
    from plans.units import rate

    assert rate(mb_s) == text


def test_the_status_table_prints_memory_and_throughput_in_units_that_fit():
    from net.messages import LinkStatus, MemberStatus
    from swarmctl.commands.status import format_table

    members = [MemberStatus(name="alice", role="trunk", may="trunk", address="198.51.100.7:7471", layers=[4, 15],
                            memory=300_000_000, health="ready")]
    links = [LinkStatus(source="asker", target="alice", rtt_ms=4.0, bandwidth_mb_s=2.56404, measured=True,
                        bandwidth_measured=True, basis="measured"),
             LinkStatus(source="alice", target="asker", rtt_ms=4.0, bandwidth_mb_s=0.4, basis="bound")]
    table = format_table(_status(members, links))
    assert " 300 MB " in _rows(table)["alice"], table  # before: 0.3 GB
    assert " 2.56 MB/s " in table and " 400 KB/s " in table, table  # before: "3 MB/s" and "0 MB/s"


def test_the_planners_shortfall_and_link_warnings_use_the_same_units():
    from plans.layout import ModelLayout
    from plans.links import LinkModel
    from plans.nodes import Link, NodeDescriptor
    from plans.planner import Constraints, PlanError, plan_layers

    from swarmctl.model_files.models import default_model_path

    layout = ModelLayout.from_gguf(default_model_path())  # SmolLM2-135M: a few MB per layer
    short = layout.range_bytes(4, layout.n_layer - 4) + 300_000_000  # its weights and the reserve, no room for KV
    with pytest.raises(PlanError, match=r"need \d+ MB .* offer \d+\.\d MB after a 300 MB reserve each: \d+ MB missing$"):
        plan_layers(layout, [NodeDescriptor("a", short, 1.0, "cpu", "10.0.0.1:7471", {})], Constraints())  # was 0.0 GB
    nodes = [NodeDescriptor("a", 10**9, 1.0, "cpu", "", {"c": Link(10.0, 2.56404)}),
             NodeDescriptor("b", 10**9, 1.0, "cpu", "", {"c": Link(5.0, 50.0)}),
             NodeDescriptor("c", 10**9, 1.0, "cpu", "", {})]
    described = LinkModel(nodes).link("a", "b").describe("a", "b")  # bounded through c, at a → c's rate
    assert "2.56 MB/s" in described and "2.56404" not in described, described
