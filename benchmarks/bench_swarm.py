"""The swarm benchmark suite, side by side in one run; prints JSON.

    python benchmarks/bench_swarm.py [--decode 64] [--threads N] [--skip-transport]

a. single-stream decode tok/s: llama-cpp-python (whole model) vs the in-process engine (asker +
   2 trunk stages in one process) vs a local swarm (asker + 2 trunk processes over QUIC + mTLS);
b. aggregate tok/s at concurrency 1, 4, 8, 16 on the local swarm;
c. per-hop breakdown of a token's latency (compute per stage, queueing, transfer);
d. WAN emulation: every link through an impairing relay (20 ms ± 5 ms one way, 0.5 % loss), next to
   the limit 1 / (sum of one-way link latencies + compute per token);
e. each trunk process's peak RSS next to its tensors' bytes plus its peak KV cache;
f. transport alone: one 16 KB / 1 MB / 16 MB frame between two processes, QUIC vs TCP + TLS;
g. speculative steps over the same WAN (``--speculative`` runs only this section): single-stream
   tok/s of --speculate off, ngram and draft (the bundled model drafting for itself, the ceiling),
   each with one window per round trip and with windows in flight (as the cost model chooses, and
   ngram with three always), on held-back tasks (a code rename, a log extraction, a paragraph to
   copy with one change: answers that repeat the prompt; a story: one that does not), with
   acceptance; and aggregate tok/s of 8 concurrent requests, off vs ngram.
h. a long prompt over capped links (``--prompt-stream N`` runs only this section; ``--rate-mbit``):
   first-token time of an N-token prompt over the same WAN with every link's directions capped,
   its 512-token chunks streamed through the stages (several out at once) vs one at a time.
i. drafts the asker makes with no extra crossing (``--asker-drafts`` runs only this section):
   --speculate mtp on tiny DeepSeek-V3s with a nextn layer (random, and one built to know the
   next token) and layerskip on the bundled model, over the same WAN: tok/s over off, acceptance.
j. activations in f16 vs f32 over capped links (``--wire-first-token N`` runs only this section;
   ``--rate-mbit``): first-token time of an N-token prompt on a model as wide as Kimi K2 and
   otherwise thin, so that the crossings dominate as they would for a Kimi-sized trunk.
k. windows in flight beyond the asker's cap (``--windows-sweep`` runs only this section): single-
   stream tok/s with 1, 2, 4, 6 and 8 windows always out, ngram and the model drafting for itself,
   over the same WAN, on the two tasks that copy the prompt; tokens must equal off's; the asker's
   own choice under two caps (``--caps``), one stream and 8 concurrent requests.

Targets: a ≥ 0.8 × llama-cpp-python; b at 8 ≥ 3 × single-stream; d ≥ 0.85 × the limit;
e ≤ tensor bytes + KV + 200 MB; g (issue 34): ngram ≥ 4 × off on the repetitive tasks, ≥ 0.97 × on
the story, draft (k = 4) ≥ 3 × off, 8 concurrent with ngram ≥ 0.95 × off. Medians; this machine is
shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.sampling import SamplingParams  # noqa: E402
from net.endpoint import Address, ask_member  # noqa: E402
from swarmctl.asker.head_tail import Asker, Generation, InprocTrunk, generate_all, u_split  # noqa: E402
from swarmctl.node.local_swarm import Fronts, LocalSwarm, free_udp_port  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402

GREEDY = SamplingParams(temperature=0)
PROMPT = "Once upon a time, in a lighthouse by a cold grey sea, there lived a keeper who"
WAN = {"delay_s": 0.020, "jitter_s": 0.005, "loss": 0.005}


def decode_rate(gen: Generation) -> float:
    """Tokens per second after the first token (the prefill excluded; a speculative step may
    yield several tokens, so tokens are counted, not steps), over the wall time from the first
    token's choice to the last's (windows in flight overlap: their steps' times do not add up)."""
    if len(gen.timings) < 2:
        return 0.0
    return (len(gen.tokens) - 1) / (gen.timings[-1].done - gen.timings[0].done)


def llama_cpp_decode(model: Path, prompt: list[int], n: int, threads: int) -> float:
    from kernels.oracle_llama import last_logits, load_llama

    # plain weight buffers, like the engine (benchmarks/bench_repack.py measures the repacked default)
    llm = load_llama(model, n_ctx=1024, n_threads=threads, n_threads_batch=threads)
    llm.eval(prompt)
    tok = int(np.argmax(last_logits(llm)))
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    rate = n / (time.perf_counter() - t0)
    llm.close()
    return rate


def breakdown(gens: list[Generation]) -> dict:
    steps = [t for g in gens for t in g.timings[1:] if t.trunk is not None]
    if not steps:
        return {}

    def ms(values) -> float:
        return round(statistics.median(values) * 1e3, 3)

    stages: dict[str, dict[str, list[float]]] = {}
    for t in steps:
        for hop in t.trunk.hops:
            s = stages.setdefault(hop.stage, {"compute": [], "queued": [], "batch": []})
            s["compute"].append(hop.compute_us / 1e6)
            s["queued"].append(hop.queued_us / 1e6)
            s["batch"].append(hop.batch)
    return {
        "tokens": len(steps),
        "total_ms": ms([t.total_s for t in steps]),
        "asker_head_compute_ms": ms([t.head.compute_s for t in steps]),
        "asker_head_queued_ms": ms([t.head.queued_s for t in steps]),
        "asker_tail_compute_ms": ms([t.tail.compute_s for t in steps]),
        "asker_tail_queued_ms": ms([t.tail.queued_s for t in steps]),
        "stages": {name: {"compute_ms": ms(v["compute"]), "queued_ms": ms(v["queued"]),
                          "median_batch": statistics.median(v["batch"])} for name, v in stages.items()},
        "transfer_ms": ms([t.transfer_s for t in steps]),
        "other_ms": ms([t.total_s - t.head.compute_s - t.tail.compute_s - t.trunk.round_trip_s
                        - t.head.queued_s - t.tail.queued_s for t in steps]),
    }


async def stage_stats(swarm: LocalSwarm, link: SwarmLink) -> list[dict]:
    creds = swarm.asker_home.credentials()
    return [await ask_member(Address.parse(stage.address), creds, stage.member, {"type": "stats"})
            for stage in link.plan.stages]


async def swarm_runs(model: Path, prompt: list[int], n_decode: int, threads: int, *, concurrency_levels=()) -> dict:
    out: dict = {"threads_per_process": threads}
    with LocalSwarm(model=str(model), n_trunks=2, planner=PlannerSettings(head_layers=4), threads=threads) as swarm:
        link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
        asker = Asker(model, link.head_layers, n_threads=threads, max_in_flight=64)
        try:
            await generate_all(asker, prompt, link, ignore_eos=True, max_tokens=8, sampling=GREEDY)  # warm-up
            singles = [await generate_all(asker, prompt, link, ignore_eos=True, max_tokens=n_decode, sampling=GREEDY)
                       for _ in range(3)]
            out["single_stream_decode_tok_s"] = statistics.median(decode_rate(g) for g in singles)
            out["single_stream_breakdown"] = breakdown(singles)
            concurrency = {}
            for c in concurrency_levels:
                t0 = time.perf_counter()
                gens = await asyncio.gather(*[generate_all(asker, prompt, link, ignore_eos=True, max_tokens=32, sampling=GREEDY)
                                              for _ in range(c)])
                wall = time.perf_counter() - t0
                concurrency[str(c)] = {"aggregate_tok_s": sum(len(g.tokens) for g in gens) / wall,
                                       "breakdown": breakdown(gens)}
            out["concurrency"] = concurrency
            out["nodes"] = [{k: s[k] for k in ("name", "layers", "peak_rss", "tensor_bytes", "peak_kv_bytes",
                                               "largest_batch")} for s in await stage_stats(swarm, link)]
            for node in out["nodes"]:
                node["rss_over_tensors_plus_kv_mb"] = (node["peak_rss"] - node["tensor_bytes"]
                                                       - node["peak_kv_bytes"]) / 1e6
        finally:
            await link.close()
            asker.close()
    return out


@contextmanager
def wan_fronts(rate_mbit: float = 0.0, delay_s: float = WAN["delay_s"], jitter_s: float = WAN["jitter_s"],
               loss: float = WAN["loss"], n_trunks: int = 2) -> Iterator[Fronts]:
    """Ports for a local swarm's host and trunks, each behind an impairing relay (WAN), the
    relays running until the block ends. Relays run in a process of their own: in the asker's
    process their per-datagram work would share its interpreter and cores and inflate its compute
    (measured: head + tail 27 ms instead of 7)."""
    import subprocess

    host_port, trunk_ports = free_udp_port(), [free_udp_port() for _ in range(n_trunks)]
    relay_ports = [free_udp_port() for _ in range(n_trunks + 1)]
    links = [f"{t}:{r}" for t, r in zip([host_port, *trunk_ports], relay_ports)]
    relays = subprocess.Popen([sys.executable, "-m", "net.relay", *sum((["--link", x] for x in links), []),
                               "--delay", str(delay_s), "--jitter", str(jitter_s),
                               "--loss", str(loss), "--rate-mbit", str(rate_mbit)], stdout=subprocess.PIPE,
                              text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert relays.stdout.readline().strip() == "ready"
        yield Fronts.behind([host_port, *trunk_ports], [f"127.0.0.1:{p}" for p in relay_ports])
    finally:
        relays.kill()
        relays.wait()


@asynccontextmanager
async def wan_swarm(model: Path, threads: int, rate_mbit: float = 0.0, head_layers: int = 4, wire_dtype: str = "f32",
                    delay_s: float = WAN["delay_s"], jitter_s: float = WAN["jitter_s"], loss: float = WAN["loss"]):
    """A local swarm (host + 2 trunks) whose every link passes an impairing relay (WAN), and a
    link to it."""
    with wan_fronts(rate_mbit, delay_s, jitter_s, loss) as fronts, \
            LocalSwarm(model=str(model), n_trunks=2,
                       planner=PlannerSettings(head_layers=head_layers, wire_dtype=wire_dtype),
                       threads=threads, fronts=fronts) as swarm:
        link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, ready_timeout=120,
                                    min_stages=2)
        try:
            yield link
        finally:
            await link.close()


async def wan_run(model: Path, prompt: list[int], n_decode: int, threads: int) -> dict:
    async with wan_swarm(model, threads) as link:
        asker = Asker(model, link.head_layers, n_threads=threads)
        try:
            await generate_all(asker, prompt, link, ignore_eos=True, max_tokens=4, sampling=GREEDY)
            gens = [await generate_all(asker, prompt, link, ignore_eos=True, max_tokens=n_decode, sampling=GREEDY)
                    for _ in range(2)]
            t0 = time.perf_counter()
            conc = await asyncio.gather(*[generate_all(asker, prompt, link, ignore_eos=True, max_tokens=32,
                                                       sampling=GREEDY) for _ in range(8)])
            aggregate8 = sum(len(g.tokens) for g in conc) / (time.perf_counter() - t0)
        finally:
            asker.close()
    return {"single_stream_decode_tok_s": statistics.median(decode_rate(g) for g in gens),
            "concurrency_8_aggregate_tok_s": aggregate8, "breakdown": breakdown(gens)}


async def prompt_stream_run(model: Path, threads: int, n_tokens: int, rate_mbit: float, repeats: int) -> dict:
    """Section h: first-token time of an ``n_tokens`` prompt, chunks streamed vs one at a time
    (the link's steps_in_flight set to 1), alternating, over links capped at ``rate_mbit``."""
    rng = np.random.default_rng(3)
    out: dict = {"links": {**WAN, "rate_mbit_each_direction": rate_mbit}, "prompt_tokens": n_tokens,
                 "threads_per_process": threads, "repeats": repeats}
    async with wan_swarm(model, threads, rate_mbit) as link:
        asker = Asker(model, link.head_layers, n_threads=threads)
        streamed_depth = link.steps_in_flight
        times: dict[str, list[float]] = {"one_chunk_at_a_time": [], "streamed": []}
        answers: dict[str, list[int]] = {}
        try:
            await generate_all(asker, [int(t) for t in rng.integers(100, 40000, 600)], link, max_tokens=1,
                               sampling=GREEDY)  # warm-up: connections, congestion windows
            for _ in range(repeats):
                prompt = [int(t) for t in rng.integers(100, 40000, n_tokens)]
                for mode, depth in (("one_chunk_at_a_time", 1), ("streamed", streamed_depth)):
                    link.steps_in_flight = depth
                    t0 = time.perf_counter()
                    gen = await generate_all(asker, prompt, link, max_tokens=1, sampling=GREEDY)
                    times[mode].append(gen.timings[0].done - t0)
                    answers.setdefault(mode, []).append(gen.tokens[0])
        finally:
            link.steps_in_flight = streamed_depth
            asker.close()
    for mode, ts in times.items():
        out[mode] = {"first_token_s_median": round(statistics.median(ts), 3), "runs": [round(t, 3) for t in ts]}
    out["streamed_speedup"] = round(statistics.median(times["one_chunk_at_a_time"])
                                    / statistics.median(times["streamed"]), 3)
    out["same_first_tokens"] = answers["streamed"] == answers["one_chunk_at_a_time"]
    return out


# Held-back tasks for speculation (no test uses them): two whose answers repeat the prompt, one
# whose answer does not.
SPECULATIVE_TASKS = {
    "code_rename": "Rewrite this function with the variable `items` renamed to `values`. Output only the code.\n\n"
                   "def total(items, limit):\n    result = 0\n    for item in items:\n        if item > limit:\n"
                   "            result += item * 2\n        else:\n            result -= item\n    return result\n",
    "log_extract": "Copy every line of this log that mentions ERROR, unchanged, one per line.\n\n"
                   "09:14:02 INFO  server started on port 8080\n09:14:07 ERROR disk /dev/sdb1 is 97% full\n"
                   "09:15:11 INFO  user alice logged in\n09:15:40 ERROR connection to db-2 timed out after 30s\n"
                   "09:16:03 WARN  slow query on table orders (2.3s)\n09:16:59 ERROR disk /dev/sdb1 is 99% full\n"
                   "09:17:20 INFO  backup finished\n",
    "copy_paragraph": "Copy this paragraph exactly, changing only the word \"blue\" to \"green\".\n\n"
                      "The harbour was quiet that morning. Fishing boats sat low in the water, their blue hulls "
                      "streaked with salt, and the gulls walked the pier as if they owned it. Down by the "
                      "market, an old man was mending a net, pulling each knot tight with his teeth.",
    "story": "Write a short story about a fox who finds a brass key in the snow.",
}


async def speculative_run(model: Path, threads: int, max_tokens: int, repeats: int) -> dict:
    """Section g: single-stream tok/s per task and --speculate mode, and 8 concurrent requests."""
    from swarmctl.asker.speculate import ModelDraft, speculation_for

    out: dict = {"links": WAN, "one_way_links_per_token": 3, "threads_per_process": threads,
                 "max_tokens": max_tokens, "repeats": repeats, "tasks": {}}
    async with wan_swarm(model, threads) as link:
        asker = Asker(model, link.head_layers, n_threads=threads, max_in_flight=16)
        draft = ModelDraft(model, asker.gguf, n_threads=threads)
        try:
            # ngram and draft as the cost model chooses windows in flight; *_one_window: one window per
            # round trip (as before issue 34); ngram_3_windows: always three in flight
            modes = {"off": lambda: None,
                     "ngram_one_window": lambda: speculation_for("ngram", windows=1),
                     "ngram": lambda: speculation_for("ngram"),
                     "ngram_3_windows": lambda: speculation_for("ngram", windows=3),
                     "draft_self_k4_one_window": lambda: speculation_for("draft", draft, k_max=4, windows=1),
                     "draft_self_k4": lambda: speculation_for("draft", draft, k_max=4)}
            for task, text in SPECULATIVE_TASKS.items():
                prompt = asker.tokenizer.encode_chat([{"role": "user", "content": text}])
                await generate_all(asker, prompt, link, max_tokens=4, sampling=GREEDY)  # warm-up
                row: dict = {"prompt_tokens": len(prompt)}
                answers = {}
                for mode, make in modes.items():
                    gens = [await generate_all(asker, prompt, link, max_tokens=max_tokens, sampling=GREEDY,
                                               speculation=make()) for _ in range(repeats)]
                    answers[mode] = gens[0].tokens
                    g = gens[0]
                    row[mode] = {"tok_s": round(statistics.median(decode_rate(x) for x in gens), 3),
                                 "tokens": len(g.tokens), "steps": len(g.timings), "drafted": g.drafted,
                                 "accepted": g.accepted,
                                 "acceptance": round(g.accepted / g.drafted, 3) if g.drafted else None}
                for mode in modes:
                    if mode != "off":
                        row[mode]["over_off"] = round(row[mode]["tok_s"] / row["off"]["tok_s"], 3)
                        row[mode]["same_tokens_as_off"] = answers[mode] == answers["off"]
                out["tasks"][task] = row
            prompts = [asker.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in SPECULATIVE_TASKS.values()]
            batch = [prompts[i % len(prompts)] for i in range(8)]
            aggregate = {}
            for mode in ("off", "ngram_one_window", "ngram"):
                rates = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    gens = await asyncio.gather(*[generate_all(asker, p, link, max_tokens=max_tokens, sampling=GREEDY,
                                                               speculation=modes[mode]()) for p in batch])
                    rates.append(sum(len(g.tokens) for g in gens) / (time.perf_counter() - t0))
                aggregate[mode] = round(statistics.median(rates), 3)
            out["concurrency_8_aggregate_tok_s"] = {**aggregate, "ngram_over_off": round(aggregate["ngram"] / aggregate["off"], 3),
                                                    "ngram_one_window_over_off": round(aggregate["ngram_one_window"]
                                                                                       / aggregate["off"], 3)}
        finally:
            draft.close()
            asker.close()
    out["targets"] = {"ngram_repetitive_over_off": 4.0, "ngram_story_over_off": 0.97, "draft_self_k4_over_off": 3.0,
                      "concurrency_8_ngram_over_off": 0.95}
    return out


async def windows_sweep_run(model: Path, threads: int, max_tokens: int, repeats: int, delay_s: float,
                            counts: tuple[int, ...] = (1, 2, 4, 6, 8), caps: tuple[int, ...] = (4, 8)) -> dict:
    """Section k: single-stream tok/s with a fixed number of speculative windows in flight, beyond
    the asker's cap (MAX_WINDOWS, plans/whatif.py) too, over the same WAN: ngram drafts on the tasks whose
    answers repeat the prompt, and the bundled model drafting for itself (k = 4, every draft kept:
    the chain of windows never breaks, so what more windows buy is the trip they fill). Tokens
    must equal --speculate off's."""
    from swarmctl.asker.speculate import ModelDraft, speculation_for

    out: dict = {"links": {**WAN, "delay_s": delay_s}, "one_way_links_per_token": 3, "threads_per_process": threads,
                 "max_tokens": max_tokens, "repeats": repeats, "tasks": {}}
    async with wan_swarm(model, threads, delay_s=delay_s) as link:
        asker = Asker(model, link.head_layers, n_threads=threads, max_in_flight=16)
        draft = ModelDraft(model, asker.gguf, n_threads=threads)
        try:
            for task in ("copy_paragraph", "log_extract"):
                prompt = asker.tokenizer.encode_chat([{"role": "user", "content": SPECULATIVE_TASKS[task]}])
                await generate_all(asker, prompt, link, max_tokens=4, sampling=GREEDY)  # warm-up
                off = await generate_all(asker, prompt, link, max_tokens=max_tokens, sampling=GREEDY)
                row: dict = {"prompt_tokens": len(prompt), "off_tok_s": round(decode_rate(off), 3)}
                # mode → its speculation: a fixed count of windows, or the asker's own choice under each cap
                modes = {**{f"ngram_{n}_windows": lambda n=n: speculation_for("ngram", windows=n) for n in counts},
                         **{f"draft_self_k4_{n}_windows": lambda n=n: speculation_for(
                             "draft", draft, k_max=4, windows=n) for n in counts},
                         **{f"ngram_chosen_cap_{cap}": lambda cap=cap: speculation_for("ngram", max_windows=cap)
                            for cap in caps},
                         **{f"draft_self_k4_chosen_cap_{cap}": lambda cap=cap: speculation_for(
                             "draft", draft, k_max=4, max_windows=cap) for cap in caps}}
                for mode, make in modes.items():
                    gens = []
                    for _ in range(repeats):
                        gens.append(await generate_all(asker, prompt, link, max_tokens=max_tokens, sampling=GREEDY,
                                                       speculation=make()))
                    row[mode] = {"tok_s": round(statistics.median(decode_rate(g) for g in gens), 3),
                                 "runs": [round(decode_rate(g), 3) for g in gens],
                                 "acceptance": round(gens[0].accepted / gens[0].drafted, 3) if gens[0].drafted else None,
                                 "same_tokens_as_off": all(g.tokens == off.tokens for g in gens)}
                for source in ("ngram", "draft_self_k4"):
                    top = max(counts)
                    low = min(counts)
                    row[f"{source}_{top}_over_{low}_windows"] = round(row[f"{source}_{top}_windows"]["tok_s"]
                                                                      / row[f"{source}_{low}_windows"]["tok_s"], 3)
                    if len(caps) == 2:
                        row[f"{source}_chosen_cap_{caps[1]}_over_cap_{caps[0]}"] = round(
                            row[f"{source}_chosen_cap_{caps[1]}"]["tok_s"] / row[f"{source}_chosen_cap_{caps[0]}"]["tok_s"], 3)
                out["tasks"][task] = row
            # 8 concurrent requests (the four tasks mixed), aggregate: off, and ngram as the asker
            # chooses under each cap (while the stages queue other requests' steps)
            prompts = [asker.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in SPECULATIVE_TASKS.values()]
            batch = [prompts[i % len(prompts)] for i in range(8)]
            rates: dict[str, list[float]] = {}
            for _ in range(repeats):  # (modes alternate, so that the box's slow spells fall on all of them)
                for cap in (None, *caps):
                    t0 = time.perf_counter()
                    gens = await asyncio.gather(*[generate_all(
                        asker, p, link, max_tokens=max_tokens, sampling=GREEDY,
                        speculation=speculation_for("ngram", max_windows=cap) if cap else None) for p in batch])
                    rate = sum(len(g.tokens) for g in gens) / (time.perf_counter() - t0)
                    rates.setdefault(f"ngram_chosen_cap_{cap}" if cap else "off", []).append(round(rate, 3))
            aggregate = {mode: {"tok_s": statistics.median(r), "runs": r} for mode, r in rates.items()}
            for cap in caps:
                aggregate[f"ngram_chosen_cap_{cap}_over_off"] = round(
                    aggregate[f"ngram_chosen_cap_{cap}"]["tok_s"] / aggregate["off"]["tok_s"], 3)
            out["concurrency_8_aggregate"] = aggregate
        finally:
            draft.close()
            asker.close()
    return out


async def wire_first_token_run(threads: int, n_tokens: int, rate_mbit: float, repeats: int) -> dict:
    """Section j: first-token time of an ``n_tokens`` prompt over links capped at ``rate_mbit``,
    activations in f32 and in f16 (issue 33's target: f16 at least 1.8x faster), on a model as wide
    as Kimi K2 (7168) and otherwise thin (harness/tiny_models.WIDE_THIN: a few MB of matrices besides
    its embedding), so that the crossings, not this machine's compute, are what a prompt waits for,
    as they are for a Kimi-sized trunk over home uplinks. One swarm per dtype; prompts alternate."""
    import tempfile

    from harness.tiny_models import WIDE_THIN, write_tiny_model

    rng = np.random.default_rng(5)
    out: dict = {"links": {**WAN, "rate_mbit_each_direction": rate_mbit}, "prompt_tokens": n_tokens,
                 "threads_per_process": threads, "repeats": repeats, "n_embd": WIDE_THIN.n_embd}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "wide-thin.gguf", WIDE_THIN, default_model_path())
        prompts = [[int(t) for t in rng.integers(100, 40000, n_tokens)] for _ in range(repeats)]
        for dtype in ("f32", "f16"):
            async with wan_swarm(model, threads, rate_mbit, head_layers=1, wire_dtype=dtype) as link:
                asker = Asker(model, link.head_layers, n_threads=threads)
                try:
                    await generate_all(asker, prompts[0][:600], link, max_tokens=1, sampling=GREEDY)  # warm-up
                    times, firsts = [], []
                    for prompt in prompts:
                        t0 = time.perf_counter()
                        gen = await generate_all(asker, prompt, link, max_tokens=1, sampling=GREEDY)
                        times.append(gen.timings[0].done - t0)
                        firsts.append(gen.tokens[0])
                finally:
                    asker.close()
            out[dtype] = {"first_token_s_median": round(statistics.median(times), 3),
                          "runs": [round(t, 3) for t in times], "first_tokens": firsts}
    out["f16_speedup"] = round(out["f32"]["first_token_s_median"] / out["f16"]["first_token_s_median"], 3)
    out["target"] = 1.8
    return out


