"""Uplink inversion: from the hidden states a trunk stage receives back to the token ids.

The attacker has the GGUF (public weights) and the activations in hand. Position by position, it
tries candidate tokens on top of the prefix it has recovered so far, runs the head layers [0, K)
on each (one decode step that rewinds to this position, so the prefix's cache is reused) and keeps
the candidate whose state is closest to the observed one, by relative L2 distance. There is no
acceptance threshold: the kept token is always the closest one tried.

Candidates come in this order, alternating between two rankings, up to ``max_candidates``:
  1. the public model's next-token prediction: the stage runs layers [K, L) and the LM head on the
     states it observed up to the previous position (it holds them; nothing needs guessing). For
     position 0 there is no prefix: the prediction after the model's document-start token;
  2. the whole vocabulary, ranked by cosine similarity of the observed state to ``TokenTable``.
The search stops early once a candidate reproduces the observed state to within float noise
(``EXACT_MATCH``): that ends the search order, it is not a threshold on acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec

from .capture import ObservedStream
from .tables import TokenTable, load_or_build

# Relative L2 distance taken as a reproduction. Measured on the bundled model: a prefill and
# one-token steps round differently, by up to 0.6 %; the nearest wrong candidate was 1.5 % away at
# position 0 (where a few outsized dimensions dominate the norm) and at least 5 % elsewhere.
EXACT_MATCH = 1e-2
PREDICT_CHUNK = 128  # positions per prediction pass (bounds the [n, n_vocab] logits held at once)
DEFAULT_MAX_CANDIDATES = 128


@dataclass
class TokenGuess:
    token: int
    distance: float  # relative L2 distance between the kept candidate's state and the observed one
    tried: int  # candidates run through the head at this position


@dataclass
class Inversion:
    request_id: bytes
    layer_index: int
    guesses: list[TokenGuess]
    n_prefill: int  # positions that arrived in prefill packets (the prompt)

    @property
    def tokens(self) -> list[int]:
        return [g.token for g in self.guesses]


class UplinkInverter:
    """Holds the public model's head [0, K) and rest [K, L) + LM head; inverts observed streams."""

    def __init__(self, model: str | Path, layer_index: int, *, cache_dir: Path | None = None,
                 max_candidates: int = DEFAULT_MAX_CANDIDATES, n_threads: int | None = None,
                 weights: np.ndarray | None = None, table_threads: int | None = None) -> None:
        """``max_candidates`` 0 means the whole vocabulary. ``weights`` (optional, [n_embd]) scales
        each dimension before distances are taken: against noise of known per-dimension scale,
        1/scale makes the closest candidate the most likely one. ``table_threads``: threads for
        building the inversion table when it is not cached (None: ``n_threads``)."""
        self.gguf = GGUFFile(model)
        self.head: SliceEngine | None = None
        self.rest: SliceEngine | None = None
        try:
            spec = ModelSpec.from_gguf(self.gguf)
            self.head = SliceEngine(self.gguf, SliceSpec(0, layer_index, has_embedding=True), n_threads=n_threads)
            self.rest = SliceEngine(self.gguf, SliceSpec(layer_index, spec.n_layer, has_lm_head=True),
                                    n_threads=n_threads)
            context, start = _public_tokens(Path(model))
            self.table: TokenTable = load_or_build(self.head, Path(model), context, cache_dir, table_threads)
            self.first_prediction = self._predict_after(start)
        except BaseException:
            self.close()
            raise
        self.layer_index = layer_index
        self.max_candidates = min(max_candidates or spec.n_vocab, spec.n_vocab)
        self.weights = None if weights is None else np.asarray(weights, np.float32)

    def invert(self, stream: ObservedStream) -> Inversion:
        if stream.layer_index != self.layer_index:
            raise ValueError(f"stream is at layer {stream.layer_index}, this inverter at {self.layer_index}")
        observed = stream.states()
        rid = b"audit-invert-" + stream.request_id[:3]
        guesses: list[TokenGuess] = []
        predicted = self.first_prediction  # for the next position
        try:
            for start in range(0, len(observed), PREDICT_CHUNK):
                chunk = observed[start:start + PREDICT_CHUNK]
                logits = self.rest.forward(rid, start_pos=start, hidden=chunk, outputs="all")
                similarity = self.table.similarity(chunk)
                for i, state in enumerate(chunk):
                    pos = start + i
                    near = self.table.similarity(chunk[:1], position0=True)[:, 0] if pos == 0 else similarity[:, i]
                    guesses.append(self._search(rid, pos, state, self._interleave(predicted, near)))
                    predicted = logits[i]
        finally:
            self.head.release(rid)
            self.rest.release(rid)
        return Inversion(stream.request_id, stream.layer_index, guesses, stream.n_prefill)

    def _predict_after(self, token: int) -> np.ndarray:
        rid = b"audit-predict-00"
        try:
            return self.rest.forward(rid, start_pos=0, hidden=self.head.forward(rid, start_pos=0, tokens=[token]))[0]
        finally:
            self.head.release(rid)
            self.rest.release(rid)

    def _ranked(self, scores: np.ndarray) -> np.ndarray:
        k = self.max_candidates
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        return top[np.argsort(-scores[top], kind="stable")]

    def _interleave(self, predicted: np.ndarray, similarity: np.ndarray) -> np.ndarray:
        """Alternate the prediction's and the table's rankings; a token's first occurrence counts."""
        a, b = self._ranked(predicted), self._ranked(similarity)
        merged = np.empty(len(a) + len(b), np.int64)
        merged[0::2], merged[1::2] = a, b
        _, first = np.unique(merged, return_index=True)
        return merged[np.sort(first)][:self.max_candidates]

    def _search(self, rid: bytes, pos: int, observed: np.ndarray, order: np.ndarray) -> TokenGuess:
        w = self.weights if self.weights is not None else np.float32(1.0)
        target = observed * w
        scale = float(np.linalg.norm(target)) or 1.0
        best, best_d, tried = -1, np.inf, 0
        for token in order:
            state = self.head.forward(rid, start_pos=pos, tokens=[int(token)], rewind=True)[0]
            tried += 1
            d = float(np.linalg.norm(state * w - target)) / scale
            if d < best_d:
                best, best_d = int(token), d
            if d <= EXACT_MATCH:
                break
        if int(order[tried - 1]) != best:  # the cache holds the last one tried: put the kept token back
            self.head.forward(rid, start_pos=pos, tokens=[best], rewind=True)
        return TokenGuess(best, best_d, tried)

    def close(self) -> None:
        for engine in (self.head, self.rest):
            if engine is not None:
                engine.close()
        self.head = self.rest = None
        self.gguf.close()

    def __enter__(self) -> "UplinkInverter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _public_tokens(model: Path) -> tuple[int, int]:
    """From the GGUF's own vocabulary: the table's context token (a space, as in running text) and
    the token documents start after in pretraining (``<|endoftext|>`` where the vocabulary has it
    as one token, else BOS, else EOS), whose prediction ranks candidates for position 0."""
    from kernels.tokenizer import Tokenizer

    tok = Tokenizer(model)
    specials = {tok.bos_id, tok.eos_id}
    space = [t for t in tok.encode_prompt(" ") if t not in specials]
    end_of_text = [t for t in tok.encode_prompt("<|endoftext|>") if t != tok.bos_id]
    start = end_of_text[0] if len(end_of_text) == 1 else tok.bos_id if tok.bos_id >= 0 else tok.eos_id
    return (space[0] if space else 0), max(start, 0)
