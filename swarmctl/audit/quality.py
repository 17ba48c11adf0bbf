"""What the noise costs: perplexity of a fixed text, and greedy agreement with a clean run."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec

from .traffic import PromptRun


def perplexity(model: str | Path, head_layers: int, text: str, *,
               uplink_transform: Callable[[np.ndarray], np.ndarray] | None = None,
               n_threads: int | None = None) -> float:
    """Perplexity of ``text`` with the U-split computed in this process: head, then the transform
    (as the asker applies it before the trunk), then trunk, tail and LM head on every position."""
    from kernels.tokenizer import Tokenizer

    tokens = Tokenizer(model).encode_prompt(text)
    rid = b"audit-perplexity"
    with GGUFFile(model) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        k, n = head_layers, spec.n_layer
        slices = [SliceSpec(0, k, has_embedding=True), SliceSpec(k, n - k), SliceSpec(n - k, n, has_lm_head=True)]
        engines = [SliceEngine(gguf, s, n_threads=n_threads) for s in slices if s.stop > s.start or s.has_embedding
                   or s.has_lm_head]
        try:
            x = engines[0].forward(rid, start_pos=0, tokens=tokens, outputs="all")
            if uplink_transform is not None:
                x = np.ascontiguousarray(uplink_transform(x), dtype=np.float32)
            for engine in engines[1:]:
                x = engine.forward(rid, start_pos=0, hidden=x, outputs="all")
        finally:
            for engine in engines:
                engine.close()
    logits = x[:-1].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    nll = -log_probs[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(nll.mean()))


def greedy_agreement(clean: Sequence[PromptRun], other: Sequence[PromptRun]) -> float:
    """Share of the clean run's generated tokens that the other run produced at the same position
    (after a first difference the two continuations rarely line up again)."""
    total = agree = 0
    for a, b in zip(clean, other):
        total += len(a.generated)
        agree += sum(x == y for x, y in zip(a.generated, b.generated))
    return agree / total if total else 1.0
