"""Choosing the next token from logits: greedy, or temperature with top-k and top-p, seeded.

The order follows llama.cpp's default sampler chain: top-k, then top-p, then temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 → greedy (argmax)
    top_k: int = 40  # 0 → no limit
    top_p: float = 0.95  # 1 → no limit
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class Candidates:
    """The distribution a sampler draws the next token from: token ids and their probabilities
    (after top-k, top-p and temperature), most likely first. Greedy: the argmax with probability 1."""

    ids: np.ndarray  # int64 [m]
    probs: np.ndarray  # float64 [m], sums to 1

    def prob(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if len(hit) else 0.0

    @staticmethod
    def only(token: int) -> "Candidates":
        return Candidates(np.array([token], np.int64), np.array([1.0]))


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits: float32 [n_vocab] for the next position."""
        return self.draw(self.candidates(logits))

    def draw(self, c: Candidates) -> int:
        if self.params.greedy:
            return int(c.ids[0])
        return int(c.ids[self._rng.choice(len(c.ids), p=c.probs)])

    def uniform(self) -> float:
        """A draw in [0, 1) from this sampler's generator (speculative acceptance)."""
        return float(self._rng.random())

    def candidates(self, logits: np.ndarray) -> Candidates:
        p = self.params
        if p.greedy:
            return Candidates.only(int(np.argmax(logits)))
        ids = np.arange(logits.shape[0])
        values = logits.astype(np.float64)
        if 0 < p.top_k < values.shape[0]:
            keep = np.argpartition(values, -p.top_k)[-p.top_k:]
            ids, values = ids[keep], values[keep]
        order = np.argsort(-values, kind="stable")
        ids, values = ids[order], values[order]
        probs = _softmax(values)
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1  # smallest prefix reaching top_p
            ids, values = ids[:cut], values[:cut]
        return Candidates(ids, _softmax(values / p.temperature))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
