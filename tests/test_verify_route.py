"""``--verify`` over a route of two stages, with real processes: the stage that lies is found
stage by stage and named alone (issue 30 item 6), the honest one is not; on that report the host
checks the named member itself, on its serving path (swarmctl/host/recheck.py), and the liar
fails the check, leaves the plan, and the swarm answers right again without it.

The liar is a real trunk process with SWARMCTL_TEST_CORRUPT (noise of 0.3 x each output row's
RMS on every step it sends on); its layer proofs to the host stay honest (they run on their own
engine), but the host's re-check of its results goes the way askers' steps go.

Issue 43 item 4: askers of two invites that name the honest stage, with or without having sent
it steps, leave it in the plan: their word alone is not counted, and with the stage's record of
their re-check steps it only makes the host check it, which it passes.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from harness.swarm import Swarm, swarmctl
from net.endpoint import Address, ask_member
from swarmctl.node.home import SwarmHome

ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "12")
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A host; "honest" and "liar" serving a stage each; alice and bob, askers of two invites."""
    s = Swarm(tmp_path_factory.mktemp("verify-route"))
    try:
        s.init()
        s.start_host()
        s.wait_host()
        for name in ("honest", "liar"):
            s.join(name)
        for name in ("alice", "bob"):
            s.join(name, role="asker")
        s.start_trunk("honest", capture=False)
        os.environ["SWARMCTL_TEST_CORRUPT"] = "0.3"  # read by the liar's process when it starts
        try:
            s.start_trunk("liar", capture=False)
        finally:
            del os.environ["SWARMCTL_TEST_CORRUPT"]
        s.wait_complete(2)
        yield s
    finally:
        s.close()


def _member(swarm: Swarm, name: str) -> dict:
    return next(m for m in swarm.status()["members"] if m["name"] == name)


def _accuse(swarm: Swarm, accuser: str, name: str, version: int) -> dict:
    """What the issue's attacker sends: ``bad_result`` naming ``name`` stage by stage."""
    creds = SwarmHome(swarm.homes[accuser]).credentials()
    return asyncio.run(ask_member(Address("127.0.0.1", swarm.host_port), creds, "host",
                                  {"type": "bad_result", "members": [name], "attributed": True,
                                   "plan_version": version}))


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_two_invites_framing_an_honest_stage_leave_it_in_the_plan(swarm):
    """Askers of two invites, alice and bob, name the honest stage without ever having sent it a
    step (before: it left the plan at bob's first report, for good while connected)."""
    version = swarm.plan(via="alice")["version"]
    out_of_plan = []  # honest members out of the plan, after each report
    for accuser in ("alice", "bob", "alice", "bob"):
        assert _accuse(swarm, accuser, "honest", version) == {"type": "ok", "counted": []}
        out_of_plan.append(int(_member(swarm, "honest")["layers"] is None))
    assert out_of_plan == [0, 0, 0, 0]
    assert swarm.plan(via="alice")["version"] == version
    honest = _member(swarm, "honest")
    assert honest["bad_results"] == 0 and honest["health"] == "ready", honest


def test_the_lying_stage_is_named_alone_and_the_hosts_own_check_takes_it_out(swarm, oracle):
    want = oracle.create_completion(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"] + "\n"
    unchecked = swarmctl(swarm.homes["alice"], *ASK, PROMPT)
    assert unchecked.returncode == 0, unchecked.stderr
    assert unchecked.stdout != want  # the lie reaches the user unchecked

    checked = swarmctl(swarm.homes["alice"], *ASK, "--verify", "1", PROMPT)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == want  # finished on alice's machine: llama-cpp-python's tokens
    assert "trunk liar returned a wrong result" in checked.stderr, checked.stderr
    assert "found by re-checking the route stage by stage" in checked.stderr
    assert "honest" not in checked.stderr
    assert _member(swarm, "honest")["bad_results"] == 0
    # alice's report had the liar's record of her re-check steps behind it: the host checked the
    # liar itself, the liar's rows came back wrong, and that (not her word) takes it out
    _wait_for(lambda: _member(swarm, "liar")["layers"] is None and swarm.status().get("complete"), "liar out")
    assert "returned wrong results to the host's own re-check" in _member(swarm, "liar")["health"]
    assert _member(swarm, "honest")["layers"] is not None
    plain = swarmctl(swarm.homes["alice"], *ASK, PROMPT)
    assert plain.returncode == 0 and plain.stdout == want, plain.stderr  # the swarm answers right without it

    # alice's re-check did send the honest stage steps: her report on it now counts, so the host
    # checks it too, and it passes and stays; bob sent it none: his is not counted
    record = swarm.stats_of("honest", via="alice")["one_stage"]
    assert record["alice"][0] > 0 and "bob" not in record, record
    version = swarm.plan(via="alice")["version"]
    assert _accuse(swarm, "alice", "honest", record["alice"][1]) == {"type": "ok", "counted": ["honest"]}
    assert _accuse(swarm, "bob", "honest", version) == {"type": "ok", "counted": []}
    host_log = swarm.nodes[0].log
    _wait_for(lambda: "trunk honest passed the host's re-check" in host_log(), "the host's check of honest")
    honest = _member(swarm, "honest")
    assert honest["layers"] is not None and honest["health"] == "ready" and honest["bad_results"] == 1
    assert swarm.plan(via="alice")["version"] == version
