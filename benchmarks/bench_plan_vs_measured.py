"""Issue 33 item 4 on one machine: what `swarmctl plan` predicts for a token against what a run
measures, at Kimi K2's width.

    python benchmarks/bench_plan_vs_measured.py [--model PATH] [--tokens 16] [--repeats 3] [--out FILE]

Without --model it writes (once, into --cache) a deepseek2 GGUF with Kimi K2's per-layer shapes
(harness/tiny_models.KIMI_WIDTH: n_embd 7168, 64 heads, q rank 1536, kv rank 512, expert FFN 2048,
8 of 16 experts used, one shared, the first layer dense; 4 layers, Q8_0, ~3.7 GB), so each token
reads the bytes a Kimi layer reads; with --shape llama-1b, Llama 3.2 1B's shapes (n_embd 2048, 16
layers, 32 heads, 8 for K/V, FFN 8192; the bundled vocabulary, tied output; Q8_0, ~1.1 GB). It starts a local swarm of two trunk processes on loopback (the
asker keeps layers 0 and 3, the embedding and the LM head), runs greedy generations and measures
decode ms per token (wall time from the first token to the last) and where it went (the asker's
head and tail, each stage's compute, the rest: transfer and waiting). It asks the host
`swarmctl plan --json --asker trunk-1` twice: the plan on the members' own measured speeds, with
the asker's layers and LM head charged at trunk-1's speed (the same machine), once on their
start-up probes and once after a warm-up and ``--settle`` seconds, when the figures from the
batches they served have reached the host. Predicted and measured side by side, with their ratio;
the issue's bar is within 20 %.

First-token time is predicted by `plan` from each member's measured prompt rate (plans/prefill.py)
and measured for the chat prompt and for a prompt of ``--long-prompt`` tokens (one chunk: on one
machine the stages share the cores, so a longer prompt's chunks could not overlap as the plan has
them do between machines).

Not the network lab: one machine, loopback links (the plan's link figures are the members' own
measurements of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit_json  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from swarmctl.asker.head_tail import Asker, generate_all  # noqa: E402
from swarmctl.asker.local_link import open_local_link  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

GREEDY = SamplingParams(temperature=0)
PROMPT = "Explain in two sentences why the sky is blue."


SHAPES = {"kimi-width": ("KIMI_WIDTH", "kimi-width-4l-16e-q8_0.gguf"), "llama-1b": ("LLAMA_1B", "llama-1b-q8_0.gguf")}


def shaped_model(cache: Path, shape: str = "kimi-width") -> Path:
    """The benchmark's model of that shape (harness/tiny_models), written once into ``cache``."""
    from harness import tiny_models

    config, name = SHAPES[shape]
    path = cache / name
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tiny_models.write_tiny_model(path.with_suffix(".part"), getattr(tiny_models, config), default_model_path())
        path.with_suffix(".part").rename(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    return path


def decode_ms(gen) -> float:
    """Wall ms per token after the first: from the first token's step to the last one's."""
    steps = gen.timings
    return (steps[-1].done - steps[0].done) / max(1, len(gen.tokens) - 1) * 1e3


def measured_parts(gens) -> dict:
    """Medians over the decode steps (all but each generation's first) of where a token went."""
    steps = [t for g in gens for t in g.timings[1:]]
    stages: dict[str, list[float]] = {}
    for t in steps:
        for h in t.trunk.hops:
            stages.setdefault(h.stage, []).append(h.compute_us / 1e3)
    asker = [(t.head.compute_s + t.tail.compute_s) * 1e3 for t in steps]
    step = [t.latency_s * 1e3 for t in steps]
    stage_ms = {name: statistics.median(v) for name, v in stages.items()}
    return {"asker_head_and_tail_ms": statistics.median(asker), "stage_compute_ms": stage_ms,
            "step_ms": statistics.median(step),
            "rest_ms": statistics.median(step) - statistics.median(asker) - sum(stage_ms.values())}


def plan_of(swarm: LocalSwarm, asker_member: str, prompt_tokens: int) -> dict:
    deadline = time.monotonic() + 120
    while True:  # (the link may open on one trunk's stage before the other is a member)
        r = subprocess.run([sys.executable, "-m", "swarmctl", "plan", "--json", "--asker", asker_member,
                            "--prompt-tokens", str(prompt_tokens)],
                           env={**os.environ, "SWARMCTL_HOME": str(swarm.host_home.path)}, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        if r.returncode == 0 or "no such member" not in r.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    if r.returncode != 0:
        raise SystemExit(f"swarmctl plan failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


async def members_of(swarm: LocalSwarm) -> dict:
    """The figures the host plans with, per member: a decode token's and a prompt row's per layer."""
    from net import messages as m
    from swarmctl.commands.status import ask_host
    from swarmctl.node.home import SwarmHome

    nodes = (await ask_host(SwarmHome(swarm.host_home.path), m.GetNodes(), m.Nodes)).nodes
    return {n.name: {"ms_per_layer_token": round(n.ms_per_layer_token, 3),
                     "prompt_ms_per_layer_row": n.prompt_ms_per_layer_row and round(n.prompt_ms_per_layer_row, 3)}
            for n in nodes}


def prediction(plan: dict) -> dict:
    return {"whole_ms_per_token": plan["whole_ms_per_token"], "asker_ms": plan["asker_ms"],
            "asker_basis": plan["asker_basis"], "trunk_and_links_ms": plan["ms_per_token"],
            "stage_compute_ms": {s["member"]: s["compute_ms"] for s in plan["stages"]},
            "stages": [(s["member"], s["start"], s["stop"]) for s in plan["stages"]],
            "time": {t["part"]: round(t["ms"], 2) for t in plan["time"]},
            "first_token_s": plan["first_token"]["ms"] / 1e3 if plan["first_token"]["ms"] is not None else None,
            "hops": [{k: h[k] for k in ("src", "dst", "rtt_ms", "bandwidth_mb_s", "ms", "packet_ms")} for h in plan["hops"]],
            "changes_from_the_running_plan": plan.get("changes")}


def ratios(predicted: dict, measured: dict) -> dict:
    first = predicted["first_token_s"]
    return {"whole_token": round(predicted["whole_ms_per_token"] / measured["decode_ms_per_token"], 3),
            "first_token": round(first / measured["first_token_s"], 3) if first else None,
            "asker": round(predicted["asker_ms"] / measured["asker_head_and_tail_ms"], 3),
            **{f"stage {m}": round(p / measured["stage_compute_ms"][m], 3)
               for m, p in predicted["stage_compute_ms"].items() if m in measured["stage_compute_ms"]}}


LONG_TEXT = ("The river rose through the night, and by morning the lower fields were under water. The farmers "
             "moved the cattle to the ridge, counted them twice, and went back for the ones that had strayed. ")


def long_prompt(asker: Asker, tokens: int) -> list[int]:
    """A chat prompt of about ``tokens`` tokens: a paragraph repeated, then a question about it."""
    text = LONG_TEXT
    while len(asker.tokenizer.encode_prompt(text)) < tokens:
        text += LONG_TEXT
    words = text.split()
    while len(asker.tokenizer.encode_chat([{"role": "user", "content": " ".join(words)}])) > tokens:
        words.pop()
    return asker.tokenizer.encode_chat([{"role": "user", "content": " ".join(words)}])


async def first_token_s(asker: Asker, prompt: list[int], link, parts: list | None = None) -> float:
    t0 = time.perf_counter()
    gen = await generate_all(asker, prompt, link, max_tokens=1, sampling=GREEDY, ignore_eos=True)
    if parts is not None:
        parts.append(prompt_parts(gen))
    return gen.timings[0].done - t0


def prompt_parts(gen) -> dict:
    """Where a prompt's (one) step went: the asker's head and tail, each stage's compute (ms)."""
    step = gen.timings[0]
    return {"asker_head_ms": round(step.head.compute_s * 1e3, 1), "asker_tail_ms": round(step.tail.compute_s * 1e3, 1),
            **{h.stage: round(h.compute_us / 1e3, 1) for h in step.trunk.hops}}


async def run(model: Path, tokens: int, repeats: int, threads: int, settle_s: float, long_tokens: int) -> dict:
    with LocalSwarm(model=str(model), n_trunks=2, planner=PlannerSettings(head_layers=1), threads=threads) as swarm:
        link = await open_local_link(swarm, bound=900)
        asker = Asker(model, link.head_layers, n_threads=threads)
        try:
            prompt = asker.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
            at_start = plan_of(swarm, "trunk-1", len(prompt))  # on the members' start-up probes
            members_at_start = await members_of(swarm)
            long = long_prompt(asker, long_tokens) if long_tokens else []
            # Warm-up, and long enough for each trunk's figures from the batches it served (a prompt
            # row's, then a decode token's, sent together) to reach the host (kernels/speed.py
            # SpeedTracker; the host adopts it: plans/hysteresis.py).
            if long:
                await first_token_s(asker, long, link)
            await generate_all(asker, prompt, link, max_tokens=24, sampling=GREEDY, ignore_eos=True)
            await asyncio.sleep(settle_s)
            gens = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                gen = await generate_all(asker, prompt, link, max_tokens=tokens, sampling=GREEDY, ignore_eos=True)
                gen.first_token_s = gen.timings[0].done - t0
                gens.append(gen)
            long_parts: list[dict] = []
            long_s = [await first_token_s(asker, long, link, long_parts) for _ in range(repeats)] if long else []
        finally:
            asker.close()
            await link.close()
        served = plan_of(swarm, "trunk-1", len(prompt))  # on the figures as the host has them after serving
        members_served = await members_of(swarm)
        measured_lines = {home.path.name: [line.split(" - ")[-1] for line in (home.path / "node.log").read_text(
            errors="replace").splitlines() if "measured" in line or "while serving" in line]
            for home in swarm.trunk_homes}
        served_long = plan_of(swarm, "trunk-1", len(long)) if long else None
    measured = measured_parts(gens)
    measured["decode_ms_per_token"] = statistics.median(decode_ms(g) for g in gens)
    measured["decode_runs_ms"] = [round(decode_ms(g), 1) for g in gens]
    measured["first_token_s"] = statistics.median(g.first_token_s for g in gens)
    measured["first_token_compute_ms"] = [prompt_parts(g) for g in gens]
    predicted = {"on_start_up_probes": {**prediction(at_start), "members": members_at_start},
                 "after_serving": {**prediction(served), "members": members_served}}
    out = {"model": model.name, "prompt_tokens": len(prompt), "tokens": tokens, "repeats": repeats,
           "threads_per_process": threads, "settle_s": settle_s, "measured": measured, "predicted": predicted,
           "trunk_logs": measured_lines,
           "predicted_over_measured": {k: ratios(v, measured) for k, v in predicted.items()},
           "target": "within 20 % (0.8-1.2) for the whole token and the first token"}
    if long:
        measured_long = statistics.median(long_s)
        predicted_long = prediction(served_long)["first_token_s"]
        out["long_prompt"] = {"prompt_tokens": len(long), "measured_first_token_s": round(measured_long, 3),
                              "runs_s": [round(v, 3) for v in long_s], "compute_ms": long_parts,
                              "predicted_first_token_s": predicted_long,
                              "predicted_over_measured": round(predicted_long / measured_long, 3)
                              if predicted_long else None}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a GGUF (default: the --shape file, written once into --cache)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="kimi-width",
                   help="without --model: Kimi K2's layer shapes (deepseek2, 4 layers, 16 experts) or Llama 3.2 "
                        "1B's (16 layers)")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "bench-models")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--settle", type=float, default=20.0, help="seconds after the warm-up before measuring")
    p.add_argument("--long-prompt", type=int, default=400, metavar="TOKENS",
                   help="also time the first token of a prompt this long (0: no; one chunk is up to 512)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model = args.model or shaped_model(args.cache, args.shape)
    emit_json(asyncio.run(run(model, args.tokens, args.repeats, args.threads, args.settle, args.long_prompt)), args.out)


if __name__ == "__main__":
    main()
