"""An expert server's engine: some of the experts of some MoE layers, and nothing else.

Expert parallelism places a MoE layer's experts on several nodes. A node holding experts
[first, last) of layers L maps exactly those experts' slices of the gate/up/down tensors
(zero-copy: in a GGUF an expert's weights are one contiguous slab of its layer's tensor) and runs
rows through them on request. It keeps no per-request state.

The op sequence matches the whole-layer graph (kernels.graph, GraphBuilder.experts): the same
mul_mat_id kernels and SwiGLU on the same rows, so each row's result has the same bits as when the
stage runs the experts itself.
"""

from __future__ import annotations

import numpy as np

import dataclasses

from . import ggml
from .backend import Backend, cpu_device
from .errors import InputShapeError, UnsupportedModelError
from .gguf_file import GGUFFile
from .spec import ModelSpec
from .weight_bufts import Candidate, ExtraCopies, choose

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# An expert node's fetched file (swarmctl/model_files/expert_slices.py) holds only experts [first, last) of
# each expert tensor, and says which in these keys.
FIRST_KEY, LAST_KEY = "swarmctl.experts.first", "swarmctl.experts.last"


def expert_slabs(gguf: GGUFFile, layer: int, first: int, last: int) -> list[tuple[int, str, object, int, int]]:
    """Where experts [first, last) of ``layer``'s expert tensors lie in ``gguf``: (layer, stem, tensor
    info, byte offset in its part, bytes) for each expert tensor the layer has, in EXPERT_TENSORS'
    order. The file may be the model's or an expert node's cut to the experts it holds (FIRST_KEY)."""
    spec = ModelSpec.from_gguf(gguf)
    held_first, held_last = int(gguf.get(FIRST_KEY, 0)), int(gguf.get(LAST_KEY, spec.n_expert))
    if not held_first <= first < last <= held_last:
        raise UnsupportedModelError(f"{gguf.path.name} holds experts [{held_first}, {held_last}), not [{first}, {last})")
    out = []
    for stem in EXPERT_TENSORS:
        info = gguf.tensors.get(f"blk.{layer}.{stem}.weight")
        if info is not None:
            slab = info.n_bytes // (held_last - held_first)
            out.append((layer, stem, info, info.offset + (first - held_first) * slab, (last - first) * slab))
    return out


def rows_for(selected: np.ndarray, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, slot) pairs of a router's choices ``selected`` [n, k] that fall in experts [first, last)."""
    return np.nonzero((selected >= first) & (selected < last))


