"""The stand-in compute: an engine with ``SliceEngine``'s interface whose outputs are a cheap,
deterministic function of its inputs and of each request's history, for simulated runs where the
real engine's arithmetic is not what is under test (``python -m harness.sim --compute stand-in``).

Each layer keeps, per request, a chain of digests, one per position: position p's digest hashes
the one before it with the row that layer got at p (a KV cache's stand-in: a rewind or a restart
cuts the chain, ``move`` keeps a prefix of it). A layer's output row is half its input plus a
fixed row picked by that digest; the embedding is a fixed row per token id; the LM head gives one
logit of 1 at the token a hash of the final row picks. So:

- stages compose layer by layer: any split of the trunk (and the reference's single in-process
  stage) gives the same bits, batched or alone, prefill or step by step;
- any change to an activation (a trunk that adds noise, a lost or reordered row) changes every
  later token, which the invariant "the fault-free tokens" catches;
- a step costs one small hash and a few numpy operations per layer, not a graph.

``engines("stand-in")`` puts it in place of ``SliceEngine`` for one run: every loaded module that
imported the class (the trunk's stages, the asker's head and tail, the layer proofs, the speed
measurement) builds this one instead, and gets the real class back after.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kernels.errors import InputShapeError, RequestStateError, SliceRangeError
from kernels.gguf_file import GGUFFile
from kernels.graph_inputs import WithHidden
from kernels.kv_cache import grown_capacity
from kernels.slice import DEFAULT_MAX_CONTEXT, ForwardStats, Step, check_position
from kernels.spec import ModelSpec, SliceSpec, layer_of

ROWS = 256  # fixed rows a layer picks from
COMPUTE_KINDS = ("tiny", "stand-in")  # the real engine on the tiny model, or this one


@functools.cache
def _table(what: str, rows: int, n_embd: int) -> np.ndarray:
    """Fixed rows, the same in every process (seeded by name)."""
    seed = int.from_bytes(hashlib.blake2b(what.encode(), digest_size=8).digest(), "little")
    return (np.random.default_rng(seed).standard_normal((rows, n_embd)) * 0.5).astype(np.float32)


def _digest(before: bytes, row: bytes) -> bytes:
    return hashlib.blake2b(row, digest_size=8, key=before).digest()


@dataclass
class StandInWeights:
    """What the trunk reads of an engine's weights: their bytes (for its memory budget) and kernels."""

    n_bytes: int
    kernels: str = "plain"
    repacked: tuple[str, ...] = ()
    kept_in_host: tuple[str, ...] = ()

    def close(self) -> None:
        pass


@dataclass
class StandInBackend:
    n_threads: int | None = None
    name: str = "stand-in"

    def close(self) -> None:
        pass


@dataclass
class _Request:
    chains: dict[int, list[bytes]]  # layer → the digest at each filled position
    capacity: int = 0  # cells a real cache would hold (its growth is what admission charges)
    n_filled: int = 0


