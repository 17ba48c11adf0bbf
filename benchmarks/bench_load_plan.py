"""Eight streams through `serve` on a two-trunk swarm planned for latency, against one stream; and
whether the plan moved meanwhile (issue 29, item 5). Prints JSON.

    python benchmarks/bench_load_plan.py [--streams 8] [--max-tokens 96] [--repeats 2]

The swarm is a persistent one, as a user sets it up (init --objective latency, invite, join, run:
host and two trunk processes on loopback, QUIC + mTLS; the latency planner puts every trunk layer
on one trunk and keeps the other standing by), and `swarmctl serve` runs as a member of it. The
issue measured 14.6 tokens/s for eight streams against 43.5 for one (0.34x) while the host moved
every layer between the trunks four times in 45 s. Reported: aggregate tokens/s of one stream and
of --streams at once (the round with the median rate of --repeats), their ratio, the plan version
before and after the load, the plans the host logged, and the reroutes the host heard of.
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
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.swarm import Swarm  # noqa: E402

PROMPT = "Once upon a time, in a lighthouse by a cold grey sea, there lived a keeper who"
REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = 180


async def one_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int, seed: int) -> int:
    usage = None
    stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.7,
                                             seed=seed, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "the stream ended without its usage chunk"
    return usage.completion_tokens


async def round_of(client: openai.AsyncOpenAI, model: str, streams: int, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one_stream(client, model, max_tokens, seed + i) for i in range(streams)))
    wall = time.perf_counter() - t0
    return {"streams": streams, "completion_tokens": sum(tokens), "wall_s": round(wall, 2),
            "aggregate_tok_s": round(sum(tokens) / wall, 2)}


async def single_round(client: openai.AsyncOpenAI, model: str, max_tokens: int, seed: int, runs: int) -> dict:
    """One stream at a time, ``runs`` of them back to back (a sampled completion may end early at
    EOS: one short run would weigh its first-token time heavily)."""
    t0, total = time.perf_counter(), 0
    for i in range(runs):
        total += await one_stream(client, model, max_tokens, seed + i)
    wall = time.perf_counter() - t0
    return {"streams": 1, "runs": runs, "completion_tokens": total, "wall_s": round(wall, 2),
            "aggregate_tok_s": round(total / wall, 2)}


def median_round(rounds: list[dict]) -> dict:
    return sorted(rounds, key=lambda r: r["aggregate_tok_s"])[len(rounds) // 2]


def start_swarm(root: Path) -> Swarm:
    swarm = Swarm(root)
    swarm.init("--objective", "latency")
    swarm.start_host()
    swarm.wait_host()
    for name in ("trunk-a", "trunk-b", "asker"):
        swarm.join(name)
    swarm.start_trunk("trunk-a", "--threads", "1", capture=False)
    swarm.start_trunk("trunk-b", "--threads", "1", capture=False)
    swarm.wait_complete(1, timeout=STARTUP_TIMEOUT)
    deadline = time.monotonic() + STARTUP_TIMEOUT  # both trunks checked: what joining changes has changed
    while time.monotonic() < deadline:
        members = [m for m in swarm.status().get("members", []) if m["name"].startswith("trunk-")]
        if len(members) == 2 and all(m["health"] in ("ready", "up") for m in members):
            break
        time.sleep(0.5)
    return swarm


def start_server(swarm: Swarm, root: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "SWARMCTL_HOME": str(swarm.homes["asker"])}
    out, err = root / "serve.out", root / "serve.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--port", "0", "--threads", "1"],
                                   env=env, cwd=REPO, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not (match := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", out.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"swarmctl serve did not start: {err.read_text().strip()[-2000:]}")
        time.sleep(0.2)
    return process, match[1]


async def measure(base_url: str, streams: int, max_tokens: int, repeats: int) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    await round_of(client, model, streams, 8, 0)  # warm-up: graphs for the batch sizes, connections
    single, many = [], []
    for r in range(repeats):
        single.append(await single_round(client, model, max_tokens, 100 + 10 * r, runs=4))
        many.append(await round_of(client, model, streams, max_tokens, 1000 * (r + 1)))
    await client.close()
    return {"model": model, "single": median_round(single), "many": median_round(many),
            "many_rounds_tok_s": [r["aggregate_tok_s"] for r in many],
            "single_rounds_tok_s": [r["aggregate_tok_s"] for r in single]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-plan-") as tmp:
        root = Path(tmp)
        swarm = start_swarm(root)
        process = None
        try:
            before = swarm.status()
            logged_before = len(re.findall(r"plan v\d+:", swarm.nodes[0].log()))
            process, base_url = start_server(swarm, root)
            result = asyncio.run(measure(base_url, args.streams, args.max_tokens, args.repeats))
            after = swarm.status()
            plans_logged = re.findall(r"plan v\d+: [^\n]*", swarm.nodes[0].log())[logged_before:]
        finally:
            if process is not None:
                process.send_signal(signal.SIGTERM)
                process.wait(30)
            swarm.close()
    n = args.streams
    print(json.dumps({
        "model": result["model"],
        "setup": "persistent swarm, objective latency: host + 2 trunk processes (1 thread each) on loopback, "
                 "`swarmctl serve --threads 1` as a member; openai client, streaming completions",
        "cpus": os.cpu_count(),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "single_stream": result["single"],
        f"{n}_streams": result["many"],
        f"{n}_streams_rounds_tok_s": result["many_rounds_tok_s"],
        "single_stream_rounds_tok_s": result["single_rounds_tok_s"],
        f"ratio_{n}_vs_1": round(result["many"]["aggregate_tok_s"] / result["single"]["aggregate_tok_s"], 2),
        "plan_version_before": before["plan_version"],
        "plan_version_after": after["plan_version"],
        "plans_logged_during_load": plans_logged,
        "reroutes_reported": after["recovery"]["recoveries"] - before["recovery"]["recoveries"],
        "stage_holders_after": [m["name"] for m in after["members"] if m["layers"]],
        "median_single_tok_s": statistics.median(result["single_rounds_tok_s"]),
    }, indent=2))


if __name__ == "__main__":
    main()
