"""A real swarm on loopback (host + 2 trunks, asker-only members): a member revoked while its asks
are running gets the revocation as its answer at once. Every stage refuses it from then on, and a
refusal no route can get past is no reason to reroute: before, its asks rerouted every few seconds
until their 300 s deadline, logging the very reason each time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness.swarm import Swarm, die_with_this_process, swarmctl

PROMPT = "The three primary colours are"
# Long enough that the ask is still decoding when the revocation lands (it is ended by it, never
# finished), short of the request deadline so that a loop would show as that deadline's message.
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "2000")


# The heavy tier (tests/markers.py): the simulator's seeds 9, 25, 314, 10, 458, 99, 178 and 157
# revoke an asker while its asks run, reroute or wait, and check that they end with the revocation.
pytestmark = pytest.mark.heavy

@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with Swarm.two_trunks(tmp_path_factory.mktemp("revoke"), askers=("mallory", "alice")) as s:
        yield s


def _holding(swarm: Swarm, member: str) -> list[str]:
    """The stages where ``member`` holds KV for a request now (by its budget account)."""
    held = []
    for stage in swarm.plan(via="alice")["stages"]:
        stats = swarm.stats_of(stage["member"], via="alice")
        if stats["budget"]["members"].get(member, {}).get("requests"):
            held.append(stage["member"])
    return held


def test_revocation_ends_running_asks_with_its_reason(swarm):
    env = {**os.environ, "SWARMCTL_HOME": str(swarm.homes["mallory"])}
    ask = subprocess.Popen([sys.executable, "-m", "swarmctl", *ASK, PROMPT], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, preexec_fn=die_with_this_process())
    try:
        # Revoke while the ask is decoding: both stages hold its request.
        while len(_holding(swarm, "mallory")) < 2:
            assert ask.poll() is None, ask.communicate()
            time.sleep(0.3)
        r = swarmctl(swarm.host_home, "revoke", "mallory")
        assert r.returncode == 0 and "revoked mallory" in r.stdout, r.stderr
        _, err = ask.communicate(timeout=600)
    finally:
        if ask.poll() is None:
            ask.kill()
            ask.wait()
    lines = err.strip().splitlines()
    assert ask.returncode != 0, err
    # The revocation itself, once, on one line: not a deadline reached after rerouting.
    assert len(lines) == 1 and "membership revoked: member 'mallory' was revoked by the host" in lines[0], err
    assert "did not answer" not in err and "rerout" not in err, err
    # Nothing of it is held anywhere afterwards (its connections were closed at every stage).
    assert _holding(swarm, "mallory") == []
    # The rest of the swarm serves on.
    r = swarmctl(swarm.homes["alice"], "ask", "--raw", "--temperature", "0", "--max-tokens", "4", PROMPT)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
