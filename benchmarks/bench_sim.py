"""Whole-swarm simulation runs per minute (harness/sim): seeds FIRST.. for a while, each a fresh
swarm (host, 3 trunks, 2 askers: 5 members) with 8 asks and up to 3 faults in a minute of
virtual time, its invariants checked. Prints JSON (runs per minute, virtual seconds per wall
second, median run, what failed and the seeds to replay it with ``python -m harness.sim --seed``).

    python benchmarks/bench_sim.py [--minutes 2] [--first 1000] [--out benchmarks/results/bench_sim.json]

Compute is the real engine on a tiny model (harness/tiny_models.py, 8 layers of 64); the template
(model file, identities) is made once, before the clock starts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from harness.sim.run import play  # noqa: E402
from harness.sim.schedule import draw  # noqa: E402
from harness.sim.world import Template, WorldSpec  # noqa: E402


def _kind(failure: str) -> str:
    """A failure without its particulars (which ask, which tokens), to count distinct ones."""
    for key in ("never ended", "not the fault-free", "past its", "ended with an error that is not", "revoked at",
                "failed with no fault", "still holds", "the plan was", "over budget", "did not finish", "unhandled", "ended with"):
        if key in failure:
            return key
    return failure[:60]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--first", type=int, default=1000, help="the first seed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    spec = WorldSpec()
    Template.of(spec)
    play(draw(args.first - 1, spec), spec)  # warm: the measured figures and the reference tokens
    walls, virtuals, failed, kinds = [], [], {}, Counter()
    seed, start = args.first, time.perf_counter()
    while time.perf_counter() - start < args.minutes * 60:
        result = play(draw(seed, spec), spec)
        walls.append(result.wall_s)
        virtuals.append(result.virtual_s)
        if not result.ok:
            failed[seed] = result.failures
            kinds.update({_kind(f) for f in result.failures})
        seed += 1
    elapsed = time.perf_counter() - start
    emit_json({
        "runs": len(walls), "seconds": round(elapsed, 1), "runs_per_minute": round(len(walls) / elapsed * 60, 1),
        "median_run_s": round(statistics.median(walls), 3), "virtual_s_per_run_median": round(statistics.median(virtuals), 1),
        "virtual_per_wall": round(sum(virtuals) / sum(walls), 1),
        "members": spec.trunks + len(spec.askers), "asks_per_run": 8, "faults_per_run_at_most": 3,
        "failed_runs": len(failed), "failure_kinds": dict(kinds),
        "failed_seeds": {str(s): f[:3] for s, f in list(failed.items())[:20]},
        "seeds": [args.first, seed - 1],
    }, args.out)


if __name__ == "__main__":
    main()
