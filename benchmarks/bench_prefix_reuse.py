"""Prefix reuse across requests: first-token time per turn of a growing conversation, with and
without reuse, side by side in one run; prints JSON (and saves it with --out).

    python benchmarks/bench_prefix_reuse.py [--turns 8] [--new-tokens 470] [--rate-mbit 20] [--out FILE]

A local swarm (host + 2 trunk processes over QUIC) whose every link passes the WAN relay (net.relay:
20 ms one way, each direction capped at 20 Mbit/s, no jitter or loss). One conversation grows by
``--new-tokens`` user tokens plus the previous answer each turn, to about 4,000 tokens at turn 8
(the bundled model's stages hold 4,096 positions). Each turn runs three requests in turn:

- ``without``: the whole history from position 0 (no kept prefix; what every turn cost before);
- ``with``: the same prompt, starting from the prefix the previous turn kept (swarmctl/asker/prefixes.py);
- ``new_only``: a fresh request of just the positions ``with`` computed (as many tokens), the
  time it should approach.

Goals (issue 46): from turn 2 on, ``with`` within 1.3 × ``new_only``; at turn 8, ``without`` at
least 5 × ``with``. The answers of ``with`` and ``without`` must be the same tokens. The machine
is shared and noisy: one conversation per run, every figure listed.

``--engine-only`` measures what the positions before a step cost it, with no swarm: the whole
model in one engine, ``--new-tokens`` rows prefilled from position 0 and after 3,386 kept
positions, alternating (attention reads every earlier position: the work ``new_only`` skips).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_swarm import wan_swarm  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from swarmctl.asker.head_tail import Asker, Generation  # noqa: E402
from swarmctl.asker.prefixes import PrefixCache  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def prompt_compute_s(gen: Generation) -> float:
    """Compute on the asker and every stage for the prompt's steps (up to the first token): what
    a busier machine makes longer, apart from the wire."""
    return sum(t.compute_s for t in (*gen.fill_timings, gen.timings[0]))


async def first_token(asker: Asker, link, prompt: list[int], max_tokens: int,
                      prefixes: PrefixCache | None) -> tuple[float, Generation]:
    gen = Generation(secrets.token_bytes(16), len(prompt))
    t0 = time.perf_counter()
    async for _ in asker.generate(prompt, link, max_tokens=max_tokens, sampling=GREEDY, generation=gen,
                                  ignore_eos=True, prefixes=prefixes):
        pass
    return gen.timings[0].done - t0, gen


async def run(args) -> dict:
    model = default_model_path()
    rng = np.random.default_rng(7)
    out: dict = {"model": model.name, "links": {"delay_s": args.delay_ms / 1000, "jitter_s": 0.0, "loss": 0.0,
                                                "rate_mbit_each_direction": args.rate_mbit},
                 "threads_per_process": args.threads, "answer_tokens": args.answer_tokens, "turns": []}
    async with wan_swarm(model, args.threads, args.rate_mbit, delay_s=args.delay_ms / 1000, jitter_s=0.0,
                         loss=0.0) as link:
        asker = Asker(model, link.head_layers, n_threads=args.threads)
        cache = PrefixCache()
        try:
            warm = [int(t) for t in rng.integers(100, 40000, 600)]
            await first_token(asker, link, warm, 1, None)  # connections, congestion windows
            history: list[int] = []
            for turn in range(1, args.turns + 1):
                history += [int(t) for t in rng.integers(100, 40000, args.new_tokens)]
                t_without, without = await first_token(asker, link, history, args.answer_tokens, None)
                t_with, reused = await first_token(asker, link, history, args.answer_tokens, cache)
                computed = len(history) - reused.cached_tokens
                fresh = [int(t) for t in rng.integers(100, 40000, computed)]
                t_new, new_only = await first_token(asker, link, fresh, 1, None)
                row = {"turn": turn, "prompt_tokens": len(history), "cached_tokens": reused.cached_tokens,
                       "computed_tokens": computed, "without_s": round(t_without, 3), "with_s": round(t_with, 3),
                       "new_only_s": round(t_new, 3), "with_over_new_only": round(t_with / t_new, 3),
                       "without_over_with": round(t_without / t_with, 3),
                       "compute_s": {"without": round(prompt_compute_s(without), 3),
                                     "with": round(prompt_compute_s(reused), 3),
                                     "new_only": round(prompt_compute_s(new_only), 3)},
                       "same_answer": reused.tokens == without.tokens}
                out["turns"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                history += reused.tokens  # the client sends the answer back with its next message
        finally:
            asker.close()
    turns = out["turns"]
    later = turns[1:]
    out["summary"] = {
        "final_prompt_tokens": turns[-1]["prompt_tokens"],
        "turns_2_on_worst_with_over_new_only": max(t["with_over_new_only"] for t in later) if later else None,
        "turns_2_on_within_1_3x_of_new_only": sum(t["with_over_new_only"] <= 1.3 for t in later),
        "last_turn_without_over_with": turns[-1]["without_over_with"],
        "all_answers_same": all(t["same_answer"] for t in turns),
    }
    return out


def engine_only(args) -> dict:
    from kernels.slice import SliceEngine
    from kernels.spec import SliceSpec

    model = default_model_path()
    rng = np.random.default_rng(9)
    n, before = args.new_tokens, 3386
    times: dict[str, list[float]] = {"from_0": [], f"after_{before}": []}
    with SliceEngine.open(model, SliceSpec(0, 30, has_embedding=True, has_lm_head=True), n_threads=args.threads,
                          max_context=4096) as engine:
        history = [int(t) for t in rng.integers(100, 40000, before)]
        for i in range(0, before, 512):
            engine.forward(b"kept", start_pos=i, tokens=history[i:i + 512])
        for r in range(args.repeats):
            new = [int(t) for t in rng.integers(100, 40000, n)]
            t0 = time.perf_counter()
            engine.forward(b"fresh%d" % r, start_pos=0, tokens=new)
            times["from_0"].append(time.perf_counter() - t0)
            engine.release(b"fresh%d" % r)
            assert engine.move(b"kept", b"step", before)
            t0 = time.perf_counter()
            engine.forward(b"step", start_pos=before, tokens=new)
            times[f"after_{before}"].append(time.perf_counter() - t0)
            assert engine.move(b"step", b"kept", before)
    medians = {k: round(float(np.median(v)), 3) for k, v in times.items()}
    return {"model": model.name, "rows": n, "threads": args.threads, "repeats": args.repeats,
            "median_s": medians, "runs_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "after_over_from_0": round(medians[f"after_{before}"] / medians["from_0"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=470, help="user tokens each turn adds")
    p.add_argument("--answer-tokens", type=int, default=16, help="tokens each answer has (sent back next turn)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="each link's one-way delay")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="each link direction's cap")
    p.add_argument("--threads", type=int, default=2, help="threads per process")
    p.add_argument("--engine-only", action="store_true", help="only the in-process attention measurement")
    p.add_argument("--repeats", type=int, default=5, help="--engine-only: steps of each kind")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    result = engine_only(args) if args.engine_only else asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
