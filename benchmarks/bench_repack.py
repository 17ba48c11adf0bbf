"""llama.cpp's repacked weights against plain buffers, and our engine beside both; prints JSON.

    python benchmarks/bench_repack.py [--model PATH] [--threads N] [--repeats 3] [--decode 16]
                                      [--cache-dir DIR] [--out FILE]

llama.cpp's CPU backend can place weights in an "extra" buffer type that repacks them into
interleaved blocks (Q4_0 → Q4_0_8x8, Q4_K → Q4_K_8x8, ... on AVX2 / NEON; AMX tiles on Intel CPUs
with AMX) for faster matmuls. llama-cpp-python does so by default; the tests' oracle and the other
benchmarks load plain buffers, as our engine computes. This measures what that choice costs.

For the model (default: the bundled SmolLM2-135M Q4_1) and a Q4_0 and a Q4_K_M copy of it, made
with ``llama_model_quantize`` (requantized from the Q4_1 file, kept in --cache-dir):

    llama_repacked   llama-cpp-python's default loading (use_extra_bufts=True)
    llama_plain      llama-cpp-python with use_extra_bufts=False (the oracle's way)
    engine_plain     our engine, the whole model as one slice (kernels.SliceEngine), mapped weights
    engine_repacked  the same with kernels="repack" (the CPU's extra buffer types but AMX)

Each is measured in its own subprocess (so a SIGILL on an AMX CPU is reported as "crashed", not
the end of the benchmark), rounds interleaved across models and variants; the figures are medians
over --repeats rounds: prompt processing of 128 and 512 tokens (one batch each) and greedy decode
(--decode steps after each prompt), with the timing loops of bench_slice.py. Each rate comes
twice: tokens per wall-clock second (``*_tok_s``) and per second of the process's CPU time
(``*_tok_per_cpu_s``); on a machine that other work shares, the second moves far less (with one
thread it is the cleaner comparison of kernels). Also reported: the buffer types llama.cpp put
each model's weights in, how many matrices the engine repacked, and ratios between the variants.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_slice import PROMPT, bench_engine, bench_llama_cpp  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402

VARIANTS = ("llama_repacked", "llama_plain", "engine_plain", "engine_repacked")
PROMPT_LENGTHS = (128, 512)
CHILD_TIMEOUT_S = 300


def quantized_copy(source: Path, ftype_name: str, cache_dir: Path) -> Path:
    """``source`` requantized to ``LLAMA_FTYPE_MOSTLY_<ftype_name>`` (made once, then reused)."""
    import llama_cpp

    out = cache_dir / f"{source.stem}.{ftype_name}.gguf"
    if out.exists() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True  # the source is already quantized (Q4_1)
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(os.fspath(source).encode(), os.fspath(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype_name} failed ({rc})")
    tmp.replace(out)
    return out


def tensor_types(model: Path) -> dict[str, int]:
    """How many matrices of each ggml type the model holds (2-D and larger tensors)."""
    import gguf

    from kernels.gguf_file import GGUFFile

    counts: dict[str, int] = {}
    with GGUFFile(model) as g:
        for info in g.tensors.values():
            if len(info.shape) >= 2:
                name = gguf.GGMLQuantizationType(info.ggml_type).name
                counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def child(variant: str, model: Path, tokens: list[int], n_decode: int, threads: int) -> dict:
    """One round of one variant, in this (fresh) process."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "model buffer size" in message or "preferred buffer type" in message:
                lines.append(message.strip())

    llama_log = logging.getLogger("llama.cpp")
    llama_log.setLevel(logging.DEBUG)
    llama_log.addHandler(Collect())
    out: dict = {}
    gguf_file = None
    if variant.startswith("engine"):
        from kernels.gguf_file import GGUFFile
        from kernels.slice import Placement, SliceEngine
        from kernels.spec import ModelSpec, SliceSpec

        gguf_file = GGUFFile(model)
        spec = ModelSpec.from_gguf(gguf_file)
        with SliceEngine(gguf_file, SliceSpec(0, spec.n_layer, True, True), n_threads=threads,
                         max_context=256, placement=Placement(kernels="repack" if variant == "engine_repacked" else "plain")) as probe:
            out["engine_repacked_matrices"] = len(probe.weights.repacked)
    for n in PROMPT_LENGTHS:
        if variant.startswith("engine"):
            r = bench_engine(gguf_file, [], tokens[:n], n_decode, threads, repack=variant == "engine_repacked")
        else:
            r = bench_llama_cpp(model, tokens[:n], n_decode, threads, repack=variant == "llama_repacked")
        out[f"pp{n}_tok_s"] = r["prefill_tok_s"]
        out[f"decode_after_{n}_tok_s"] = r["decode_tok_s"]
        out[f"pp{n}_tok_per_cpu_s"] = r["prefill_tok_per_cpu_s"]
        out[f"decode_after_{n}_tok_per_cpu_s"] = r["decode_tok_per_cpu_s"]
    if gguf_file is not None:
        gguf_file.close()
    if lines:
        out["llama_cpp_load_log"] = sorted(set(lines))
    return out


