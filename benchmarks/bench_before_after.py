"""Nothing slower: this tree against an earlier commit, side by side in one run; prints JSON.

    python benchmarks/bench_before_after.py --before REV [--rounds 3] [--out FILE]

A restructuring must not cost speed. Each round runs, in both trees and in alternating order (so a
machine whose load changes affects both alike), each tree's own copy of

- ``benchmarks/bench_local_swarm.py --rounds 1``: single-stream greedy decode through the local
  swarm ``ask`` starts (the ``split`` layout), llama-cpp-python beside it;
- ``benchmarks/bench_swarm.py --speculative --spec-repeats 1``: speculative steps over the WAN
  emulation (20 ms links, jitter, loss), ngram and self-drafting against no speculation.

The earlier commit is checked out into a temporary git worktree; each child runs with its tree
first on ``PYTHONPATH``, so its own code is measured. Medians over the rounds, and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402

HERE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Probe:
    """One benchmark script run in a tree, and how to read its figures."""

    name: str
    args: tuple[str, ...]

    def figures(self, result: dict) -> dict[str, float]:
        if self.name == "local_swarm":
            medians = result["single_stream_decode_tok_s_median"]
            return {"split_tok_s": medians["split"], "llama_cpp_python_tok_s": medians["llama_cpp_python"]}
        tasks = result["g_speculative"]["tasks"]
        out: dict[str, float] = {}
        for task, modes in tasks.items():
            for mode, row in modes.items():
                if isinstance(row, dict) and "tok_s" in row:
                    out[f"{task}.{mode}_tok_s"] = row["tok_s"]
        return out


PROBES = (
    Probe("local_swarm", ("benchmarks/bench_local_swarm.py", "--rounds", "1")),
    Probe("wan_speculative", ("benchmarks/bench_swarm.py", "--speculative", "--spec-repeats", "1")),
)


def last_json(stdout: str) -> dict:
    """The JSON object a benchmark printed last (emit_json prints it indented, from a line '{')."""
    start = stdout.rfind("\n{")
    return json.loads(stdout[start + 1:] if start >= 0 else stdout)


def run_probe(tree: Path, probe: Probe) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, *probe.args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{probe.name} failed in {tree}: {done.stderr.strip().splitlines()[-1:]}")
    return probe.figures(last_json(done.stdout))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=[probe.name for probe in PROBES], help="run one of the two benchmarks")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    probes = [probe for probe in PROBES if args.only in (None, probe.name)]
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=HERE, capture_output=True, text=True,
                         check=True).stdout.strip()
    after_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                               check=True).stdout.strip()
    samples: dict[str, dict[str, dict[str, list[float]]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="swarmctl-before-") as tmp:
        before_tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before_tree), rev], cwd=HERE, check=True)
        try:
            trees = {"before": before_tree, "after": HERE}
            started = time.time()
            for round_no in range(args.rounds):
                order = ["before", "after"] if round_no % 2 == 0 else ["after", "before"]
                for probe in probes:
                    for side in order:
                        for key, value in run_probe(trees[side], probe).items():
                            samples[side].setdefault(probe.name, {}).setdefault(key, []).append(value)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=HERE, check=False)
    medians = {side: {name: {k: statistics.median(v) for k, v in figs.items()} for name, figs in by.items()}
               for side, by in samples.items()}
    ratio = {name: {k: round(medians["after"][name][k] / medians["before"][name][k], 3)
                    for k in medians["after"][name] if medians["before"][name].get(k)}
             for name in medians["after"]}
    emit_json({"before": rev, "after": after_rev, "rounds": args.rounds, "cpus": os.cpu_count(),
               "loadavg_after": os.getloadavg(), "wall_s": round(time.time() - started, 1),
               "medians": medians, "after_over_before": ratio, "samples": samples}, args.out)


if __name__ == "__main__":
    main()
