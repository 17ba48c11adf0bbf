"""The slice engine: runs one contiguous range of a model's layers for many requests.

    engine = SliceEngine.open(path, SliceSpec(0, 4, has_embedding=True))
    hidden = engine.forward(request_id, start_pos=0, tokens=[1, 2, 3])     # prefill
    hidden = engine.forward(request_id, start_pos=3, tokens=[4])           # one decode step
    outs = engine.forward_batch([Step(a, 17, tokens=[9]), Step(b, 4, tokens=[7])])  # one batch
    engine.release(request_id)

Each request owns a KV cache for the slice's layers. Graphs of decode steps are kept (keyed by
the batch's shape, each with its own compute buffer: kernels.graph_cache, with their host-side
inputs: kernels.graph_inputs) and reused while the shape holds, whichever requests the batch
holds (a kept graph's views of the caches are pointed at the batch's: kernels.graph_bind): a
steady decode step costs a few input copies and one ``ggml_backend_graph_compute``. Graphs that carry
prompt chunks are built, run once and freed. A batch runs the requests' tokens through shared matmuls
and gives each request exactly the bits it would get alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from . import ggml
from .backend import Backend
from .devices import Device, device_budget
from .errors import ContextOverflowError, InputShapeError, RequestStateError, SliceRangeError
from .graph import GraphShape, RequestShape, SliceGraph, build_slice_graph
from .gguf_file import GGUFFile
from .graph_cache import GraphCache, PlacedGraph, place
from .graph_inputs import InputHost, WithHidden
from .device_split import DeviceSplit, layers_that_fit, split_for_device  # noqa: F401 (layers_that_fit: the API)
from .kv_cache import ATTENTION, KVCache, grown_capacity, pad_cells
from .remote_experts import RemoteExpertLayers, RemoteExperts  # noqa: F401 (RemoteExperts: the API)
from .spec import ModelSpec, SliceSpec
from .weights import SliceWeights

Outputs = Literal["last", "all"]
DEFAULT_MAX_CONTEXT = 4096
GRAPH_CACHE_SIZE = 16  # decode graphs kept per engine (a batch's composition changes as requests come and go)
CACHED_GRAPH_MAX_TOKENS = 64  # graphs with more tokens than this (prompt chunks) are not kept


@dataclass
class Step:
    """One request's share of a forward pass: n new tokens at positions [start_pos, start_pos + n)."""

    request_id: bytes | str
    start_pos: int
    tokens: Sequence[int] | np.ndarray | None = None  # slices with the embedding
    hidden: np.ndarray | None = None  # [n, n_embd] float32, slices fed by activations
    outputs: Outputs = "last"
    # Cells from start_pos on are dropped first (a speculative step's rejected positions); a step
    # that starts before the request's filled length must say so, so a stray packet cannot.
    rewind: bool = False
    # A speculative check: each row attends on its own, with the kernels a one-token step uses, so
    # row i's output is the bits that i + 1 single steps give (see GraphBuilder._attend).
    verify: bool = False
    # A slice with the LM head also returns every row's final normed hidden state (``WithHidden``:
    # what a nextn layer drafts from); the logits are the same bits as without.
    hidden_rows: bool = False

    @property
    def key(self) -> bytes:
        rid = self.request_id
        return rid.encode() if isinstance(rid, str) else bytes(rid)


def split_hidden(out: np.ndarray | WithHidden) -> tuple[np.ndarray, np.ndarray | None]:
    """(logits or activations, the hidden states if the step returned them)."""
    return (out.rows, out.hidden) if isinstance(out, WithHidden) else (out, None)


@dataclass
class ForwardStats:
    """Where the time of ``forward`` went: inside ggml's compute, or in our Python around it."""

    calls: int = 0
    tokens: int = 0
    total_s: float = 0.0
    compute_s: float = 0.0
    graph_builds: int = 0
    graph_rebinds: int = 0  # request slots of a kept graph pointed at other caches (kernels.graph_bind)
    batched_requests: int = 0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.compute_s


class _Request:
    def __init__(self, kv: KVCache | None) -> None:
        self.kv = kv
        self.n_filled = 0  # positions processed so far (also the next start position)


