"""One stream against eight concurrent ones, on a one-stage and a two-stage plan; prints JSON.

    python benchmarks/bench_streams.py [--streams 8] [--max-tokens 64] [--repeats 3] [--no-serve] [--out FILE]

For each plan a local swarm is built with the CLI (host + 1 or 2 trunk processes over QUIC + mTLS,
``LocalSwarm``, as ``swarmctl serve`` builds its own) and driven by an Asker in this process
(what ``serve`` runs per request, without HTTP): one 64-token completion alone, then ``--streams``
at once, rounds alternating; each reports the round with the median rate. Aggregate tok/s =
completion tokens / wall time from the first request to the last token.

Where the time goes, per round: the share of the wall time the asker's head and tail runners
computed (their RunnerStats.busy_s), the share it spent choosing tokens (sampling, every
request's TokenTiming.sample_s added up), and each stage's busy share (its own stats), with the
median batch the stages and the asker's runners formed; and the CPU time each process spent per
token (what a batch saves, or adds, shows there whatever the other load on the machine). Beside
them, ``row_costs``: a decode row's CPU time at the engine's trunk slice for 1 and 8 requests, and in
llama.cpp (plain buffers) for 1 and 8 rows: what batching can save on this CPU at all. This
machine is shared and noisy.

With ``--serve`` (the default) the same 1-against-N comparison also runs through ``swarmctl serve``
(``--trunk-nodes`` 1 and 2: its own CLI-built local swarm) over HTTP with the official openai
client, streaming, serve's default top-k and top-p.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json, process_cpu_s  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from net.endpoint import Address, ask_member  # noqa: E402
from swarmctl.asker.head_tail import Asker, Generation, generate_all  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

PROMPT = "Once upon a time, in a lighthouse by a cold grey sea, there lived a keeper who"
SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.9)  # serve's defaults for top-k and top-p
HEAD_LAYERS = 4
REPO = Path(__file__).resolve().parents[1]


def scheduled(pid: int) -> tuple[float, float]:
    """Seconds a process's threads ran on a CPU, and waited runnable for one (Linux schedstat): a
    thread that waits for a core, not for another part, shows in the second."""
    run = wait = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            r, w, _ = (int(x) for x in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        run, wait = run + r, wait + w
    return run / 1e9, wait / 1e9


async def stage_busy(swarm: LocalSwarm, link: SwarmLink) -> dict[str, float]:
    creds = swarm.asker_home.credentials()
    out = {}
    for stage in link.plan.stages:
        stats = await ask_member(Address.parse(stage.address), creds, stage.member, {"type": "stats"})
        out[stage.member] = stats["busy_s"]
    return out


async def one_round(asker: Asker, link: SwarmLink, swarm: LocalSwarm, prompt: list[int], streams: int,
                    max_tokens: int, seed: int) -> dict:
    runners = (asker.head_runner, asker.tail_runner)
    busy0 = [r.stats.busy_s for r in runners]
    batches0 = [(r.stats.batches, r.stats.steps) for r in runners]
    builds0 = [e.stats.graph_builds for e in (asker.head, asker.tail)]
    stages0 = await stage_busy(swarm, link)
    members = {"asker": os.getpid(), **{f"process {i}": p.pid for i, p in enumerate(swarm.processes)}}
    cpu0 = {k: process_cpu_s(pid) for k, pid in members.items()}
    sched0 = {k: scheduled(pid) for k, pid in members.items()}
    t0 = time.perf_counter()
    gens: list[Generation] = await asyncio.gather(*(generate_all(
        asker, prompt, link, max_tokens=max_tokens, ignore_eos=True,
        sampling=SamplingParams(seed=seed + i, **SAMPLING)) for i in range(streams)))
    wall = time.perf_counter() - t0
    cpu = {k: process_cpu_s(pid) - cpu0[k] for k, pid in members.items()}
    waited = {k: scheduled(pid)[1] - sched0[k][1] for k, pid in members.items()}
    stages1 = await stage_busy(swarm, link)
    tokens = sum(len(g.tokens) for g in gens)
    steps = [t for g in gens for t in g.timings]
    share = {
        "asker_head": (runners[0].stats.busy_s - busy0[0]) / wall,
        "asker_tail": (runners[1].stats.busy_s - busy0[1]) / wall,
        "asker_sampling": sum(t.sample_s for t in steps) / wall,
        **{f"stage {name}": (stages1[name] - stages0[name]) / wall for name in stages1},
    }
    builds = {name: e.stats.graph_builds - b for name, e, b in zip(("asker_head", "asker_tail"), (asker.head, asker.tail),
                                                                  builds0)}
    mean_batch = {name: (r.stats.steps - s) / max(1, r.stats.batches - b)
                  for name, r, (b, s) in zip(("asker_head", "asker_tail"), runners, batches0)}
    return {
        "streams": streams,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),
        # CPU time each process spent per token generated (host first, then the trunks): work a
        # batch does beyond what its rows need shows here, whatever the other load on the machine
        "cpu_ms_per_token": {k: round(v / tokens * 1e3, 2) for k, v in cpu.items()},
        # the cores these processes had, together, over the round (a shared machine caps it)
        "cores_used": round(sum(cpu.values()) / wall, 3),
        # seconds its threads waited runnable for a core, per second of the round: the machine's
        # cores, not one part waiting for another, held them back
        "runqueue_wait_share_of_wall": {k: round(v / wall, 3) for k, v in waited.items()},
        "busy_share_of_wall": {k: round(v, 3) for k, v in share.items()},
        "asker_mean_batch": {k: round(v, 2) for k, v in mean_batch.items()},
        "asker_batches": {name: r.stats.batches - b for name, r, (b, _) in zip(("asker_head", "asker_tail"), runners,
                                                                               batches0)},
        "asker_graph_builds": builds,
        "stage_median_batch": statistics.median(h.batch for t in steps if t.trunk for h in t.trunk.hops),
        "step_ms_median": {
            "total": round(statistics.median(t.latency_s for t in steps if t.done) * 1e3, 2),
            "head_queued": round(statistics.median(t.head.queued_s for t in steps) * 1e3, 2),
            "head_compute": round(statistics.median(t.head.compute_s for t in steps) * 1e3, 2),
            "trunk_round_trip": round(statistics.median(t.trunk.round_trip_s for t in steps if t.trunk) * 1e3, 2),
            "trunk_queued": round(statistics.median(t.trunk_queued_s for t in steps) * 1e3, 2),
            "trunk_compute": round(statistics.median(t.trunk_compute_s for t in steps) * 1e3, 2),
            "tail_queued": round(statistics.median(t.tail.queued_s for t in steps) * 1e3, 2),
            "tail_compute": round(statistics.median(t.tail.compute_s for t in steps) * 1e3, 2),
            "sampling": round(statistics.median(t.sample_s for t in steps if t.done) * 1e3, 3),
        },
    }


def median_round(rounds: list[dict]) -> dict:
    """The round with the median rate, whole (field-by-field medians would mix rounds)."""
    return sorted(rounds, key=lambda r: r["aggregate_tok_s"])[len(rounds) // 2]


async def plan_run(model: Path, n_stages: int, streams: int, max_tokens: int, repeats: int,
                   threads: int) -> dict:
    with LocalSwarm(model=str(model), n_trunks=n_stages, planner=PlannerSettings(head_layers=HEAD_LAYERS),
                    threads=threads) as swarm:
        link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=n_stages)
        asker = Asker(model, link.head_layers, n_threads=threads, max_in_flight=max(16, streams))
        try:
            prompt = asker.tokenizer.encode_prompt(PROMPT)
            await one_round(asker, link, swarm, prompt, streams, 8, 0)  # warm-up: graphs of each batch size
            singles, many = [], []
            for r in range(repeats):
                singles.append(await one_round(asker, link, swarm, prompt, 1, max_tokens, 100 + r))
                many.append(await one_round(asker, link, swarm, prompt, streams, max_tokens, 1000 * (r + 1)))
        finally:
            await link.close()
            asker.close()
    one, n = median_round(singles), median_round(many)
    return {
        "stages": n_stages,
        "single": one,
        f"concurrent_{streams}": n,
        "single_rounds_tok_s": [r["aggregate_tok_s"] for r in singles],
        f"concurrent_{streams}_rounds_tok_s": [r["aggregate_tok_s"] for r in many],
        "ratio_median": round(n["aggregate_tok_s"] / one["aggregate_tok_s"], 2),
        "ratio_per_round": [round(b["aggregate_tok_s"] / a["aggregate_tok_s"], 2) for a, b in zip(singles, many)],
    }


def start_serve(root: Path, n_stages: int, threads: int) -> tuple[subprocess.Popen, str]:
    """``swarmctl serve`` with no swarm joined: its own local swarm of ``n_stages`` trunk processes."""
    env = {**os.environ, "SWARMCTL_HOME": str(root / "no-swarm")}
    out = root / "stdout"
    with open(out, "wb") as stdout, open(root / "stderr", "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--port", "0", "--trunk-nodes",
                                    str(n_stages), "--threads", str(threads), "--head-layers", str(HEAD_LAYERS)],
                                   env=env, cwd=REPO, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (match := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", out.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"swarmctl serve did not start: {(root / 'stderr').read_text().strip()}")
        time.sleep(0.2)
    return process, match[1]


async def serve_rounds(base_url: str, pid: int, streams: int, max_tokens: int, repeats: int) -> dict:
    """The same comparison through ``serve``'s HTTP API (the official openai client, streaming)."""
    import openai

    from benchmarks.bench_api import round_of

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        await round_of(client, model, streams, 8, 0, pid)  # warm-up
        singles, many = [], []
        for r in range(repeats):
            singles.append(await round_of(client, model, 1, max_tokens, 100 + r, pid))
            many.append(await round_of(client, model, streams, max_tokens, 1000 * (r + 1), pid))
    finally:
        await client.close()
    one, n = median_round(singles), median_round(many)
    return {"single": one, f"concurrent_{streams}": n,
            "single_rounds_tok_s": [r["aggregate_tok_s"] for r in singles],
            f"concurrent_{streams}_rounds_tok_s": [r["aggregate_tok_s"] for r in many],
            "ratio_median": round(n["aggregate_tok_s"] / one["aggregate_tok_s"], 2),
            "ratio_per_round": [round(b["aggregate_tok_s"] / a["aggregate_tok_s"], 2) for a, b in zip(singles, many)]}


