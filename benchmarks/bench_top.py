"""Does watching the swarm slow it? Aggregate tok/s with and without `swarmctl top` attached;
prints JSON.

    python benchmarks/bench_top.py [--requests 8] [--max-tokens 48] [--repeats 3]

One local swarm (host + 2 trunk processes over QUIC + mTLS, one compute thread each) and an
asker in this process. A round sends --requests requests at once, --max-tokens tokens each
(end-of-text ignored), and measures aggregate tok/s = all tokens / wall time. Rounds interleave
four conditions, the same requests in each:

  without_top      nothing watches
  collector_only   a process running top's monitor alone: polls the host and both trunks every
                   0.5 s (status, nodes, stats, a QUIC ping), draws nothing. What the nodes pay.
  with_top         a process running the whole `swarmctl top` app as the command does (at its
                   default lower CPU priority, nice 10), headless: Textual lays out and renders
                   every frame, only no terminal receives them
  with_top_nice_0  the same at the swarm's own priority: the worst case on a machine it shares

Medians of --repeats rounds each, the median of each repeat's ratio to its own round without
top, and the watcher's CPU use. The machine is shared and noisy:
compare the columns. The watcher processes are this script run with hidden flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import process_cpu_s  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from swarmctl.asker.head_tail import Asker, generate_all  # noqa: E402
from swarmctl.commands.top import DEFAULT_NICE  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402

GREEDY = SamplingParams(temperature=0)
REPO = Path(__file__).resolve().parents[1]


def prompt_for(i: int) -> list[int]:
    """Distinct prompts of 12-40 tokens (ids from the ordinary vocabulary range)."""
    n = 12 + (i * 7) % 29
    return [200 + (i * 131 + j * 17) % 30000 for j in range(n)]


async def one_round(asker: Asker, swarm: LocalSwarm, n_requests: int, max_tokens: int, seed: int) -> float:
    # A link per round: one link stalls at its 129th request (request streams to the first stage
    # are never finished on the trunk's side, and aioquic grants 128), which these rounds would reach.
    link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
    try:
        t0 = time.perf_counter()
        gens = await asyncio.gather(*[generate_all(asker, prompt_for(seed * 100 + i), link, max_tokens=max_tokens,
                                                   sampling=GREEDY, ignore_eos=True) for i in range(n_requests)])
        return sum(len(g.tokens) for g in gens) / (time.perf_counter() - t0)
    finally:
        await link.close()


async def keep_busy(asker: Asker, link: SwarmLink, stop: asyncio.Event, *, concurrency: int = 4,
                    max_tokens: int = 48) -> int:
    """Load for demos and screenshots: ``concurrency`` requests at a time, each followed by the
    next, with staggered lengths so requests come and go. Returns the tokens generated."""
    async def worker(i: int) -> int:
        done, k = 0, 0
        await asyncio.sleep(0.3 * i)
        while not stop.is_set():
            gen = await generate_all(asker, prompt_for(i * 1000 + k), link, sampling=GREEDY, ignore_eos=True,
                                     max_tokens=max_tokens + 16 * ((i + k) % 3))
            done, k = done + len(gen.tokens), k + 1
        return done

    return sum(await asyncio.gather(*[worker(i) for i in range(concurrency)]))


# How each condition watches the swarm: none, the monitor alone (what the nodes pay: answering
# stats and pings), or the whole app at `swarmctl top`'s default priority and at normal priority.
CONDITIONS = {"without_top": None, "collector_only": ["--attached-collector"],
              "with_top": ["--attached-top", "--nice", str(DEFAULT_NICE)],
              "with_top_nice_0": ["--attached-top", "--nice", "0"]}


def start_watcher(home: Path, how: list[str]) -> subprocess.Popen:
    env = {**os.environ, "SWARMCTL_HOME": str(home)}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *how, "--home", str(home)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_watcher(process: subprocess.Popen) -> float:
    """Stop it; returns the CPU seconds it used."""
    if process.poll() is not None:
        raise RuntimeError(f"top exited early: {process.stderr.read().decode(errors='replace')[-2000:]}")
    cpu = process_cpu_s(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return cpu


def attached_top(home: Path, nice: int) -> None:
    """The app as `swarmctl top` runs it (at its default lower priority), minus the terminal;
    polls until SIGTERM."""
    from swarmctl.commands.top import lower_priority
    from swarmctl.node.home import SwarmHome
    from swarmctl.monitor.poller import Monitor
    from swarmctl.tui.app import TopApp

    lower_priority(nice)
    app = TopApp(Monitor(SwarmHome(home)))
    signal.signal(signal.SIGTERM, lambda *_: app.call_later(app.exit))
    app.run(headless=True, size=(120, 40))


def attached_collector(home: Path) -> None:
    """Only the monitor: polls as `swarmctl top` does, draws nothing."""
    from swarmctl.node.home import SwarmHome
    from swarmctl.monitor.poller import Monitor

    async def poll() -> None:
        task = asyncio.ensure_future(Monitor(SwarmHome(home)).run())
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(poll())


async def measure(swarm: LocalSwarm, args: argparse.Namespace) -> dict:
    link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
    asker = Asker(default_model_path(), link.head_layers, n_threads=1, max_in_flight=max(16, args.requests))
    await link.close()
    try:
        await one_round(asker, swarm, args.requests, 8, seed=99)  # warm-up: graphs built, caches sized
        rates: dict[str, list[float]] = {name: [] for name in CONDITIONS}
        cpu: dict[str, list[float]] = {name: [] for name in CONDITIONS if CONDITIONS[name]}
        names = list(CONDITIONS)
        for repeat in range(args.repeats):
            # interleaved, the same requests in every condition, each condition first in turn
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                how = CONDITIONS[name]
                watcher = start_watcher(swarm.asker_home.path, how) if how else None
                try:
                    if watcher is not None:
                        await asyncio.sleep(args.attach_s)  # imported, connected, polling
                        cpu_before, t0 = process_cpu_s(watcher.pid), time.perf_counter()
                    rates[name].append(await one_round(asker, swarm, args.requests, args.max_tokens, seed=repeat))
                    print(f"round {repeat + 1}/{args.repeats} {name}: {rates[name][-1]:.1f} tok/s", file=sys.stderr)
                finally:
                    if watcher is not None:
                        used = stop_watcher(watcher) - cpu_before
                        cpu[name].append(100 * used / (time.perf_counter() - t0))
        medians = {k: statistics.median(v) for k, v in rates.items()}
        # each repeat against its own round without top: the machine's load drifts between repeats
        paired = {k: statistics.median(x / base for x, base in zip(v, rates["without_top"])) for k, v in rates.items()}
        return {"requests": args.requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
                "top_poll_interval_s": 0.5, "top_refresh_s": 0.25,
                "aggregate_tok_s": {k: round(v, 1) for k, v in medians.items()},
                "ratio_to_without_top": {k: round(v / medians["without_top"], 3) for k, v in medians.items()},
                "paired_ratio_median": {k: round(v, 3) for k, v in paired.items()},
                "watcher_cpu_percent_of_one_core": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
                "rounds_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    finally:
        asker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attach-s", type=float, default=3.0, help="seconds top gets to start before a round")
    parser.add_argument("--attached-top", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attached-collector", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attached_top:
        attached_top(args.home, args.nice)
        return
    if args.attached_collector:
        attached_collector(args.home)
        return
    with LocalSwarm(model=str(default_model_path()), n_trunks=2, planner=PlannerSettings(head_layers=4),
                    threads=1) as swarm:
        try:
            result = asyncio.run(measure(swarm, args))
        except BaseException:
            for home in (swarm.host_home, *swarm.trunk_homes):  # what the nodes saw, before the swarm is removed
                lines = (home.path / "node.log").read_text(errors="replace").splitlines()
                print(f"--- {home.path.name}: last lines of its log", *lines[-15:], sep="\n", file=sys.stderr)
            raise
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
