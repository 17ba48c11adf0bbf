"""Slice engine vs llama-cpp-python, side by side in one run; prints JSON.

    python benchmarks/bench_slice.py [--model PATH] [--threads N] [--decode 64] [--repeats 5]

(a) llama-cpp-python, whole model; (b) our engine as one slice; (c) our engine as 4 slices in one
process. Same prompt, same thread count, interleaved repeats; medians and ratios b/a, c/a.
Decode = one token per step with greedy argmax, including each runtime's own per-step overhead
(llama-cpp-python copies logits into numpy, we copy the output tensor). Also the peak RSS of a
process holding only layers [10, 20) against one holding the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.gguf_file import GGUFFile  # noqa: E402
from kernels.slice import SliceEngine  # noqa: E402
from kernels.spec import ModelSpec, SliceSpec  # noqa: E402

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should have a beginning, a middle and an end, and it should mention the sea, "
          "a storm, a gull named Pete, an old radio, and a letter from a sister who lives far away. ") * 2


def per_cpu_second(n_prefill: int, prefill_cpu_s: float, n_decode: int, decode_cpu_s: float) -> dict:
    """Tokens per second of the process's CPU time (all its threads): unlike wall-clock rates,
    barely moved by other processes competing for the cores, though with several threads it
    counts their spin-waits too."""
    return {"prefill_tok_per_cpu_s": n_prefill / prefill_cpu_s, "decode_tok_per_cpu_s": n_decode / decode_cpu_s}


def bench_llama_cpp(model: Path, tokens: list[int], n_decode: int, threads: int, *, repack: bool = False) -> dict:
    """``repack=False``: plain weight buffers, like the engine; ``True``: llama.cpp's default
    (repacked extra buffer types; can die with SIGILL on AMX CPUs, see bench_repack.py)."""
    from kernels.oracle_llama import last_logits, load_llama

    llm = load_llama(model, repack=repack, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads)
    llm.eval(tokens[:8])  # warm-up
    llm.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    llm.eval(tokens)
    t1, c1 = time.perf_counter(), time.process_time()
    tok = int(np.argmax(last_logits(llm)))
    t2, c2 = time.perf_counter(), time.process_time()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    t3, c3 = time.perf_counter(), time.process_time()
    llm.close()
    return {"prefill_tok_s": len(tokens) / (t1 - t0), "decode_tok_s": n_decode / (t3 - t2),
            **per_cpu_second(len(tokens), c1 - c0, n_decode, c3 - c2)}


def bench_engine(gguf: GGUFFile, cuts: list[int], tokens: list[int], n_decode: int, threads: int,
                 *, repack: bool = False) -> dict:
    spec = ModelSpec.from_gguf(gguf)
    bounds = [0, *cuts, spec.n_layer]
    engines = [SliceEngine(gguf, SliceSpec(a, b, a == 0, b == spec.n_layer), n_threads=threads, max_context=1024,
                           repack=repack)
               for a, b in zip(bounds, bounds[1:])]

    def step(rid: bytes, pos: int, new: list[int]) -> np.ndarray:
        x = engines[0].forward(rid, start_pos=pos, tokens=new)
        for e in engines[1:]:
            x = e.forward(rid, start_pos=pos, hidden=x)
        return x

    try:
        warm = secrets.token_bytes(16)
        step(warm, 0, tokens[:8])
        for e in engines:
            e.release(warm)
        rid = secrets.token_bytes(16)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = step(rid, 0, tokens)
        t1, c1 = time.perf_counter(), time.process_time()
        tok = int(np.argmax(logits[-1]))
        for e in engines:  # count only decode steps in the overhead figures
            e.stats.calls = e.stats.tokens = 0
            e.stats.total_s = e.stats.compute_s = 0.0
        t2, c2 = time.perf_counter(), time.process_time()
        for i in range(n_decode):
            tok = int(np.argmax(step(rid, len(tokens) + i, [tok])[-1]))
        t3, c3 = time.perf_counter(), time.process_time()
        overhead_us = sum(e.stats.overhead_s for e in engines) / n_decode * 1e6
        compute_us = sum(e.stats.compute_s for e in engines) / n_decode * 1e6
        return {"prefill_tok_s": len(tokens) / (t1 - t0), "decode_tok_s": n_decode / (t3 - t2),
                "python_overhead_us_per_token": overhead_us, "ggml_compute_us_per_token": compute_us,
                **per_cpu_second(len(tokens), c1 - c0, n_decode, c3 - c2)}
    finally:
        for e in engines:
            e.close()


def rss_child(model: str, start: int, stop: int, threads: int) -> None:
    """Runs in a fresh process: hold one slice, run it once, report memory."""
    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    baseline = status("VmRSS")
    gguf = GGUFFile(model)
    spec = ModelSpec.from_gguf(gguf)
    s = SliceSpec(start, stop, start == 0, stop == spec.n_layer)
    engine = SliceEngine(gguf, s, n_threads=threads, max_context=512)
    x = {"tokens": list(range(100, 164))} if s.has_embedding else {
        "hidden": np.random.default_rng(0).standard_normal((64, spec.n_embd)).astype(np.float32)}
    engine.forward(b"r" * 16, start_pos=0, **x)
    print(json.dumps({"baseline_rss": baseline, "peak_rss": status("VmHWM"), "rss": status("VmRSS"),
                      "tensor_bytes": engine.weights.n_bytes, "kv_bytes": engine.kv_bytes}))


def measure_rss(model: Path, start: int, stop: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--rss-child", os.fspath(model), str(start), str(stop),
                          "--threads", str(threads)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    r["rss_above_baseline"] = r["rss"] - r["baseline_rss"]
    r["rss_above_baseline_over_tensor_bytes"] = r["rss_above_baseline"] / r["tensor_bytes"]
    return r


def memory_report(model: Path, n_layer: int, threads: int) -> dict:
    """RSS of processes holding [10, 20), the whole model, and one layer [10, 11). The one-layer
    process estimates the fixed cost (ggml tables, thread stacks, compute buffer), so
    (RSS - fixed) / tensor bytes shows whether memory tracks the tensors a slice holds."""
    one, ten, whole = (measure_rss(model, a, b, threads) for a, b in ((10, 11), (10, 20), (0, n_layer)))
    fixed = one["rss_above_baseline"] - one["tensor_bytes"]
    for r in (ten, whole):
        r["rss_above_baseline_minus_fixed_over_tensor_bytes"] = (r["rss_above_baseline"] - fixed) / r["tensor_bytes"]
    return {"layers_10_20": ten, "whole_model": whole, "layer_10_only": one, "fixed_bytes_estimate": fixed,
            "tensor_bytes_ratio_10_20_over_whole": ten["tensor_bytes"] / whole["tensor_bytes"],
            "rss_above_baseline_ratio_10_20_over_whole": ten["rss_above_baseline"] / whole["rss_above_baseline"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rss-child", nargs=3, metavar=("MODEL", "START", "STOP"))
    args = p.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]), int(args.rss_child[2]), args.threads)
        return

    from kernels.tokenizer import Tokenizer
    from swarmctl.models import resolve_model

    model = resolve_model(args.model)
    tokens = Tokenizer(model).encode_prompt(PROMPT)
    gguf = GGUFFile(model)
    n_layer = ModelSpec.from_gguf(gguf).n_layer
    four = [4, n_layer // 2, n_layer - 4]
    runs: dict[str, list[dict]] = {"a_llama_cpp": [], "b_engine_1_slice": [], "c_engine_4_slices": []}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all three alike
        runs["a_llama_cpp"].append(bench_llama_cpp(model, tokens, args.decode, args.threads))
        runs["b_engine_1_slice"].append(bench_engine(gguf, [], tokens, args.decode, args.threads))
        runs["c_engine_4_slices"].append(bench_engine(gguf, four, tokens, args.decode, args.threads))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    a = med["a_llama_cpp"]
    result = {
        "model": model.name, "threads": args.threads, "prompt_tokens": len(tokens), "decode_tokens": args.decode,
        "repeats": args.repeats, "four_slice_cuts": four, "median": med,
        "ratios": {
            "decode_b_over_a": med["b_engine_1_slice"]["decode_tok_s"] / a["decode_tok_s"],
            "decode_c_over_a": med["c_engine_4_slices"]["decode_tok_s"] / a["decode_tok_s"],
            "prefill_b_over_a": med["b_engine_1_slice"]["prefill_tok_s"] / a["prefill_tok_s"],
            "prefill_c_over_a": med["c_engine_4_slices"]["prefill_tok_s"] / a["prefill_tok_s"],
        },
        "targets": {"decode": 0.95, "prefill": 0.9},
        "memory": memory_report(model, n_layer, args.threads),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
