"""The slice engine: runs one contiguous range of a model's layers for many requests.

    engine = SliceEngine.open(path, SliceSpec(0, 4, has_embedding=True))
    hidden = engine.forward(request_id, start_pos=0, tokens=[1, 2, 3])     # prefill
    hidden = engine.forward(request_id, start_pos=3, tokens=[4])           # one decode step
    engine.release(request_id)

Each request owns a KV cache for the slice's layers. A built graph is kept per request and
reused while its shape holds (decode steps within one 256-cell window), so a decode step costs
a few input copies and one ``ggml_backend_graph_compute``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from . import ggml
from .backend import Backend
from .errors import ContextOverflowError, InputShapeError, RequestStateError
from .graph import GraphShape, SliceGraph, build_slice_graph
from .gguf_file import GGUFFile
from .kv_cache import KVCache, pad_cells
from .spec import ModelSpec, SliceSpec
from .weights import SliceWeights

Outputs = Literal["last", "all"]
DEFAULT_MAX_CONTEXT = 4096


@dataclass
class ForwardStats:
    """Where the time of ``forward`` went: inside ggml's compute, or in our Python around it."""

    calls: int = 0
    tokens: int = 0
    total_s: float = 0.0
    compute_s: float = 0.0
    graph_builds: int = 0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.compute_s


class _InputHost:
    """Host-side arrays for one graph's inputs, allocated with the graph and refilled per step, so a
    decode step costs a few in-place writes and one copy per input (no allocation)."""

    def __init__(self, graph: SliceGraph, n_embd_kv: int, kv_capacity: int) -> None:
        n, n_kv = graph.shape.n_tokens, graph.shape.n_kv
        self.n = n
        self.pos = np.empty(n, dtype=np.int32)
        self.cells = np.arange(n_kv, dtype=np.int32)
        self.mask = np.empty((n, n_kv), dtype=np.float32)
        self.k_idxs = np.empty(n, dtype=np.int64)
        self.v_idxs = np.empty((n, n_embd_kv), dtype=np.int64)
        self.v_channel_base = np.arange(n_embd_kv, dtype=np.int64) * kv_capacity  # V is transposed
        self.out_ids = np.array([n - 1], dtype=np.int32)
        self.out_shape = ggml.tensor_shape(graph.output)[1::-1]  # (rows, width)
        inp = graph.inputs
        self.copies = [(inp.pos, self.pos), (inp.kq_mask, self.mask), (inp.k_idxs, self.k_idxs),
                       (inp.v_idxs, self.v_idxs), (inp.out_ids, self.out_ids)]
        self.copies = [(t, a.ctypes.data, a.nbytes) for t, a in self.copies if t is not None]

    def fill(self, start: int) -> None:
        n = self.n
        if n == 1:  # a decode step: the common case, kept cheap
            self.pos[0] = start
            self.mask.fill(-np.inf)
            self.mask[0, : start + 1] = 0.0
            self.k_idxs[0] = start
            np.add(self.v_channel_base, start, out=self.v_idxs[0])
        else:
            self.pos[:] = np.arange(start, start + n, dtype=np.int32)
            self.mask[:] = np.where(self.cells[None, :] <= self.pos[:, None], np.float32(0), np.float32(-np.inf))
            self.k_idxs[:] = self.pos  # cell i holds position i
            np.add(self.k_idxs[:, None], self.v_channel_base[None, :], out=self.v_idxs)

    def upload(self) -> None:
        for tensor, address, size in self.copies:
            ggml.backend_tensor_set(tensor, address, 0, size)


class _Request:
    def __init__(self, kv: KVCache | None) -> None:
        self.kv = kv
        self.n_filled = 0  # positions processed so far (also the next start position)
        self.graph: SliceGraph | None = None
        self.host: _InputHost | None = None


