"""Drafts that never cost (swarmctl/asker/speculate.py, DraftLength and MatchGate): the drafting
policy fed sequences of kept and rejected drafts and step times, no I/O. A step's time here is what the asker
measures from a step's start to its logits: a plain step's, and a drafting step's with its extra
rows, whose real cost (queueing behind other work on a busy machine) the compute-only cost model
does not see."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from kernels.sampling import SamplingParams
from swarmctl.asker.speculate import (PLAIN_EVERY, RETRY_MAX, Draft, DraftLength, MatchGate, NgramDraft,
                                      Speculation)


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    drafting_steps: int = 0
    plain_steps: int = 0
    retries_at: list[int] | None = None

    def rate_over_plain(self, plain_s: float) -> float:
        """Tokens per second over what plain steps alone would give."""
        return self.tokens / self.seconds * plain_s


def run(length: DraftLength, steps: int, kept: Callable[[int, int], int], *, plain_s: float = 0.060,
        compute_s: float = 0.010, row_compute_s: float = 0.001, row_real_s: float = 0.001,
        start: int = 0, slowed: Callable[[int], float] = lambda i: 1.0) -> Run:
    """``steps`` steps of one request: ``kept(i, k)`` drafts kept of the k drafted at step i; a
    drafting step takes ``row_real_s`` more per extra row than a plain one, while its compute
    (what the cost model reads) grows by ``row_compute_s`` a row; ``slowed(i)``: how many times
    longer step i's drafting step takes (other work on the machine)."""
    out = Run(retries_at=[])
    for i in range(start, start + steps):
        was_plain = length.k == 0
        k = length.next()
        if k == 0:
            length.observe(1, compute_s, plain_s)
            length.update(0, 0)
            out.tokens, out.seconds, out.plain_steps = out.tokens + 1, out.seconds + plain_s, out.plain_steps + 1
            continue
        if was_plain:
            out.retries_at.append(i)
        accepted = kept(i, k)
        total = (plain_s + k * row_real_s) * slowed(i)
        length.observe(1 + k, compute_s + k * row_compute_s, total)
        length.yielded(accepted + 1, total)
        length.update(k, accepted)
        out.tokens, out.seconds = out.tokens + accepted + 1, out.seconds + total
        out.drafting_steps += 1
    return out


def story(i: int, k: int) -> int:
    """Prompt lookup on text that does not repeat: one drafted token in five kept, by chance."""
    return 1 if i % 5 == 0 else 0


def copy(i: int, k: int) -> int:
    return k


def test_a_story_on_a_busy_machine_costs_nothing():
    """One draft in five kept looks worth drafting to the model over a WAN (a row's compute is 2 %
    of a step), but on a busy machine each extra row really costs 20 % of a step: drafting must
    stop, and its retries must not cost more than a few percent."""
    length = DraftLength(k=4, k_max=8)
    result = run(length, 600, story, row_real_s=0.012)
    assert result.rate_over_plain(0.060) >= 0.97, result
    assert result.drafting_steps < 0.06 * 600, result


def test_copyable_text_keeps_its_gain():
    length = DraftLength(k=4, k_max=8)
    result = run(length, 100, copy, row_real_s=0.003)
    assert result.rate_over_plain(0.060) >= 4.0, result
    assert result.plain_steps == 0 and length.k == 8  # no plain step timed while drafts are kept


def test_failed_retries_back_off_exponentially_and_a_kept_one_brings_drafting_back():
    length = DraftLength(k=4, k_max=8, retry_after=8)
    result = run(length, 600, lambda i, k: 0, row_real_s=0.012)
    gaps = [b - a for a, b in zip(result.retries_at, result.retries_at[1:])]
    assert gaps[:4] == [16, 32, 64, RETRY_MAX], gaps  # steps from one retry to the next
    assert result.rate_over_plain(0.060) >= 0.97
    # the text turns repetitive: the next retry keeps its draft and drafting comes back in full
    later = run(length, 2 * RETRY_MAX + 40, copy, row_real_s=0.003, start=600)
    assert length.k == 8 and length.retry_every == RETRY_MAX // 2
    assert later.drafting_steps >= 30


