"""Slice engine vs llama-cpp-python, side by side in one run; prints JSON.

    python benchmarks/bench_slice.py [--model PATH] [--threads N] [--decode 64] [--repeats 5]
                                     [--device cpu|cuda[:N]|vulkan[:N]|...] [--prompt-tokens N] [--out FILE]

(a) llama-cpp-python, whole model; (b) our engine as one slice; (c) our engine as 4 slices in one
process. Same prompt, same thread count, interleaved repeats; medians and ratios b/a, c/a.
Decode = one token per step with greedy argmax, including each runtime's own per-step overhead
(llama-cpp-python copies logits into numpy, we copy the output tensor). Prefill ends when the
last position's logits are in hand (a GPU backend computes asynchronously; reading them waits).

On the CPU (the default) also the peak RSS of a process holding only layers [10, 20) against one
holding the whole model. On a GPU (``--device``): llama-cpp-python runs with every layer there
(n_gpu_layers=-1), our slices with weights, KV cache and graphs there; each run is a fresh
process (one Vulkan user per process, and a run that crashes is reported, not fatal), and the
memory report is the engine's device buffers (weights, KV cache, compute) against its tensors and
KV, with what the device itself reports used where it tracks that.

    GGML_VK_VISIBLE_DEVICES=0 .venv-gpu/bin/python benchmarks/bench_slice.py --device vulkan --decode 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.devices import Device, DeviceError, available_devices, choose_device  # noqa: E402
from kernels.gguf_file import GGUFFile  # noqa: E402
from kernels.slice import Placement, SliceEngine  # noqa: E402
from kernels.spec import ModelSpec, SliceSpec  # noqa: E402

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should have a beginning, a middle and an end, and it should mention the sea, "
          "a storm, a gull named Pete, an old radio, and a letter from a sister who lives far away. ") * 2
RUNTIMES = ("a_llama_cpp", "b_engine_1_slice", "c_engine_4_slices")
CHILD_TIMEOUT_S = 3600  # one run on lavapipe (~100x slower than the CPU) stays far below this
LLAMA_SPLIT_MODE_NONE = 0  # llama.h: the whole model on main_gpu


def per_cpu_second(n_prefill: int, prefill_cpu_s: float, n_decode: int, decode_cpu_s: float) -> dict:
    """Tokens per second of the process's CPU time (all its threads): unlike wall-clock rates,
    barely moved by other processes competing for the cores, though with several threads it
    counts their spin-waits too."""
    return {"prefill_tok_per_cpu_s": n_prefill / prefill_cpu_s, "decode_tok_per_cpu_s": n_decode / decode_cpu_s}


def llama_device_args(device: Device | None) -> dict:
    """llama-cpp-python's arguments for running every layer on ``device`` alone (none: the CPU);
    split mode NONE keeps llama.cpp from spreading layers over several GPUs. Its ``main_gpu``
    counts llama.cpp's own list (src/llama.cpp, model loading): RPC servers, then the other GPUs in
    the registry's order, integrated GPUs only where there is no other. Not followed here: it also
    drops a GPU whose device id an earlier one has (one card seen by two backends, as in a build
    with both CUDA and Vulkan), which would shift the count."""
    if device is None or device.is_cpu:
        return {}
    devices = available_devices()
    rpc = [d.name for d in devices if d.family == "rpc"]
    gpus = [d.name for d in devices if d.kind == "gpu" and d.family != "rpc"]
    order = rpc + (gpus or [d.name for d in devices if d.kind == "igpu"])
    if device.name not in order:
        raise DeviceError(f"llama-cpp-python does not use {device.label} (an integrated GPU beside another)")
    return {"n_gpu_layers": -1, "split_mode": LLAMA_SPLIT_MODE_NONE, "main_gpu": order.index(device.name)}


def device_memory(device: Device | None) -> tuple[int, int] | None:
    """(used, total) bytes as the device reports them now; None on the CPU."""
    if device is None or device.is_cpu:
        return None
    d = device.refreshed()
    return d.memory_total - d.memory_free, d.memory_total


def reported_growth(device: Device | None, before: tuple[int, int] | None) -> int | None:
    """Bytes the device reports used now beyond ``before``; None where that says nothing: on the
    CPU, when the total itself changed, or when the device reports the host's memory, whose free
    bytes move with every process on the machine (lavapipe: a fixed 2 GiB, or the host's memory,
    seen both ways)."""
    after = device_memory(device)
    if before is None or after is None or after[1] != before[1]:
        return None
    if after[1] == choose_device("cpu").memory_total:
        return None
    return after[0] - before[0]


def warmup_tokens(tokens: list[int], device: Device | None) -> list[int]:
    """What each runtime runs before it is timed. On a GPU the whole prompt: the backend builds
    its kernels for each shape on first use (on lavapipe an LLVM compile of seconds), and a
    shorter batch can take another matmul kernel than the timed one."""
    return tokens[:8] if device is None or device.is_cpu else tokens


def bench_llama_cpp(model: Path, tokens: list[int], n_decode: int, threads: int, *, repack: bool = False,
                    device: Device | None = None, flash: bool = False) -> dict:
    """``repack=False``: plain weight buffers, like the engine; ``True``: llama.cpp's default
    (repacked extra buffer types; can die with SIGILL on AMX CPUs, see bench_repack.py).
    ``flash``: llama-cpp-python's ``flash_attn=True``."""
    from kernels.oracle_llama import last_logits, load_llama

    before = device_memory(device)
    llm = load_llama(model, repack=repack, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                     flash_attn=flash, **llama_device_args(device))
    llm.eval(warmup_tokens(tokens, device))
    last_logits(llm)
    llm.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    llm.eval(tokens)
    tok = int(np.argmax(last_logits(llm)))
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    t2, c2 = time.perf_counter(), time.process_time()
    result = {"prefill_tok_s": len(tokens) / (t1 - t0), "decode_tok_s": n_decode / (t2 - t1),
              **per_cpu_second(len(tokens), c1 - c0, n_decode, c2 - c1)}
    if before is not None:
        result["device_reported_used_bytes"] = reported_growth(device, before)
    llm.close()
    return result