class StandInEngine:
    """``kernels.slice.SliceEngine``'s interface (constructor, steps, request state, KV bytes)."""

    def __init__(self, gguf: GGUFFile, slice_spec: SliceSpec, *, n_threads: int | None = None,
                 max_context: int | None = None, remote_experts=None, placement=None) -> None:
        self.gguf = gguf
        self.spec = ModelSpec.from_gguf(gguf)
        slice_spec.check(self.spec)
        if slice_spec.nextn or (remote_experts is not None and self.spec.n_expert):
            raise SliceRangeError("the stand-in compute has no nextn layer and no remote experts")
        self.slice = slice_spec
        self.remote_experts = None
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, self.spec.n_ctx_train)
        self.split = None
        self.backend = StandInBackend(n_threads)
        self.weights = StandInWeights(self._weight_bytes(), getattr(placement, "kernels", "plain"))
        self.attention = getattr(placement, "attention", "plain")  # (what a member compares with its plan's)
        self.stats = ForwardStats()
        self._owns_file = False
        self._requests: dict[bytes, _Request] = {}
        self._embedding = _table("embedding", self.spec.n_vocab, self.spec.n_embd) if slice_spec.has_embedding else None
        self._layers = [(layer, layer.to_bytes(4, "little"), _table(f"layer {layer}", ROWS, self.spec.n_embd))
                        for layer in slice_spec.layers]

    def describe_attention(self) -> str:
        return f"attention {self.attention} (the stand-in compute: no attention at all)"

    def _weight_bytes(self) -> int:
        """The bytes the real slice would map: its layers' tensors, the embedding and the head."""
        total = 0
        for name, info in self.gguf.tensors.items():
            layer = layer_of(name)
            if layer is not None:
                total += info.n_bytes if layer in self.slice.layers else 0
            elif (self.slice.has_embedding and name.startswith("token_embd")) or \
                    (self.slice.has_lm_head and name.startswith("output")):
                total += info.n_bytes
        return total

    @classmethod
    def open(cls, path: str | os.PathLike[str], slice_spec: SliceSpec, **kwargs) -> "StandInEngine":
        engine = cls(GGUFFile(path), slice_spec, **kwargs)
        engine._owns_file = True
        return engine

    def placement(self) -> str:
        return self.backend.name

    def compute_buffer_bytes(self) -> int:
        return 0

    # --- requests ---

    @property
    def n_requests(self) -> int:
        return len(self._requests)

    @property
    def kv_bytes_per_position(self) -> int:
        return self.spec.kv_bytes_per_token_per_layer * len(self.slice.layers)

    @property
    def kv_bytes(self) -> int:
        return sum(r.capacity for r in list(self._requests.values())) * self.kv_bytes_per_position

    def kv_bytes_of(self, request_id: bytes | str) -> int:
        request = self._requests.get(_key(request_id))
        return request.capacity * self.kv_bytes_per_position if request is not None else 0

    def kv_bytes_after(self, request_id: bytes | str, n_positions: int) -> int:
        if not len(self.slice.layers):
            return 0
        request = self._requests.get(_key(request_id))
        return self._grown(request.capacity if request is not None else 0, n_positions) * self.kv_bytes_per_position

    def _grown(self, capacity: int, n_tokens: int) -> int:
        """Cells a real cache would hold (what admission charges): kernels/kv_cache.py's growth."""
        return grown_capacity(capacity, min(n_tokens, self.max_context), self.max_context)

    def position_of(self, request_id: bytes | str) -> int:
        request = self._requests.get(_key(request_id))
        return request.n_filled if request is not None else 0

    def has_request(self, request_id: bytes | str) -> bool:
        return _key(request_id) in self._requests

    def release(self, request_id: bytes | str) -> bool:
        return self._requests.pop(_key(request_id), None) is not None

    def move(self, from_id: bytes | str, to_id: bytes | str, n_positions: int) -> bool:
        src, dst = _key(from_id), _key(to_id)
        request = self._requests.get(src)
        if request is None or dst in self._requests or not 0 <= n_positions <= request.n_filled:
            return False
        del self._requests[src]
        request.n_filled = n_positions
        for chain in request.chains.values():
            del chain[n_positions:]
        self._requests[dst] = request
        return True

    # --- steps ---

    def forward(self, request_id: bytes | str, *, start_pos: int, tokens=None, hidden=None, outputs: str = "last",
                rewind: bool = False) -> np.ndarray:
        return self.forward_batch([Step(request_id, start_pos, tokens, hidden, outputs, rewind=rewind)])[0]

    def check_step(self, step) -> np.ndarray:
        """kernels.slice.SliceEngine.check_step's checks (the same EngineError kinds); the input array."""
        x = self._input(step.tokens, step.hidden)
        if step.hidden_rows and not self.slice.has_lm_head:
            raise InputShapeError("only a slice with the LM head returns hidden states with its rows")
        request = self._requests.get(step.key)
        check_position(step, None if request is None else request.n_filled, len(x), self.max_context)
        return x

    def _input(self, tokens, hidden) -> np.ndarray:
        if self.slice.has_embedding:
            if tokens is None or hidden is not None:
                raise InputShapeError("this slice starts at the embedding: give token ids, not activations")
            ids = np.array(tokens, dtype=np.int64).reshape(-1)
            if ids.size == 0:
                raise InputShapeError("no tokens to run")
            if not (0 <= int(ids.min()) and int(ids.max()) < self.spec.n_vocab):
                raise InputShapeError(f"token id outside the vocabulary [0, {self.spec.n_vocab})")
            return ids.astype(np.int32)
        if hidden is None or tokens is not None:
            raise InputShapeError("this slice starts mid-model: give activations, not token ids")
        act = np.asarray(hidden)
        if act.ndim != 2 or act.shape[1] != self.spec.n_embd or act.shape[0] == 0:
            raise InputShapeError(
                f"activations of shape {list(act.shape)} do not fit: expected [n_tokens, {self.spec.n_embd}]")
        return np.ascontiguousarray(act, dtype=np.float32)

    def forward_batch(self, steps: Sequence) -> list:
        t0 = time.perf_counter()
        if not steps:
            return []
        inputs = [self.check_step(step) for step in steps]
        keys = [step.key for step in steps]
        if len(set(keys)) != len(keys):
            raise RequestStateError("a batch cannot hold the same request twice")
        results = []
        for step, key, x in zip(steps, keys, inputs):
            request = self._requests.get(key)
            if request is None:
                request = self._requests[key] = _Request({layer: [] for layer in self.slice.layers})
            results.append(self._run(step, request, x))
            request.n_filled = step.start_pos + len(x)
            if len(self.slice.layers):
                request.capacity = self._grown(request.capacity, request.n_filled)
        self.stats.calls += 1
        self.stats.batched_requests += len(steps)
        self.stats.tokens += sum(len(x) for x in inputs)
        self.stats.total_s += time.perf_counter() - t0
        return results

    def _run(self, step, request: _Request, x: np.ndarray):
        h = self._embedding[x] if self._embedding is not None else x
        half = np.float32(0.5)
        for layer, first, rows in self._layers:
            chain = request.chains[layer]
            del chain[step.start_pos:]  # (a rewind, or a restart at 0: the later cells are gone)
            before = chain[-1] if chain else first
            data, width = h.tobytes(), h.shape[1] * 4
            picks = []
            for start in range(0, len(data), width):
                before = _digest(before, data[start:start + width])
                chain.append(before)
                picks.append(before[0])
            h = h * half + rows[picks]
        if not self.slice.has_lm_head:
            return h
        rows = h if step.outputs == "all" else h[-1:]
        logits = np.zeros((len(rows), self.spec.n_vocab), np.float32)
        for i, row in enumerate(rows):
            logits[i, int.from_bytes(_digest(b"lm head", row.tobytes()), "little") % self.spec.n_vocab] = 1.0
        return WithHidden(logits, h) if step.hidden_rows else logits

    # --- lifetime ---

    def close(self) -> None:
        self._requests.clear()
        if self._owns_file:
            self.gguf.close()

    def __enter__(self) -> "StandInEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key(request_id: bytes | str) -> bytes:
    return request_id.encode() if isinstance(request_id, str) else bytes(request_id)


@contextlib.contextmanager
def engines(kind: str):
    """Runs within use the compute ``kind`` (COMPUTE_KINDS): "tiny" changes nothing; "stand-in"
    puts StandInEngine wherever a loaded module holds kernels.slice.SliceEngine."""
    if kind not in COMPUTE_KINDS:
        raise ValueError(f"compute is one of {', '.join(COMPUTE_KINDS)}, not {kind!r}")
    if kind == "tiny":
        yield
        return
    import kernels.slice

    real = kernels.slice.SliceEngine
    _put(real, StandInEngine)
    try:
        yield
    finally:
        _put(StandInEngine, real)  # (modules first imported during the run took the stand-in too)


def _put(old: type, new: type) -> None:
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("SliceEngine") is old:  # (no module's __getattr__ runs)
            module.SliceEngine = new
