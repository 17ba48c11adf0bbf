"""An agent's tool loop through ``swarmctl serve``, with and without prefix reuse, side by side in
one run; prints JSON (and saves it with --out).

    python benchmarks/bench_agent_loop.py [--rounds 10] [--repeats 2] [--no-wan] [--out FILE]

A local swarm (host + 2 trunk processes over QUIC) whose every link passes the WAN relay (net.relay:
20 ms one way, each direction capped at 20 Mbit/s, no jitter or loss; ``--no-wan``: plain
loopback), and ``swarmctl serve`` joined to it as the asker (its own process). The official
OpenAI client plays an agent: a system prompt, a task, two tools; each round it sends the whole
conversation with ``tool_choice: "required"`` (the grammar makes even the 135M model call a tool),
appends the assistant's call and a tool result of about ``--result-tokens`` tokens (a file's
lines, seeded), and sends it all again: ``--rounds`` rounds, the way coding agents loop.

Each repeat runs the same conversation twice, in alternating order: ``with`` (serve's default:
every stage and the asker start from the prefix the previous round kept) and ``without``
(``cache_prompt: false`` in the body: every round prefills the whole conversation). Each repeat
is a new conversation (a session line at the top of the system prompt), so nothing kept carries
over from the one before. Reported: each round's wall time, prompt and cached tokens (OpenAI's
``usage.prompt_tokens_details.cached_tokens``), the loop's total, medians over repeats, and
whether both ways called the same tools with the same arguments (they must: the oracle rule).

Memory: after the last ``with`` loop, what each stage keeps for the asker's next requests as
``status`` shows it (tokens and KV bytes, told by each trunk to the host: message ``cached``)
next to each trunk's KV budget for one account (its ``stats``), the bound those bytes live under.
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
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_swarm import wan_fronts  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from net.endpoint import Address, ask_member  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402
from swarmctl.commands.status import fetch_status  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one test file.",
        "parameters": {"type": "object", "properties": {"target": {"type": "string", "maxLength": 40}},
                       "required": ["target"], "additionalProperties": False}}},
]
WORDS = ("def return self value index count total result items append range open path line parse "
         "check error raise None True False import from class with yield lambda assert break").split()


def tool_result(rng: np.random.Generator, tokens: int) -> str:
    """A file's worth of code-like lines, about ``tokens`` tokens (a word and a space are about one)."""
    lines, n = [], 0
    while n < tokens:
        words = [str(w) for w in rng.choice(WORDS, size=int(rng.integers(4, 10)))]
        lines.append("    " * int(rng.integers(0, 3)) + " ".join(words))
        n += len(words) + 2
    return "\n".join(lines)


def start_serve(root: Path, asker_home: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """``swarmctl serve`` as the swarm's asker (its home joined to the local swarm)."""
    env = {**os.environ, "SWARMCTL_HOME": str(asker_home)}
    out = root / "serve.stdout"
    with open(out, "wb") as stdout, open(root / "serve.stderr", "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--port", "0", "--threads",
                                    str(threads)], env=env, cwd=REPO, stdout=stdout, stderr=stderr,
                                   stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (match := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", out.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"swarmctl serve did not start: {(root / 'serve.stderr').read_text().strip()}")
        time.sleep(0.2)
    return process, match[1]


def agent_loop(client, model: str, session: int, args, reuse: bool) -> dict:
    """One conversation of ``args.rounds`` rounds; every round resends all of it."""
    rng = np.random.default_rng(1000 + session)  # the same conversation both ways within a repeat
    messages: list[dict] = [
        {"role": "system", "content": f"Session {session}. You are a coding agent working in a Python repository. "
                                      "Call one tool at a time; read files before you change them."},
        {"role": "user", "content": "The test test_parse_line fails with an IndexError. Find out why."}]
    rounds, calls = [], []
    extra = {} if reuse else {"cache_prompt": False}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                                  max_tokens=args.max_tokens, temperature=0, extra_body=extra)
        wall = time.perf_counter() - t0
        message = response.choices[0].message
        details = response.usage.prompt_tokens_details
        call = message.tool_calls[0] if message.tool_calls else None
        if call is None:  # (cut by max_tokens: the loop goes on with a call of its own)
            name, arguments, call_id = "read_file", json.dumps({"path": f"src/part{r}.py"}), f"call_{r}"
        else:
            name, arguments, call_id = call.function.name, call.function.arguments, call.id
        calls.append([name, arguments])
        rounds.append({"round": r + 1, "wall_s": round(wall, 3), "prompt_tokens": response.usage.prompt_tokens,
                       "cached_tokens": details.cached_tokens if details else 0,
                       "completion_tokens": response.usage.completion_tokens, "model_called": call is not None})
        print(json.dumps({"session": session, "reuse": reuse, **rounds[-1]}), file=sys.stderr, flush=True)
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(rng, args.result_tokens)})
    return {"total_s": round(sum(x["wall_s"] for x in rounds), 3), "rounds": rounds, "calls": calls}


