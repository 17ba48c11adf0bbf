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


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits: float32 [n_vocab] for the next position."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
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
        probs = _softmax(values / p.temperature)
        return int(ids[self._rng.choice(len(ids), p=probs)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
