"""Which source fetches which chunk next, when a member fetches one file from several sources at
once (swarmctl/model_files/distribution.py drives it). No I/O here: the driver asks, the sources' results are
told to it, and it answers with chunk ids.

- Chunks are pending in file order. Each free source pulls the next up to ``limit`` pending chunks
  it holds (``next_batch``): a fast source simply pulls more often.
- A source that fails a batch gives its chunks back (``failed``); three failed batches in a row,
  or one wrong chunk (``wrong``), and it is dropped for this fetch (``drop``).
- The end game: when nothing is pending, an idle source may take one chunk that is still out with
  another source, the last of its batch (the one it reaches last); the first copy to arrive wins
  (``delivered`` says whether a copy is the first).

A source is known by its name; ``holds`` (None: every chunk) is what it can send, so a member that
holds some layers can be one more source with its own set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_FAILURES = 3  # failed batches in a row before a source is dropped for this fetch


@dataclass
class SourceState:
    name: str
    holds: frozenset[str] | None  # None: every chunk
    failures: int = 0  # failed batches in a row
    dropped: str = ""  # why it was dropped ("" while it is in use)
    out: set[str] = field(default_factory=set)  # chunks it has been asked for and not yet sent
    bytes: int = 0  # bytes it delivered first

    def can_send(self, chunk: str) -> bool:
        return self.holds is None or chunk in self.holds


class FetchPlan:
    """The chunks of one fetch (id → size, in file order) and the sources it pulls them from."""

    def __init__(self, chunks: dict[str, int]) -> None:
        self.sizes = dict(chunks)
        self.index = {c: i for i, c in enumerate(self.sizes)}  # file order
        self.pending: dict[str, None] = dict.fromkeys(chunks)  # not done and not out anywhere, in file order
        self.done: set[str] = set()
        self.sources: dict[str, SourceState] = {}

    def add_source(self, name: str, holds: frozenset[str] | None = None) -> None:
        self.sources[name] = SourceState(name, holds)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.sizes)

    @property
    def live(self) -> list[str]:
        return [s.name for s in self.sources.values() if not s.dropped]

    def holders(self, chunk: str) -> list[str]:
        return [s.name for s in self.sources.values() if not s.dropped and chunk in s.out]

    def next_batch(self, source: str, limit: int) -> list[str]:
        """Up to ``limit`` chunks for ``source`` to fetch now (file order); in the end game, one chunk
        another source still has out; [] when there is nothing for it (yet)."""
        state = self.sources[source]
        if state.dropped or state.out:
            return []
        batch = []
        for chunk in self.pending:
            if state.can_send(chunk):
                batch.append(chunk)
                if len(batch) == limit:
                    break
        if not batch:
            batch = self._end_game(state)
        for chunk in batch:
            self.pending.pop(chunk, None)
        state.out.update(batch)
        return batch

    def _end_game(self, state: SourceState) -> list[str]:
        for other in self.sources.values():
            if other is state or other.dropped:
                continue
            for chunk in sorted(other.out, key=self.index.__getitem__, reverse=True):  # what it reaches last
                if state.can_send(chunk) and self.holders(chunk) == [other.name]:
                    return [chunk]
        return []

    def wanted(self, source: str, chunk: str) -> bool:
        """Whether a copy of ``chunk`` from ``source`` is still needed (not a late duplicate)."""
        return chunk not in self.done and chunk in self.sources[source].out

    def delivered(self, source: str, chunk: str) -> bool:
        """``chunk`` arrived from ``source``, checked and written. Whether it was the first copy."""
        state = self.sources[source]
        state.out.discard(chunk)
        state.failures = 0
        if chunk in self.done:
            return False
        self.done.add(chunk)
        state.bytes += self.sizes[chunk]
        for other in self.sources.values():
            other.out.discard(chunk)
        return True

    def batch_ended(self, source: str) -> None:
        """``source`` answered its batch; whatever it did not send goes back (it did not hold it)."""
        self._give_back(self.sources[source])

    def failed(self, source: str, reason: str) -> bool:
        """A batch failed (timeout, lost stream): its chunks go back. Whether the source is now dropped."""
        state = self.sources[source]
        state.failures += 1
        self._give_back(state)
        if state.failures >= MAX_FAILURES:
            self.drop(source, f"{MAX_FAILURES} failed batches in a row, the last: {reason}")
        return bool(state.dropped)

    def wrong(self, source: str, reason: str) -> None:
        """``source`` sent bytes that do not match the host's hash: not trusted again for this fetch."""
        self.drop(source, reason)

    def drop(self, source: str, reason: str) -> None:
        state = self.sources[source]
        state.dropped = reason or "dropped"
        self._give_back(state)

    def _give_back(self, state: SourceState) -> None:
        back = {c for c in state.out if c not in self.done and not self.holders_except(c, state.name)}
        state.out.clear()
        if back:
            self.pending = dict.fromkeys(sorted(self.pending.keys() | back, key=self.index.__getitem__))

    def holders_except(self, chunk: str, source: str) -> list[str]:
        return [h for h in self.holders(chunk) if h != source]

    def shares(self) -> dict[str, int]:
        """Bytes each source delivered first."""
        return {s.name: s.bytes for s in self.sources.values()}
