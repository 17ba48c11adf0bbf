"""The oracle rule of shared/design.md, against llama-cpp-python on the same GGUF.

1. Our greedy tokens equal llama-cpp-python's, or agree up to a first divergence where
   llama-cpp-python's top-2 logit gap on the shared prefix is below 0.25 (a near-tie); and
2. teacher-forced along llama-cpp-python's tokens, our logits have cosine >= 0.9999 with its
   logits, and our argmax equals its argmax wherever its top-2 gap is >= 0.25.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

NEAR_TIE = 0.25
MIN_COSINE = 0.9999


@dataclass
class OracleVerdict:
    ours: list[int]
    theirs: list[int]
    first_divergence: int | None  # index into the generated tokens, None if identical
    gap_at_divergence: float | None
    min_cosine: float
    confident_argmax_mismatches: int

    @property
    def passes(self) -> bool:
        tokens_ok = self.first_divergence is None or (
            self.gap_at_divergence is not None and self.gap_at_divergence < NEAR_TIE)
        return tokens_ok and self.min_cosine >= MIN_COSINE and self.confident_argmax_mismatches == 0

    def explain(self) -> str:
        return (f"divergence at {self.first_divergence} (gap {self.gap_at_divergence}), min cosine "
                f"{self.min_cosine:.6f}, confident argmax mismatches {self.confident_argmax_mismatches}\n"
                f"  ours:   {self.ours}\n  theirs: {self.theirs}")


def top2_gap(row: np.ndarray) -> float:
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


def oracle_greedy(llm, prompt: Sequence[int], n: int) -> list[int]:
    """llama-cpp-python's greedy continuation: ``Llama.generate`` at temperature 0, the generator
    that ``create_completion(temperature=0)`` drives, stopped at end-of-generation or n tokens."""
    out: list[int] = []
    for token in llm.generate(list(prompt), temp=0.0, reset=True):
        if _is_eog(llm, token):
            break
        out.append(token)
        if len(out) == n:
            break
    return out


def _is_eog(llm, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))


def oracle_logits(llm, tokens: Sequence[int]) -> np.ndarray:
    """llama-cpp-python's logits for every position of ``tokens`` (needs ``logits_all=True``)."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def judge(prompt: Sequence[int], ours: list[int], theirs: list[int],
          our_logits_fn: Callable[[list[int]], np.ndarray], llm) -> OracleVerdict:
    """Apply the oracle rule. ``our_logits_fn(tokens)`` returns our logits for every position."""
    forced = list(prompt) + theirs
    return judge_logits(prompt, ours, theirs, our_logits_fn(forced), oracle_logits(llm, forced))


def judge_logits(prompt: Sequence[int], ours: list[int], theirs: list[int], mine: np.ndarray,
                 ref: np.ndarray) -> OracleVerdict:
    """The oracle rule on logits already computed for every position of prompt + theirs (ours
    and llama-cpp-python's), e.g. by llama-cpp-python in another process."""
    rows = slice(len(prompt) - 1, len(prompt) + len(theirs))  # the positions that predict generated tokens
    ref_rows, my_rows = ref[rows], mine[rows]
    cos = (ref_rows * my_rows).sum(1) / (np.linalg.norm(ref_rows, axis=1) * np.linalg.norm(my_rows, axis=1))
    mismatches = sum(1 for r, m in zip(ref_rows, my_rows)
                     if top2_gap(r) >= NEAR_TIE and int(np.argmax(r)) != int(np.argmax(m)))
    divergence = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if divergence is None and len(ours) != len(theirs):
        divergence = min(len(ours), len(theirs))
    gap = None
    if divergence is not None and divergence < len(theirs) + 1:
        gap = top2_gap(ref[len(prompt) - 1 + divergence])
    return OracleVerdict(ours, theirs, divergence, gap, float(cos.min()), mismatches)