@dataclass(frozen=True)
class Placement:
    """Where a slice's weights, KV cache and graphs live.

    ``device``: where the slice computes (kernels.devices; None: the CPU); on a GPU its weights, KV
    cache and graphs live in the device's memory. ``gpu_memory``: bytes the slice may take on a GPU
    (None: what it reports free, less a reserve); when its layers (weights, and one request's KV
    cache at the full context) need more, the first ones that fit go there and the rest stay on the
    CPU, as llama.cpp's ``n_gpu_layers`` does (``SliceEngine.backend.device_layers``). ``upload``:
    copy the weights even on the CPU, the device path without a device (tests). ``kernels``:
    plain, or repack (amx) to copy the weights the CPU's extra buffer types take into them
    (kernels/weights.py, kernels/backend.py KERNELS). ``attention``: plain, or flash for
    ggml_flash_attn_ext over a cache laid out for it (kernels/kv_cache.py ATTENTION; a model
    with latent attention keeps plain, ``SliceEngine.flash``)."""

    device: Device | None = None
    gpu_memory: int | None = None
    upload: bool = False
    kernels: str = "plain"
    attention: str = "plain"


ON_THE_CPU = Placement()


class SliceEngine:
    def __init__(self, gguf: GGUFFile, slice_spec: SliceSpec, *, n_threads: int | None = None,
                 max_context: int | None = None, remote_experts: RemoteExperts | None = None,
                 placement: Placement = ON_THE_CPU) -> None:
        """``remote_experts``: the slice's MoE experts live on other nodes (expert parallelism);
        the engine runs each layer up to its router, calls this for the experts' outputs, and
        combines them itself. Called on the compute thread; it may block on the network.
        ``placement``: where it computes and keeps its weights (``Placement``; default the CPU)."""
        device, gpu_memory = placement.device, placement.gpu_memory
        if placement.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, not {placement.attention!r}")
        self.gguf = gguf
        self.spec = ModelSpec.from_gguf(gguf)
        slice_spec.check(self.spec)
        # Flash attention where the cache has V; latent attention (no V: deepseek2's MLA) stays plain.
        self.attention = placement.attention  # (as asked: what a member compares with its plan's)
        self.flash = placement.attention == "flash" and self.spec.kv_widths[1] > 0
        self.slice = slice_spec
        self.remote_experts = remote_experts if self.spec.n_expert else None
        if self.remote_experts is not None and (slice_spec.has_embedding or slice_spec.has_lm_head or slice_spec.nextn):
            raise SliceRangeError("only a trunk slice (no embedding, no LM head) can use remote experts")
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, self.spec.n_ctx_train)
        self.split: DeviceSplit | None = None  # what a device too small for the slice holds of it
        if (device is not None and not device.is_cpu) or (placement.upload and gpu_memory is not None):
            budget = device_budget(device) if gpu_memory is None else gpu_memory
            self.split = split_for_device(self.spec, slice_spec, budget, self.max_context)
        self.backend = Backend(n_threads, device, upload=placement.upload,
                               device_layers=self.split.dense if self.split else None,
                               expert_layers=self.split.experts if self.split else None)
        try:
            self.weights = SliceWeights(gguf, self.spec, slice_spec, self.backend,
                                        with_experts=self.remote_experts is None, kernels=placement.kernels)
        except BaseException:
            self.backend.close()
            raise
        self.stats = ForwardStats()
        self._owns_file = False  # (open() makes it True: the engine closes the file it opened)
        self._transient: PlacedGraph | None = None  # a prompt graph, freed after its one run
        self._requests: dict[bytes, _Request] = {}
        self._graphs: GraphCache[GraphShape] = GraphCache(GRAPH_CACHE_SIZE)  # decode graphs by shape
        # A kept graph serves any requests of its shape, rebound to their caches, where one backend
        # runs it whole (kernels.graph_bind); else its shape names the requests it was built for
        # (as it does here too once this is set False: the reference in tests and benchmarks).
        self.rebind_graphs = self.remote_experts is None and self.backend.handle == self.backend.cpu_handle
        # (shape, layer) → one layer's graph, for remote experts
        self._segments: GraphCache[tuple[GraphShape, int]] = GraphCache(
            GRAPH_CACHE_SIZE * max(1, len(slice_spec.layers)))
        self._remote: RemoteExpertLayers | None = None if self.remote_experts is None else RemoteExpertLayers(
            self.spec, slice_spec, self.weights, self.remote_experts, self._place, self._segments)

    @classmethod
    def open(cls, path: str | os.PathLike[str], slice_spec: SliceSpec, **kwargs) -> "SliceEngine":
        gguf = GGUFFile(path)
        try:
            engine = cls(gguf, slice_spec, **kwargs)
        except BaseException:
            gguf.close()
            raise
        engine._owns_file = True
        return engine

    def placement(self) -> str:
        """Where the slice computes, for logs and status: ``cpu``, ``vulkan:0``, or split
        (kernels/device_split.py) ``vulkan:0 for layers [4, 9), cpu for [9, 15)``."""
        where = self.split.describe(self.backend.name, self.slice, self.spec) if self.split else self.backend.name
        kept = self.weights.kept_in_host
        return where + (f" ({len(kept)} tensors too large for it in host memory: {kept[0]}, ...)" if kept else "")

    def describe_attention(self) -> str:
        """One line for a member's log: the attention it computes with, and what it fell back to."""
        if self.attention == "flash" and not self.flash:
            return "attention flash: this model's latent attention has no flash path here; attention stays plain"
        return f"attention {self.attention}" + (": ggml_flash_attn_ext (llama.cpp's -fa 1)" if self.flash else "")

    def compute_buffer_bytes(self) -> int:
        """Bytes of the compute buffers this engine holds: its kept graphs' and segments'
        allocators and the idle ones its backend keeps for reuse (graphs split by a scheduler,
        under partial offload, are not counted)."""
        placed = self._graphs.placed() + self._segments.placed()
        held = sum(ggml.gallocr_get_buffer_size(p.galloc, 0) for p in placed if p.galloc)
        return held + self.backend.idle_gallocr_bytes()

    @property
    def n_requests(self) -> int:
        return len(self._requests)

    @property
    def kv_bytes(self) -> int:
        # list() copies in one step under the GIL: the event loop asks while the compute thread
        # may be adding a request, and iterating the live dict would then raise.
        return sum(r.kv.n_bytes for r in list(self._requests.values()) if r.kv is not None)

    def forward(self, request_id: bytes | str, *, start_pos: int, tokens: Sequence[int] | np.ndarray | None = None,
                hidden: np.ndarray | None = None, outputs: Outputs = "last", rewind: bool = False) -> np.ndarray:
        """Run the slice on ``n`` new tokens at positions [start_pos, start_pos + n).

        Input: token ids (slices with the embedding) or activations ``[n, n_embd]`` float32.
        Output: float32 ``[rows, n_embd]`` activations, or ``[rows, n_vocab]`` logits for a slice
        with the LM head. Rows are all ``n`` tokens, except in a slice with the LM head, where
        ``outputs="last"`` keeps only the final token (as llama.cpp does without logits_all; the
        rows are dropped at the model's last layer, or before the head when the slice has no
        layers). A slice without the LM head returns every row even when it ends at the last
        layer: the slice that makes the logits is the one that knows which rows are wanted.
        """
        return self.forward_batch([Step(request_id, start_pos, tokens, hidden, outputs, rewind=rewind)])[0]

    def forward_batch(self, steps: Sequence[Step]) -> list[np.ndarray | WithHidden]:
        """One pass for several requests (distinct ids). Every step is checked before any state
        changes: if one is invalid, this raises and nothing ran. A step with ``hidden_rows``, and
        every step of a nextn slice (token ids in ``tokens``, the hidden states before them in
        ``hidden``), gets a ``WithHidden``."""
        t0 = time.perf_counter()
        if not steps:
            return []
        inputs = [self.check_step(step) for step in steps]
        keys = [step.key for step in steps]
        if len(set(keys)) != len(keys):
            raise RequestStateError("a batch cannot hold the same request twice")
        requests = [self._requests.get(k) or self._new_request(k) for k in keys]
        for step, request, x in zip(steps, requests, inputs):
            if request.kv is not None:
                request.kv.reserve(step.start_pos + len(x))
        shape = _graph_shape(steps, requests, inputs, self.slice.has_lm_head or self.slice.nextn, self.flash,
                             self.rebind_graphs)
        order = _shape_order(shape) if self.rebind_graphs else None
        if order is not None:
            steps, requests, inputs = ([xs[i] for i in order] for xs in (steps, requests, inputs))
            shape = GraphShape(tuple(shape.requests[i] for i in order), (), shape.hidden, shape.flash)
        tokens = np.concatenate([np.asarray(s.tokens, dtype=np.int32) for s in steps]) if self.slice.nextn else None
        if self.remote_experts is not None:
            t1 = time.perf_counter()
            outputs = self._remote.forward(shape, [r.kv for r in requests], inputs, [s.start_pos for s in steps])
            t2 = time.perf_counter()
        else:
            placed = self._graph_for(shape, requests)
            try:
                placed.host.set(inputs[0] if len(inputs) == 1 else np.concatenate(inputs), [s.start_pos for s in steps],
                                tokens)
                t1 = time.perf_counter()
                placed.compute()
                t2 = time.perf_counter()
                outputs = placed.host.read_outputs([self.slice.nextn or step.hidden_rows for step in steps])
            finally:
                self._free_transient()
            if order is not None:  # back in the order the steps came
                outputs = [out for _, out in sorted(zip(order, outputs), key=lambda pair: pair[0])]
        for step, request, x in zip(steps, requests, inputs):
            request.n_filled = step.start_pos + len(x)
            if request.kv is not None:
                request.kv.n_filled = request.n_filled
        self.stats.calls += 1
        self.stats.batched_requests += len(steps)
        self.stats.tokens += shape.n_tokens
        self.stats.compute_s += t2 - t1
        self.stats.total_s += time.perf_counter() - t0
        return outputs

    def check_step(self, step: Step) -> np.ndarray:
        """Validate one step against this slice and the request's state; returns its input array.
        Raises an EngineError (one line) without changing anything."""
        x = _input_array(self.slice, self.spec, step.tokens, step.hidden)
        if step.hidden_rows and not self.slice.has_lm_head:
            raise InputShapeError("only a slice with the LM head returns hidden states with its rows")
        request = self._requests.get(step.key)
        check_position(step, None if request is None else request.n_filled, len(x), self.max_context)
        return x

    def release(self, request_id: bytes | str) -> bool:
        """Free a request's KV cache and the graphs that used it (graphs rebound batch by batch name
        no request: they go with the last request, so an idle engine holds no compute buffers and
        no view of a freed cache). Returns False if the id was unknown."""
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        request = self._requests.pop(key, None)
        if request is None:
            return False
        self._graphs.drop_where(lambda shape: key in shape.request_ids or not self._requests)
        self._segments.drop_where(lambda seg: key in seg[0].request_ids)
        if request.kv is not None:
            request.kv.close()
        return True

    def move(self, from_id: bytes | str, to_id: bytes | str, n_positions: int) -> bool:
        """Give request ``from_id``'s cache to ``to_id``, keeping only positions [0, n_positions):
        how a request's cells are kept past its end as a prefix, and how a later request takes
        them up (the cells stay where they are; nothing is copied). False, and nothing changed,
        when ``from_id`` is unknown, holds fewer positions, or ``to_id`` is in use."""
        src = from_id.encode() if isinstance(from_id, str) else bytes(from_id)
        dst = to_id.encode() if isinstance(to_id, str) else bytes(to_id)
        request = self._requests.get(src)
        if request is None or dst in self._requests or not 0 <= n_positions <= request.n_filled:
            return False
        del self._requests[src]
        # Graphs built for the old id read its cells by that id's slot; the new id builds its own.
        self._graphs.drop_where(lambda shape: src in shape.request_ids)
        self._segments.drop_where(lambda seg: src in seg[0].request_ids)
        # Later cells stay allocated but masked: the next step at n_positions overwrites them.
        request.n_filled = n_positions
        if request.kv is not None:
            request.kv.n_filled = n_positions
        self._requests[dst] = request
        return True

    def position_of(self, request_id: bytes | str) -> int:
        """Positions a request has filled (0 for an unknown one)."""
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        request = self._requests.get(key)
        return request.n_filled if request is not None else 0

    def has_request(self, request_id: bytes | str) -> bool:
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        return key in self._requests

    @property
    def kv_bytes_per_position(self) -> int:
        """KV bytes one cached position costs across this slice's layers."""
        return self.spec.kv_bytes_per_token_per_layer * len(self.slice.layers)

    def kv_bytes_of(self, request_id: bytes | str) -> int:
        """KV bytes one request's cache holds now (0 for an unknown one)."""
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        request = self._requests.get(key)
        return request.kv.n_bytes if request is not None and request.kv is not None else 0

    def kv_bytes_after(self, request_id: bytes | str, n_positions: int) -> int:
        """KV bytes the request's cache will hold once it has room for positions [0, n_positions)
        (a new request starts empty): what admission control charges before a step runs."""
        if not len(self.slice.layers):
            return 0
        key = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
        request = self._requests.get(key)
        capacity = request.kv.capacity if request is not None and request.kv is not None else 0
        cells = grown_capacity(capacity, min(n_positions, self.max_context), self.max_context)
        return cells * self.kv_bytes_per_position

    # --- internals ---

    def _new_request(self, key: bytes) -> _Request:
        kv = None
        if self.slice.stop > self.slice.start:
            kv = KVCache(self.backend, self.slice.layers, self.spec.kv_widths, self.max_context, flash=self.flash)
        request = self._requests[key] = _Request(kv)
        return request

    def _graph_for(self, shape: GraphShape, requests: list[_Request]) -> PlacedGraph:
        """The graph for this shape, placed in memory: kept when it is a decode step's, else freed
        after its one run (``_free_transient``)."""
        caches = [r.kv for r in requests] if self.slice.stop > self.slice.start else []
        entry = self._graphs.get(shape)
        if entry is None:
            entry = self._place(build_slice_graph(self.spec, self.slice, self.weights, caches, shape), caches)
            if shape.n_tokens <= CACHED_GRAPH_MAX_TOKENS:
                self._graphs.put(shape, entry)
            else:
                self._transient = entry
        elif self.rebind_graphs and entry.graph.kv_views is not None:
            self.stats.graph_rebinds += entry.graph.kv_views.bind(caches)
        return entry

    def _place(self, graph: SliceGraph, caches: list[KVCache]) -> PlacedGraph:
        try:
            host = InputHost(graph, self.spec.kv_widths[1], [c.capacity for c in caches])
        except BaseException:
            graph.close()
            raise
        entry = place(graph, host, self.backend)  # frees the graph if it does not fit
        self.stats.graph_builds += 1
        return entry

    def _free_transient(self) -> None:
        if self._transient is not None:
            self._transient.free()
            self._transient = None

    @contextlib.contextmanager
    def threads(self, n_threads: int):
        """Computes on ``n_threads`` threads within the block, then as before (batched work that
        gains from every core, in an engine whose one-token steps do not)."""
        before = self.backend.n_threads
        self.backend.set_threads(n_threads)
        try:
            yield self
        finally:
            self.backend.set_threads(before)

    def close(self) -> None:
        for key in list(self._requests):
            self.release(key)
        self._graphs.clear()
        self._segments.clear()
        self._free_transient()
        self.weights.close()
        self.backend.close()
        if self._owns_file:
            self.gguf.close()

    def __enter__(self) -> "SliceEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_position(step: Step, n_filled: int | None, n_rows: int, max_context: int) -> None:
    """Whether ``step`` may run on its request (``n_filled`` positions; None: the engine holds none
    of it): RequestStateError or ContextOverflowError (one line) otherwise. A rewind (or a restart
    at 0) masks the later cells out; the step then overwrites them."""
    if n_filled is None:
        if step.start_pos != 0:
            raise RequestStateError(f"unknown request {step.key.hex()[:8]} (a new request starts at position 0)")
    elif step.start_pos < 0 or step.start_pos > n_filled:
        raise RequestStateError(f"request {step.key.hex()[:8]} has {n_filled} positions; "
                                f"cannot continue at {step.start_pos}")
    elif 0 < step.start_pos < n_filled and not step.rewind:
        raise RequestStateError(f"request {step.key.hex()[:8]} has {n_filled} positions; a step at "
                                f"{step.start_pos} would drop the rest and does not say rewind")
    if step.start_pos + n_rows > max_context:
        raise ContextOverflowError(f"request needs {step.start_pos + n_rows} positions but the context length is "
                                   f"{max_context}")


