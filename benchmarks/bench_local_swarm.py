"""The one-command local swarm's sizing (issue 29, item 10), before and after; prints JSON.

    python benchmarks/bench_local_swarm.py [--decode 48] [--rounds 5] [--cpus N] [--concurrent 8]
                                           [--model GGUF | --wide]

Single-stream greedy decode tok/s (after the first token, as bench_swarm.py counts) of the bundled
model (or --model) through a local swarm laid out

- before: what `ask` started before the fix: host + 2 trunk processes, every process
  ``cpus // 3`` threads (at least 1), planned "even";
- split: ``size_local_swarm``'s trunks (swarmctl/node/local_swarm.py), the cores split between the
  processes (what `serve` starts now, and `ask` for a narrow model);
- all_cores: the same trunks, every process taking every core (what `ask` starts for a wide model);

next to llama-cpp-python (whole model, ``cpus`` threads and 1 thread) in the same rounds. The
layouts run in turn within each round, so a machine whose load changes (this one is shared) affects
them alike; medians over the rounds. Each layout's swarm is started for its measurement and closed
after it (``alone``): nothing else of ours runs beside it. With ``--concurrent C``: aggregate tok/s
of C concurrent requests on each layout too (what `serve` sees under load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_swarm import GREEDY, PROMPT, decode_rate, llama_cpp_decode  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from kernels.slice import Placement  # noqa: E402
from swarmctl.asker.head_tail import Asker, Generation, generate_all  # noqa: E402
from swarmctl.batching import compute_thread  # noqa: E402
from swarmctl.asker.local_link import open_local_link  # noqa: E402
from kernels.threads import usable_cores  # noqa: E402
from swarmctl.node.local_swarm import LocalLayout, LocalSwarm, size_local_swarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

SETTLE_S = 3.0  # after a swarm's warm-up, before it is measured


def layouts(cpus: int, width: int) -> tuple[dict[str, LocalLayout], dict[str, str]]:
    """The layouts measured, and which of them `ask` and `serve` start now."""
    old = max(1, cpus // 3)
    split = size_local_swarm(cpus, streams=16)  # the cores split between the processes
    measured = {"before": LocalLayout(2, old, old), "split": split,
                "all_cores": LocalLayout(split.trunks, cpus, cpus)}  # each process every core, taking turns
    chosen = {}
    for command, layout in (("ask", size_local_swarm(cpus, width=width)), ("serve", split)):
        name = next((k for k, v in measured.items() if v == layout), f"{command}_now")
        measured.setdefault(name, layout)
        chosen[command] = name
    return measured, chosen


class Running:
    """One layout, up: its local swarm, the asker's link and the asker."""

    def __init__(self, model: Path, layout: LocalLayout, planner: PlannerSettings = PlannerSettings(head_layers=4)) -> None:
        self.layout = layout
        self.swarm = LocalSwarm(model=str(model), n_trunks=layout.trunks, planner=planner, threads=layout.trunk_threads)
        self.link = None
        self.asker: Asker | None = None

    async def start(self, model: Path) -> None:
        self.link = await open_local_link(self.swarm, min_stages=self.layout.trunks)
        # (the plan's kernels and attention, as `ask` gives its head and tail)
        placement = Placement(kernels=self.link.plan.kernels, attention=self.link.plan.attention)
        self.asker = Asker(model, self.link.head_layers, n_threads=self.layout.asker_threads, max_in_flight=64,
                           placement=placement)

    async def generate(self, prompt: list[int], n: int) -> Generation:
        return await generate_all(self.asker, prompt, self.link, ignore_eos=True, max_tokens=n, sampling=GREEDY)

    async def decode(self, prompt: list[int], n: int) -> float:
        return decode_rate(await self.generate(prompt, n))

    async def aggregate(self, prompt: list[int], n: int, c: int) -> float:
        t0 = time.perf_counter()
        gens = await asyncio.gather(*[generate_all(self.asker, prompt, self.link, ignore_eos=True, max_tokens=n,
                                                   sampling=GREEDY) for _ in range(c)])
        return sum(len(g.tokens) for g in gens) / (time.perf_counter() - t0)

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        if self.asker is not None:
            self.asker.close()
        self.swarm.close()