def serve_run(n_stages: int, streams: int, max_tokens: int, repeats: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        process, base_url = start_serve(Path(tmp), n_stages, threads)
        try:
            return {"stages": n_stages, **asyncio.run(serve_rounds(base_url, process.pid, streams, max_tokens, repeats))}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


def row_costs(model: Path, threads: int, repeats: int = 20) -> dict:
    """CPU time per row of one decode step (this thread's, so other processes' load does not
    count): at a trunk slice of the engine, for 1 and 8 requests of one row each and one request
    of 8 rows; and in llama.cpp (plain weight buffers, as the engine uses) for 1 and 8 rows of one
    sequence, whose logits it computes for the last row only (one LM head for 8 rows). What eight
    streams need is eight sequences of one row each, a logits row each: that, in llama.cpp (its
    default per-sequence KV streams) and in the engine's whole model, is the like-for-like pair.
    What batching can save at most on this CPU, whatever the asker does."""
    import numpy as np

    from kernels.gguf_file import GGUFFile
    from kernels.oracle_llama import load_llama
    from kernels.slice import SliceEngine, Step
    from kernels.spec import ModelSpec, SliceSpec

    out: dict = {}
    with GGUFFile(model) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        trunk = SliceSpec(HEAD_LAYERS, spec.n_layer - HEAD_LAYERS)
        whole = SliceSpec(0, spec.n_layer, has_embedding=True, has_lm_head=True)
        for label, slice_spec, cases in (("engine_trunk", trunk, (("1x1", 1, 1), ("8x1", 8, 1), ("1x8", 1, 8))),
                                         ("engine_whole_model", whole, (("1x1", 1, 1), ("8x1", 8, 1)))):
            with SliceEngine(gguf, slice_spec, n_threads=threads) as engine:
                for name, n_requests, rows in cases:
                    def step(rid: bytes, pos: int, n: int) -> Step:
                        if slice_spec.has_embedding:
                            return Step(rid, pos, tokens=[5] * n)
                        return Step(rid, pos, hidden=np.zeros((n, spec.n_embd), np.float32))
                    ids = [f"{name}/{i}".encode() for i in range(n_requests)]
                    engine.forward_batch([step(i, 0, 16) for i in ids])
                    pos, cpu = 16, []
                    for _ in range(repeats):
                        t0 = time.thread_time()
                        engine.forward_batch([step(i, pos, rows) for i in ids])
                        cpu.append((time.thread_time() - t0) / (n_requests * rows))
                        pos += rows
                    out[f"{label}_{name}_cpu_ms_per_row"] = round(statistics.median(cpu) * 1e3, 3)
    llm = load_llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads)
    try:
        llm.eval(llm.tokenize(PROMPT.encode()))
        for rows in (1, 8):
            cpu = []
            for _ in range(repeats):
                t0 = time.thread_time()
                llm.eval([5] * rows)
                cpu.append((time.thread_time() - t0) / rows)
            out[f"llama_cpp_plain_whole_model_1x{rows}_cpu_ms_per_row"] = round(statistics.median(cpu) * 1e3, 3)
        out.update(llama_sequences(llm, threads, repeats))
    finally:
        llm.close()
    out["engine_8_requests_over_1"] = round(out["engine_trunk_8x1_cpu_ms_per_row"] / out["engine_trunk_1x1_cpu_ms_per_row"], 3)
    out["llama_cpp_8_rows_over_1"] = round(out["llama_cpp_plain_whole_model_1x8_cpu_ms_per_row"]
                                          / out["llama_cpp_plain_whole_model_1x1_cpu_ms_per_row"], 3)
    out["engine_whole_model_8_requests_over_1"] = round(out["engine_whole_model_8x1_cpu_ms_per_row"]
                                                        / out["engine_whole_model_1x1_cpu_ms_per_row"], 3)
    out["llama_cpp_8_sequences_over_1"] = round(out["llama_cpp_plain_whole_model_8x1_cpu_ms_per_row"]
                                               / out["llama_cpp_plain_whole_model_1x1_seq_cpu_ms_per_row"], 3)
    return out