class ExpertEngine:
    def __init__(self, gguf: GGUFFile, layers: range, first: int, last: int, *, n_threads: int | None = None,
                 kernels: str = "plain") -> None:
        """``kernels``: plain, or repack (amx) to copy the slabs the CPU's extra buffer types take
        into them, as a stage's own experts are (kernels/weight_bufts.py)."""
        self.kernels = kernels
        self.spec = ModelSpec.from_gguf(gguf)
        if not self.spec.n_expert:
            raise UnsupportedModelError("the model has no experts to serve")
        if not 0 <= first < last <= self.spec.n_expert:
            raise UnsupportedModelError(f"experts [{first}, {last}) are outside the model's {self.spec.n_expert}")
        self.layers, self.first, self.last = layers, first, last
        # the MoE layers among them: a model whose first layers are dense (DeepSeek) has no experts there
        self.moe_layers = tuple(il for il in layers if self.spec.is_moe_layer(il))
        self.backend = Backend(n_threads)
        self.tensors: dict[tuple[int, str], int] = {}
        self.n_bytes = 0
        self.rows_served = 0
        self._buffers: dict[int, int] = {}  # part of the file → a buffer over its mapped experts (zero-copy)
        infos = []
        if not self.moe_layers:
            raise UnsupportedModelError(f"layers [{layers.start}, {layers.stop}) have no experts")
        for il in self.moe_layers:
            for stem in EXPERT_TENSORS:
                info = gguf.tensors.get(f"blk.{il}.{stem}.weight")
                if info is None:
                    raise UnsupportedModelError(f"layer {il} has no {stem} tensor")
                infos.append((il, stem, info))
        self._ctx = ggml.new_context(len(infos) + 1)
        all_spans = [span for il in self.moe_layers for span in expert_slabs(gguf, il, first, last)]
        self._extra = self._repack(gguf, all_spans, first, last)
        spans = [span for span in all_spans if _slab_name(span, first, last) not in self._extra.tensors]
        for il, stem, _, _, size in all_spans:
            t = self._extra.tensors.get(_slab_name((il, stem), first, last))
            if t is not None:
                self.tensors[(il, stem)] = t
                self.n_bytes += size
        # one buffer over the mapped bytes of each part that holds some (a split model's parts are mapped apart)
        for part in sorted({info.part for _, _, info, _, _ in spans}):
            in_part = [(offset, size) for _, _, info, offset, size in spans if info.part == part]
            lo = min(offset for offset, _ in in_part)
            hi = max(offset + size for offset, size in in_part)
            self._buffers[part] = self.backend.weights_buffer(gguf.part_address(part) + lo, hi - lo)
        for il, stem, info, offset, size in spans:
            ne0, ne1, _ = info.shape
            t = ggml.new_tensor_3d(self._ctx, info.ggml_type, ne0, ne1, last - first)
            ggml.set_name(t, _slab_name((il, stem), first, last).encode())
            address = gguf.part_address(info.part) + offset
            if ggml.backend_tensor_alloc(self._buffers[info.part], t, address) != ggml.STATUS_SUCCESS:
                raise RuntimeError(f"cannot place experts of {info.name}")
            self.tensors[(il, stem)] = t
            self.n_bytes += size
        self._gguf = gguf

    def _repack(self, gguf: GGUFFile, spans: list, first: int, last: int) -> ExtraCopies:
        """The slabs the kernels' extra buffer types take, copied there (none under plain)."""
        extra = ExtraCopies()
        bufts = self.backend.weight_buffer_types(self.kernels)
        if not bufts:
            return extra
        candidates = [Candidate(dataclasses.replace(info, shape=(*info.shape[:2], last - first), offset=offset,
                                                    n_bytes=size), _slab_name((il, stem), first, last), experts=True)
                      for il, stem, info, offset, size in spans]
        chosen = choose(candidates, bufts, cpu_device(), max(1, self.spec.n_expert_used))
        try:
            extra.copy(gguf, candidates, chosen)
        except BaseException:
            extra.close()
            raise
        return extra

    @property
    def repacked(self) -> tuple[str, ...]:
        """The slabs held in an extra buffer type (``blk.L.ffn_up_exps[first:last]``)."""
        return tuple(self._extra.placed)

    def forward(self, layer: int, x: np.ndarray, expert_ids: np.ndarray) -> np.ndarray:
        """Rows ``x`` [m, n_embd] through experts ``expert_ids`` [m] (model-wide ids): [m, n_embd]."""
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if layer not in self.moe_layers:
            raise InputShapeError(f"this node holds no experts of layer {layer}")
        if x.ndim != 2 or x.shape[1] != self.spec.n_embd or x.shape[0] != ids.size or ids.size == 0:
            raise InputShapeError(f"expert rows of shape {list(x.shape)} with {ids.size} ids do not fit")
        if ids.min() < self.first or ids.max() >= self.last:
            raise InputShapeError(f"expert ids outside [{self.first}, {self.last}) held here")
        m = ids.size
        size = 32
        ctx = ggml.new_context(size + 8, graph_nodes=size)
        galloc = ggml.gallocr_new(self.backend.buffer_type())
        try:
            graph = ggml.new_graph_custom(ctx, size, False)
            x_t = ggml.new_tensor_3d(ctx, ggml.TYPE_F32, self.spec.n_embd, 1, m)
            ids_t = ggml.new_tensor_2d(ctx, ggml.TYPE_I32, 1, m)
            for t in (x_t, ids_t):
                ggml.set_input(t)
            up = ggml.mul_mat_id(ctx, self.tensors[(layer, "ffn_up_exps")], x_t, ids_t)
            gate = ggml.mul_mat_id(ctx, self.tensors[(layer, "ffn_gate_exps")], x_t, ids_t)
            act = ggml.swiglu_split(ctx, gate, up)
            out = ggml.mul_mat_id(ctx, self.tensors[(layer, "ffn_down_exps")], act, ids_t)  # [n_embd, 1, m]
            ggml.set_output(out)
            ggml.build_forward_expand(graph, out)
            if not ggml.gallocr_alloc_graph(galloc, graph):
                raise MemoryError("cannot allocate the experts' graph")
            local = (ids - self.first).astype(np.int32)
            ggml.backend_tensor_set(x_t, x.ctypes.data, 0, x.nbytes)
            ggml.backend_tensor_set(ids_t, local.ctypes.data, 0, local.nbytes)
            self.backend.compute(graph)
            result = np.empty((m, self.spec.n_embd), dtype=np.float32)
            ggml.backend_tensor_get(out, result.ctypes.data, 0, result.nbytes)
        finally:
            ggml.gallocr_free(galloc)
            ggml.free(ctx)
        self.rows_served += m
        return result

    def close(self) -> None:
        for buffer in self._buffers.values():
            ggml.backend_buffer_free(buffer)
        self._buffers = {}
        self._extra.close()
        if self._ctx:
            ggml.free(self._ctx)
            self._ctx = 0
        self.backend.close()

    def __enter__(self) -> "ExpertEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slab_name(span: tuple, first: int, last: int) -> str:
    """The ggml name of a layer's slab of experts [first, last): ``span`` starts (layer, stem, ...)."""
    return f"blk.{span[0]}.{span[1]}[{first}:{last}]"


class LocalExperts:
    """Expert parallelism within one process: a ``remote_experts`` callable for SliceEngine that
    hands each ExpertEngine the rows routed to its experts. The swarm does the same over QUIC
    (swarmctl.trunk); tests and benchmarks use this to compare the two placements directly."""

    def __init__(self, engines: list[ExpertEngine]) -> None:
        self.engines = engines

    def __call__(self, layer: int, x: np.ndarray, selected: np.ndarray) -> np.ndarray:
        out = np.zeros((x.shape[0], selected.shape[1], x.shape[1]), dtype=np.float32)
        for engine in self.engines:
            rows, slots = rows_for(selected, engine.first, engine.last)
            if rows.size:
                out[rows, slots] = engine.forward(layer, x[rows], selected[rows, slots])
        return out
