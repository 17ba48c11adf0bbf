"""Bad input to the swarm commands: one line on stderr, a non-zero exit, no traceback, no state."""

from __future__ import annotations

import pytest

from harness.swarm import swarmctl


@pytest.fixture(scope="module")
def host_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("errors") / "host"
    swarmctl(home, "init", "--listen", "127.0.0.1:1", check=True)
    return home


CASES = {
    "join with a garbage code": (["join", "hello-world"], "not a swarmctl invite code", False),
    "join with a damaged payload": (["join", "swarm1.!!!!.00000000"], "invite code is damaged", False),
    "invite without a swarm": (["invite"], "no swarm state", False),
    "status without a swarm": (["status"], "no swarm state", False),
    "run without a swarm": (["run", "--role", "trunk"], "no swarm state", False),
    "invite with a bad ttl": (["invite", "--ttl", "soon"], "invalid duration", True),
    "revoke an unknown member": (["revoke", "nobody"], "no member named 'nobody'", True),
    "init twice": (["init"], "already holds a swarm node", True),
    "bad listen address": (["init", "--listen", "localhost:notaport"], "invalid address", False),
    "bad member name": (["init", "--name", "Bad Name!"], "invalid member name", False),
    "trunk with a bad memory size": (["run", "--role", "trunk", "--memory", "lots"], "invalid size", True),
    "host with an upload cap of 0": (["run", "--role", "host", "--upload-mbit", "0"], "must be above 0", True),
    "host with a bad upload rate": (["run", "--role", "host", "--upload-mbit", "fast"], "invalid rate 'fast'", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_swarm_input(tmp_path, host_home, case):
    args, expected, on_host = CASES[case]
    home = host_home if on_host else tmp_path / "empty"
    r = swarmctl(home, *args, timeout=30)
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert expected in lines[0], lines[0]
    if not on_host:
        assert not (home / "node.json").exists()