def make_engines(gguf: GGUFFile, cuts: list[int], threads: int, *, repack: bool = False,
                 device: Device | None = None, max_context: int = 1024, attention: str = "plain") -> list[SliceEngine]:
    """The model as consecutive slices, cut before each layer in ``cuts`` (none: one slice)."""
    n_layer = ModelSpec.from_gguf(gguf).n_layer
    bounds = [0, *cuts, n_layer]
    engines: list[SliceEngine] = []
    try:
        for a, b in zip(bounds, bounds[1:]):
            engines.append(SliceEngine(gguf, SliceSpec(a, b, a == 0, b == n_layer), n_threads=threads,
                                       max_context=max_context, placement=Placement(
                                           device=device, kernels="repack" if repack else "plain", attention=attention)))
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def bench_engine(gguf: GGUFFile, cuts: list[int], tokens: list[int], n_decode: int, threads: int,
                 *, repack: bool = False, device: Device | None = None, attention: str = "plain") -> dict:
    """On a GPU the result also carries ``memory``: the engines' device buffers (device_buffers)."""
    before = device_memory(device)
    engines = make_engines(gguf, cuts, threads, repack=repack, device=device, attention=attention)

    def step(rid: bytes, pos: int, new: list[int]) -> np.ndarray:
        x = engines[0].forward(rid, start_pos=pos, tokens=new)
        for e in engines[1:]:
            x = e.forward(rid, start_pos=pos, hidden=x)
        return x

    try:
        warm = secrets.token_bytes(16)
        step(warm, 0, warmup_tokens(tokens, device))
        for e in engines:
            e.release(warm)
        rid = secrets.token_bytes(16)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = step(rid, 0, tokens)
        tok = int(np.argmax(logits[-1]))
        t1, c1 = time.perf_counter(), time.process_time()
        for e in engines:  # count only decode steps in the overhead figures
            e.stats.calls = e.stats.tokens = 0
            e.stats.total_s = e.stats.compute_s = 0.0
        for i in range(n_decode):
            tok = int(np.argmax(step(rid, len(tokens) + i, [tok])[-1]))
        t2, c2 = time.perf_counter(), time.process_time()
        overhead_us = sum(e.stats.overhead_s for e in engines) / n_decode * 1e6
        compute_us = sum(e.stats.compute_s for e in engines) / n_decode * 1e6
        result = {"prefill_tok_s": len(tokens) / (t1 - t0), "decode_tok_s": n_decode / (t2 - t1),
                  "python_overhead_us_per_token": overhead_us, "ggml_compute_us_per_token": compute_us,
                  **per_cpu_second(len(tokens), c1 - c0, n_decode, c2 - c1)}
        if before is not None:
            result["memory"] = device_buffers(engines, reported_growth(device, before))
        return result
    finally:
        for e in engines:
            e.close()


