"""Whole-swarm simulation runs per minute (harness/sim): seeds FIRST.. for a while, each a fresh
swarm (host, 3 trunks, 2 askers: 5 members) with 8 asks and up to 3 faults in a minute of
virtual time, its invariants checked. Prints JSON (runs per minute, virtual seconds per wall
second, median run in wall and CPU seconds, datagrams carried, what failed and the seeds to replay
it with ``python -m harness.sim --seed``).

    python benchmarks/bench_sim.py [--minutes 2] [--first 1000] [--compute tiny,stand-in] [--jobs 2] [--out FILE]

``--compute``: the real engine on a tiny model (harness/tiny_models.py, 8 layers of 64) and/or the
stand-in (harness/sim/standin.py), one after the other in this process, on the same seeds; the
result is one entry per kind. The template (model file, identities) is made once; in each process one
run of each kind warms up (the model headers, the engines' first load) inside the measured minutes.
``--jobs N``: N processes forked after the template is made, each on its own seeds, runs per minute
summed (on 2 cores, 2 jobs is the most that helps). CPU seconds are the workers' own: on a machine
others share they say more than wall time does.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from harness.sim.run import play  # noqa: E402
from harness.sim.schedule import draw  # noqa: E402
from harness.sim.standin import COMPUTE_KINDS  # noqa: E402
from harness.sim.world import Template, WorldSpec  # noqa: E402


def _kind(failure: str) -> str:
    """A failure without its particulars (which ask, which tokens), to count distinct ones."""
    for key in ("never ended", "not the fault-free", "past its", "ended with an error that is not", "revoked at",
                "failed with no fault", "still holds", "the plan was", "over budget", "did not finish", "unhandled", "ended with"):
        if key in failure:
            return key
    return failure[:60]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


@dataclass
class Runs:
    """What one process measured: one entry per run."""

    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    virtuals: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    failed: dict[int, list[str]] = field(default_factory=dict)

    def extend(self, other: "Runs") -> None:
        self.walls += other.walls
        self.cpus += other.cpus
        self.virtuals += other.virtuals
        self.sent += other.sent
        self.failed.update(other.failed)


def run_for(spec: WorldSpec, compute: str, seeds: range, until: float) -> Runs:
    """Seeds from `seeds`, one after another, until the clock passes `until` (time.time())."""
    play(draw(seeds[0] - 1, spec), spec, compute=compute)  # warm: the template, headers and first engine loads
    gc.collect()
    gc.freeze()  # (what the warm run left, modules and template included, is not walked by every full collection)
    runs = Runs()
    for seed in seeds:
        if time.time() >= until:
            break
        cpu = time.process_time()
        result = play(draw(seed, spec), spec, compute=compute)
        runs.cpus.append(time.process_time() - cpu)
        runs.walls.append(result.wall_s)
        runs.virtuals.append(result.virtual_s)
        runs.sent.append(result.net.sent)
        if not result.ok:
            runs.failed[seed] = result.failures
    return runs


def bench(spec: WorldSpec, compute: str, first: int, minutes: float, jobs: int) -> dict:
    """`jobs` processes, each on its own seeds (first+i, first+i+jobs, ...), for `minutes` of wall time;
    runs per minute are all of theirs together."""
    load, start = os.getloadavg()[0], time.perf_counter()
    until = time.time() + minutes * 60
    seed_sets = [range(first + i, first + 10**7, jobs) for i in range(jobs)]
    runs = Runs()
    if jobs == 1:
        runs.extend(run_for(spec, compute, seed_sets[0], until))
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for part in pool.starmap(run_for, [(spec, compute, seeds, until) for seeds in seed_sets]):
                runs.extend(part)
    elapsed = time.perf_counter() - start
    kinds = Counter(kind for failures in runs.failed.values() for kind in {_kind(f) for f in failures})
    return {
        "compute": compute, "jobs": jobs, "runs": len(runs.walls), "seconds": round(elapsed, 1),
        "runs_per_minute": round(len(runs.walls) / elapsed * 60, 1),
        "median_run_s": round(statistics.median(runs.walls), 3),
        "median_run_cpu_s": round(statistics.median(runs.cpus), 3),
        "runs_per_cpu_minute": round(len(runs.cpus) / sum(runs.cpus) * 60, 1),
        "virtual_s_per_run_median": round(statistics.median(runs.virtuals), 1),
        "virtual_per_wall": round(sum(runs.virtuals) / sum(runs.walls), 1),
        "datagrams_per_run_median": int(statistics.median(runs.sent)),
        "members": spec.trunks + len(spec.askers), "asks_per_run": 8, "faults_per_run_at_most": 3,
        "failed_runs": len(runs.failed), "failure_kinds": dict(kinds),
        "failed_seeds": {str(s): f[:3] for s, f in sorted(runs.failed.items())[:20]},
        "seeds_from": first, "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="per compute kind")
    parser.add_argument("--first", type=int, default=1000, help="the first seed")
    parser.add_argument("--compute", default=",".join(COMPUTE_KINDS),
                        help=f"comma-separated, of {', '.join(COMPUTE_KINDS)} (default both)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes, each on its own seeds (default 1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs takes 1 or more")
    kinds = args.compute.split(",")
    if any(k not in COMPUTE_KINDS for k in kinds):
        parser.error(f"--compute takes {', '.join(COMPUTE_KINDS)}")
    spec = WorldSpec()
    Template.of(spec)
    emit_json({"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "results": [bench(spec, kind, args.first, args.minutes, args.jobs) for kind in kinds]}, args.out)


if __name__ == "__main__":
    main()