def llama_sequences(llm, threads: int, repeats: int) -> dict:
    """llama.cpp decoding 1 and 8 sequences of one row each, a logits row for each (a context of
    its own with 8 sequences, over ``llm``'s model): what eight streams ask of it."""
    import llama_cpp

    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 8 * 256, 512, 512, 8
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context of 8 sequences")

    def decode(rows: list[tuple[int, int]]) -> float:  # (position, sequence) per row; CPU seconds
        batch = llama_cpp.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (pos, seq) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 5, pos, 1, True
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(rows)
            t0 = time.thread_time()
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            return time.thread_time() - t0
        finally:
            llama_cpp.llama_batch_free(batch)

    out = {}
    try:
        for seq in range(8):
            decode([(p, seq) for p in range(16)])
        pos = [16] * 8
        for name, n in (("1x1_seq", 1), ("8x1", 8)):
            cpu = []
            for _ in range(repeats):
                cpu.append(decode([(pos[s], s) for s in range(n)]) / n)
                for s in range(n):
                    pos[s] += 1
            out[f"llama_cpp_plain_whole_model_{name}_cpu_ms_per_row"] = round(statistics.median(cpu) * 1e3, 3)
    finally:
        llama_cpp.llama_free(ctx)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plans", default="1,2", help="stage counts to run, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="compute threads per process")
    p.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                   help="also through `swarmctl serve` over HTTP (default on)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = default_model_path()
    stages = [int(n) for n in args.plans.split(",")]
    plans = [asyncio.run(plan_run(model, n, args.streams, args.max_tokens, args.repeats, args.threads)) for n in stages]
    served = [serve_run(n, args.streams, args.max_tokens, args.repeats, args.threads) for n in stages] \
        if args.serve else []
    costs = row_costs(model, args.threads)
    emit_json({
        "model": model.name,
        "row_costs": costs,
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "setup": f"local swarm built with the CLI (host + trunk processes, QUIC + mTLS), Asker in this process, "
                 f"{args.threads} compute thread(s) per process; sampling {SAMPLING}",
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "plans": plans,
        "serve": served,
    }, args.out)


if __name__ == "__main__":
    main()