def device_buffers(engines: list[SliceEngine], reported_used: int | None) -> dict:
    """The engines' device memory while one request (prompt + decode) is in flight, slice by slice:
    weights as copied, KV cache as allocated (it grows with the request, up to max_context), and
    compute buffers, against the tensors' own bytes + that KV. ``reported_used``: what the device
    says it lost meanwhile (None where that means nothing: reported_growth)."""
    slices = []
    for e in engines:
        s = {"layers": [e.slice.start, e.slice.stop], "placement": e.placement(),
             "tensor_bytes": e.weights.n_bytes, "weights_device_bytes": e.weights.copied_bytes,
             "kv_bytes": e.kv_bytes, "compute_bytes": e.compute_buffer_bytes()}
        s["weights_kv_over_tensors_kv"] = ((s["weights_device_bytes"] + s["kv_bytes"])
                                           / (s["tensor_bytes"] + s["kv_bytes"]))
        slices.append(s)
    fields = ("tensor_bytes", "weights_device_bytes", "kv_bytes", "compute_bytes")
    total = {k: sum(s[k] for s in slices) for k in fields}
    buffers = total["weights_device_bytes"] + total["kv_bytes"] + total["compute_bytes"]
    ratio = (total["weights_device_bytes"] + total["kv_bytes"]) / (total["tensor_bytes"] + total["kv_bytes"])
    # The target: device memory <= tensors + KV + 10 % + the backend's fixed cost. Compute buffers
    # are counted with the fixed cost: they follow the largest graph (the prompt chunk), not the
    # layers held; llama.cpp reserves its own for n_batch tokens.
    return {"slices": slices, "total": total, "device_buffer_bytes": buffers,
            "weights_kv_over_tensors_kv": ratio, "weights_kv_within_10_percent": ratio <= 1.1,
            "device_reported_used_bytes": reported_used,
            "device_reported_beyond_buffers": None if reported_used is None else reported_used - buffers}


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


# --- on a GPU: every run in a process of its own ---

def run_child(args: argparse.Namespace, runtime: str, cuts: list[int]) -> dict:
    """One run of ``runtime`` (llama or engine) in a fresh process: its result, or ``{"failed":
    why}`` when it crashed, failed or hung."""
    cmd = [sys.executable, __file__, "--device-child", runtime, "--cuts", ",".join(map(str, cuts)),
           "--device", args.device, "--threads", str(args.threads), "--decode", str(args.decode),
           "--prompt-tokens", str(args.prompt_tokens or 0)]
    if args.model:
        cmd += ["--model", args.model]
    return json_child(cmd, CHILD_TIMEOUT_S)


def json_child(cmd: list[str], timeout_s: float) -> dict:
    """A child process whose last line of output is its JSON result: that, or ``{"failed": why}``
    when it crashed, failed or ran past ``timeout_s``."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout_s} s"}
    if out.returncode != 0:
        return {"failed": exit_reason(out.returncode, out.stderr)}
    return json.loads(out.stdout.strip().splitlines()[-1])


def exit_reason(returncode: int, stderr: str) -> str:
    """A child's failure in one line: the signal that killed it, or its exit code and last words."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"exit {returncode}: {lines[-1] if lines else 'no message'}"


def device_child(args: argparse.Namespace, device: Device) -> None:
    runtime = args.device_child
    cuts = [int(c) for c in args.cuts.split(",") if c]
    model, tokens = prompt_tokens(args)
    if runtime == "llama":
        result = bench_llama_cpp(model, tokens, args.decode, args.threads, device=device)
    else:
        with GGUFFile(model) as gguf:
            result = bench_engine(gguf, cuts, tokens, args.decode, args.threads, device=device)
    print(json.dumps(result))


def prompt_tokens(args: argparse.Namespace) -> tuple[Path, list[int]]:
    from kernels.tokenizer import Tokenizer
    from swarmctl.model_files.models import resolve_model

    model = resolve_model(args.model)
    tokens = Tokenizer(model).encode_prompt(PROMPT)
    return model, tokens[:args.prompt_tokens] if args.prompt_tokens else tokens


def medians(rs: list[dict]) -> dict:
    """Per-figure medians over the runs that finished (figures some run lacks left out)."""
    ok = [r for r in rs if "failed" not in r]
    if not ok:
        return {}
    return {k: statistics.median(r[k] for r in ok) for k in ok[0]
            if all(isinstance(r.get(k), (int, float)) for r in ok)}


