"""The head's output for every vocabulary token, computed once per model from the GGUF.

``TokenTable.states`` is ``[n_vocab, n_embd]``: each token at position 1 after one fixed context
token, rows scaled to unit length for cosine ranking. At the head's depth a state is dominated by
its own token, so this ranks candidates for any position well: on the bundled model with K = 4 the
true token ranks first for ~88 % of the audit prompts' positions past the first.

Position 0 is different: with nothing to attend to but itself, every token's state there carries
the same few outsized dimensions (the "attention sink"). Ranking position 0 ignores those
``sink_dims``, found from a spread of tokens run at position 0.

Building costs n_vocab one-token steps of the head (51 s for SmolLM2 on one core), so
the table is cached on disk, keyed by the model file, the layer count and the context token. The
steps go BATCH at a time, and so gain from a second thread where a lone step does not: 57 s on one
thread and 37.5 s on two for the bundled model's K = 4 (extrapolated from 4,096 tokens, Zen 4).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels.slice import SliceEngine, Step

log = logging.getLogger("swarmctl.audit")

BATCH = 64  # requests per step while building (larger batches are not faster: compute dominates)
SINK_SAMPLE = 64  # tokens run at position 0 to find the sink dimensions
N_SINK_DIMS = 8  # SmolLM2 at position 0: mean |x| 743, 132, 130, then 27; dropping 4, 8 or 16 ranks alike
FORMAT = 2


@dataclass
class TokenTable:
    states: np.ndarray  # [n_vocab, n_embd] float32, unit rows: each token at position 1 after context_token
    sink_dims: np.ndarray  # [N_SINK_DIMS] int: dimensions that position 0 inflates for every token
    context_token: int
    build_s: float = 0.0  # 0 when loaded from the cache

    def similarity(self, states: np.ndarray, *, position0: bool = False) -> np.ndarray:
        """Cosine similarity of observed states [n, n_embd] to every token's row: [n_vocab, n].
        For position 0 the sink dimensions are left out of both sides."""
        x = np.array(states, dtype=np.float32)
        if not position0:
            return self.states @ (x / _norms(x)).T
        x[:, self.sink_dims] = 0.0
        sink = self.states[:, self.sink_dims]
        rest_norm = np.sqrt(np.maximum(1.0 - np.einsum("vd,vd->v", sink, sink), 1e-12))  # rows are unit length
        return (self.states @ (x / _norms(x)).T) / rest_norm[:, None]


def _norms(x: np.ndarray) -> np.ndarray:
    return np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "swarmctl" / "audit"


def _cache_path(model: Path, layers: int, context_token: int, cache_dir: Path) -> Path:
    st = model.stat()
    key = f"{FORMAT}|{model.name}|{st.st_size}|{st.st_mtime_ns}|{layers}|{context_token}"
    return cache_dir / f"table-{model.stem}-k{layers}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"


def load_or_build(head: SliceEngine, model: Path, context_token: int, cache_dir: Path | None,
                  build_threads: int | None = None) -> TokenTable:
    """``head`` runs the embedding and layers [0, K) of ``model``; a build computes on
    ``build_threads`` (None: the head's own)."""
    path = _cache_path(model, head.slice.stop, context_token, cache_dir) if cache_dir else None
    if path is not None and path.exists():
        with np.load(path) as f:
            return TokenTable(f["states"].astype(np.float32), f["sink_dims"], context_token)
    if build_threads is None:
        table = build(head, context_token)
    else:
        with head.threads(build_threads):
            table = build(head, context_token)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:  # half precision halves the file; rankings do not change
            np.savez(f, states=table.states.astype(np.float16), sink_dims=table.sink_dims)
        tmp.replace(path)
    return table


def build(head: SliceEngine, context_token: int) -> TokenTable:
    t0 = time.perf_counter()
    n_vocab = head.spec.n_vocab
    ids = [b"audit-table-%04d" % i for i in range(BATCH)]  # 16 bytes each, like real request ids
    try:
        sample = range(0, n_vocab, max(1, n_vocab // SINK_SAMPLE))
        at_zero = _run_all(head, ids, 0, sample)
        sink_dims = np.argsort(-np.abs(at_zero).mean(axis=0))[:N_SINK_DIMS]
        for rid in ids:  # the context token at position 0; every candidate then rewinds to position 1
            head.forward(rid, start_pos=0, tokens=[context_token])
        states = _run_all(head, ids, 1, range(n_vocab))
    finally:
        for rid in ids:
            head.release(rid)
    states /= _norms(states)
    elapsed = time.perf_counter() - t0
    log.info("built the inversion table (%d tokens) in %.1fs", n_vocab, elapsed)
    return TokenTable(states, sink_dims, context_token, elapsed)


def _run_all(head: SliceEngine, ids: list[bytes], pos: int, tokens: range) -> np.ndarray:
    """Each token as a one-token step at ``pos``, BATCH requests at a time: [len(tokens), n_embd]."""
    out = np.empty((len(tokens), head.spec.n_embd), np.float32)
    for start in range(0, len(tokens), len(ids)):
        chunk = tokens[start:start + len(ids)]
        rows = head.forward_batch([Step(rid, pos, tokens=[t], rewind=True) for rid, t in zip(ids, chunk)])
        out[start:start + len(rows)] = np.concatenate(rows)
    return out