def _input_array(slice_spec: SliceSpec, spec: ModelSpec, tokens: Sequence[int] | np.ndarray | None,
                 hidden: np.ndarray | None) -> np.ndarray:
    """A step's input as the graph takes it: I32 token ids [n] for a slice with the embedding,
    F32 activations [n, n_embd] for one fed mid-model. InputShapeError (one line) otherwise."""
    if slice_spec.nextn:
        ids = _token_ids(spec, tokens)
        act = _input_array(SliceSpec(0, 0), spec, None, hidden)
        if len(ids) != len(act):
            raise InputShapeError(f"a nextn step takes a token per hidden state, not {len(ids)} for {len(act)}")
        return act
    if slice_spec.has_embedding:
        if tokens is None or hidden is not None:
            raise InputShapeError("this slice starts at the embedding: give token ids, not activations")
        return _token_ids(spec, tokens)
    if hidden is None or tokens is not None:
        raise InputShapeError("this slice starts mid-model: give activations, not token ids")
    act = np.asarray(hidden)
    if act.ndim != 2 or act.shape[1] != spec.n_embd or act.shape[0] == 0:
        raise InputShapeError(
            f"activations of shape {list(act.shape)} do not fit: expected [n_tokens, {spec.n_embd}]")
    return np.ascontiguousarray(act, dtype=np.float32)


