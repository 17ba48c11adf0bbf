"""``--wire-dtype`` (issue 33 item 3): how activations travel between machines.

With real processes: a swarm set to q8_0 answers exactly what the same model gives in one process
with every hop rounded the way q8_0 delivers it (the kernels see the same rows, so the same tokens),
so the stages convert as the plan says; set back to f32 with `swarmctl config`, it answers
llama-cpp-python's tokens again. In process: `auto` takes f32 within a site and f16 between sites,
and the planner charges each hop its dtype's bytes.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.spec import SliceSpec
from net.wire import DType
from plans.layout import ModelLayout
from plans.nodes import ASKER, GB, Link, NodeDescriptor
from plans.planner import Constraints, plan_layers
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all
from harness.swarm import Swarm, swarmctl
from tests.conftest import N_THREADS

PROMPT = "The three primary colours are"
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "16", PROMPT)


def _stages(status: dict) -> list[tuple[int, int]]:
    return sorted(tuple(m["layers"]) for m in status["members"] if m["layers"])


def _hops(plan: dict) -> set[str]:
    """The dtypes activations travel in under ``plan``: into the first stage and out of each."""
    return {plan["entry_dtype"], *(s["send_dtype"] for s in plan["stages"])}


def _inproc_answer(model, stages: list[tuple[int, int]], hop: DType) -> str:
    """The answer in one process, every hop's rows rounded as ``hop`` delivers them."""
    asker = Asker(model, stages[0][0], n_threads=N_THREADS, max_context=512)
    try:
        with GGUFFile(model) as gguf:
            trunk = InprocTrunk(gguf, [SliceSpec(a, b) for a, b in stages], n_threads=N_THREADS, max_context=512,
                                wire=[hop] * (len(stages) + 1))
            try:
                gen = asyncio.run(generate_all(asker, asker.tokenizer.encode_prompt(PROMPT), trunk, max_tokens=16,
                                               sampling=SamplingParams(temperature=0.0)))
            finally:
                trunk.close()
        return asker.tokenizer.decode(gen.tokens) + "\n"
    finally:
        asker.close()


def test_a_swarm_on_q8_0_answers_what_its_rounding_gives_and_f32_again_after_config(tmp_path, bundled_model, oracle):
    with Swarm.two_trunks(tmp_path, askers=("alice",), init=("--wire-dtype", "q8_0")) as swarm:
        status = swarm.status()
        stages = _stages(status)
        r = swarmctl(swarm.homes["alice"], *ASK)
        assert r.returncode == 0, r.stderr
        assert r.stdout == _inproc_answer(bundled_model, stages, DType.Q8_0)
        exact = oracle.create_completion(PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"] + "\n"
        assert _inproc_answer(bundled_model, stages, DType.F32) == exact  # (the emulation is exact at f32)

        version = status["plan_version"]
        swarmctl(swarm.host_home, "config", "wire-dtype", "f32", check=True)
        deadline = time.monotonic() + 60
        # (a changed plan is staged until its stages are ready: wait until none is and the plan in
        # use carries f32 on every hop, not another plan that came between, e.g. a re-plan on the
        # trunks' served speeds, still at q8_0)
        while not ((now := swarm.status()).get("plan_version", version) > version and now.get("complete")
                   and not now.get("staged") and _hops(swarm.plan(via="alice")) == {"f32"}):
            assert time.monotonic() < deadline, now
            time.sleep(0.3)
        r = swarmctl(swarm.homes["alice"], *ASK)
        assert r.returncode == 0 and r.stdout == exact, r.stderr


# --- the planner's side ---

WIDE = ModelLayout("wide", 12, 7168, (2_000_000_000,) * 12, (1,) * 12, 1024, 0, 0)


def _nodes(rtt_between: float) -> list[NodeDescriptor]:
    return [NodeDescriptor("a", int(15 * GB), 1.0, links={ASKER: Link(1.0, 100.0), "b": Link(rtt_between, 2.5)}),
            NodeDescriptor("b", int(15 * GB), 1.0, links={ASKER: Link(1.0, 100.0)})]


@pytest.mark.parametrize("setting, lan, wan", [("f32", "f32", "f32"), ("f16", "f16", "f16"), ("q8_0", "q8_0", "q8_0"),
                                               ("auto", "f32", "f16")])
def test_each_hop_gets_its_dtype_and_is_charged_its_bytes(setting, lan, wan):
    """Two stages 40 ms apart over a 20 Mbit/s uplink, each 1 ms from the asker (a LAN):
    ``auto`` keeps the asker's hops in f32 and sends f16 between the homes."""
    c = Constraints(head_layers=2, context_tokens=16, wire_dtype=setting)
    p = plan_layers(WIDE, _nodes(40.0), c)
    assert sorted(s.member for s in p.stages) == ["a", "b"]  # (it needs both: 16 GB of layers)
    assert [h.dtype.label for h in p.hops] == [lan, wan, lan]
    between = p.hops[1]
    bytes_ = {"f32": 7168 * 4, "f16": 7168 * 2, "q8_0": 7168 // 32 * 34}[wan]
    assert between.ms - between.packet_ms == pytest.approx(20.0 + bytes_ / (2.5 * 1e3))
    f32 = plan_layers(WIDE, _nodes(40.0), Constraints(head_layers=2, context_tokens=16))
    assert (p.ms_per_token < f32.ms_per_token) == (wan != "f32")


def test_q8_0_on_a_model_whose_width_is_not_whole_blocks_travels_in_f16():
    odd = ModelLayout("odd", 12, 7000, (2_000_000_000,) * 12, (1,) * 12, 1024, 0, 0)
    p = plan_layers(odd, _nodes(40.0), Constraints(head_layers=2, context_tokens=16, wire_dtype="q8_0"))
    assert {h.dtype.label for h in p.hops} == {"f16"}
