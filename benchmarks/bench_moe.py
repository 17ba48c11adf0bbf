"""Expert parallelism vs pipeline-only placement of the same mixture-of-experts model; prints JSON.

    python benchmarks/bench_moe.py [--arch qwen3moe|deepseek2] [--decode 32] [--threads 1] [--out FILE]

The model is a random-weight GGUF written for the run (12 layers, n_embd 512, 16 experts, top-2,
Q8_0; the bundled model's tokenizer), small enough for this machine: qwen3moe, or deepseek2
(DeepSeek-V3's shape in small: latent attention with a Q rank, one dense leading layer, a shared
expert, sigmoid gating with a routing bias and 4 expert groups). Side by side:

a. llama-cpp-python on the whole file (decode tok/s) alternated with our engine on the whole
   file in one slice (the kernels' own speed), our in-process pipeline (asker + one trunk slice,
   a worker thread per hop) with the experts local, and the same trunk slice with its experts run by two in-process
   expert engines (the cost of splitting each MoE layer at its router, without a network);
b. local swarms over QUIC + mTLS on loopback: pipeline-only (2 trunk stages holding their own
   experts) and expert parallelism (2 stages + 2 expert nodes), single-stream decode, with the bytes
   each placement moves per token (activations between stages and asker; expert calls, both ways)
   measured from the trunks' own counters, next to the bytes the layout (plans.layout, read from
   the GGUF) predicts: per MoE layer a stage runs, its top-k rows and ids out and k rows back.

Medians; this machine has 2 cores shared by up to 6 processes here, so the swarm figures say more
about the extra round trips than about what separate machines would see.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_swarm import decode_rate, llama_cpp_decode  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from kernels.experts import ExpertEngine, LocalExperts  # noqa: E402
from kernels.gguf_file import GGUFFile  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from kernels.slice import SliceEngine  # noqa: E402
from kernels.spec import ModelSpec, SliceSpec  # noqa: E402
from net.endpoint import Address, ask_member  # noqa: E402
from plans.layout import ModelLayout  # noqa: E402
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402
from harness.tiny_models import TinyConfig, write_tiny_model  # noqa: E402  (the GGUF writer the tests use)

GREEDY = SamplingParams(temperature=0)
PROMPT = "Once upon a time, in a lighthouse by a cold grey sea, there lived a keeper who"
HEAD_LAYERS = 2
MODELS = {
    "qwen3moe": TinyConfig(arch="qwen3moe", qtype="Q8_0", n_layer=12, n_embd=512, n_head=8, n_head_kv=4, n_ff=768,
                           n_expert=16, n_expert_used=2, n_ctx=1024, seed=11),
    "deepseek2": TinyConfig(arch="deepseek2", qtype="Q8_0", n_layer=12, n_embd=512, n_head=8, n_ff=768, n_ctx=1024,
                            q_rank=192, kv_rank=128, qk_nope=64, qk_rope=32, v_head=64, n_ff_exp=384,
                            n_expert=16, n_expert_used=2, n_dense_lead=1, n_shared=1, sigmoid_gating=True,
                            n_groups=4, n_group_used=2, weights_scale=2.5, seed=11),
}


def whole_model_decode(model: Path, prompt: list[int], n: int, threads: int) -> dict:
    """llama-cpp-python and our whole-model engine, alternated three times each: medians."""
    theirs, ours = [], []
    for _ in range(3):
        theirs.append(llama_cpp_decode(model, prompt, n, threads))
        ours.append(whole_engine_decode(model, prompt, n, threads))
    return {"llama_cpp_python_decode_tok_s": round(statistics.median(theirs), 2),
            "whole_engine_decode_tok_s": round(statistics.median(ours), 2)}


async def inproc_decode(model: Path, prompt: list[int], n: int, threads: int) -> float:
    asker = Asker(model, HEAD_LAYERS, n_threads=threads, max_context=1024)
    start, stop = HEAD_LAYERS, asker.spec.n_layer - HEAD_LAYERS
    trunk = InprocTrunk(asker.gguf, [SliceSpec(start, stop)], n_threads=threads, max_context=1024)
    try:
        runs = [await generate_all(asker, prompt, trunk, ignore_eos=True, max_tokens=n, sampling=GREEDY)
                for _ in range(3)]
        return statistics.median(decode_rate(g) for g in runs)
    finally:
        trunk.close()
        asker.close()


def whole_engine_decode(model: Path, prompt: list[int], n: int, threads: int) -> float:
    """Our engine on the whole model in one slice, greedy decode: the kernels' own speed against
    llama-cpp-python's, without the asker's pipeline (three slices, a worker thread each hop)."""
    with GGUFFile(model) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        with SliceEngine(gguf, SliceSpec(0, spec.n_layer, True, True), n_threads=threads, max_context=1024) as engine:
            rid = b"w" * 16
            logits = engine.forward(rid, start_pos=0, tokens=prompt, outputs="last")
            t0 = time.perf_counter()
            for i in range(n):
                logits = engine.forward(rid, start_pos=len(prompt) + i, tokens=[int(np.argmax(logits[-1]))],
                                        outputs="last")
            rate = n / (time.perf_counter() - t0)
            engine.release(rid)
    return rate


def trunk_slice_ms(model: Path, n: int, threads: int) -> dict:
    """One trunk slice, decode steps: experts in the graph vs experts in two ExpertEngines."""
    with GGUFFile(model) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        trunk = SliceSpec(HEAD_LAYERS, spec.n_layer - HEAD_LAYERS)
        half = spec.n_expert // 2
        holders = [ExpertEngine(gguf, trunk.layers, a, b, n_threads=threads) for a, b in ((0, half), (half, spec.n_expert))]
        engines = {"experts_local": SliceEngine(gguf, trunk, n_threads=threads),
                   "experts_split_in_process": SliceEngine(gguf, trunk, n_threads=threads,
                                                           remote_experts=LocalExperts(holders))}
        rng = np.random.default_rng(0)
        prompt = rng.standard_normal((16, spec.n_embd)).astype(np.float32)
        steps = rng.standard_normal((n, 1, spec.n_embd)).astype(np.float32)
        out = {}
        try:
            for name, engine in engines.items():
                engine.forward(b"r" * 16, start_pos=0, hidden=prompt)
                times = []
                for i, x in enumerate(steps):
                    t0 = time.perf_counter()
                    engine.forward(b"r" * 16, start_pos=16 + i, hidden=x)
                    times.append(time.perf_counter() - t0)
                out[name] = {"ms_per_token": round(statistics.median(times) * 1e3, 3),
                             "weights_mapped_bytes": engine.weights.n_bytes}
            out["expert_engines_bytes"] = [h.n_bytes for h in holders]
        finally:
            for engine in [*engines.values(), *holders]:
                engine.close()
    return out


async def member_stats(home, address: str, name: str) -> dict:
    return await ask_member(Address.parse(address), home.credentials(), name, {"type": "stats"})


async def swarm_run(model: Path, prompt: list[int], n: int, threads: int, expert_nodes: int) -> dict:
    n_trunks = 2 + expert_nodes
    with LocalSwarm(model=str(model), n_trunks=n_trunks,
                    planner=PlannerSettings(head_layers=HEAD_LAYERS, expert_nodes=expert_nodes),
                    threads=threads) as swarm:
        link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
        asker = Asker(model, link.head_layers, n_threads=threads, max_in_flight=8, max_context=1024)
        replans = 0
        try:
            for _ in range(3):  # the host may re-plan on a re-measured speed (plans/hysteresis.py): measure again
                version = link.plan.version
                members = [(s.member, s.address) for s in link.plan.stages] + \
                    [(e.member, e.address) for e in link.plan.experts]

                async def counters() -> dict[str, dict]:
                    return {m: await member_stats(swarm.asker_home, a, m) for m, a in members}

                await generate_all(asker, prompt, link, ignore_eos=True, max_tokens=4, sampling=GREEDY)  # warm-up
                before = await counters()
                runs = [await generate_all(asker, prompt, link, ignore_eos=True, max_tokens=n, sampling=GREEDY)
                        for _ in range(3)]
                after = await counters()
                if link.plan.version == version:
                    break
                replans += 1
            recoveries = link.stats.recoveries
        finally:
            await link.close()
            asker.close()
    tokens = sum(len(prompt) + len(g.tokens) - 1 for g in runs)  # every position crossed the trunk once
    stage_names = [s.member for s in link.plan.stages]

    def per_token(key: str, names: list[str]) -> float:
        return round(sum(after[m][key] - before[m][key] for m in names) / tokens, 1)

    steps = [t for g in runs for t in g.timings[1:]]
    return {
        "trunks": n_trunks,
        "plan": {"stages": [[s.member, s.start, s.stop] for s in link.plan.stages],
                 "experts": [[e.member, e.start, e.stop] for e in link.plan.experts]},
        "single_stream_decode_tok_s": round(statistics.median(decode_rate(g) for g in runs), 2),
        "median_ms_per_token": round(statistics.median(t.total_s for t in steps) * 1e3, 2),
        "median_trunk_round_trip_ms": round(statistics.median(t.trunk.round_trip_s for t in steps) * 1e3, 2),
        "stage_activation_bytes_per_token": per_token("activation_bytes_sent", stage_names),
        "expert_call_bytes_per_token": per_token("expert_call_bytes", stage_names),
        "recoveries": recoveries,  # requests replayed after a route failed (0 on a healthy run)
        "replans_during_measurement": replans,  # measurements repeated because the plan changed
        "expert_rows_served": {m: after[m]["expert_rows_served"] - before[m]["expert_rows_served"]
                               for m, _ in members if m not in stage_names},
        "tensor_bytes_per_member": {m: after[m]["tensor_bytes"] for m, _ in members},
    }


def predicted_bytes(model: Path) -> dict:
    """Payload bytes per token from the layout alone (frame and packet headers not counted)."""
    layout = ModelLayout.from_gguf(model)
    trunk = range(HEAD_LAYERS, layout.n_layer - HEAD_LAYERS)
    moe_layers = sum(1 for il in trunk if layout.expert_bytes[il])  # a dense leading layer calls no experts
    row = layout.activation_bytes_per_token
    return {"activation_payload_per_hop": row, "trunk_moe_layers": moe_layers,
            "expert_payload_per_token": moe_layers * layout.n_expert_used * (row + 4 + row)}  # rows+ids out, rows back


async def main_async(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    model = write_tiny_model(root / f"bench-{args.arch}.gguf", MODELS[args.arch], default_model_path())
    with GGUFFile(model) as gguf:
        spec = ModelSpec.from_gguf(gguf)
    asker = Asker(model, HEAD_LAYERS, n_threads=args.threads)
    prompt = asker.tokenizer.encode_prompt(PROMPT)
    asker.close()
    result = {
        "model": {"arch": spec.architecture, "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_expert": spec.n_expert,
                  "n_expert_used": spec.n_expert_used, "moe_layers": list(spec.moe_layers),
                  "kv_bytes_per_token_per_layer": spec.kv_bytes_per_token_per_layer,
                  "file_bytes": model.stat().st_size},
        "decode_tokens": args.decode, "threads_per_process": args.threads, "prompt_tokens": len(prompt),
        **whole_model_decode(model, prompt, args.decode, args.threads),
        "inproc_decode_tok_s": round(await inproc_decode(model, prompt, args.decode, args.threads), 2),
        "trunk_slice": trunk_slice_ms(model, args.decode, args.threads),
        "predicted": predicted_bytes(model),
        "pipeline_only": await swarm_run(model, prompt, args.decode, args.threads, expert_nodes=0),
        "expert_parallel": await swarm_run(model, prompt, args.decode, args.threads, expert_nodes=2),
    }
    p, e = result["pipeline_only"], result["expert_parallel"]
    result["ratios"] = {
        "ep_vs_pipeline_ms_per_token": round(e["median_ms_per_token"] / p["median_ms_per_token"], 2),
        "ep_vs_pipeline_bytes_per_token": round(
            (e["stage_activation_bytes_per_token"] + e["expert_call_bytes_per_token"])
            / p["stage_activation_bytes_per_token"], 1),
        "whole_engine_vs_llama_cpp_python_decode": round(result["whole_engine_decode_tok_s"]
                                                         / result["llama_cpp_python_decode_tok_s"], 3),
        "inproc_pipeline_vs_llama_cpp_python_decode": round(result["inproc_decode_tok_s"]
                                                            / result["llama_cpp_python_decode_tok_s"], 3),
        "expert_bytes_measured_vs_layout": round(e["expert_call_bytes_per_token"]
                                                 / result["predicted"]["expert_payload_per_token"], 4),
        "split_in_process_vs_local_trunk_ms": round(result["trunk_slice"]["experts_split_in_process"]["ms_per_token"]
                                                    / result["trunk_slice"]["experts_local"]["ms_per_token"], 2),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(MODELS), default="qwen3moe")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