async def kept_memory(asker_home, within_s: float = 15.0) -> list[dict]:
    """What each trunk keeps for askers' next requests, as ``status`` shows it (once every trunk
    has told the host: at its next tick), and its KV budget for one account."""
    deadline = time.monotonic() + within_s
    while True:
        status = await fetch_status(asker_home)
        trunks = [r for r in status.members if r.role == "trunk" and r.layers]
        if all(r.cached_tokens for r in trunks) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    creds, out = asker_home.credentials(), []
    for row in trunks:
        stats = await ask_member(Address.parse(row.address), creds, row.name, {"type": "stats"})
        limits = stats["budget"]["limits"]
        out.append({"member": row.name, "layers": row.layers, "cached_tokens": row.cached_tokens,
                    "cached_kv_bytes": row.cached_kv_bytes,
                    "kv_bytes_per_cached_token": round(row.cached_kv_bytes / row.cached_tokens) if row.cached_tokens
                    else None,
                    "account_kv_budget_bytes": limits["member_kv_bytes"], "stage_kv_budget_bytes": limits["total_kv_bytes"],
                    "budget_basis": limits["basis"],
                    "kept_prefixes": {k: v["kept_prefixes"] for k, v in stats["budget"]["members"].items()}})
    return out


def summary(repeats: list[dict]) -> dict:
    with_s = [r["with"]["total_s"] for r in repeats]
    without_s = [r["without"]["total_s"] for r in repeats]
    return {"with_total_s_median": round(statistics.median(with_s), 3),
            "without_total_s_median": round(statistics.median(without_s), 3),
            "without_over_with_median": round(statistics.median(w / v for w, v in zip(without_s, with_s)), 3),
            "with_total_s": with_s, "without_total_s": without_s,
            "all_calls_same": all(r["same_calls"] for r in repeats)}


def run(args) -> dict:
    import openai

    model = default_model_path()
    out: dict = {"model": model.name, "rounds": args.rounds, "repeats": args.repeats,
                 "result_tokens_per_round": args.result_tokens, "max_tokens": args.max_tokens,
                 "threads_per_process": args.threads,
                 "links": None if args.no_wan else {"delay_s": args.delay_ms / 1000, "jitter_s": 0.0, "loss": 0.0,
                                                    "rate_mbit_each_direction": args.rate_mbit},
                 "load_before": os.getloadavg()}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        fronts = None if args.no_wan else stack.enter_context(
            wan_fronts(args.rate_mbit, args.delay_ms / 1000, 0.0, 0.0))
        swarm = stack.enter_context(LocalSwarm(model=str(model), n_trunks=2, planner=PlannerSettings(head_layers=4),
                                               threads=args.threads,
                                               fronts=fronts))

        async def ready() -> None:  # both trunks in the plan before serve connects
            link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, ready_timeout=180,
                                        min_stages=2)
            await link.close()
        asyncio.run(ready())
        process, base_url = start_serve(Path(tmp), swarm.asker_home.path, args.threads)
        try:
            client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=1800)
            served = client.models.list().data[0].id
            client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            repeats = []
            for rep in range(args.repeats):
                order = [True, False] if rep % 2 == 0 else [False, True]
                loops = {reuse: agent_loop(client, served, rep, args, reuse) for reuse in order}
                repeats.append({"repeat": rep + 1, "first": "with" if order[0] else "without",
                                "with": loops[True], "without": loops[False],
                                "same_calls": loops[True]["calls"] == loops[False]["calls"]})
            out["memory_after_last_with_loop"] = asyncio.run(kept_memory(swarm.asker_home))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    out["load_after"] = os.getloadavg()
    out["repeats_run"] = repeats
    out["summary"] = summary(repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="conversations, each run both ways")
    p.add_argument("--result-tokens", type=int, default=280, help="about this many tokens per tool result")
    p.add_argument("--max-tokens", type=int, default=48, help="per answer (a tool call)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="each link's one-way delay")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="each link direction's cap")
    p.add_argument("--no-wan", action="store_true", help="plain loopback, no relay")
    p.add_argument("--threads", type=int, default=2, help="threads per process")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    emit_json(run(args), args.out)


if __name__ == "__main__":
    main()
