"""Log-probabilities of the tokens a request chose, from the logits the asker already has
(``logprobs`` / ``top_logprobs`` in the API): the model's own distribution at each position, a
log-softmax of the raw logits in float64, before temperature, top-k or top-p, as llama-cpp-python
reports them. They never leave the asker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per position at most (OpenAI's chat limit)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at that position and theirs, best first


def token_logprob(logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    logp = z - np.log(np.exp(z).sum())
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        best = np.argpartition(-logp, min(top_n, len(logp) - 1))[:top_n]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = tuple((int(t), float(logp[t])) for t in best)
    return TokenLogprob(int(token), float(logp[token]), top)