def ratios(med: dict) -> dict:
    a = med["a_llama_cpp"]
    out = {}
    for phase in ("decode", "prefill"):
        for key, name in (("b", "b_engine_1_slice"), ("c", "c_engine_4_slices")):
            ours, theirs = med[name].get(f"{phase}_tok_s"), a.get(f"{phase}_tok_s")
            out[f"{phase}_{key}_over_a"] = ours / theirs if ours and theirs else None
    return out


def device_main(args: argparse.Namespace, device: Device, n_layer: int, n_prompt: int, model: Path) -> dict:
    four = [4, n_layer // 2, n_layer - 4]
    plan = {"a_llama_cpp": ("llama", []), "b_engine_1_slice": ("engine", []), "c_engine_4_slices": ("engine", four)}
    runs: dict[str, list[dict]] = {name: [] for name in RUNTIMES}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all three alike
        for name in RUNTIMES:
            runs[name].append(run_child(args, *plan[name]))
    med = {name: medians(rs) for name, rs in runs.items()}
    memory = {name: next((r["memory"] for r in runs[name] if "memory" in r), None) for name in RUNTIMES[1:]}
    memory["a_llama_cpp_device_reported_used_bytes"] = med["a_llama_cpp"].get("device_reported_used_bytes")
    return {
        "command": " ".join(["python", *sys.argv]),
        "note": "tokens per wall-clock second, medians over the runs that finished; every run a fresh process "
                "warmed up on the whole prompt; prefill ends when the last logits are read; memory from the "
                "first engine run that finished, while its request is in flight",
        "model": model.name, "device": {"label": device.label, "name": device.name,
                                         "description": device.description, "memory_total": device.memory_total},
        "threads": args.threads, "prompt_tokens": n_prompt, "decode_tokens": args.decode,
        "repeats": args.repeats, "four_slice_cuts": four, "median": med,
        "failed_runs": {name: [r["failed"] for r in rs if "failed" in r] for name, rs in runs.items()},
        "ratios": ratios(med) if all(med.values()) else None,
        "targets": {"decode": 0.9, "prefill": 0.9, "device_memory_over_tensors_kv": 1.1},
        "memory": memory,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda[:N], vulkan[:N], metal, rocm[:N], auto")
    p.add_argument("--prompt-tokens", type=int, default=0, help="keep only the prompt's first N tokens (0: all)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--rss-child", nargs=3, metavar=("MODEL", "START", "STOP"))
    p.add_argument("--device-child", choices=("llama", "engine"), help=argparse.SUPPRESS)
    p.add_argument("--cuts", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]), int(args.rss_child[2]), args.threads)
        return
    if args.decode < 1 or args.repeats < 1 or args.prompt_tokens < 0:
        sys.exit("bench_slice: --decode and --repeats must be at least 1, --prompt-tokens at least 0")
    try:
        device = choose_device(args.device)
    except DeviceError as e:
        print(f"bench_slice: {e}", file=sys.stderr)
        sys.exit(2)
    if args.device_child:
        device_child(args, device)
        return

    model, tokens = prompt_tokens(args)
    gguf = GGUFFile(model)
    n_layer = ModelSpec.from_gguf(gguf).n_layer
    if not device.is_cpu:
        gguf.close()
        result = device_main(args, device, n_layer, len(tokens), model)
    else:
        result = cpu_main(args, gguf, model, tokens, n_layer)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def cpu_main(args: argparse.Namespace, gguf: GGUFFile, model: Path, tokens: list[int], n_layer: int) -> dict:
    four = [4, n_layer // 2, n_layer - 4]
    runs: dict[str, list[dict]] = {name: [] for name in RUNTIMES}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all three alike
        runs["a_llama_cpp"].append(bench_llama_cpp(model, tokens, args.decode, args.threads))
        runs["b_engine_1_slice"].append(bench_engine(gguf, [], tokens, args.decode, args.threads))
        runs["c_engine_4_slices"].append(bench_engine(gguf, four, tokens, args.decode, args.threads))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    return {
        "model": model.name, "threads": args.threads, "prompt_tokens": len(tokens), "decode_tokens": args.decode,
        "repeats": args.repeats, "four_slice_cuts": four, "median": med, "ratios": ratios(med),
        "targets": {"decode": 0.95, "prefill": 0.9},
        "memory": memory_report(model, n_layer, args.threads),
    }


if __name__ == "__main__":
    main()
