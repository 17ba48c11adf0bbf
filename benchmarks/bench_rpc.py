"""A local swarm against llama.cpp's RPC with two servers, at the same threads; prints JSON.

    python benchmarks/bench_rpc.py --llama-bench PATH --rpc-server PATH [--threads 1,2]
                                   [--rounds 5] [--decode 48] [--model GGUF] [--out FILE]

Both binaries are built from the llama.cpp that llama-cpp-python vendors, with ``-DGGML_RPC=ON``
(docs/kernels.md says how, and how long it took). Single-stream greedy decode, tok/s after the
first token, at each thread count T:

    swarm_plain   a local swarm as `ask` starts one: a host, two trunk processes of T threads, the
                  asker (embedding, 4 head and 4 tail layers, LM head) with T threads, over loopback QUIC
    swarm_flash   the same, set to attention flash (llama.cpp's -fa 1)
    rpc           llama-bench -ngl 99 --rpc A,B: two rpc-server processes of T threads each hold the
                  layers (llama.cpp splits them by the servers' memory), llama-bench's process T
                  threads; -fa 0 and -fa 1, the better one counts
    llama_bench   llama-bench in one process, T threads, --repack 0 (the swarm's default kernels
                  plain) by -fa 0,1: what one process gets

The variants run in turn within each round (one repetition of llama-bench each), so a machine whose
load changes affects them alike. Each swarm measurement starts a swarm of its own and closes it
after, so nothing of ours runs beside the variant being measured. Quoted: medians over the rounds
and ``swarm_over_rpc`` (the better swarm over the better RPC). Both sides move every token's
activations between three processes over loopback; the swarm's QUIC with mutual TLS, llama.cpp's
RPC plain TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_local_swarm import alone  # noqa: E402
from benchmarks.bench_repack import cpu_description  # noqa: E402
from benchmarks.bench_swarm import PROMPT, breakdown, decode_rate  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.node.local_swarm import LocalLayout  # noqa: E402

BENCH_TIMEOUT_S = 300
SERVER_START_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServers:
    """Two rpc-server processes of ``threads`` threads each on loopback."""

    def __init__(self, binary: Path, threads: int) -> None:
        self.endpoints: list[str] = []
        self.processes: list[subprocess.Popen] = []
        for _ in range(2):
            port = free_port()
            self.processes.append(subprocess.Popen([os.fspath(binary), "-H", "127.0.0.1", "-p", str(port), "-t",
                                                    str(threads)], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
            self.endpoints.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + SERVER_START_S
        for endpoint in self.endpoints:
            host, port = endpoint.split(":")
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in self.processes):
                        self.close()
                        raise SystemExit(f"bench_rpc: rpc-server did not start at {endpoint}")
                    time.sleep(0.1)

    def close(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def llama_bench_tg(binary: Path, model: Path, threads: int, n_decode: int, extra: list[str]) -> dict[str, float]:
    """One repetition of llama-bench's tg at -fa 0 and 1: tok/s keyed fa0/fa1 (empty if it failed)."""
    cmd = [os.fspath(binary), "-m", os.fspath(model), "-p", "0", "-n", str(n_decode), "-t", str(threads), "-r", "1",
           "-fa", "0,1", "-o", "json", *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {}
    if proc.returncode != 0:
        print(f"bench_rpc: {' '.join(cmd[:1] + extra)} failed: {proc.stderr[-300:]}", file=sys.stderr)
        return {}
    return {f"fa{int(row['flash_attn'])}": float(row["samples_ts"][0]) for row in json.loads(proc.stdout)}


async def measure(args: argparse.Namespace, model: Path, prompt: list[int]) -> dict:
    out: dict = {}
    for t in args.threads:
        samples: dict[str, list[float]] = {}  # swarm: counted as bench_swarm counts (decode_rate)
        generations: dict[str, list] = {}
        servers = RpcServers(args.rpc_server, t)  # (idle rpc-servers block in accept: they cost nothing)
        try:
            for _ in range(args.rounds):
                for attention in ("plain", "flash"):  # (one swarm up at a time: bench_local_swarm.alone)
                    async with alone(model, LocalLayout(2, t, t), prompt,
                                     PlannerSettings(head_layers=4, attention=attention)) as swarm:
                        gen = await swarm.generate(prompt, args.decode)
                    samples.setdefault(f"swarm_{attention}", []).append(decode_rate(gen))
                    generations.setdefault(f"swarm_{attention}", []).append(gen)
                rpc = llama_bench_tg(args.llama_bench, model, t, args.decode,
                                     ["-ngl", "99", "--rpc", ",".join(servers.endpoints)])
                for fa, v in rpc.items():
                    samples.setdefault(f"rpc_{fa}", []).append(v)
                one = llama_bench_tg(args.llama_bench, model, t, args.decode, ["--repack", "0"])
                for fa, v in one.items():
                    samples.setdefault(f"llama_bench_{fa}", []).append(v)
        finally:
            servers.close()
        med = {k: round(statistics.median(v), 2) for k, v in samples.items()}
        swarm = max(med["swarm_plain"], med["swarm_flash"])
        best_rpc = max((v for k, v in med.items() if k.startswith("rpc_")), default=None)
        best_one = max((v for k, v in med.items() if k.startswith("llama_bench_")), default=None)
        out[f"threads_{t}"] = {
            "decode_tok_s_median": med, "decode_tok_s_samples": {k: [round(x, 2) for x in v] for k, v in samples.items()},
            # where a swarm's step goes: the asker's head and tail, each stage's compute, the hops
            "swarm_step_breakdown_ms": {name: breakdown(gens) for name, gens in generations.items()},
            "swarm_over_rpc": round(swarm / best_rpc, 3) if best_rpc else None,
            "swarm_over_one_process_llama_bench": round(swarm / best_one, 3) if best_one else None,
            "rpc_over_one_process_llama_bench": round(best_rpc / best_one, 3) if best_rpc and best_one else None,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bench", type=Path, required=True, help="llama-bench built with -DGGML_RPC=ON")
    p.add_argument("--rpc-server", type=Path, required=True, help="rpc-server from the same build")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode", type=int, default=48, help="tokens decoded per run")
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    try:
        args.threads = [int(t) for t in str(args.threads).split(",")]
    except ValueError:
        p.error(f"--threads: not a list of numbers: {args.threads}")
    if args.rounds < 1 or args.decode < 1 or min(args.threads) < 1:
        p.error("--rounds, --decode and every thread count must be at least 1")
    for name in ("llama_bench", "rpc_server"):
        if not getattr(args, name).is_file():
            p.error(f"--{name.replace('_', '-')}: no such file: {getattr(args, name)}")
    from kernels.tokenizer import Tokenizer
    from swarmctl.model_files.models import default_model_path

    model = args.model or default_model_path()
    prompt = Tokenizer(model).encode_prompt(PROMPT)
    load_start = os.getloadavg()
    results = asyncio.run(measure(args, model, prompt))
    emit_json({"benchmark": "bench_rpc", **cpu_description(), "model": model.name, "decode_tokens": args.decode,
               "rounds": args.rounds, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
               "results": results}, args.out)


if __name__ == "__main__":
    main()
