"""Drafts that never cost, measured: --speculate ngram against off over 20 ms links, side by side in
one run, on a story (drafts rarely kept) and on three texts the answer copies; prints JSON.

    python benchmarks/bench_draft_backoff.py [--max-tokens 96] [--repeats 3] [--busy N] [--tasks T ...] [--out FILE]

The swarm of benchmarks/bench_swarm.py's section g (host + 2 trunks, every link through an
impairing relay: 20 ms ± 5 ms one way, 0.5 % loss), greedy answers. Modes, in turn within each
round: ``off``; ``ngram`` (swarmctl/asker/speculate.py's policy as it is: DraftLength and the
MatchGate); ``ngram_no_gate``: DraftLength as it is, but drafting from a match of any length (the
policy before the gate); and ``ngram_model_only``: the policy before drafts were checked against
what they gave (the cost model alone, retries every 8 plain steps, no back-off, no gate), for
comparison in the same run. Decode tok/s after the first token, medians over ``--repeats``; per
round, how many decode steps carried drafts and what they cost beyond plain steps as a share of the
run (``drafting_over_plain``). ``--busy N`` runs N processes that spin on the CPU beside it (the
machine busy with other work); this machine is shared and noisy anyway, and its load average is
recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_swarm import GREEDY, SPECULATIVE_TASKS, WAN, decode_rate, wan_swarm  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from swarmctl.asker.head_tail import Asker, generate_all  # noqa: E402
from swarmctl.asker.speculate import DraftLength, MatchGate, NgramDraft, Speculation  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402

TASKS = ("story", "copy_paragraph", "code_rename", "log_extract")


class ModelOnly(DraftLength):
    """The drafting policy before: the cost model alone decides, a single draft every retry_after
    plain steps, never backing off, never checked against what drafting steps gave."""

    def next(self) -> int:
        if self.k == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.retry_after:
                self._plain_steps = 0
                return 1
        return self.k

    def yielded(self, tokens: int, total_s: float) -> None:
        pass


class NoGate(MatchGate):
    """Drafts from a match of any length, as before the gate."""

    def allows(self, match: int | None) -> bool:
        return True


MODES = {
    "off": lambda: None,
    "ngram": lambda: Speculation(NgramDraft(), DraftLength(k=4)),
    "ngram_no_gate": lambda: Speculation(NgramDraft(), DraftLength(k=4), NoGate()),
    "ngram_model_only": lambda: Speculation(NgramDraft(), ModelOnly(k=4), NoGate()),
}


def drafting_over_plain(gen) -> float | None:
    """What its drafting steps cost a run beyond plain steps, as a share of its decode time: each
    decode step with drafts took its latency where plain steps would have taken the run's median
    plain-step latency per token it chose. Read from one run's own steps, so the machine's load
    drifting between runs (what makes the ratios of whole runs noisy here) mostly cancels; a step
    slowed by a fallen window's compute is not counted. Negative: drafting saved time. None where
    windows were in flight (their latencies overlap) or no plain step was taken."""
    steps = gen.timings[1:]  # after the prompt's step
    plain = [t.latency_s for t in steps if t.drafted == 0 and len(t.tokens) == 1]
    decode_s = gen.timings[-1].done - gen.timings[0].done
    overlapped = any(b.started < a.done for a, b in zip(gen.timings, steps))
    if not plain or decode_s <= 0 or overlapped:
        return None
    per_token = statistics.median(plain)
    return sum(t.latency_s - len(t.tokens) * per_token for t in steps if t.drafted) / decode_s


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


async def measure(max_tokens: int, repeats: int, tasks: tuple[str, ...] = TASKS) -> dict:
    model = default_model_path()
    out: dict = {}
    async with wan_swarm(model, 1) as link:
        asker = Asker(model, link.head_layers, n_threads=1)
        try:
            prompts = {t: asker.tokenizer.encode_chat([{"role": "user", "content": SPECULATIVE_TASKS[t]}])
                       for t in tasks}
            for prompt in prompts.values():
                await generate_all(asker, prompt, link, max_tokens=4, sampling=GREEDY)  # warm-up
            runs: dict = {t: {m: [] for m in MODES} for t in tasks}
            for _ in range(repeats):
                for task, prompt in prompts.items():
                    for mode, make in MODES.items():
                        runs[task][mode].append(await generate_all(asker, prompt, link, max_tokens=max_tokens,
                                                                   sampling=GREEDY, speculation=make()))
            for task in tasks:
                row = {}
                for mode in MODES:
                    gens = runs[task][mode]
                    rates = [decode_rate(g) for g in gens]
                    row[mode] = {"tok_s_median": round(statistics.median(rates), 2),
                                 "tok_s_rounds": [round(r, 2) for r in rates],
                                 "drafted": gens[0].drafted, "accepted": gens[0].accepted,
                                 "steps": len(gens[0].timings), "tokens": len(gens[0].tokens),
                                 "drafting_steps_rounds": [sum(1 for t in g.timings[1:] if t.drafted) for g in gens],
                                 "drafting_over_plain_rounds": [rounded(drafting_over_plain(g)) for g in gens],
                                 "same_tokens_as_off": gens[0].tokens == runs[task]["off"][0].tokens}
                for mode in MODES:
                    if mode != "off":
                        row[mode]["over_off"] = round(row[mode]["tok_s_median"] / row["off"]["tok_s_median"], 3)
                        row[mode]["over_off_per_round"] = [
                            round(decode_rate(g) / decode_rate(o), 3)
                            for g, o in zip(runs[task][mode], runs[task]["off"])]
                out[task] = row
        finally:
            asker.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU beside the run")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    spinners = [multiprocessing.Process(target=spin, args=(time.time() + 3600,), daemon=True)
                for _ in range(args.busy)]
    for s in spinners:
        s.start()
    load_before = os.getloadavg()
    try:
        tasks = asyncio.run(measure(args.max_tokens, args.repeats, tuple(args.tasks)))
    finally:
        for s in spinners:
            s.terminate()
    emit_json({"links": WAN, "cpus": os.cpu_count(), "busy_spinners": args.busy,
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "max_tokens": args.max_tokens, "repeats": args.repeats, "tasks": tasks,
               "targets": {"story_ngram_over_off": 0.97, "copy_ngram_over_off": 4.0}}, args.out)


if __name__ == "__main__":
    main()