@contextlib.asynccontextmanager
async def alone(model: Path, layout: LocalLayout, prompt: list[int],
                planner: PlannerSettings = PlannerSettings(head_layers=4)) -> AsyncIterator[Running]:
    """A local swarm of ``layout`` started for one measurement, warmed up and settled, and closed
    after it, so that only one swarm is ever up. An idle swarm beside the measured one is not idle:
    its members ping each other every second, and a trunk whose first speed measurement had to
    share the CPU measures again 10, 20, 40 and 80 s later (kernels/speed.py); where processes share
    cores, any that wakes stalls the computing one (and, at two threads or more, its barriers)."""
    running = Running(model, layout, planner)
    try:
        await running.start(model)
        await running.decode(prompt, 8)  # warm-up: graphs built, caches placed
        await asyncio.sleep(SETTLE_S)  # what joining starts (the host's layer checks) is over by then
        yield running
    finally:
        await running.close()


async def measure(model: Path, prompt: list[int], width: int, args: argparse.Namespace) -> dict:
    measured, chosen = layouts(args.cpus, width)
    # llama-cpp-python with every core, and with one thread (what each process of a split layout has on 2 cores)
    llama_threads = {"llama_cpp_python": args.cpus, "llama_cpp_python_1_thread": 1}
    samples: dict[str, list[float]] = {name: [] for name in [*llama_threads, *measured]}
    aggregate: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(args.rounds):
        for name, threads in llama_threads.items():
            samples[name].append(compute_thread().submit(
                llama_cpp_decode, model, prompt, args.decode, threads).result())
        for name, layout in measured.items():
            async with alone(model, layout, prompt) as r:
                samples[name].append(await r.decode(prompt, args.decode))
                if args.concurrent:
                    aggregate[name].append(await r.aggregate(prompt, 24, args.concurrent))
    out = {
        "layouts": {name: {"trunks": layout.trunks, "trunk_threads": layout.trunk_threads,
                           "asker_threads": layout.asker_threads} for name, layout in measured.items()},
        "now_started_by": chosen,
        "single_stream_decode_tok_s_median": {k: statistics.median(v) for k, v in samples.items()},
        "single_stream_decode_tok_s_samples": samples,
    }
    med = out["single_stream_decode_tok_s_median"]
    out["ask_now_over_before"] = med[chosen["ask"]] / med["before"]
    out["ask_now_over_llama_cpp"] = med[chosen["ask"]] / med["llama_cpp_python"]
    out["before_over_llama_cpp"] = med["before"] / med["llama_cpp_python"]
    if args.concurrent:
        out[f"aggregate_tok_s_{args.concurrent}_streams_median"] = {k: statistics.median(v)
                                                                   for k, v in aggregate.items()}
        out[f"aggregate_tok_s_{args.concurrent}_streams_samples"] = aggregate
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=48, help="tokens decoded per single-stream run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpus", type=int, default=usable_cores(), help="cores to size for (default: this process's)")
    p.add_argument("--concurrent", type=int, default=0, metavar="C", help="also C concurrent requests per layout")
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--wide", action="store_true",
                   help="a random-weight llama 2048 wide (10 layers, Q4_0, about 0.4 GB) in a temporary folder")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-local-swarm-") as tmp:
        model = args.model or (wide_model(Path(tmp)) if args.wide else default_model_path())
        run(model, args)


def wide_model(folder: Path) -> Path:
    """A model wide enough that a step's matrices keep an OpenMP team busy (size_local_swarm's WIDE_MODEL)."""
    from harness.tiny_models import TinyConfig, write_tiny_model

    config = TinyConfig(arch="llama", n_layer=10, n_embd=2048, n_head=16, n_head_kv=4, n_ff=5632, n_ctx=1024,
                        qtype="Q4_0", seed=1)
    return write_tiny_model(folder / "wide2048.gguf", config, default_model_path())


def run(model: Path, args: argparse.Namespace) -> None:
    from kernels.gguf_file import GGUFFile
    from kernels.spec import ModelSpec
    from kernels.tokenizer import Tokenizer

    prompt = Tokenizer(model).encode_prompt(PROMPT)
    with GGUFFile(model) as gguf:
        width = ModelSpec.from_gguf(gguf).n_embd
    load_before = os.getloadavg()
    result = {"model": model.name, "n_embd": width, "cpus": args.cpus, "decode_tokens": args.decode,
              "rounds": args.rounds, "loadavg_before": load_before, **asyncio.run(measure(model, prompt, width, args)),
              "loadavg_after": os.getloadavg()}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
