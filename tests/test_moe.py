"""Expert parallelism: a stage runs attention and the routers, expert nodes run the experts.

In one process first (bit-identical to the stage running its own experts, for both MoE
architectures, prefill, decode and batches), then the plan's refusal of a placement that leaves
experts unplaced, then one real swarm: host, two stage trunks, two expert nodes and an asker, all
separate processes on loopback, answering exactly as the in-process pipeline does.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import InputShapeError
from kernels.experts import ExpertEngine, LocalExperts
from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine, Step
from kernels.spec import SliceSpec
from net.wire import ExpertCall, ExpertCallKind, WireError, decode_expert_call, encode_expert_call
from plans.layout import ModelLayout
from plans.nodes import NodeDescriptor
from plans.plan import ExpertAssignment, Plan, PlanError
from plans.planner import Constraints, place_experts
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all
from swarmctl.node.home import SwarmHome
from swarmctl.asker.link import SwarmLink
from tests.conftest import N_THREADS
from harness.swarm import Swarm, swarmctl

TRUNK = SliceSpec(1, 3)  # the tiny models have 4 layers: the asker keeps 0 and 3
PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("name", ["llama-moe-q8_0", "qwen3moe-q8_0", "deepseek2-f32", "deepseek2-q4_1"])
def test_remote_experts_give_the_same_bits_as_local_ones(tiny_model, name):
    with GGUFFile(tiny_model(name)) as gguf:
        n_expert = int(gguf.metadata[f"{gguf.metadata['general.architecture']}.expert_count"])
        holders = [ExpertEngine(gguf, TRUNK.layers, a, b, n_threads=N_THREADS) for a, b in ((0, 3), (3, n_expert))]
        local = SliceEngine(gguf, TRUNK, n_threads=N_THREADS)
        split = SliceEngine(gguf, TRUNK, n_threads=N_THREADS, remote_experts=LocalExperts(holders))
        try:
            # The stage maps no expert weights; the expert nodes map exactly the experts' bytes.
            # (deepseek2-f32's layer 1 is dense: it has no experts; its shared experts stay with the stage)
            expert_bytes = sum(gguf.tensors[name].n_bytes for il in TRUNK.layers
                               for stem in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
                               if (name := f"blk.{il}.{stem}.weight") in gguf.tensors)
            assert split.weights.n_bytes == local.weights.n_bytes - expert_bytes
            assert sum(h.n_bytes for h in holders) == expert_bytes

            rng = np.random.default_rng(1)
            prompts = {b"a" * 16: 7, b"b" * 16: 3, b"c" * 16: 5}
            hidden = {rid: rng.standard_normal((n, 64)).astype(np.float32) for rid, n in prompts.items()}
            for rid, x in hidden.items():  # prefill, one request at a time
                np.testing.assert_array_equal(split.forward(rid, start_pos=0, hidden=x),
                                              local.forward(rid, start_pos=0, hidden=x))
            for _ in range(3):  # decode, all three batched together
                steps = [Step(rid, local.position_of(rid), hidden=rng.standard_normal((1, 64)).astype(np.float32))
                         for rid in prompts]
                for a, b in zip(split.forward_batch(steps), local.forward_batch(steps)):
                    np.testing.assert_array_equal(a, b)
            assert all(h.rows_served > 0 for h in holders)  # the router sent work to both holders
        finally:
            for engine in (local, split, *holders):
                engine.close()


def test_an_expert_node_refuses_rows_it_cannot_serve(tiny_model):
    with GGUFFile(tiny_model("llama-moe-q8_0")) as gguf, ExpertEngine(gguf, TRUNK.layers, 2, 5) as experts:
        x = np.ones((2, 64), dtype=np.float32)
        with pytest.raises(InputShapeError, match="outside"):
            experts.forward(1, x, np.array([2, 5]))  # expert 5 is held elsewhere
        with pytest.raises(InputShapeError, match="layer 3"):
            experts.forward(3, x, np.array([2, 3]))  # layer 3 is the asker's
        with pytest.raises(InputShapeError, match="do not fit"):
            experts.forward(1, np.ones((2, 63), dtype=np.float32), np.array([2, 3]))
        assert experts.forward(1, x, np.array([2, 4])).shape == (2, 64)


def test_expert_calls_round_trip_and_reject_malformed_bytes():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    call = decode_expert_call(encode_expert_call(ExpertCall(ExpertCallKind.REQUEST, 7, x, np.array([1, 0, 5])))[5:])
    assert (call.kind, call.layer) == (ExpertCallKind.REQUEST, 7)
    np.testing.assert_array_equal(call.data, x)
    np.testing.assert_array_equal(call.expert_ids, [1, 0, 5])
    body = encode_expert_call(ExpertCall(ExpertCallKind.REQUEST, 7, x, np.array([1, 0, 5])))[5:]
    for bad in (body[:10], body[:-1], body + b"\0", b"\x09" + body[1:]):
        with pytest.raises(WireError):
            decode_expert_call(bad)


def _plan(experts: list[ExpertAssignment]) -> Plan:
    return Plan(version=1, model_name="m", n_layer=4, head_layers=1, experts=experts, n_expert=8)


def test_the_planner_spreads_experts_by_memory_and_the_stages_plan_without_them(tiny_model):
    layout = ModelLayout.from_gguf(tiny_model("llama-moe-q8_0"))
    nodes = [NodeDescriptor(name, int(gb * 1e9), 1.0) for name, gb in
             (("small", 1), ("big", 4), ("mid", 2), ("mid2", 2))]
    placement = place_experts(layout, nodes, Constraints(head_layers=1), 3)
    assert [(e.member, e.start, e.stop) for e in placement.experts] == [("big", 0, 4), ("mid", 4, 6), ("mid2", 6, 8)]
    assert [n.name for n in placement.stage_nodes] == ["small"]
    assert placement.stage_layout.layer_bytes == tuple(b - e for b, e in zip(layout.layer_bytes, layout.expert_bytes))
    assert all(e > 0 for e in layout.expert_bytes)
    _plan(placement.experts).check_experts()
    # Too few nodes: nothing is placed, and the plan says why.
    few = place_experts(layout, nodes[:3], Constraints(head_layers=1), 3)
    assert few.experts == [] and "waits for 4 trunks" in few.warnings[0]
    with pytest.raises(PlanError, match="cannot hold experts"):
        place_experts(layout, [NodeDescriptor(n, 300_100_000, 1.0) for n in "abc"], Constraints(head_layers=1), 2)


def test_swarmctl_plan_places_experts_and_charges_their_round_trips(tiny_model, tmp_path):
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([{"name": n, "memory_gb": gb, "ms_per_layer_token": 1.0,
                                  "links": {"asker": {"rtt_ms": 10}}} for n, gb in (("a", 1), ("b", 4), ("c", 2))]))
    args = ("plan", "--model", str(tiny_model("qwen3moe-q8_0")), "--nodes", str(nodes), "--head-layers", "1", "--json")
    alone = json.loads(swarmctl(None, *args, check=True).stdout)
    split = json.loads(swarmctl(None, *args, "--expert-nodes", "2", check=True).stdout)
    assert alone["experts"] == [] and len(alone["stages"]) >= 1
    assert [(e["member"], e["start"], e["stop"]) for e in split["experts"]] == [("b", 0, 5), ("c", 5, 8)]
    assert [s["member"] for s in split["stages"]] == ["a"]
    # two trunk layers, each a round trip to the slowest expert node over a default 20 ms link
    assert split["ms_per_token"] > alone["ms_per_token"] + 2 * 20
    assert any("expert calls add" in w for w in split["warnings"])
    bad = swarmctl(None, *args, "--expert-nodes", "-1")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--expert-nodes" in bad.stderr


def test_the_plan_refuses_a_placement_that_leaves_experts_unplaced():
    with pytest.raises(PlanError, match=r"experts \[3, 5\) unplaced"):
        _plan([ExpertAssignment("e1", "a", 0, 3), ExpertAssignment("e2", "b", 5, 8)]).check_experts()
    with pytest.raises(PlanError, match=r"experts \[4, 5\) on more than one node"):
        _plan([ExpertAssignment("e1", "a", 0, 5), ExpertAssignment("e2", "b", 4, 8)]).check_experts()
    with pytest.raises(PlanError, match="model with 8"):
        _plan([ExpertAssignment("e1", "a", 0, 9)]).check_experts()
    assert not _plan([ExpertAssignment("e1", "a", 0, 8, ready=False)]).complete  # waits for its expert node


STAGES, EXPERT_NODES = ("stage-a", "stage-b"), ("experts-a", "experts-b")


@pytest.fixture(scope="module", params=["qwen3moe-q8_0", "deepseek2-f32"])
def moe_swarm(request, tmp_path_factory, tiny_model):
    """Host + 2 stage trunks + 2 expert nodes + an asker, each its own process. (llama-MoE's
    experts are checked in process above; deepseek2-f32's trunk holds a dense leading layer, a MoE
    layer and shared experts, which stay with the stage.)"""
    model = str(tiny_model(request.param))
    s = Swarm(tmp_path_factory.mktemp("moe"))
    try:
        s.init("--model", model, "--head-layers", "1", "--expert-nodes", "2", "--context", "512")
        s.start_host()
        s.wait_host()
        for name in (*STAGES, *EXPERT_NODES, "asker"):
            s.join(name, "--model", model)
        for name in STAGES:
            s.start_trunk(name, "--threads", "1", "--memory", "1G", capture=False)
        for name in EXPERT_NODES:  # the planner gives experts to the members with the most memory
            s.start_trunk(name, "--threads", "1", "--memory", "2G", capture=False)
        s.wait_complete(2, expert_nodes=EXPERT_NODES)
        yield s, model
    finally:
        s.close()


def test_a_swarm_with_expert_nodes_answers_as_in_process(moe_swarm):
    swarm, model = moe_swarm
    members = {m["name"]: m for m in swarm.status()["members"]}
    assert [members[n]["experts"] for n in EXPERT_NODES] == [[0, 4], [4, 8]]
    assert all(members[n]["layers"] is None for n in EXPERT_NODES)
    assert sorted(members[n]["layers"] for n in STAGES) == [[1, 2], [2, 3]]  # in the order they registered

    ask = ("ask", "--raw", "--temperature", "0", "--max-tokens", "16", PROMPT)
    swarm_answer = swarmctl(swarm.homes["asker"], *ask, check=True).stdout
    inproc_answer = swarmctl(None, *ask, "--transport", "inproc", "--model", model, "--head-layers", "1",
                             check=True).stdout
    assert swarm_answer == inproc_answer and swarm_answer.strip()

    stats = {name: swarm.stats_of(name) for name in (*STAGES, *EXPERT_NODES)}
    for name in EXPERT_NODES:  # every expert node did real work and holds only its experts
        assert stats[name]["role"] == "experts" and stats[name]["expert_rows_served"] > 0
    moe_stages = [n for n in STAGES if "deepseek2" not in model or members[n]["layers"] == [2, 3]]
    for name in STAGES:  # the stages with MoE layers sent rows out
        assert stats[name]["role"] == "stage" and (stats[name]["expert_call_bytes"] > 0) == (name in moe_stages)
    assert "experts [0, 4)" in swarmctl(swarm.host_home, "status", check=True).stdout


def _in_process_tokens(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    asker = Asker(model, 1, n_threads=N_THREADS, max_context=512)
    trunk = InprocTrunk(asker.gguf, [TRUNK], n_threads=N_THREADS, max_context=512)
    try:
        return asyncio.run(generate_all(asker, prompt, trunk, max_tokens=max_tokens, sampling=GREEDY,
                                        ignore_eos=True)).tokens
    finally:
        trunk.close()
        asker.close()


def test_an_expert_node_killed_mid_answer_costs_a_replay_not_the_idle_timeout(moe_swarm):
    """kill -9 of an expert node while an answer is under way (issue 29): the stage gives up the
    call at its deadline (no answer, no ping) instead of at QUIC's idle timeout, the request is
    replayed on the plan without the node, and the answer is the one-process answer. Printed:
    the time from the kill to the last token, and the longest pause between tokens after the kill
    (the issue's target is within 10 s; asserting it here would fail a correct swarm on a loaded
    machine). Last on this fixture: it leaves the swarm one expert node short."""
    swarm, model = moe_swarm
    victim, max_tokens = EXPERT_NODES[0], 48

    async def run() -> tuple[list[int], list[int], dict]:
        link = await SwarmLink.open(SwarmHome(swarm.homes["asker"]), min_stages=2)
        asker = Asker(model, 1, n_threads=N_THREADS, max_context=512)
        prompt = asker.tokenizer.encode_prompt(PROMPT)
        try:
            job = asyncio.ensure_future(generate_all(asker, prompt, link, max_tokens=max_tokens, sampling=GREEDY,
                                                     ignore_eos=True))
            while not asker.in_flight or len(next(iter(asker.in_flight.values())).tokens) < 8:
                assert not job.done(), job.result()
                await asyncio.sleep(0.01)
            gen = next(iter(asker.in_flight.values()))
            node = next(n for n in swarm.nodes if n.home == swarm.homes[victim])
            node.process.kill()  # SIGKILL: no goodbye
            killed = last = time.monotonic()
            seen, pause = len(gen.tokens), 0.0
            at_kill = seen
            while not job.done():  # the longest wait for a token after the kill: the recovery
                await asyncio.sleep(0.01)
                now = time.monotonic()
                if len(gen.tokens) != seen or job.done():
                    seen, pause, last = len(gen.tokens), max(pause, now - last), now
                assert now - killed < 120, "no answer two minutes after the kill"
            await asyncio.to_thread(node.process.wait)
            swarm.nodes.remove(node)
            figures = {"model": Path(model).name, "kill_to_answer_s": round(time.monotonic() - killed, 2),
                       "longest_pause_s": round(pause, 2), "recoveries": link.stats.recoveries,
                       "tokens_after_kill": max_tokens - at_kill}
            return prompt, (await job).tokens, figures
        finally:
            await link.close()
            asker.close()

    prompt, tokens, figures = asyncio.run(run())
    print(json.dumps(figures))
    assert figures["recoveries"] >= 1  # the kill landed mid-answer
    assert tokens == _in_process_tokens(model, prompt, max_tokens)
    # A stage found the node dead by its own deadline, not by QUIC giving the connection up.
    stage_logs = [n.log() for n in swarm.nodes if n.home in {swarm.homes[s] for s in STAGES}]
    assert any("answered neither a call nor a ping" in log for log in stage_logs), \
        "\n".join(log[-3000:] for log in stage_logs)


def test_swarmctl_plan_charges_expert_calls_only_on_moe_layers(tiny_model, tmp_path):
    """deepseek2-f32's trunk [1, 3) holds a dense leading layer (1) and a MoE layer (2): one expert
    round trip per token, not two (qwen3moe's two MoE trunk layers cost > 2 × 20 ms above); the layout
    read from the GGUF knows which layers have experts."""
    layout = ModelLayout.from_gguf(tiny_model("deepseek2-f32"))
    assert [bool(e) for e in layout.expert_bytes] == [False, False, True, True]
    assert layout.kv_bytes_per_token_per_layer == (32 + 16) * 2  # the latent + RoPE part, no V
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([{"name": n, "memory_gb": gb, "ms_per_layer_token": 1.0,
                                  "links": {"asker": {"rtt_ms": 10}}} for n, gb in (("a", 1), ("b", 4), ("c", 2))]))
    args = ("plan", "--model", str(tiny_model("deepseek2-f32")), "--nodes", str(nodes), "--head-layers", "1", "--json")
    alone = json.loads(swarmctl(None, *args, check=True).stdout)
    split = json.loads(swarmctl(None, *args, "--expert-nodes", "2", check=True).stdout)
    extra = split["ms_per_token"] - alone["ms_per_token"]
    assert 20 <= extra < 2 * 20  # one MoE layer's round trip over a default 20 ms link, not two
