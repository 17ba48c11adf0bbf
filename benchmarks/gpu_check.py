"""The one check to run on a machine with a GPU: does swarmctl compute right and fast there?

    scripts/gpu-env.sh cuda
    .venv-gpu/bin/python benchmarks/gpu_check.py [--device cuda] [--generate 16] [--decode 32] [--repeats 3]

1. Lists the devices this build of llama-cpp-python offers (what ``swarmctl devices`` shows).
2. The oracle rule (harness/oracle.py) on the device: our engine, whole model and as 4 slices, against
   llama-cpp-python with every layer on the same device: greedy tokens, then logits teacher-forced
   along llama-cpp-python's tokens.
3. ``benchmarks/bench_slice.py --device``: decode and prefill against llama-cpp-python on the
   device, whole and as 4 slices, and the engine's device memory against its tensors + KV cache.

Prints one JSON summary; exit 0 when the oracle rule holds everywhere and nothing crashed, 1
otherwise, 2 when the device is not there. Every run is a process of its own (ggml-vulkan crashed
with two Vulkan users in one process) and a crash is reported as one, not retried unless
``--attempts`` says so (each crashed attempt is listed). Any device works, e.g. Mesa's lavapipe:

    GGML_VK_VISIBLE_DEVICES=0 .venv-gpu/bin/python benchmarks/gpu_check.py --device vulkan \\
        --generate 6 --decode 4 --repeats 1 --prompt-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_slice import exit_reason, llama_device_args, make_engines  # noqa: E402
from kernels.devices import Device, DeviceError, available_devices, choose_device  # noqa: E402
from kernels.gguf_file import GGUFFile  # noqa: E402
from kernels.slice import SliceEngine  # noqa: E402
from kernels.spec import ModelSpec  # noqa: E402
from harness.oracle import judge_logits  # noqa: E402

PROMPT = "The capital of France is"
CHILD_TIMEOUT_S = 3600
SPEED_TARGET = 0.9  # issue 16: decode and prefill >= 0.9x llama-cpp-python on the same device
MEMORY_TARGET = 1.1  # device weights + KV <= 1.1x tensors + KV (the fixed cost reported beside it)


# --- in child processes ---

def oracle_child(args: argparse.Namespace, device: Device, out: Path) -> None:
    """llama-cpp-python on the device: the prompt's ids, its greedy tokens, and its logits
    teacher-forced along them, by the schedule our engine follows (forced_then_greedy): the
    prompt in one batch, then one token per step. Not harness.oracle.oracle_logits' one batch over
    everything: a row computed in a batch and the same row computed alone differ by more than
    the rule's cosine allows (0.99928 seen, on the CPU as on lavapipe), in either runtime."""
    from kernels.oracle_llama import last_logits, load_llama
    from swarmctl.model_files.models import resolve_model
    from harness.oracle import oracle_greedy

    llm = load_llama(resolve_model(args.model), n_ctx=512, n_batch=512, n_threads=args.threads,
                     n_threads_batch=args.threads, **llama_device_args(device))
    ids = llm.tokenize(args.prompt.encode(), add_bos=True, special=False)
    theirs = oracle_greedy(llm, ids, args.generate)
    llm.reset()
    rows = []
    for batch in [ids] + [[t] for t in theirs]:
        llm.eval(batch)
        rows.append(last_logits(llm).copy())
    # judge_logits reads a matrix over every position; the prompt's rows but its last stay zero.
    logits = np.zeros((len(ids) + len(theirs), len(rows[0])), dtype=np.float32)
    logits[len(ids) - 1:] = rows
    np.savez(out, ids=np.array(ids), theirs=np.array(theirs, dtype=np.int64), logits=logits)
    llm.close()


def engine_child(args: argparse.Namespace, device: Device, oracle: Path, out: Path) -> None:
    """Our engine on the device, as the slices ``--cuts`` makes: teacher-forced logits along the
    oracle's tokens, and our own greedy tokens."""
    from kernels.tokenizer import Tokenizer
    from swarmctl.model_files.models import resolve_model

    model = resolve_model(args.model)
    data = np.load(oracle)
    ids, theirs = [int(t) for t in data["ids"]], [int(t) for t in data["theirs"]]
    cuts = [int(c) for c in args.cuts.split(",") if c]
    with GGUFFile(model) as gguf:
        engines = make_engines(gguf, cuts, args.threads, device=device, max_context=512)
        try:
            placement = [e.placement() for e in engines]
            rows, ours = forced_then_greedy(engines, ids, theirs, args.generate, Tokenizer(model).is_end_of_generation)
        finally:
            for e in engines:
                e.close()
    np.savez(out, rows=np.array(rows), ours=np.array(ours, dtype=np.int64), placement=np.array(placement))


