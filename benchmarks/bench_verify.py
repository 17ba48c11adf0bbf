"""What spot checks cost (``--verify P``, swarmctl/asker/verify.py); prints JSON.

    python benchmarks/bench_verify.py [--decode 64] [--rounds 3] [--threads 1] [--out FILE]

A local swarm (host + 2 trunk processes over QUIC + mTLS, honest) and an asker in this process.
For P = 0 (off: the link itself), 0.1, 0.5 and 1, side by side, in interleaved rounds (medians):

- single-stream decode tok/s (the prefill excluded) and whole-request tok/s;
- aggregate tok/s of 4 concurrent requests;
- the asker's CPU seconds per generated token (this process: head, tail and the checks);
- steps checked, the tokens the verification passes ran (catch-ups), their wall time, and the
  largest relative error an honest trunk's checked rows had (the tolerance is 0.10).

Verification runs on the asker's one compute thread, next to its head and tail: a checked step
costs a pass over the trunk's layers here (a batched catch-up of the steps since the last check).
This machine is shared and noisy; each process gets ``--threads`` compute threads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_swarm import GREEDY, PROMPT, decode_rate  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from swarmctl.asker.head_tail import Asker, generate_all  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402
from swarmctl.asker.verify import MIN_COSINE, REL_TOLERANCE, VerifyingTrunk, VerifyStats  # noqa: E402

SHARES = (0.0, 0.1, 0.5, 1.0)
CONCURRENCY = 4


async def one_round(asker: Asker, trunk, prompt: list[int], n_decode: int) -> dict:
    stats = getattr(trunk, "stats", None)
    if stats is not None:
        trunk.stats = VerifyStats()
    cpu0, t0 = time.process_time(), time.perf_counter()
    single = await generate_all(asker, prompt, trunk, ignore_eos=True, max_tokens=n_decode, sampling=GREEDY)
    single_wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    gens = await asyncio.gather(*[generate_all(asker, prompt, trunk, ignore_eos=True, max_tokens=n_decode // 2,
                                               sampling=GREEDY) for _ in range(CONCURRENCY)])
    aggregate = sum(len(g.tokens) for g in gens) / (time.perf_counter() - t1)
    tokens = len(single.tokens) + sum(len(g.tokens) for g in gens)
    out = {"decode_tok_s": decode_rate(single), "request_tok_s": len(single.tokens) / single_wall,
           "aggregate_tok_s": aggregate, "asker_cpu_ms_per_token": (time.process_time() - cpu0) / tokens * 1e3}
    if stats is not None:
        s: VerifyStats = trunk.stats
        out.update(steps=s.steps, checked=s.checked, checked_tokens=s.checked_tokens, check_s=s.check_s,
                   mismatches=s.mismatches, worst_rel_ok=s.worst_rel_ok)
    return out


async def run(n_decode: int, rounds: int, threads: int) -> dict:
    model = default_model_path()
    with LocalSwarm(model=str(model), n_trunks=2, planner=PlannerSettings(head_layers=4), threads=threads) as swarm:
        link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
        asker = Asker(model, link.head_layers, n_threads=threads, max_in_flight=64)
        trunks = {p: link if p == 0 else VerifyingTrunk(link, asker.gguf, share=p, n_threads=threads,
                                                       max_context=asker.max_context) for p in SHARES}
        prompt = asker.tokenizer.encode_prompt(PROMPT)
        try:
            for trunk in trunks.values():  # warm-up: graphs built, pages touched
                await generate_all(asker, prompt, trunk, ignore_eos=True, max_tokens=8, sampling=GREEDY)
            results: dict[float, list[dict]] = {p: [] for p in SHARES}
            for r in range(rounds):
                order = SHARES if r % 2 == 0 else tuple(reversed(SHARES))  # interleaved: drift hits all alike
                for p in order:
                    results[p].append(await one_round(asker, trunks[p], prompt, n_decode))
        finally:
            for trunk in trunks.values():
                if isinstance(trunk, VerifyingTrunk):
                    trunk.close()
            await link.close()
            asker.close()

    def med(p: float, key: str) -> float:
        return statistics.median(x[key] for x in results[p])

    def by_share(key: str, digits: int = 2) -> dict:
        return {str(p): round(med(p, key), digits) for p in SHARES}

    checked = {str(p): {"share_of_steps_checked": round(sum(x["checked"] for x in results[p])
                                                        / max(1, sum(x["steps"] for x in results[p])), 3),
                        "catch_up_tokens_per_check": round(sum(x["checked_tokens"] for x in results[p])
                                                           / max(1, sum(x["checked"] for x in results[p])), 2),
                        "check_ms_per_check": round(1e3 * sum(x["check_s"] for x in results[p])
                                                    / max(1, sum(x["checked"] for x in results[p])), 3),
                        "mismatches": sum(x["mismatches"] for x in results[p]),
                        "worst_honest_rel_error": round(max(x["worst_rel_ok"] for x in results[p]), 5)}
               for p in SHARES if p}
    return {
        "model": model.name, "threads_per_process": threads, "cores": os.cpu_count(), "trunks": 2,
        "prompt_tokens": len(prompt), "decode_tokens": n_decode, "concurrency": CONCURRENCY, "rounds": rounds,
        "tolerance": {"rel_error_max": REL_TOLERANCE, "cosine_min": MIN_COSINE},
        "single_stream_decode_tok_s": by_share("decode_tok_s"),
        "single_stream_request_tok_s": by_share("request_tok_s"),
        f"concurrency_{CONCURRENCY}_aggregate_tok_s": by_share("aggregate_tok_s"),
        "decode_relative_to_off": {str(p): round(med(p, "decode_tok_s") / med(0.0, "decode_tok_s"), 3)
                                   for p in SHARES},
        "aggregate_relative_to_off": {str(p): round(med(p, "aggregate_tok_s") / med(0.0, "aggregate_tok_s"), 3)
                                      for p in SHARES},
        "asker_cpu_ms_per_token": by_share("asker_cpu_ms_per_token", 3),
        "checks": checked,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=64, help="tokens per single-stream request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="compute threads of each process")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    emit_json(asyncio.run(run(args.decode, args.rounds, args.threads)), args.out)


if __name__ == "__main__":
    main()
