"""Decode speed under each kernels and attention choice, ours and llama.cpp's, side by side in one run; prints JSON.

    python benchmarks/bench_kernels.py [--threads 1,2] [--repeats 3] [--decode 64]
                                       [--llama-bench PATH] [--cache-dir DIR] [--out FILE]
                                       [--models bundled_q4_1,q4_0_copy]

For the bundled model (SmolLM2-135M Q4_1) and a Q4_0 copy of it (made once with
``llama_model_quantize``, kept in --cache-dir: Q4_0 is a type the CPU's repacked buffers take on
AVX2 / AVX-512 / NEON; Q4_1 has a layout only in AMX's), at each thread count:

    engine_plain      our engine, the whole model as one slice, kernels plain (weights mapped)
    engine_repack     the same with kernels repack (the CPU's extra buffer types but AMX)
    engine_flash, engine_repack_flash   the same two with attention flash (ggml_flash_attn_ext)
    llama_plain       llama-cpp-python, use_extra_bufts=False
    llama_default     llama-cpp-python's default load (use_extra_bufts=True: every extra type)
    llama_plain_flash, llama_default_flash   the same two with flash_attn=True
    llama_bench_rR_faF  llama-bench built from the llama.cpp llama-cpp-python vendors (--llama-bench),
                      ``--repack 0,1`` by ``-fa 0,1``: tg (decode) only, its own repetitions (flash
                      attention is llama.cpp's default on the CPU)

Each engine and llama-cpp-python figure is one subprocess (a crash, as llama.cpp's AMX path had
on AMX Xeons, is reported, not fatal), rounds interleaved across variants (llama-bench too: one
repetition of each of its four configurations a round, a key ``llama_bench_error`` if it fails); quoted: medians over
--repeats rounds of greedy decode after an 8-token prompt, per wall-clock second (``decode_tok_s``)
and per second of the process's CPU time (``decode_tok_per_cpu_s``: steadier on a shared machine).
``ratios`` gives the engine's best over llama.cpp's best configuration at each thread count (from
llama-cpp-python, and from llama-bench with and without flash attention): the goal is >= 0.95.
With two threads on a 2-core machine that other work shares, any other process stalls ggml's
thread barriers: read those rounds' spread before their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_repack import cpu_description, quantized_copy  # noqa: E402
from benchmarks.bench_slice import bench_engine, bench_llama_cpp  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402

VARIANTS = ("engine_plain", "engine_repack", "engine_flash", "engine_repack_flash",
            "llama_plain", "llama_default", "llama_plain_flash", "llama_default_flash")
PROMPT = list(range(1000, 1008))  # 8 token ids: the decode runs at a short context, as llama-bench's tg does
CHILD_TIMEOUT_S = 300


def child(variant: str, model: Path, n_decode: int, threads: int) -> dict:
    """One round of one variant, in this (fresh) process."""
    if variant.startswith("engine"):
        from kernels.backend import describe_kernels
        from kernels.gguf_file import GGUFFile
        from kernels.slice import Placement, SliceEngine
        from kernels.spec import ModelSpec, SliceSpec

        kernels = "repack" if "repack" in variant else "plain"
        attention = "flash" if variant.endswith("_flash") else "plain"
        with GGUFFile(model) as gguf:
            spec = ModelSpec.from_gguf(gguf)
            with SliceEngine(gguf, SliceSpec(0, spec.n_layer, True, True), n_threads=threads, max_context=256,
                             placement=Placement(kernels=kernels, attention=attention)) as probe:
                placed = sorted(set(probe.weights.repacked_into.values()))
                n = len(probe.weights.repacked)
                said = probe.describe_attention()
            r = bench_engine(gguf, [], PROMPT, n_decode, threads, repack=kernels == "repack", attention=attention)
        extra = {"repacked_weights": n, "repacked_into": placed, "kernels": describe_kernels(kernels),
                 "attention": said, "python_overhead_us_per_token": r["python_overhead_us_per_token"],
                 "ggml_compute_us_per_token": r["ggml_compute_us_per_token"]}
    else:
        r = bench_llama_cpp(model, PROMPT, n_decode, threads, repack="default" in variant,
                            flash=variant.endswith("_flash"))
        extra = {}
    return {"decode_tok_s": r["decode_tok_s"], "decode_tok_per_cpu_s": r["decode_tok_per_cpu_s"], **extra}


def run_child(variant: str, model: Path, n_decode: int, threads: int) -> dict:
    args = [sys.executable, __file__, "--child", variant, os.fspath(model), "--threads", str(threads),
            "--decode", str(n_decode)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    if proc.returncode < 0:
        return {"error": f"crashed: {signal.Signals(-proc.returncode).name}", "stderr_tail": proc.stderr[-500:]}
    if proc.returncode != 0:
        return {"error": f"exit status {proc.returncode}", "stderr_tail": proc.stderr[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_bench(binary: Path, model: Path, threads: int, n_decode: int, repeats: int) -> dict:
    """llama-bench's tg figures (decode of ``n_decode`` tokens, ``repeats`` repetitions: the rounds
    call it with one, between the other variants) for ``--repack 0,1`` by ``-fa 0,1``, keyed ``llama_bench_r{repack}_fa{fa}``: its samples' median, its mean and the samples, tok/s."""
    cmd = [os.fspath(binary), "-m", os.fspath(model), "-p", "0", "-n", str(n_decode), "-t", str(threads),
           "-r", str(repeats), "--repack", "0,1", "-fa", "0,1", "-o", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"llama_bench_error": {"error": f"timed out after {CHILD_TIMEOUT_S} s"}}
    if proc.returncode != 0:
        why = f"crashed: {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"llama_bench_error": {"error": why, "stderr_tail": proc.stderr[-500:]}}
    out = {}
    for row in json.loads(proc.stdout):
        key = f"llama_bench_r{int(row['repack'])}_fa{int(row['flash_attn'])}"
        out[key] = {"decode_tok_s": round(statistics.median(row["samples_ts"]), 2), "mean_tok_s": round(row["avg_ts"], 2),
                    "samples_tok_s": [round(x, 2) for x in row["samples_ts"]], "build_commit": row.get("build_commit")}
    return out