async def asker_drafts_run(threads: int, max_tokens: int, repeats: int) -> dict:
    """Section i: drafts the asker makes with no extra crossing, over the WAN relay: --speculate mtp
    on two tiny DeepSeek-V3s with a nextn layer (a random one, and the echo model's, built to know
    the next token: harness/tiny_models._echo), and layerskip on the bundled model. Tok/s over
    off (wall time, first token to last), drafts kept, and whether the answers equal off's."""
    import tempfile

    from harness.tiny_models import TINY_CONFIGS, write_tiny_model
    from swarmctl.asker.speculate import LayerSkipDraft, MtpDraft, speculation_for

    bundled = default_model_path()
    out: dict = {"links": WAN, "one_way_links_per_token": 3, "threads_per_process": threads,
                 "max_tokens": max_tokens, "repeats": repeats, "ignore_eos": True, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        for name in ("deepseek2-mtp-q4_1", "deepseek2-echo-f32"):
            path = write_tiny_model(Path(tmp) / f"{name}.gguf", TINY_CONFIGS[name], bundled)
            cases.append((f"mtp_{name}", path, 1, "mtp", lambda path=path: MtpDraft(path, n_threads=threads)))
        cases.append(("layerskip_bundled", bundled, 4, "layerskip",
                      lambda: LayerSkipDraft(bundled, 4, n_threads=threads)))
        for label, model, head_layers, mode, open_draft in cases:
            async with wan_swarm(model, threads, head_layers=head_layers) as link:
                asker = Asker(model, link.head_layers, n_threads=threads)
                draft = open_draft()
                row: dict = {"model": model.name, "head_layers": head_layers, "tasks": {}}
                try:
                    for task in ("copy_paragraph", "story"):
                        prompt = asker.tokenizer.encode_chat([{"role": "user", "content": SPECULATIVE_TASKS[task]}])
                        await generate_all(asker, prompt, link, max_tokens=4, sampling=GREEDY)  # warm-up
                        runs = {}
                        for which, make in (("off", lambda: None), (mode, lambda: speculation_for(mode, draft))):
                            runs[which] = [await generate_all(asker, prompt, link, max_tokens=max_tokens,
                                                              sampling=GREEDY, ignore_eos=True, speculation=make())
                                           for _ in range(repeats)]
                        rate = {w: statistics.median(decode_rate(g) for g in gens) for w, gens in runs.items()}
                        spec = runs[mode][0]
                        row["tasks"][task] = {
                            "off_tok_s": round(rate["off"], 3), f"{mode}_tok_s": round(rate[mode], 3),
                            "over_off": round(rate[mode] / rate["off"], 3), "drafted": spec.drafted,
                            "accepted": spec.accepted,
                            "acceptance": round(spec.accepted / spec.drafted, 3) if spec.drafted else None,
                            "same_tokens_as_off": all(g.tokens == runs["off"][0].tokens for g in runs[mode])}
                finally:
                    draft.close()
                    asker.close()
                out["runs"][label] = row
    return out


async def inproc_run(model: Path, prompt: list[int], n_decode: int, threads: int) -> float:
    asker = Asker(model, 4, n_threads=threads)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 4, 2).trunk, n_threads=threads,
                        max_context=asker.max_context)
    try:
        await generate_all(asker, prompt, trunk, ignore_eos=True, max_tokens=8, sampling=GREEDY)
        gens = [await generate_all(asker, prompt, trunk, ignore_eos=True, max_tokens=n_decode, sampling=GREEDY) for _ in range(3)]
        return statistics.median(decode_rate(g) for g in gens)
    finally:
        trunk.close()
        asker.close()


