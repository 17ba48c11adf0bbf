"""Graph builds when the set of requests in a batch keeps changing; prints JSON.

    python benchmarks/bench_batch_graphs.py [--batches 120] [--threads 1] [--out FILE]

Eight requests decode at the asker's head (embedding + 4 layers), its tail (4 layers + LM head)
and a trunk stage between them (the rest), in batches of 2 or 3 of them drawn at random (what
the asker's runners formed with eight streams), then the same three every batch. For each slice,
with kept graphs rebound to the batch's caches (kernels/graph_bind.py, the engine's default on
the CPU) and with graphs kept by the requests they were built for (``rebind_graphs`` False, as
before): graphs built, and the engine's time per batch outside ggml's compute (``ForwardStats``:
building, rebinding, inputs, outputs), medians, with the compute beside it. CPU time of this thread, so
other processes' load counts little; the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from kernels.gguf_file import GGUFFile  # noqa: E402
from kernels.slice import SliceEngine, Step  # noqa: E402
from kernels.spec import ModelSpec, SliceSpec  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

HEAD_LAYERS = 4
N_REQUESTS = 8


def run(gguf: GGUFFile, spec: ModelSpec, slice_spec: SliceSpec, rebind: bool, batches: int, threads: int) -> dict:
    def step(rid: bytes, pos: int, n: int) -> Step:
        if slice_spec.has_embedding:
            return Step(rid, pos, tokens=[5] * n)
        return Step(rid, pos, hidden=np.zeros((n, spec.n_embd), np.float32))

    with SliceEngine(gguf, slice_spec, n_threads=threads) as engine:
        engine.rebind_graphs = rebind
        ids = [f"r{i}".encode() for i in range(N_REQUESTS)]
        pos = dict.fromkeys(ids, 16)
        for rid in ids:
            engine.forward_batch([step(rid, 0, 16)])
        for k in (1, 2, 3):  # every batch size once: the shapes a steady run keeps
            engine.forward_batch([step(rid, pos[rid], 1) for rid in ids[:k]])
            for rid in ids[:k]:
                pos[rid] += 1
        rng = random.Random(1)
        out = {}
        for phase, pick in (("random_2_or_3_of_8", lambda: rng.sample(ids, rng.choice((2, 3)))),
                            ("same_3_every_batch", lambda: ids[:3])):
            builds, outside, compute, cpu = engine.stats.graph_builds, [], [], []
            for _ in range(batches):
                batch = pick()
                before = (engine.stats.total_s, engine.stats.compute_s)
                t0 = time.thread_time()
                engine.forward_batch([step(rid, pos[rid], 1) for rid in batch])
                cpu.append(time.thread_time() - t0)
                total, comp = engine.stats.total_s - before[0], engine.stats.compute_s - before[1]
                outside.append(total - comp)
                compute.append(comp)
                for rid in batch:
                    pos[rid] += 1
            out[phase] = {
                "graph_builds": engine.stats.graph_builds - builds,
                "batches": batches,
                "outside_compute_ms_median": round(statistics.median(outside) * 1e3, 3),
                "outside_compute_ms_mean": round(statistics.mean(outside) * 1e3, 3),
                "compute_ms_median": round(statistics.median(compute) * 1e3, 3),
                "cpu_ms_per_batch_median": round(statistics.median(cpu) * 1e3, 3),
                "cpu_ms_per_batch_mean": round(statistics.mean(cpu) * 1e3, 3),
            }
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=120)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = default_model_path()
    results = {}
    with GGUFFile(model) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        slices = {"asker_head": SliceSpec(0, HEAD_LAYERS, has_embedding=True),
                  "trunk": SliceSpec(HEAD_LAYERS, spec.n_layer - HEAD_LAYERS),
                  "asker_tail": SliceSpec(spec.n_layer - HEAD_LAYERS, spec.n_layer, has_lm_head=True)}
        for name, slice_spec in slices.items():
            results[name] = {mode: run(gguf, spec, slice_spec, mode == "rebound", args.batches, args.threads)
                             for mode in ("kept_by_requests", "rebound")}
    emit_json({"model": model.name, "threads": args.threads, "cpus": os.cpu_count(),
               "load_average_at_end": os.getloadavg(), "slices": results}, args.out)


if __name__ == "__main__":
    main()
