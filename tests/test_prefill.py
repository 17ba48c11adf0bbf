"""First-token time in the plan (issue 33 item 4): a prompt's chunks streamed through the plan's
stations (plans/prefill.py), `swarmctl plan --prompt-tokens`, and the bad input around it. The
model's figures against measured runs are in benchmarks/bench_plan_vs_measured.py (README table);
here, the pipeline arithmetic and the plumbing, without I/O but for the CLI runs."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from plans.layout import layout_by_name
from plans.nodes import load_nodes
from plans.planner import Constraints, plan_layers
from plans.prefill import PREFILL_CHUNK, Station, chunk_rows, first_token, flow_ms
from plans.proposal import ASSUMED_ASKER


def test_chunks_are_the_askers():
    from swarmctl.asker.head_tail import PREFILL_CHUNK as ASKER_CHUNK

    assert PREFILL_CHUNK == ASKER_CHUNK
    assert chunk_rows(1) == [1] and chunk_rows(512) == [512] and chunk_rows(1000) == [512, 488]


def test_chunks_stream_through_stations_as_a_flow_shop():
    # head 10 ms a chunk; a link that holds 2 ms and flies 5 more; a stage 10 ms (worked by hand)
    trip = [Station("head", 10, 0), Station("link", 2, 0, delay_ms=5), Station("stage", 10, 0)]
    assert flow_ms(trip, [1]) == 27
    # chunk 2 leaves the head at 20, the link at 22, reaches the stage at 27 when it is free: 37; chunk 3: 47
    assert flow_ms(trip, [1, 1, 1]) == 47
    assert flow_ms(trip, [1, 1, 1], streamed=False) == 81  # each chunk waits for the one before to come back
    # a slow stage sets the pace: chunks queue for it
    slow = [Station("head", 1, 0), Station("stage", 30, 0)]
    assert flow_ms(slow, [1, 1, 1, 1]) == 1 + 4 * 30
    # rows beyond the first at the station's row figure
    assert flow_ms([Station("stage", 4, 0.5)], [9]) == 8


def four_friends(prompt_ms: float | None = 0.05):
    nodes = load_nodes("plans/examples/four-friends.json")
    return [replace(n, prompt_ms_per_layer_row=prompt_ms) for n in nodes]


def test_a_plan_says_its_first_token_time_and_what_it_could_not_price():
    layout = layout_by_name("llama-3-70b-q4_k_m")
    nodes = four_friends()
    proposal = plan_layers(layout, nodes, Constraints(head_layers=4))
    asker = replace(ASSUMED_ASKER, prompt_ms_per_layer_row=0.05)
    short = first_token(proposal, layout, nodes, asker, 4, 100)
    long = first_token(proposal, layout, nodes, asker, 4, 2000)
    assert short.chunks == 1 and long.chunks == 4 and 0 < short.ms < long.ms
    alone = first_token(proposal, layout, nodes, asker, 4, 2000, streamed=False)
    assert long.ms < alone.ms  # streaming overlaps the chunks
    # a whole token's trip is the least a one-row prompt can take
    assert first_token(proposal, layout, nodes, asker, 4, 1).ms == pytest.approx(proposal.whole_ms_per_token, rel=1e-6)

    unmeasured = [replace(nodes[0], prompt_ms_per_layer_row=None), *nodes[1:]]
    missing = first_token(proposal, layout, unmeasured, ASSUMED_ASKER, 4, 100)
    assert missing.unmeasured[0] == "asker" and nodes[0].name in missing.unmeasured or \
        nodes[0].name not in [s.member for s in proposal.stages]
    assert "not predicted" in missing.describe()


def test_lighter_crossings_shorten_a_long_prompt_over_a_slow_uplink():
    """Issue 33's lever on paper: a 1,000-token prompt's bytes dominate a 20 Mbit/s hop; f16 halves them."""
    layout = layout_by_name("llama-3-70b-q4_k_m")
    nodes = four_friends(prompt_ms=0.01)
    nodes = [replace(n, links={k: replace(v, bandwidth_mb_s=2.5) for k, v in n.links.items()}) for n in nodes]
    asker = replace(ASSUMED_ASKER, prompt_ms_per_layer_row=0.01)
    times = {}
    for dtype in ("f32", "f16"):
        proposal = plan_layers(layout, nodes, Constraints(head_layers=4, wire_dtype=dtype))
        times[dtype] = first_token(proposal, layout, nodes, asker, 4, 1000).ms
    assert times["f32"] / times["f16"] > 1.8, times


def plan_cli(*args: str, nodes: str = "plans/examples/four-friends.json"):
    return subprocess.run([sys.executable, "-m", "swarmctl", "plan", "--layout", "llama-3-70b-q4_k_m",
                           "--nodes", nodes, *args], capture_output=True, text=True, timeout=120)


def test_plan_prints_the_first_token_time_from_a_nodes_file(tmp_path):
    raw = json.loads(open("plans/examples/four-friends.json").read())
    for n in raw:
        n["prompt_ms_per_layer_row"] = n["ms_per_layer_token"] / 20
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(raw))
    r = plan_cli("--prompt-tokens", "1500", "--asker", "gpu-box", "--json", nodes=str(path))
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)["first_token"]
    assert found["prompt_tokens"] == 1500 and found["chunks"] == 3 and found["ms"] > 0 and found["unmeasured"] == []
    assert found["said"].startswith("first token for a 1500-token prompt: ")
    # the asker is not a member here: it is charged as the one a member is with --asker
    r = plan_cli(nodes=str(path))
    assert r.returncode == 0 and "first token for a 1000-token prompt: " in r.stdout, r.stdout
    said = next(line for line in r.stdout.splitlines() if line.startswith("first token"))
    assert "not predicted (asker measured no prompt rate" in said, said
    r = plan_cli("--asker", "gpu-box", nodes=str(path))
    said = next(line for line in r.stdout.splitlines() if line.startswith("first token"))
    assert "3 chunks" not in said and " s (2 chunks of up to 512 rows, streamed through the plan)" in said, said


@pytest.mark.parametrize("args, nodes_patch, said", [
    (("--prompt-tokens", "0"), None, "--prompt-tokens: must be a whole number of tokens from 1, not '0'"),
    (("--prompt-tokens", "lots"), None, "--prompt-tokens: must be a whole number of tokens from 1, not 'lots'"),
    ((), {"prompt_ms_per_layer_row": -1}, "prompt_ms_per_layer_row must be more than 0"),
])
def test_bad_first_token_input_is_one_line(tmp_path, args, nodes_patch, said):
    path = "plans/examples/four-friends.json"
    if nodes_patch:
        raw = json.loads(open(path).read())
        raw[0].update(nodes_patch)
        path = str(tmp_path / "nodes.json")
        open(path, "w").write(json.dumps(raw))
    r = plan_cli(*args, nodes=path)
    assert r.returncode != 0 and said in r.stderr + r.stdout and "Traceback" not in r.stderr, r.stderr
    assert len((r.stderr + r.stdout).strip().splitlines()) == 1, r.stderr + r.stdout
