"""`swarmctl plan` inside a running swarm (issue 29, item 16): with no options it plans under the
swarm's own settings, shows the plan that runs and what a re-plan would change; and the host's
status shows an asker that came and went as an asker, with when it was last seen (item 11)."""

from __future__ import annotations

import re
import time

import pytest

from harness.swarm import Swarm, swarmctl


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, tiny_model):
    model = str(tiny_model("llama-f32"))  # 4 layers: the default of 4 head layers cannot fit it
    s = Swarm(tmp_path_factory.mktemp("plan"))
    try:
        s.init("--model", model, "--head-layers", "1", "--objective", "latency", "--context", "512")
        s.start_host()
        s.wait_host()
        s.join("trunk-a", "--model", model)
        s.join("carol", "--model", model, role="asker")
        s.start_trunk("trunk-a", "--threads", "1", "--memory", "1G", capture=False)
        s.wait_complete(1)
        yield s
    finally:
        s.close()


def test_plan_in_a_swarm_takes_its_settings_and_shows_the_running_plan(swarm):
    r = swarmctl(swarm.homes["carol"], "plan")  # before: "head layers 4 do not fit a model of 4 layers"
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("running plan v") and "the asker keeps [0, 1) and [3, 4); objective latency" in lines[0]
    assert lines[2].split()[:3] == ["1", "trunk-a", "[1,"], r.stdout
    assert ("a re-plan now, with the members' current figures (objective latency, head layers 1, KV for 512 tokens "
            "× 4 requests, max stages no limit, expert nodes 0 (the running plan's settings)):") in lines, r.stdout
    assert lines[-1] == "a re-plan would change: nothing", r.stdout


def test_plan_on_the_host_uses_its_settings_and_options_override_them(swarm):
    r = swarmctl(swarm.host_home, "plan", "--head-layers", "2")
    assert r.returncode == 0, r.stderr
    assert "expert nodes 0 (the swarm's settings and options)):" in r.stdout, r.stdout
    assert "none: the asker runs every layer" in r.stdout  # 2 at each end of 4
    assert r.stdout.splitlines()[-1] == "a re-plan would change: head layers 1 → 2; trunk-a [1, 3) → standby", r.stdout


def test_an_asker_that_came_and_went_is_an_asker_last_seen(swarm):
    swarmctl(swarm.homes["carol"], "status", check=True)  # carol connects, and goes
    deadline = time.monotonic() + 30
    while True:
        out = swarmctl(swarm.host_home, "status", check=True).stdout
        row = next(line for line in out.splitlines() if line.startswith("carol "))
        if "asker, seen " in row or time.monotonic() > deadline:
            break
        time.sleep(0.3)  # (its connection's close may reach the host a moment later)
    assert row.split()[1] == "asker" and re.search(r"  asker, seen (just now|\d+[smhd] ago)$", row), out  # was "down"


def test_a_trunk_reports_what_a_datagram_costs_it_and_plan_charges_the_hops(swarm):
    """The trunk measured its datagram cost at start (net/packet_cost.py) and registered it; the host
    plans with it, and `plan` shows the hops' packet CPU on its own line."""
    import asyncio

    from net import messages as m
    from swarmctl.commands.status import ask_host
    from swarmctl.node.home import SwarmHome

    nodes = asyncio.run(ask_host(SwarmHome(swarm.homes["carol"]), m.GetNodes(), m.Nodes)).nodes
    (trunk,) = [n for n in nodes if n.name == "trunk-a"]
    assert trunk.datagram_us is not None and 1 < trunk.datagram_us < 10_000, trunk
    out = swarmctl(swarm.homes["carol"], "plan", check=True).stdout
    row = next(line for line in out.splitlines() if line.strip().startswith("packets (CPU per datagram"))
    assert row.split()[6] == "2", out  # count: asker → trunk-a → asker


def test_a_trunk_reports_a_prompt_rows_cost_and_plan_predicts_the_first_token(swarm):
    """The trunk measured a prompt row's cost at start (kernels/speed.py measure_prompt_rate) on its
    real layer and registered it; `plan` in the swarm predicts a first-token time with it
    (plans/prefill.py), the asker charged as trunk-a."""
    import asyncio
    import json

    from net import messages as m
    from swarmctl.commands.status import ask_host
    from swarmctl.node.home import SwarmHome

    nodes = asyncio.run(ask_host(SwarmHome(swarm.homes["carol"]), m.GetNodes(), m.Nodes)).nodes
    (trunk,) = [n for n in nodes if n.name == "trunk-a"]
    assert trunk.prompt_ms_per_layer_row is not None and 0 < trunk.prompt_ms_per_layer_row, trunk
    out = swarmctl(swarm.homes["carol"], "plan", "--asker", "trunk-a", "--prompt-tokens", "700", "--json",
                   check=True).stdout
    found = json.loads(out)["first_token"]
    assert found["chunks"] == 2 and found["ms"] > json.loads(out)["whole_ms_per_token"], found


def test_plan_on_a_member_that_serves_prices_the_asker_as_itself(swarm):
    """On a trunk member (one that may also ask) `plan` charges the asker's part at the member's
    own figures, so the first-token time is predicted without --asker; on an asker-only member it
    says what is missing."""
    out = swarmctl(swarm.homes["trunk-a"], "plan", check=True).stdout
    said = next(line for line in out.splitlines() if line.startswith("first token"))
    assert said.startswith("first token for a 1000-token prompt: ") and "not predicted" not in said, out
    assert "as trunk-a measured" in out, out
    said = next(line for line in swarmctl(swarm.homes["carol"], "plan", check=True).stdout.splitlines()
                if line.startswith("first token"))
    assert "not predicted (asker measured no prompt rate" in said, said
