"""Speculative steps on the asker (issue 18): draft a few tokens cheaply, run them through the
swarm in one step, keep the prefix the model agrees with.

Over a WAN every token pays every link's round trip; a step that carries the last token plus k
drafted ones pays it once for up to k + 1 tokens. The asker drafts, checks and samples, so nothing
changes for the trunk: a step is n positions from a start position, as a prefill is, and the next
step starts right after the last kept token, which rewinds every stage's KV cache over the rejected
positions (kernels/slice.py masks cells past a step's start and overwrites them).

Exactness, as found so far (CPU, SmolLM2 Q4_1, whole model in one engine): a step of n positions
does NOT always give each position the bits that n single steps give. After a 37-token prompt, a
step of 9 gave rows 0-5 identical logits and rows 6-8 logits up to 0.25-0.30 apart; after a
30-token prompt only row 0 matched, after 60 rows 0-2. The KV length (padded to 256) and cache
capacity are not the cause (reserving 256 cells up front changes nothing). Through a 2-trunk
swarm, greedy ngram speculation on a repetitive prompt diverged from plain decoding at token 21.
Until that is understood and made identical, nothing turns speculation on (no CLI option).
Only greedy decoding would speculate; with sampling the asker decodes one token per step.

    ngram   prompt lookup: the longest recent n-gram of the context that occurred before
            proposes what followed it then (code edits, extraction, quoting chat)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

MODES = ("off", "ngram")
MAX_DRAFT = 8  # drafted tokens per step at most
MAX_NGRAM = 4  # longest n-gram matched against the context
LOOKBACK = 4096  # how far back the lookup searches (tokens)


@dataclass
class NgramDraft:
    """Prompt lookup decoding: no model, just the context."""

    max_ngram: int = MAX_NGRAM
    lookback: int = LOOKBACK

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens: what followed the latest earlier occurrence of the context's longest
        matching suffix (of ``max_ngram`` tokens down to one); [] when nothing matches."""
        if k <= 0:
            return []
        window = list(context[-self.lookback:])
        n_ctx = len(window)
        for n in range(min(self.max_ngram, n_ctx - 1), 0, -1):
            suffix = window[-n:]
            for start in range(n_ctx - n - 1, -1, -1):  # the latest occurrence before the suffix itself
                if window[start:start + n] == suffix:
                    return window[start + n:start + n + k]
        return []


@dataclass
class DraftLength:
    """How many tokens to draft next, from how the recent drafts fared: one more after a step that
    kept every draft, half after one that kept none; at 0 (plain steps), try one draft again after
    ``retry_after`` plain steps, so a request that turns repetitive later gets its speed back."""

    k: int = 4
    k_max: int = MAX_DRAFT
    retry_after: int = 8
    _plain_steps: int = field(default=0, repr=False)

    def next(self) -> int:
        if self.k == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.retry_after:
                self._plain_steps = 0
                return 1
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k_max, max(self.k, drafted) + 1)
        elif accepted == 0:
            self.k //= 2
        else:
            self.k = max(1, accepted)


@dataclass
class Speculation:
    """A request's drafting: the source, the adaptive length, and what it achieved."""

    source: NgramDraft
    length: DraftLength = field(default_factory=DraftLength)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    def propose(self, context: Sequence[int], room: int) -> list[int]:
        """Drafts for the next step; ``room``: how many tokens may still be generated after the
        one the step is sure to produce."""
        return self.source.propose(context, min(self.length.next(), room))

    def record(self, drafted: int, accepted: int) -> None:
        self.length.update(drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1


def speculation_for(mode: str) -> Speculation | None:
    """The drafting for ``--speculate MODE`` (None: off)."""
    if mode == "off":
        return None
    if mode == "ngram":
        return Speculation(NgramDraft())
    raise ValueError(f"--speculate {mode!r}: expected one of {', '.join(MODES)}")
