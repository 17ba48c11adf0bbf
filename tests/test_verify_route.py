"""``--verify`` over a route of two stages, with real processes: the stage that lies is found
stage by stage and named alone (issue 30 item 6), the honest one is not; the host checks the named
member itself, and once askers of two invites have named it, it leaves the plan and the swarm
answers right again without it.

The liar is a real trunk process with SWARMCTL_TEST_CORRUPT (noise of 0.3 x each output row's
RMS on every step it sends on); its layer proofs to the host stay honest (they run on their own
engine), so the host's own check passes it and only the two invites' word takes it out.
"""

from __future__ import annotations

import os
import time

import pytest

from harness.swarm import Swarm, swarmctl

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


def test_the_lying_stage_is_named_alone_and_two_invites_take_it_out(swarm, oracle):
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
    liar = _member(swarm, "liar")
    assert liar["bad_results"] == 1 and liar["layers"] is not None  # one invite's word evicts nobody

    checked = swarmctl(swarm.homes["bob"], *ASK, "--verify", "1", PROMPT)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == want and "trunk liar returned a wrong result" in checked.stderr
    deadline = time.monotonic() + 60
    while not (_member(swarm, "liar")["layers"] is None and swarm.status().get("complete")):
        assert time.monotonic() < deadline, swarm.status()
        time.sleep(0.3)
    assert _member(swarm, "honest")["layers"] is not None
    plain = swarmctl(swarm.homes["alice"], *ASK, PROMPT)
    assert plain.returncode == 0 and plain.stdout == want, plain.stderr  # the swarm answers right without it