def _token_ids(spec: ModelSpec, tokens: Sequence[int] | np.ndarray | None) -> np.ndarray:
    ids = np.array(tokens if tokens is not None else [], dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise InputShapeError("no tokens to run")
    if not (0 <= int(ids.min()) and int(ids.max()) < spec.n_vocab):
        raise InputShapeError(f"token id outside the vocabulary [0, {spec.n_vocab})")
    return ids.astype(np.int32)


def _shape_order(shape: GraphShape) -> list[int] | None:
    """The batch's requests in the order of their shapes (None: already so), so that a batch of
    the same shapes in any order finds one kept graph. (With quantized weights a row's bits do
    not depend on its neighbours: tests/test_batching.py.)"""
    order = sorted(range(len(shape.requests)), key=lambda i: shape.requests[i])
    return None if order == list(range(len(order))) else order


def _graph_shape(steps: Sequence[Step], requests: list[_Request], inputs: list[np.ndarray],
                 makes_logits: bool, flash: bool = False, rebinds: bool = False) -> GraphShape:
    """The batch's graph shape. ``makes_logits``: the slice has the LM head, and only then may a
    step keep fewer rows than it has tokens. Why not any slice that ends at the model's last
    layer: with no layers at the asker's end (--head-layers 0) that is the last trunk stage, and
    rows it dropped would leave the asker's tail one row for a prompt of n positions (and a
    speculative check without the rows it checks; with remote experts, a segment read past its
    output)."""
    shapes = []
    for step, request, x in zip(steps, requests, inputs):
        n = len(x)
        n_outputs = 1 if (step.outputs == "last" and makes_logits) else n
        if request.kv is None:
            shapes.append(RequestShape(n, 0, n_outputs, 0))
        else:
            n_kv = min(request.kv.capacity, pad_cells(step.start_pos + n))
            shapes.append(RequestShape(n, n_kv, n_outputs, 0 if rebinds else request.kv.generation,
                                       rowwise=step.verify and n > 1, kv_cells=request.kv.capacity))
    # ``rebinds``: the graph is pointed at the batch's caches before each run (kernels.graph_bind),
    # so it is kept by shape alone, not by the requests it was built for
    return GraphShape(tuple(shapes), () if rebinds else tuple(step.key for step in steps),
                      hidden=makes_logits and any(step.hidden_rows for step in steps), flash=flash)
