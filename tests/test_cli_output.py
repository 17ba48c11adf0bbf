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
                                  ["plan", "--layout", "llama-3-70b-q4_k_m", "--nodes", EXAMPLE_NODES]],
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