def run_child(variant: str, model: Path, tokens: list[int], n_decode: int, threads: int) -> dict:
    args = [sys.executable, __file__, "--child", variant, os.fspath(model), "--threads", str(threads),
            "--decode", str(n_decode), "--tokens", ",".join(map(str, tokens))]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        return {"error": f"crashed: {sig}", "stderr_tail": proc.stderr[-500:]}
    if proc.returncode != 0:
        return {"error": f"exit status {proc.returncode}", "stderr_tail": proc.stderr[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_description() -> dict:
    info = {"cpu": "unknown", "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and info["cpu"] == "unknown":
            info["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
            break
    return info


def summarize(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[0]["error"], "rounds_failed": len(rounds)}
    keys = [k for k, v in ok[0].items() if isinstance(v, float)]
    med = {k: round(statistics.median(r[k] for r in ok), 2) for k in keys}
    if len(ok) < len(rounds):
        med["rounds_failed"] = len(rounds) - len(ok)
        med["errors"] = sorted({r["error"] for r in rounds if "error" in r})
    med.update((k, v) for k, v in ok[0].items() if not isinstance(v, float))  # what was loaded where
    return med


def ratios(med: dict) -> dict:
    def ratio(a: str, b: str) -> dict:
        x, y = med.get(a, {}), med.get(b, {})
        if "error" in x or "error" in y:
            return {"error": x.get("error") or y.get("error")}
        return {k: round(x[k] / y[k], 3) for k, v in x.items() if isinstance(v, float) and k in y}

    return {"llama_plain_over_llama_repacked": ratio("llama_plain", "llama_repacked"),
            "engine_plain_over_llama_plain": ratio("engine_plain", "llama_plain"),
            "engine_plain_over_llama_repacked": ratio("engine_plain", "llama_repacked"),
            "engine_repacked_over_engine_plain": ratio("engine_repacked", "engine_plain"),
            "engine_repacked_over_llama_repacked": ratio("engine_repacked", "llama_repacked")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "swarmctl-bench-repack")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        tokens = [int(t) for t in args.tokens.split(",")]
        print(json.dumps(child(args.child[0], Path(args.child[1]), tokens, args.decode, args.threads)))
        return

    from kernels.backend import cpu_extra_buffer_types
    from kernels.tokenizer import Tokenizer
    from swarmctl.model_files.models import resolve_model

    t_start = time.perf_counter()
    source = resolve_model(args.model)
    models = {"source": source, "Q4_0": quantized_copy(source, "Q4_0", args.cache_dir),
              "Q4_K_M": quantized_copy(source, "Q4_K_M", args.cache_dir)}
    tokens = Tokenizer(source).encode_prompt(PROMPT * 8)
    if len(tokens) < max(PROMPT_LENGTHS):
        raise SystemExit(f"the prompt gives only {len(tokens)} tokens")
    tokens = tokens[:max(PROMPT_LENGTHS)]
    rounds: dict[str, dict[str, list[dict]]] = {m: {v: [] for v in VARIANTS} for m in models}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every variant alike
        for name, path in models.items():
            for variant in VARIANTS:
                rounds[name][variant].append(run_child(variant, path, tokens, args.decode, args.threads))
    result = {
        "command": " ".join(["python benchmarks/bench_repack.py", *sys.argv[1:]]),
        "machine": cpu_description(), "extra_buffer_types": sorted(cpu_extra_buffer_types()), "threads": args.threads, "repeats": args.repeats,
        "decode_tokens": args.decode, "prompt_lengths": list(PROMPT_LENGTHS),
        "note": "medians over rounds; each round a fresh process per variant; tokens per wall-clock "
                "second (*_tok_s) and per CPU second of the process (*_tok_per_cpu_s)",
        "models": {},
    }
    for name, path in models.items():
        med = {v: summarize(rounds[name][v]) for v in VARIANTS}
        result["models"][name] = {"file": path.name, "matrix_types": tensor_types(path), "median": med,
                                  "ratios": ratios(med)}
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
