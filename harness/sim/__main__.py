"""python -m harness.sim --seed N: one simulated run of the whole swarm, replayed from its seed,
with its schedule, its event log (virtual seconds, node, what happened) and what failed.

    python -m harness.sim --seed 42                 replay seed 42 (warnings and the sim's own events)
    python -m harness.sim --seed 42 --verbose       every node's info log too
    python -m harness.sim --seed 42 --shrink        a failing run: the fewest events that still fail
    python -m harness.sim --seeds 0:200             many runs; one line each, the failing seeds at the end
    python -m harness.sim --seeds 0:200 --compute stand-in    the same with the stand-in compute (faster)
    python -m harness.sim --seeds 0:200 --jobs 2    the same in two worker processes (one line per seed, in order)
    python -m harness.sim --seeds 0:100 --world verified        askers that verify every step; lying trunks
    python -m harness.sim --seed 9 --kinds classic  the seven kinds the seeds recorded before "rejoin" were drawn with
    python -m harness.sim --seed 68 --kinds pre-stop  every kind but "stop" (seeds recorded with "all" before it)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from harness.sim.run import play
from harness.sim.schedule import CLASSIC, draw, kinds_for
from harness.sim.shrink import shrink
from harness.sim.standin import COMPUTE_KINDS
from harness.sim.world import WORLDS


def _seeds(text: str) -> range:
    first, _, last = text.partition(":")
    try:
        return range(int(first), int(last)) if last else range(int(first), int(first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed range (FIRST:LAST, e.g. 0:100)") from None


@dataclass(frozen=True)
class SeedOutcome:
    """What one run of a seed range reports: small enough to come back from a worker process."""

    seed: int
    ok: bool
    wall_s: float
    failures: tuple[str, ...]


def _run_seed(seed: int, *, spec_name: str, asks: int, faults: int, kinds: tuple[str, ...], compute: str) -> SeedOutcome:
    spec = WORLDS[spec_name]
    started = time.monotonic()
    try:
        result = play(draw(seed, spec, asks=asks, faults=faults, kinds=kinds), spec, compute=compute)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - the harness's own failure is this seed's, not the sweep's
        # (a CancelledError, a BaseException, escaped a run once and took a --jobs worker with it:
        # the pool never heard of that seed again and the sweep waited for good)
        return SeedOutcome(seed, False, time.monotonic() - started, (f"the harness raised {e!r}",))
    return SeedOutcome(seed, result.ok, result.wall_s, tuple(result.failures))


def _outcomes(seeds: range, jobs: int, run_one) -> Iterator[SeedOutcome]:
    """The seeds' outcomes in seed order, from this process or from `jobs` forked workers (each run
    is a fresh swarm on its own virtual clock, so runs share nothing and a seed replays the same
    wherever it ran)."""
    if jobs <= 1:
        yield from map(run_one, seeds)
        return
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap(run_one, seeds, chunksize=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.sim", description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=int, help="replay this seed, with its event log")
    which.add_argument("--seeds", type=_seeds, help="run FIRST:LAST (one line per seed)")
    parser.add_argument("--asks", type=int, default=8, help="asks per run (default 8)")
    parser.add_argument("--faults", type=int, default=3, help="faults per run, at most (default 3)")
    parser.add_argument("--jobs", type=int, default=1, help="with --seeds: worker processes (default 1)")
    parser.add_argument("--verbose", action="store_true", help="every node's info log in the event log")
    parser.add_argument("--shrink", action="store_true", help="shrink a failing schedule")
    parser.add_argument("--compute", choices=COMPUTE_KINDS, default="tiny",
                        help="the real engine on a tiny model (default), or the stand-in: outputs a cheap "
                             "function of the inputs (harness/sim/standin.py)")
    parser.add_argument("--world", choices=sorted(WORLDS), default="plain",
                        help="plain (3 trunks, 2 askers; default), late (a 4th trunk not started with the swarm), "
                             "verified (late, and askers that verify every step), moe (a tiny qwen3moe, one of "
                             "the trunks an expert node; the tiny compute only), churn (layers placed by speed; "
                             "trunks whose speed changes)")
    parser.add_argument("--kinds", choices=("all", "classic", "new", "pre-stop"), default="all",
                        help="draw faults of every kind the world allows (default); of the seven the seeds "
                             "recorded in docs/simulator.md and tests/test_sim.py were drawn with; of the "
                             "world's others as first added (rejoin, join, wrong, expert_kill); or of every kind "
                             "but stop (seeds recorded with 'all' before stop existed)")
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":  # (sets of strings iterate in one order every time)
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "harness.sim", *(sys.argv[1:] if argv is None else argv)])
    if args.jobs < 1:
        parser.error(f"--jobs takes a number of worker processes, 1 or more (not {args.jobs})")
    spec = WORLDS[args.world]
    if spec.n_expert and args.compute != "tiny":
        parser.error("the stand-in compute has no mixture of experts: --world moe runs with --compute tiny")
    kinds = {"all": kinds_for(spec), "classic": CLASSIC, "new": tuple(k for k in kinds_for(spec, stop=False) if k not in CLASSIC),
             "pre-stop": kinds_for(spec, stop=False)}[args.kinds]
    if args.seeds is not None:
        failed = []
        run_one = partial(_run_seed, spec_name=args.world, asks=args.asks, faults=args.faults, kinds=kinds,
                          compute=args.compute)
        for outcome in _outcomes(args.seeds, args.jobs, run_one):
            print(f"seed {outcome.seed}: {'ok' if outcome.ok else 'FAILED'} ({outcome.wall_s:.2f} s)"
                  + "".join(f"\n    {f}" for f in outcome.failures), flush=True)
            if not outcome.ok:
                failed.append(outcome.seed)
        print(f"{len(args.seeds) - len(failed)} of {len(args.seeds)} runs passed; failed: {failed or 'none'}")
        return 1 if failed else 0
    schedule = draw(args.seed, spec, asks=args.asks, faults=args.faults, kinds=kinds)
    print(schedule.describe())
    result = play(schedule, spec, verbose=args.verbose, compute=args.compute)
    print("\n".join(result.log))
    print(f"virtual {result.virtual_s:.1f} s in {result.wall_s:.2f} s; network: {result.net}")
    if result.ok:
        print("all invariants held")
        return 0
    print("FAILED:\n" + "\n".join(f"  {f}" for f in result.failures))
    if args.shrink:
        smallest = shrink(schedule, lambda s: not play(s, spec, compute=args.compute).ok,
                          report=lambda line: print(f"shrink: {line}"))
        print("shrunk to:\n" + smallest.describe())
        print("FAILED:\n" + "\n".join(f"  {f}" for f in play(smallest, spec, compute=args.compute).failures))
    return 1


if __name__ == "__main__":
    sys.exit(main())
