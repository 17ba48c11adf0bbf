"""The simplest placement: consecutive layer ranges in proportion to each member's memory.
(The topology planner does better; this is enough to run a swarm.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    member: str
    memory: int  # bytes it offers


def split_by_memory(start: int, stop: int, candidates: list[Candidate]) -> list[tuple[str, int, int]]:
    """Layers [start, stop) cut into one contiguous range per candidate (in the given order), sized
    in proportion to memory, each at least one layer. With more candidates than layers, the ones
    with the least memory are left out."""
    n = stop - start
    if n <= 0 or not candidates:
        return []
    chosen = sorted(candidates, key=lambda c: -c.memory)[:n]
    chosen = [c for c in candidates if c in chosen]  # keep the given order
    total = sum(max(c.memory, 1) for c in chosen)
    counts = [1] * len(chosen)
    spare = n - len(chosen)
    shares = [spare * max(c.memory, 1) / total for c in chosen]
    for i, share in enumerate(shares):
        counts[i] += int(share)
    leftover = n - sum(counts)
    for i in sorted(range(len(chosen)), key=lambda i: -(shares[i] - int(shares[i])))[:leftover]:
        counts[i] += 1
    out, cursor = [], start
    for c, k in zip(chosen, counts):
        out.append((c.member, cursor, cursor + k))
        cursor += k
    return out