def forced_then_greedy(engines: Sequence[SliceEngine], ids: list[int], theirs: list[int], n: int,
                       is_eog) -> tuple[list[np.ndarray], list[int]]:
    """One request: the prompt, then llama-cpp-python's tokens one decode step at a time, whose
    last rows are the teacher-forced logits (rows[i] predicts generated token i). While our argmax
    agrees, that pass is our greedy run too; where it first differs, the cache is rewound to that
    position and our own tokens continue. Decode steps rather than one prefill keeping every row:
    it is how both runtimes generate, and on lavapipe an LM head over 10+ rows at once corrupted
    the heap (tests/test_gpu_devices.py)."""
    rid = secrets.token_bytes(16)

    def step(pos: int, new: list[int]) -> np.ndarray:
        x = engines[0].forward(rid, start_pos=pos, tokens=new)
        for e in engines[1:]:
            x = e.forward(rid, start_pos=pos, hidden=x)
        return x[-1]

    rows = [step(0, ids)]
    for i, t in enumerate(theirs):
        rows.append(step(len(ids) + i, [t]))
    ours: list[int] = []
    for row, t in zip(rows, theirs + [None]):
        tok = int(np.argmax(row))
        if len(ours) == n or is_eog(tok):
            break
        ours.append(tok)
        if tok != t:
            break
    diverged = bool(ours) and (len(ours) > len(theirs) or ours[-1] != theirs[len(ours) - 1])
    while diverged and len(ours) < n:
        tok = int(np.argmax(step(len(ids) + len(ours) - 1, [ours[-1]])))
        if is_eog(tok):
            break
        ours.append(tok)
    for e in engines:
        e.release(rid)
    return rows, ours


# --- in the parent ---

def run(cmd: list[str]) -> tuple[subprocess.CompletedProcess | None, str | None, float]:
    """A child process: (its result, why it failed or None, seconds it took)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {CHILD_TIMEOUT_S} s", time.perf_counter() - t0
    failed = exit_reason(out.returncode, out.stderr) if out.returncode else None
    return out, failed, time.perf_counter() - t0


def child_cmd(args: argparse.Namespace, *extra: str) -> list[str]:
    cmd = [sys.executable, __file__, "--device", args.device, "--threads", str(args.threads),
           "--generate", str(args.generate), "--prompt", args.prompt, *extra]
    return cmd + (["--model", args.model] if args.model else [])


def attempts(args: argparse.Namespace, cmd: list[str]) -> tuple[bool, list[str], float]:
    """Run ``cmd`` up to ``--attempts`` times until one finishes: (finished, each failure, seconds
    of the last attempt)."""
    failures: list[str] = []
    for _ in range(args.attempts):
        _, failed, seconds = run(cmd)
        if failed is None:
            return True, failures, seconds
        failures.append(failed)
    return False, failures, seconds


def check_oracle(args: argparse.Namespace, cuts_by_name: dict[str, list[int]], tmp: Path) -> dict:
    """The oracle rule for each slicing, and whole against sliced."""
    oracle = tmp / "oracle.npz"
    ok, failures, seconds = attempts(args, child_cmd(args, "--oracle-child", str(oracle)))
    if not ok:
        return {"llama_cpp": {"finished": False, "failures": failures}}
    data = np.load(oracle)
    ids, theirs, ref = [int(t) for t in data["ids"]], [int(t) for t in data["theirs"]], data["logits"]
    report: dict = {"prompt_tokens": len(ids), "theirs": theirs,
                    "llama_cpp": {"finished": True, "failures": failures, "seconds": round(seconds, 1)}}
    rows = {}
    for name, cuts in cuts_by_name.items():
        out = tmp / f"{name}.npz"
        cmd = child_cmd(args, "--engine-child", str(oracle), str(out), "--cuts", ",".join(map(str, cuts)))
        ok, failures, seconds = attempts(args, cmd)
        report[name] = {"cuts": cuts, "finished": ok, "failures": failures}
        if ok:
            mine = np.load(out)
            rows[name] = mine["rows"]
            report[name].update(judged(ids, [int(t) for t in mine["ours"]], theirs, mine["rows"], ref),
                                placement=[str(p) for p in mine["placement"]], seconds=round(seconds, 1))
    if len(rows) == 2:
        report["whole_vs_sliced"] = compare(*rows.values())
    return report


def judged(ids: list[int], ours: list[int], theirs: list[int], rows: np.ndarray, ref: np.ndarray) -> dict:
    # judge_logits reads rows [len(ids) - 1, len(ids) + len(theirs)) of a matrix over every
    # position; the earlier ones (the prompt's) were not computed and are left zero.
    mine = np.zeros((len(ids) + len(theirs), rows.shape[1]), dtype=np.float32)
    mine[len(ids) - 1:] = rows
    v = judge_logits(ids, ours, theirs, mine, ref)
    return {"passes": v.passes, "ours": ours, "first_divergence": v.first_divergence,
            "gap_at_divergence": v.gap_at_divergence, "min_cosine": v.min_cosine,
            "confident_argmax_mismatches": v.confident_argmax_mismatches}


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min_cosine": float(cosine.min()), "max_abs_diff": float(np.abs(a - b).max()),
            "same_argmax": bool(np.array_equal(a.argmax(1), b.argmax(1)))}


def run_bench(args: argparse.Namespace) -> dict:
    """bench_slice.py --device, summarised: ratios, failed runs, device memory."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_slice.py"), "--device", args.device,
           "--threads", str(args.threads), "--decode", str(args.decode), "--repeats", str(args.repeats),
           "--prompt-tokens", str(args.prompt_tokens)] + (["--model", args.model] if args.model else [])
    out, failed, seconds = run(cmd)
    if failed:
        return {"finished": False, "failure": failed}
    full = json.loads(out.stdout)
    ratios = full["ratios"] or {}
    memory = {name: None if m is None else {
        k: m[k] for k in ("weights_kv_over_tensors_kv", "device_buffer_bytes", "device_reported_used_bytes",
                          "device_reported_beyond_buffers")} | {"compute_bytes": m["total"]["compute_bytes"]}
        for name, m in full["memory"].items() if name != "a_llama_cpp_device_reported_used_bytes"}
    return {"finished": True, "seconds": round(seconds, 1), "prompt_tokens": full["prompt_tokens"],
            "decode_tokens": full["decode_tokens"], "repeats": full["repeats"],
            "tok_s": {name: {k: med.get(k) for k in ("prefill_tok_s", "decode_tok_s")}
                      for name, med in full["median"].items()},
            "ratios": ratios, "failed_runs": full["failed_runs"], "memory": memory,
            "llama_cpp_device_reported_used_bytes": full["memory"]["a_llama_cpp_device_reported_used_bytes"],
            "targets_met": {"speed": {k: v >= SPEED_TARGET for k, v in ratios.items() if v is not None},
                            "memory": {name: m["weights_kv_over_tensors_kv"] <= MEMORY_TARGET
                                       for name, m in memory.items() if m}}}


