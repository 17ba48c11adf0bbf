"""The noise mitigation's curve: token recovery against quality loss, at several noise levels; prints JSON.

    python benchmarks/privacy_curve.py [--levels 0,0.03,0.1,0.3,1,3] [--max-candidates 64] [--out FILE]

One local swarm (host + 2 trunk processes, capture on) serves every level. At each sigma scale S
the asker adds S · std_d · N(0, 1) to every uplink activation (std_d: dimension d's spread over the
calibration paragraph), runs the 20 audit prompts greedily, and the audit attacks the captures:

- recovery: prompt and generated tokens read back by the first stage, by an attacker who knows
  the mitigation (it is public code; distances weighed by 1 / std_d) and by a naive one (plain
  relative L2); and the last stage's downlink top-1 agreement with the asker's tokens;
- quality: greedy agreement of the generated tokens with the clean run (same position), and the
  perplexity of a fixed held-out paragraph with the noise applied (in-process, mean of 3 draws).

The attacker's search is capped at --max-candidates per position: with noise no candidate
reproduces the observed state, so every position costs the whole cap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from swarmctl.audit.meter import AuditSettings, attack_and_score, capture_traffic, load_prompts  # noqa: E402
from swarmctl.audit.noise import UplinkNoise, calibrate  # noqa: E402
from swarmctl.audit.quality import greedy_agreement, perplexity  # noqa: E402
from swarmctl.audit.tables import default_cache_dir  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

HELD_OUT = (
    "Every spring the river floods the low meadows, and the farmers move their sheep to the hills. The "
    "water brings silt that makes the soil rich, so the villagers have learned to wait for it rather than "
    "fight it. When the river falls again in May, they plant barley and beans, and by August the valley is "
    "green from one end to the other. The old mill still stands by the ford, although nobody has ground "
    "flour there for forty years; in autumn the children dare each other to climb its broken wheel."
)
PERPLEXITY_DRAWS = 3


def mean_perplexity(model: Path, head_layers: int, std: np.ndarray, scale: float, seed: int, threads: int) -> float:
    if not scale:
        return perplexity(model, head_layers, HELD_OUT, n_threads=threads)
    return statistics.fmean(
        perplexity(model, head_layers, HELD_OUT, n_threads=threads,
                   uplink_transform=UplinkNoise(std, scale, np.random.default_rng(seed + i)))
        for i in range(PERPLEXITY_DRAWS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="0,0.03,0.1,0.3,1,3", help="sigma scales, comma-separated (0: the clean run)")
    p.add_argument("--head-layers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16, help="generated per prompt")
    p.add_argument("--max-candidates", type=int, default=64, help="attacker's candidates per position")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", type=Path, default=default_cache_dir())
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()

    model = default_model_path()
    levels = [float(x) for x in args.levels.split(",")]
    if 0.0 not in levels:
        levels = [0.0, *levels]  # greedy agreement needs the clean run
    prompts = load_prompts()
    base = AuditSettings(head_layers=args.head_layers, max_tokens=args.max_tokens, max_candidates=args.max_candidates,
                         noise_seed=args.seed, attack_threads=args.threads, cache_dir=args.cache)
    std = calibrate(model, args.head_layers, n_threads=args.threads)
    rows, clean_runs, clean_ppl = [], None, None
    t0 = time.perf_counter()
    with LocalSwarm(model=str(model), n_trunks=2, planner=PlannerSettings(head_layers=args.head_layers),
                    threads=1, capture=True) as swarm:
        for level in sorted(levels):
            settings = replace(base, uplink_noise=level)
            runs, captures = capture_traffic(swarm, model, prompts, settings, threads=1)
            knows = attack_and_score(model, runs, captures, settings).summary()
            naive = attack_and_score(model, runs, captures, replace(settings, attacker_knows_noise=False)).summary() \
                if level else knows
            ppl = mean_perplexity(model, args.head_layers, std, level, args.seed, args.threads)
            if level == 0.0:
                clean_runs, clean_ppl = runs, ppl
            rows.append({
                "uplink_noise": level,
                "prompt_token_recovery": knows["prompt_token_recovery"],
                "prompt_token_recovery_naive_attacker": naive["prompt_token_recovery"],
                "prompts_recovered_completely": knows["prompts_recovered_completely"],
                "generated_token_recovery": knows["generated_token_recovery"],
                "candidates_per_token_mean": knows["candidates_per_token_mean"],
                "downlink_top1_agreement": knows["downlink_top1_agreement"],
                "greedy_agreement_with_clean": round(greedy_agreement(clean_runs, runs), 4),
                "perplexity": round(ppl, 2),
                "perplexity_ratio": round(ppl / clean_ppl, 3),
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "model": model.name, "head_layers": args.head_layers, "prompts": len(prompts),
        "prompt_tokens": knows["prompt_tokens"], "max_tokens": args.max_tokens,
        "max_candidates": args.max_candidates, "noise_seed": args.seed, "perplexity_draws": PERPLEXITY_DRAWS,
        "elapsed_s": round(time.perf_counter() - t0, 1), "levels": rows,
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
