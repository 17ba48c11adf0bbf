"""The asker's kept prefixes: which earlier prompt's cells a new prompt may start from.

A chat sends its whole history again every turn. When a request ends, the asker keeps the cells
of its prompt in its head and tail engines, and asks every stage of the route to keep theirs too
(swarmctl/trunk/prefixes.py), all under one random id (stages never see tokens; the id says
nothing of them). The next prompt that begins with those tokens starts at the first new position.

The oracle rule (the answer is the bits a run without reuse gives) decides which cells may be
reused. A step of several rows gives each row the same bits however many rows it has and where it
starts (kernels/slice.py's batches), but a one-row step takes other kernels. So only cells that a
plain run computes in steps of several rows are kept: the prompt's, not the generated tokens'
(each was a one-row decode step; a plain run of the next turn prefills them), and a prompt's new
positions are sent in the chunks a plain run uses (aligned to ``PREFILL_CHUNK``), never leaving a
one-row step where a plain run has none. ``resume_point`` backs off a position or two for that.

The entry also keeps what the route needs to rebuild its cells elsewhere (the link's replay
record): a stage that lost them (evicted, restarted, replanned) refuses, and the link replays the
steps from position 0, bit for bit. Nothing here is shared between askers; ``serve`` keeps one
cache per API key, so one client's prefixes are not reachable from another's.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

MAX_ENTRIES = 16  # kept prefixes per cache (a conversation holds one at a time)
MAX_POSITIONS = 65536  # positions kept per cache, all entries together


@dataclass(frozen=True)
class Steps:
    """The steps of several rows that computed positions [0, end), as (start, rows), in order."""

    spans: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.spans[-1][0] + self.spans[-1][1] if self.spans else 0

    def cut(self, p: int) -> "Steps":
        return Steps(tuple((s, min(n, p - s)) for s, n in self.spans if s < p))

    def then(self, start: int, rows: int) -> "Steps":
        return Steps((*self.spans, (start, rows)))

    def exact(self) -> "Steps":
        """The leading steps of several rows (a one-row step's cells and all after it are not kept)."""
        spans = []
        for s, n in self.spans:
            if n < 2:
                break
            spans.append((s, n))
        return Steps(tuple(spans))


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """A prompt's positions [start, end) in the steps a plain run from 0 cuts them into: up to
    each multiple of ``chunk``, then a chunk at a time."""
    bounds = []
    while start < end:
        stop = min(end, (start // chunk + 1) * chunk)
        bounds.append((start, stop - start))
        start = stop
    return bounds


def resume_point(steps: Steps, common: int, n_prompt: int, chunk: int) -> int:
    """Where a prompt of ``n_prompt`` tokens whose first ``common`` match a kept prefix computed by
    ``steps`` may start, with the bits of a plain run: at most ``common``, leaving at least the
    last token to run (its logits choose the first new token), no kept step cut to one row (a
    replay would run it as a decode step) and no first new step of one row where a plain run
    has several."""
    p = max(0, min(common, n_prompt - 1, steps.end))
    while p > 0:
        cut = next(((s, n) for s, n in steps.spans if s < p < s + n), None)
        if cut is not None and p - cut[0] == 1:
            p -= 1
            continue
        first = chunk_bounds(p, n_prompt, chunk)[0][1]
        if first == 1 and p % chunk != 0:
            p -= 1
            continue
        return p
    return 0


@dataclass
class PrefixEntry:
    """One kept prefix: its id (the key at the asker's engines and at every stage), the tokens its
    cells hold, the steps that computed them, and the trunk's record to rebuild them."""

    tokens: tuple[int, ...]
    steps: Steps
    trunk_record: Any = None  # the link's replay history for these positions (None: an in-process trunk)
    prefix: bytes = field(default_factory=lambda: secrets.token_bytes(16))  # the stages' name for it
    key: bytes = field(default_factory=lambda: b"asker-prefix/" + secrets.token_bytes(16))  # the asker engines'


@dataclass(frozen=True)
class Resume:
    entry: PrefixEntry
    start: int  # the first position the new request computes


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """An asker's kept prefixes, least recently used first. ``take`` hands one to a request
    (a prefix serves one request at a time: it moves into that request's caches)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_positions: int = MAX_POSITIONS) -> None:
        self.max_entries, self.max_positions = max_entries, max_positions
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def positions(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def take(self, prompt: Sequence[int], chunk: int) -> Resume | None:
        """The kept prefix ``prompt`` shares the most tokens with, taken out of the cache, and where
        the request may start; None when no prefix saves a position."""
        best, best_start = None, 0
        for entry in self._entries.values():
            start = resume_point(entry.steps, common_length(entry.tokens, prompt), len(prompt), chunk)
            if start > best_start:
                best, best_start = entry, start
        if best is None:
            return None
        del self._entries[best.key]
        return Resume(best, best_start)

    def put(self, entry: PrefixEntry) -> list[PrefixEntry]:
        """Keep ``entry``; returns the entries that make room for it, and those it holds all of
        (every prompt they serve it serves as well), for the caller to free."""
        evicted = [e for e in self._entries.values() if entry.tokens[:len(e.tokens)] == e.tokens]
        for e in evicted:
            del self._entries[e.key]
        self._entries[entry.key] = entry
        while len(self._entries) > self.max_entries or (self.positions > self.max_positions and len(self._entries) > 1):
            evicted.append(self._entries.popitem(last=False)[1])
        return evicted

    def clear(self) -> list[PrefixEntry]:
        entries = list(self._entries.values())
        self._entries.clear()
        return entries