def describe(d: Device) -> dict:
    return {"label": d.label, "name": d.name, "kind": d.kind, "description": d.description,
            "memory_free": d.memory_free, "memory_total": d.memory_total}


def verdict(oracle: dict, n_runs: int, bench: dict | None) -> tuple[bool, int]:
    """Passes when all ``n_runs`` oracle runs (llama-cpp-python's and each slicing's) finished,
    every slicing follows the oracle rule and no run failed; the number of failed runs (crashes,
    errors, time-outs) beside it."""
    runs = [v for v in oracle.values() if isinstance(v, dict) and "finished" in v]
    failures = sum(len(v["failures"]) for v in runs)
    finished = len(runs) == n_runs and all(v["finished"] for v in runs)
    if bench is not None:
        failures += sum(map(len, bench.get("failed_runs", {}).values())) + (not bench["finished"])
    passes = finished and all(v.get("passes", True) for v in runs) and failures == 0
    return passes, failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="the device to check (default cuda; any --device value)")
    p.add_argument("--model", help="GGUF (default: the bundled model)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompt", default=PROMPT, help="the oracle check's prompt")
    p.add_argument("--generate", type=int, default=16, help="greedy tokens in the oracle check")
    p.add_argument("--decode", type=int, default=32, help="bench_slice: decode steps")
    p.add_argument("--repeats", type=int, default=3, help="bench_slice: interleaved repeats")
    p.add_argument("--prompt-tokens", type=int, default=0, help="bench_slice: prompt tokens kept (0: all)")
    p.add_argument("--attempts", type=int, default=1, help="tries per oracle run before it counts as failed")
    p.add_argument("--skip-bench", action="store_true", help="only the oracle check")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--oracle-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--engine-child", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cuts", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.generate, args.decode, args.repeats, args.attempts, args.threads) < 1 or args.prompt_tokens < 0:
        sys.exit("gpu_check: --generate, --decode, --repeats, --attempts and --threads must be at least 1")
    devices = available_devices()
    try:
        device = choose_device(args.device, devices)
    except DeviceError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        sys.exit(2)
    if args.oracle_child:
        oracle_child(args, device, args.oracle_child)
        return
    if args.engine_child:
        engine_child(args, device, *args.engine_child)
        return

    from swarmctl.model_files.models import resolve_model

    with GGUFFile(resolve_model(args.model)) as gguf:
        n_layer = ModelSpec.from_gguf(gguf).n_layer
    cuts = {"whole": [], "four_slices": [4, n_layer // 2, n_layer - 4]}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        oracle = check_oracle(args, cuts, Path(tmp))
    bench = None if args.skip_bench else run_bench(args)
    passes, failures = verdict(oracle, 1 + len(cuts), bench)
    summary = {"pass": passes, "failed_runs": failures, "device": describe(device),
               "devices": [describe(d) for d in devices], "model": resolve_model(args.model).name,
               "oracle": oracle, "bench": bench}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if passes else 1)


if __name__ == "__main__":
    main()