def transport(repeats: int) -> dict:
    import subprocess

    r = subprocess.run([sys.executable, str(Path(__file__).parent / "bench_transport.py"), "--repeats", str(repeats)],
                       capture_output=True, text=True, timeout=900)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr.strip().splitlines()[-1:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--skip-transport", action="store_true")
    p.add_argument("--skip-wan", action="store_true")
    p.add_argument("--speculative", action="store_true", help="run only section g (speculative steps over the WAN)")
    p.add_argument("--windows-sweep", action="store_true",
                   help="run only section k (1 to 8 speculative windows in flight over the WAN)")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 6, 8], help="section k: windows always out")
    p.add_argument("--caps", type=int, nargs="+", default=[4, 8],
                   help="section k: the asker's own choice under these caps of windows (two: their ratio too)")
    p.add_argument("--delay-ms", type=float, default=WAN["delay_s"] * 1000, help="section k: each link's one-way delay")
    p.add_argument("--spec-tokens", type=int, default=96, help="max tokens per request in section g")
    p.add_argument("--spec-repeats", type=int, default=3)
    p.add_argument("--prompt-stream", type=int, metavar="N", help="run only section h, with an N-token prompt")
    p.add_argument("--asker-drafts", action="store_true", help="run only section i (mtp and layerskip over the WAN)")
    p.add_argument("--wire-first-token", type=int, metavar="N",
                   help="run only section j: first-token time of an N-token prompt in f32 vs f16 over capped links")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="section h: each link direction's cap")
    p.add_argument("--repeats", type=int, default=3, help="section h: prompts per mode")
    args = p.parse_args()
    model = default_model_path()
    if args.prompt_stream:
        print(json.dumps({"model": model.name, "h_prompt_stream": asyncio.run(prompt_stream_run(
            model, max(1, args.threads // 3), args.prompt_stream, args.rate_mbit, args.repeats))}, indent=2))
        return
    if args.wire_first_token:
        print(json.dumps({"j_wire_first_token": asyncio.run(wire_first_token_run(
            max(1, args.threads // 3), args.wire_first_token, args.rate_mbit, args.repeats))}, indent=2))
        return
    if args.asker_drafts:
        print(json.dumps({"i_asker_drafts": asyncio.run(asker_drafts_run(max(1, args.threads // 3), args.spec_tokens,
                                                                          args.spec_repeats))}, indent=2))
        return
    if args.windows_sweep:
        print(json.dumps({"model": model.name, "k_windows_sweep": asyncio.run(
            windows_sweep_run(model, max(1, args.threads // 3), args.spec_tokens, args.spec_repeats,
                              args.delay_ms / 1000, counts=tuple(args.windows), caps=tuple(args.caps)))}, indent=2))
        return
    if args.speculative:
        threads = max(1, args.threads // 3)
        print(json.dumps({"model": model.name, "g_speculative": asyncio.run(
            speculative_run(model, threads, args.spec_tokens, args.spec_repeats))}, indent=2))
        return
    from kernels.tokenizer import Tokenizer

    prompt = Tokenizer(model).encode_prompt(PROMPT)
    # llama-cpp-python runs on the same thread as our engines compute: libgomp throttles its spinning
    # once two threads each lead an OpenMP team on a machine this small, which halved whichever ran
    # second (measured); one team for both keeps the comparison fair.
    from swarmctl.batching import compute_thread

    llama = statistics.median(compute_thread().submit(llama_cpp_decode, model, prompt, args.decode,
                                                      args.threads).result() for _ in range(3))
    inproc = asyncio.run(inproc_run(model, prompt, args.decode, args.threads))
    # Single stream: one process computes at a time, so each gets the whole thread budget.
    swarm = asyncio.run(swarm_runs(model, prompt, args.decode, args.threads))
    # Many streams: all three processes compute at once, so they share the budget (one thread each on
    # 2 cores); two OpenMP threads per process on 2 cores collapse under oversubscription.
    pipelined_threads = max(1, args.threads // 3)
    piped = asyncio.run(swarm_runs(model, prompt, args.decode, pipelined_threads, concurrency_levels=(1, 4, 8, 16)))
    result = {
        "model": model.name, "threads": args.threads, "prompt_tokens": len(prompt), "decode_tokens": args.decode,
        "a_single_stream_decode_tok_s": {"llama_cpp_python": llama, "engine_inproc": inproc,
                                         "local_swarm": swarm["single_stream_decode_tok_s"],
                                         "swarm_over_llama_cpp": swarm["single_stream_decode_tok_s"] / llama,
                                         "inproc_over_llama_cpp": inproc / llama, "target": 0.8,
                                         "threads_each": args.threads},
        "b_threads_per_process": pipelined_threads,
        "b_aggregate_tok_s": {c: v["aggregate_tok_s"] for c, v in piped["concurrency"].items()},
        "b_concurrency_8_over_single_stream": piped["concurrency"]["8"]["aggregate_tok_s"]
                                              / swarm["single_stream_decode_tok_s"],
        "b_concurrency_8_over_concurrency_1": piped["concurrency"]["8"]["aggregate_tok_s"]
                                              / piped["concurrency"]["1"]["aggregate_tok_s"],
        "b_target": 3.0,
        "c_breakdown_single_stream": swarm["single_stream_breakdown"],
        "c_breakdown_concurrency_8": piped["concurrency"]["8"]["breakdown"],
        "e_nodes": piped["nodes"], "e_target_mb_over_tensors_plus_kv": 200,
    }
    if not args.skip_wan:
        # One thread per process here too: with 20 ms idle gaps between steps, two-thread OpenMP
        # teams in this VM lose their partner vCPU at every barrier (an asker head step measured
        # 1.6 ms with no delay, 12.8 ms behind 20 ms links). The limit uses the same threads' compute.
        wan = asyncio.run(wan_run(model, prompt, args.decode, pipelined_threads))
        b = piped["single_stream_breakdown"]
        compute_s = (b["asker_head_compute_ms"] + b["asker_tail_compute_ms"]
                     + sum(s["compute_ms"] for s in b["stages"].values())) / 1e3
        limit = 1.0 / (3 * WAN["delay_s"] + compute_s)  # asker→stage 1→stage 2→asker: three one-way links
        result["d_wan"] = {**wan, "links": WAN, "threads_per_process": pipelined_threads,
                           "one_way_links_per_token": 3, "compute_per_token_ms": compute_s * 1e3,
                           "limit_tok_s": limit, "over_limit": wan["single_stream_decode_tok_s"] / limit,
                           "target": 0.85}
    if not args.skip_transport:
        result["f_transport"] = transport(5)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