def summarize(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[0]["error"], "rounds_failed": len(rounds)}
    out = {k: round(statistics.median(r[k] for r in ok), 2) for k in ("decode_tok_s", "decode_tok_per_cpu_s")}
    out["rounds_tok_s"] = [round(r["decode_tok_s"], 2) for r in ok]
    for k in ("python_overhead_us_per_token", "ggml_compute_us_per_token"):
        if k in ok[0]:
            out[k] = round(statistics.median(r[k] for r in ok), 1)
    out.update((k, v) for k, v in ok[0].items() if k not in out and not isinstance(v, float))
    if len(ok) < len(rounds):
        out["errors"] = sorted({r["error"] for r in rounds if "error" in r})
    return out


def summarize_bench(rounds: list[dict]) -> dict:
    """llama-bench's rounds (one repetition each): the median of its samples."""
    samples = [x for r in rounds for x in r.get("samples_tok_s", [])]
    if not samples:
        return {"error": rounds[0].get("error", "no samples"), "rounds_failed": len(rounds)}
    return {"decode_tok_s": round(statistics.median(samples), 2), "rounds_tok_s": samples,
            "build_commit": rounds[0].get("build_commit")}


def ratios(at: dict) -> dict:
    """The engine's best over llama.cpp's best, per source of llama.cpp's figure."""
    def best(*names: str) -> float | None:
        values = [at[n]["decode_tok_s"] for n in names if n in at and "decode_tok_s" in at[n]]
        return max(values) if values else None

    engine = best(*(v for v in VARIANTS if v.startswith("engine")))
    out = {}
    for label, names in (("llama_cpp_python", tuple(v for v in VARIANTS if v.startswith("llama"))),
                         ("llama_bench_without_flash_attn", ("llama_bench_r0_fa0", "llama_bench_r1_fa0")),
                         ("llama_bench", ("llama_bench_r0_fa0", "llama_bench_r1_fa0", "llama_bench_r0_fa1",
                                          "llama_bench_r1_fa1"))):
        theirs = best(*names)
        if engine and theirs:
            out[f"engine_best_over_{label}_best"] = round(engine / theirs, 3)
    for ours, theirs in (("engine_repack", "engine_plain"), ("llama_default", "llama_plain"),
                         ("engine_plain", "llama_plain"), ("engine_repack", "llama_default"),
                         ("engine_flash", "engine_plain"), ("llama_plain_flash", "llama_plain"),
                         ("engine_flash", "llama_plain_flash"), ("engine_repack_flash", "llama_default_flash")):
        a, b = best(ours), best(theirs)
        if a and b:
            out[f"{ours}_over_{theirs}"] = round(a / b, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--models", default="bundled_q4_1,q4_0_copy", help="which of the two, comma-separated (default both)")
    p.add_argument("--llama-bench", type=Path, help="a llama-bench binary built from the vendored llama.cpp")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "swarmctl-bench-repack")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    threads = [int(t) for t in str(args.threads).split(",")]
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.decode, threads[0])))
        return
    if args.llama_bench is not None and not args.llama_bench.is_file():
        sys.exit(f"bench_kernels: no llama-bench at {args.llama_bench}")
    from kernels.backend import cpu_extra_buffer_types
    from swarmctl.model_files.models import default_model_path

    bundled = default_model_path()
    wanted = str(args.models).split(",")
    models = {"bundled_q4_1": bundled} if "bundled_q4_1" in wanted else {}
    if "q4_0_copy" in wanted:
        models["q4_0_copy"] = quantized_copy(bundled, "Q4_0", args.cache_dir)
    load_start = os.getloadavg()
    rounds: dict[tuple[str, int, str], list[dict]] = {}
    for _ in range(args.repeats):  # interleaved: each round runs every variant once, llama-bench's too
        for label, model in models.items():
            for t in threads:
                for variant in VARIANTS:
                    rounds.setdefault((label, t, variant), []).append(run_child(variant, model, args.decode, t))
                if args.llama_bench is not None:  # (one repetition a round, so the load it meets is the others')
                    for key, row in llama_bench(args.llama_bench, model, t, args.decode, 1).items():
                        rounds.setdefault((label, t, key), []).append(row)
    results: dict = {}
    for (label, t, variant), rs in rounds.items():
        summary = summarize_bench(rs) if variant.startswith("llama_bench") else summarize(rs)
        results.setdefault(label, {}).setdefault(f"threads_{t}", {})[variant] = summary
    for label in results:
        for at in results[label].values():
            at["ratios"] = ratios(at)
    emit_json({"benchmark": "bench_kernels", **cpu_description(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
               "cpu_extra_buffer_types": list(cpu_extra_buffer_types()), "decode_tokens": args.decode,
               "repeats": args.repeats, "models": {k: str(v) for k, v in models.items()}, "results": results},
              args.out)


if __name__ == "__main__":
    main()