class SliceEngine:
    def __init__(self, gguf: GGUFFile, slice_spec: SliceSpec, *, n_threads: int | None = None,
                 max_context: int | None = None, owns_file: bool = False) -> None:
        self.gguf = gguf
        self.spec = ModelSpec.from_gguf(gguf)
        slice_spec.check(self.spec)
        self.slice = slice_spec
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, self.spec.n_ctx_train)
        self.backend = Backend(n_threads)
        self.weights = SliceWeights(gguf, self.spec, slice_spec, self.backend)
        self.stats = ForwardStats()
        self._owns_file = owns_file
        self._requests: dict[bytes, _Request] = {}
        self._galloc = ggml.gallocr_new(self.backend.buffer_type())
        self._allocated: SliceGraph | None = None  # the graph whose tensors gallocr placed last

    @classmethod
    def open(cls, path: str | os.PathLike[str], slice_spec: SliceSpec, **kwargs) -> "SliceEngine":
        gguf = GGUFFile(path)
        try:
            return cls(gguf, slice_spec, owns_file=True, **kwargs)
        except BaseException:
            gguf.close()
            raise

    @property
    def n_requests(self) -> int:
        return len(self._requests)

    @property
    def kv_bytes(self) -> int:
        return sum(r.kv.n_bytes for r in self._requests.values() if r.kv is not None)

    def forward(self, request_id: bytes | str, *, start_pos: int, tokens: Sequence[int] | np.ndarray | None = None,
                hidden: np.ndarray | None = None, outputs: Outputs = "last") -> np.ndarray:
        """Run the slice on ``n`` new tokens at positions [start_pos, start_pos + n).

        Input: token ids (slices with the embedding) or activations ``[n, n_embd]`` float32.
        Output: float32 ``[rows, n_embd]`` activations, or ``[rows, n_vocab]`` logits for a slice
        with the LM head. Rows are all ``n`` tokens, except after the model's last layer, where
        ``outputs="last"`` keeps only the final token (as llama.cpp does without logits_all).
        """
        t0 = time.perf_counter()
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        x, n_tokens = self._check_input(tokens, hidden)
        request = self._request_for(key, start_pos)
        n_total = start_pos + n_tokens
        if n_total > self.max_context:
            raise ContextOverflowError(
                f"request needs {n_total} positions but the context length is {self.max_context}"
            )
        if request.kv is not None:
            request.kv.reserve(n_total)
        shape = self._shape_for(request, n_tokens, n_total, outputs)
        graph = self._graph_for(request, shape)
        self._set_inputs(graph, request, x, start_pos)
        t1 = time.perf_counter()
        self.backend.compute(graph.graph)
        t2 = time.perf_counter()
        result = self._read_output(request)
        request.n_filled = n_total
        if request.kv is not None:
            request.kv.n_filled = n_total
        self.stats.calls += 1
        self.stats.tokens += n_tokens
        self.stats.compute_s += t2 - t1
        self.stats.total_s += time.perf_counter() - t0
        return result

    def release(self, request_id: bytes | str) -> bool:
        """Free a request's KV cache and graph. Returns False if the id was unknown."""
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        request = self._requests.pop(key, None)
        if request is None:
            return False
        self._drop_graph(request)
        if request.kv is not None:
            request.kv.close()
        return True

    def has_request(self, request_id: bytes | str) -> bool:
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        return key in self._requests

    # --- internals ---

    def _check_input(self, tokens, hidden) -> tuple[np.ndarray, int]:
        if self.slice.has_embedding:
            if tokens is None or hidden is not None:
                raise InputShapeError("this slice starts at the embedding: give token ids, not activations")
            ids = np.array(tokens, dtype=np.int64).reshape(-1)
            if ids.size == 0:
                raise InputShapeError("no tokens to run")
            if not (0 <= int(ids.min()) and int(ids.max()) < self.spec.n_vocab):
                raise InputShapeError(f"token id outside the vocabulary [0, {self.spec.n_vocab})")
            return ids.astype(np.int32), int(ids.size)
        if hidden is None or tokens is not None:
            raise InputShapeError("this slice starts mid-model: give activations, not token ids")
        act = np.asarray(hidden)
        if act.ndim != 2 or act.shape[1] != self.spec.n_embd or act.shape[0] == 0:
            raise InputShapeError(
                f"activations of shape {list(act.shape)} do not fit: expected [n_tokens, {self.spec.n_embd}]"
            )
        return np.ascontiguousarray(act, dtype=np.float32), int(act.shape[0])

    def _request_for(self, key: bytes, start_pos: int) -> _Request:
        request = self._requests.get(key)
        if request is None:
            if start_pos != 0:
                raise RequestStateError(f"unknown request {key.hex()[:8]} (a new request starts at position 0)")
            kv = None
            if self.slice.stop > self.slice.start:
                kv = KVCache(self.backend, self.slice.layers, self.spec.n_embd_kv, self.max_context)
            request = self._requests[key] = _Request(kv)
        elif start_pos < 0 or start_pos > request.n_filled:
            raise RequestStateError(
                f"request {key.hex()[:8]} has {request.n_filled} positions; cannot continue at {start_pos}"
            )
        # start_pos < n_filled rewinds: later cells are masked out and then overwritten.
        return request

    def _shape_for(self, request: _Request, n_tokens: int, n_total: int, outputs: Outputs) -> GraphShape:
        holds_last = self.slice.stop == self.spec.n_layer
        n_outputs = 1 if (outputs == "last" and holds_last) else n_tokens
        if request.kv is None:
            return GraphShape(n_tokens, 0, n_outputs, 0)
        n_kv = min(request.kv.capacity, pad_cells(n_total))
        return GraphShape(n_tokens, n_kv, n_outputs, request.kv.generation)

    def _graph_for(self, request: _Request, shape: GraphShape) -> SliceGraph:
        graph = request.graph
        if graph is None or graph.shape != shape:
            self._drop_graph(request)
            graph = build_slice_graph(self.spec, self.slice, self.weights, request.kv, shape)
            request.graph = graph
            request.host = _InputHost(graph, self.spec.n_embd_kv, request.kv.capacity if request.kv else 0)
            self.stats.graph_builds += 1
        if self._allocated is not graph:
            if not ggml.gallocr_alloc_graph(self._galloc, graph.graph):
                raise MemoryError("cannot allocate the compute graph")
            self._allocated = graph
        return graph

    def _drop_graph(self, request: _Request) -> None:
        if request.graph is not None:
            if self._allocated is request.graph:
                self._allocated = None
            request.graph.close()
            request.graph = None
            request.host = None

    def _set_inputs(self, graph: SliceGraph, request: _Request, x: np.ndarray, start: int) -> None:
        inp = graph.inputs
        _set(inp.tokens if inp.tokens is not None else inp.embd, x)
        request.host.fill(start)
        request.host.upload()

    def _read_output(self, request: _Request) -> np.ndarray:
        out = np.empty(request.host.out_shape, dtype=np.float32)
        ggml.backend_tensor_get(request.graph.output, out.ctypes.data, 0, out.nbytes)
        return out

    def close(self) -> None:
        for key in list(self._requests):
            self.release(key)
        if self._galloc:
            ggml.gallocr_free(self._galloc)
            self._galloc = 0
        self.weights.close()
        self.backend.close()
        if self._owns_file:
            self.gguf.close()

    def __enter__(self) -> "SliceEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _set(tensor: int, data: np.ndarray) -> None:
    ggml.backend_tensor_set(tensor, data.ctypes.data, 0, data.nbytes)