def test_drafts_that_pay_on_a_quiet_wan_go_on():
    """Half the drafts kept and rows that cost what the model thinks: drafting stays, and pays."""
    length = DraftLength(k=4, k_max=8)
    result = run(length, 300, lambda i, k: k // 2 if i % 2 else k, row_real_s=0.001)
    assert result.rate_over_plain(0.060) > 1.5, result
    # drafts are often rejected, so a plain step is timed now and then: few, and never more
    assert result.plain_steps <= 300 // PLAIN_EVERY + 1


def test_without_timings_the_model_alone_decides():
    """A step fed no timings (tests, or a source timed elsewhere) leaves the measured gain unknown."""
    length = DraftLength(k=4, k_max=8)
    for _ in range(4):
        length.update(4, 3)
    assert length.gain is None and length.k > 0


def test_drafting_steps_slowed_now_and_then_by_other_work_do_not_stop_drafting():
    """Drafts mostly kept, but one drafting step in four takes three times as long (a busy machine):
    the measured gain is a median, and drafting goes on."""
    length = DraftLength(k=4, k_max=8)
    result = run(length, 200, lambda i, k: k - 1 if i % 3 == 0 else k, row_real_s=0.002,
                 slowed=lambda i: 3.0 if i % 4 == 1 else 1.0)
    assert result.rate_over_plain(0.060) > 2.0, result
    assert result.drafting_steps > 0.9 * 200 - 20


# The match gate: prompt lookup drafts only from matches long enough to be kept, and windows in
# flight only after a full-length one (swarmctl/asker/speculate.py, MatchGate).

A, B, C, D, E, X, Y, Z = range(10, 18)
GREEDY = SamplingParams(temperature=0)


def drafted(speculation: Speculation, context: list[int], k: int = 4) -> Draft:
    return asyncio.run(speculation.draft(b"r", context, k, GREEDY))


def test_a_one_token_match_is_not_drafted_from():
    speculation = Speculation(NgramDraft(), DraftLength(k=4))
    assert NgramDraft().propose([A, X, Y, A], 4) == [X, Y, A]  # the lookup alone would draft
    out = drafted(speculation, [A, X, Y, A])
    assert out.tokens == [] and out.match == 1
    assert drafted(speculation, [A, B, X, Y, A, B]).tokens == [X, Y, A, B]  # two tokens: drafted


def test_rejected_drafts_from_short_matches_raise_the_bar_and_kept_ones_lower_it():
    """A story: a two-token match's drafts rejected, then a three-token one's: only four-token
    matches are drafted from after that; text that turns repetitive keeps those, and the bar comes
    back down one step per window kept whole."""
    speculation = Speculation(NgramDraft(), DraftLength(k=4))
    two, three, four = [A, B, X, Y, A, B], [A, B, C, X, Y, A, B, C], [A, B, C, D, X, Y, A, B, C, D]
    speculation.record(4, 0, match=drafted(speculation, two).match)
    assert drafted(speculation, two).tokens == [] and drafted(speculation, three).tokens
    speculation.record(4, 0, match=drafted(speculation, three).match)
    assert drafted(speculation, three).tokens == [] and drafted(speculation, four).tokens == [X, Y, A, B]
    speculation.record(4, 0, match=4)  # a full-length match is always tried: the measured gain rules it
    assert drafted(speculation, four).tokens
    speculation.record(4, 2, match=4)  # partly kept (an edit in copied text) says nothing
    assert speculation.gate.least == 4
    speculation.record(4, 4, match=4)
    assert drafted(speculation, three).tokens and not drafted(speculation, two).tokens
    speculation.record(4, 4, match=4)
    speculation.record(4, 4, match=4)
    assert drafted(speculation, two).tokens and speculation.gate.least == 2  # never below two


def test_windows_go_in_flight_only_after_a_full_length_match_or_a_models_drafts():
    length = DraftLength(k=4, k_max=8)
    length.observe(1, 0.010, 0.060)  # a trip holds six steps' compute, the stages idle
    assert length.windows() > 1
    speculation = Speculation(NgramDraft(), length)
    asyncio.run(speculation.propose(b"r", [A, B, X, Y, A, B], 8, GREEDY))
    assert speculation.windows() == 1
    asyncio.run(speculation.propose(b"r", [A, B, C, D, X, Y, A, B, C, D], 8, GREEDY))
    assert speculation.windows() == length.windows() > 1
    asyncio.run(speculation.propose(b"r", [A, B, C, D, Z], 8, GREEDY))  # nothing to draft: no guess either
    assert speculation.windows() == 1
    fixed = Speculation(NgramDraft(), DraftLength(k=4, fixed_windows=3))
    asyncio.run(fixed.propose(b"r", [A, B, X, Y, A, B], 8, GREEDY))
    assert fixed.windows() == 3  # windows asked for are windows given


def test_the_gate_leaves_a_models_drafts_alone_and_fits_a_shorter_lookup():
    gate = MatchGate()
    gate.learn(None, 4, 0)
    assert gate.allows(None) and gate.sure(None) and gate.least == 2
    short = Speculation(NgramDraft(max_ngram=3), DraftLength(k=4))
    short.record(4, 0, match=3)
    assert short.gate.least == 3 and drafted(short, [A, B, C, X, Y, A, B, C]).tokens  # its longest still drafts
