"""The OpenAI-compatible API under load; prints JSON.

    python benchmarks/bench_api.py [--clients 16] [--max-tokens 64] [--repeats 3]

Starts `swarmctl serve` on a loopback port with no swarm joined, so it runs a local swarm (host +
2 trunk processes over QUIC + mTLS, one compute thread each on this machine's cores), and drives
it with the official `openai` client (async): one streaming client alone, then --clients
streaming clients at once. Tokens are the server's own usage counts (stream_options.include_usage);
aggregate tok/s = completion tokens of all clients / wall time from the first request to the last
[DONE].

Side by side, the same requests go straight into an Asker in this process, on a second local
swarm of the same shape (idle while the other is measured): what the pipeline gives without HTTP.
Rounds alternate between the two; each reports the round with the median rate of --repeats. This
machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import process_cpu_s  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from swarmctl.asker.head_tail import Asker, generate_all  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402

PROMPT = "Once upon a time, in a lighthouse by a cold grey sea, there lived a keeper who"
TEMPERATURE = 0.7  # top-p and top-k: the server's defaults, as below
STARTUP_TIMEOUT = 180
REPO = Path(__file__).resolve().parents[1]


@dataclass
class StreamResult:
    completion_tokens: int
    first_token_s: float  # from sending the request to the first text
    total_s: float


async def one_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int, seed: int) -> StreamResult:
    t0 = time.perf_counter()
    first = None
    usage = None
    stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=TEMPERATURE,
                                             seed=seed, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "the stream ended without its usage chunk"
    return StreamResult(usage.completion_tokens, first if first is not None else float("nan"),
                        time.perf_counter() - t0)


async def round_of(client: openai.AsyncOpenAI, model: str, clients: int, max_tokens: int, seed: int,
                   server_pid: int) -> dict:
    t0, client_cpu0, server_cpu0 = time.perf_counter(), time.process_time(), process_cpu_s(server_pid)
    results = await asyncio.gather(*(one_stream(client, model, max_tokens, seed + i) for i in range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    return {
        "completed": len(results),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),
        "first_token_ms_median": round(statistics.median(r.first_token_s for r in results) * 1e3, 1),
        "per_client_tok_s_median": round(statistics.median(r.completion_tokens / r.total_s for r in results), 2),
        # Where the 2 cores went besides the trunks: the load generator (openai client, this
        # process) and the server process (asker: head, tail, HTTP, QUIC).
        "client_cpu_s": round(time.process_time() - client_cpu0, 2),
        "server_cpu_s": round(process_cpu_s(server_pid) - server_cpu0, 2),
    }


def median_round(rounds: list[dict]) -> dict:
    """The round with the median aggregate rate, whole (medians taken field by field would mix rounds)."""
    return sorted(rounds, key=lambda r: r["aggregate_tok_s"])[len(rounds) // 2]


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "SWARMCTL_HOME": str(root / "no-swarm")}
    out = root / "stdout"
    with open(out, "wb") as stdout, open(root / "stderr", "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--port", "0"], env=env, cwd=REPO,
                                   stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not (match := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", out.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"swarmctl serve did not start: {(root / 'stderr').read_text().strip()}")
        time.sleep(0.2)
    return process, match[1]


async def direct_round(asker: Asker, link: SwarmLink, clients: int, max_tokens: int, seed: int) -> dict:
    """The same requests, straight into the asker: no HTTP, no JSON, no client library."""
    prompt = asker.tokenizer.encode_prompt(PROMPT)
    t0, cpu0 = time.perf_counter(), time.process_time()
    gens = await asyncio.gather(*(generate_all(asker, prompt, link, max_tokens=max_tokens,
                                               sampling=SamplingParams(temperature=TEMPERATURE, top_k=40, top_p=0.9,
                                                                       seed=seed + i))
                                  for i in range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for g in gens)
    return {"completed": len(gens), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "aggregate_tok_s": round(tokens / wall, 2),
            "asker_cpu_s": round(time.process_time() - cpu0, 2)}  # compare: server_cpu_s of the API rounds


async def measure(base_url: str, server_pid: int, clients: int, max_tokens: int, repeats: int) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    threads = max(1, (os.cpu_count() or 1) // 3)  # as `swarmctl serve` splits the cores for its local swarm
    with LocalSwarm(model=str(default_model_path()), n_trunks=2, planner=PlannerSettings(head_layers=4),
                    threads=threads) as swarm:
        link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
        asker = Asker(default_model_path(), link.head_layers, n_threads=threads)
        try:
            # Warm up both: graphs for the batch sizes to come, connections.
            await round_of(client, model, clients, 8, 0, server_pid)
            await direct_round(asker, link, clients, 8, 0)
            rounds: dict[str, list[dict]] = {"api_1": [], "direct_1": [], "api_n": [], "direct_n": []}
            for r in range(repeats):
                rounds["api_1"].append(await round_of(client, model, 1, max_tokens, 100 + r, server_pid))
                rounds["direct_1"].append(await direct_round(asker, link, 1, max_tokens, 100 + r))
                rounds["api_n"].append(await round_of(client, model, clients, max_tokens, 1000 * (r + 1), server_pid))
                rounds["direct_n"].append(await direct_round(asker, link, clients, max_tokens, 1000 * (r + 1)))
        finally:
            await link.close()
            asker.close()
    await client.close()
    return {"model": model, "threads": threads, **{k: median_round(v) for k, v in rounds.items()},
            "api_n_rounds": [r["aggregate_tok_s"] for r in rounds["api_n"]],
            "direct_n_rounds": [r["aggregate_tok_s"] for r in rounds["direct_n"]],
            "all_completed": all(r["completed"] == clients for r in rounds["api_n"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        process, base_url = start_server(Path(tmp))
        try:
            result = asyncio.run(measure(base_url, process.pid, args.clients, args.max_tokens, args.repeats))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    n = args.clients
    print(json.dumps({
        "model": result["model"],
        "setup": f"local swarm: asker + 2 trunk processes, {result['threads']} compute thread(s) each",
        "cpus": os.cpu_count(),
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "temperature": TEMPERATURE,
        "repeats": args.repeats,
        "api_single_stream": result["api_1"],
        f"api_{n}_concurrent_streams": result["api_n"],
        f"api_{n}_rounds_aggregate_tok_s": result["api_n_rounds"],
        "all_completed": result["all_completed"],
        "direct_single": result["direct_1"],
        f"direct_{n}_concurrent": result["direct_n"],
        f"direct_{n}_rounds_aggregate_tok_s": result["direct_n_rounds"],
        f"api_vs_direct_at_{n}": round(result["api_n"]["aggregate_tok_s"] / result["direct_n"]["aggregate_tok_s"], 2),
        f"api_{n}_vs_api_single": round(result["api_n"]["aggregate_tok_s"] / result["api_1"]["aggregate_tok_s"], 2),
    }, indent=2))

if __name__ == "__main__":
    main()
