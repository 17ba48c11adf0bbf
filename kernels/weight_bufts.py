"""Which weights go into the CPU's "extra" buffer types, and the buffers that hold them.

ggml's CPU backend offers buffer types beyond plain memory (``kernels.backend.
cpu_extra_buffer_types``): ``CPU_REPACK`` interleaves a matrix's blocks so its matmuls run faster
(Q4_0, Q4_K, Q8_0, IQ4_NL, ... on AVX2, AVX-512 and NEON CPUs), ``AMX`` lays them out for Intel's
tile unit. A weight copied into such a buffer with ``ggml_backend_tensor_set`` is repacked as it
arrives; the CPU backend then finds the faster kernel through the weight's buffer type, in the
same ``ggml_backend_graph_compute`` the plain weights use (no scheduler needed).

The choice is llama.cpp's loader's (``weight_buft_supported``): for each weight, the operation it
feeds (``mul_mat`` for a matrix, ``mul_mat_id`` for a layer's routed experts) is built on a
metadata-only context with the weight in an empty buffer of each extra type in ggml's order, and
the CPU device's ``supports_op`` decides; the first type that takes it wins, and a weight none
takes stays plain (mapped). Only weights that feed nothing but those operations are candidates:
the repacked layout means nothing to any other operator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import ggml
from .gguf_file import GGUFFile, TensorInfo

# ``SUPPORT_ROWS``: the batch the support check asks about, as llama.cpp's loader does (a type
# whose kernel needs whole row blocks could refuse a one-row op and take a 512-row one).
SUPPORT_ROWS = 512


@dataclass(frozen=True)
class Candidate:
    """A weight that may be repacked: its bytes in the file (or a slab of them), and the op it feeds."""

    info: TensorInfo  # its type, shape and where its bytes are (a slab of experts: a narrowed copy)
    name: str  # the ggml tensor's name
    experts: bool = False  # feeds mul_mat_id (3-D: one matrix per expert), else mul_mat (2-D)


def choose(candidates: list[Candidate], bufts: list[tuple[str, int]], cpu_device: int,
           n_expert_used: int = 1) -> dict[str, tuple[str, int]]:
    """Tensor name → (buffer type name, buffer type) for the candidates an extra buffer type
    takes, the first of ``bufts`` (ggml's order) whose ``supports_op`` says yes; the rest are
    left out (plain). One check per distinct (type, shape, op)."""
    chosen: dict[str, tuple[str, int]] = {}
    verdicts: dict[tuple, tuple[str, int] | None] = {}
    for c in candidates:
        kind = (c.info.ggml_type, c.info.shape, c.experts)
        if kind not in verdicts:
            verdicts[kind] = next((b for b in bufts if _supported(c, b[1], cpu_device, n_expert_used)), None)
        if verdicts[kind] is not None:
            chosen[c.name] = verdicts[kind]
    return chosen


def _supported(c: Candidate, buft: int, cpu_device: int, n_expert_used: int) -> bool:
    shape = c.info.shape
    if len(shape) != (3 if c.experts else 2):
        return False
    ctx = ggml.new_context(8)
    dummy = 0
    try:
        w = _new_tensor(ctx, c.info.ggml_type, shape)
        if c.experts:
            b = ggml.new_tensor_3d(ctx, ggml.TYPE_F32, shape[0], n_expert_used, SUPPORT_ROWS)
            ids = ggml.new_tensor_2d(ctx, ggml.TYPE_I32, n_expert_used, SUPPORT_ROWS)
            op = ggml.mul_mat_id(ctx, w, b, ids)
        else:
            op = ggml.mul_mat(ctx, w, ggml.new_tensor_2d(ctx, ggml.TYPE_F32, shape[0], SUPPORT_ROWS))
        # An empty buffer of the type, so that supports_op sees where the weight would live.
        dummy = ggml.backend_buft_alloc_buffer(buft, 0)
        if not dummy:
            return False
        ggml.tensor_view(w).buffer = dummy
        try:
            return bool(ggml.backend_dev_supports_op(cpu_device, op))
        finally:
            ggml.tensor_view(w).buffer = None
    finally:
        if dummy:
            ggml.backend_buffer_free(dummy)
        ggml.free(ctx)


@dataclass
class ExtraCopies:
    """The repacked copies: one metadata context and one buffer per extra buffer type used.
    ``close`` frees them."""

    tensors: dict[str, int] = field(default_factory=dict)  # name → ggml tensor
    placed: dict[str, str] = field(default_factory=dict)  # name → buffer type name
    _ctxs: list[int] = field(default_factory=list)
    _buffers: list[int] = field(default_factory=list)

    @property
    def n_bytes(self) -> int:
        return sum(ggml.backend_buffer_get_size(b) for b in self._buffers)

    def copy(self, gguf: GGUFFile, candidates: list[Candidate], chosen: dict[str, tuple[str, int]]) -> None:
        """Copy each chosen candidate into a buffer of its type (repacked as it arrives), then
        drop the mapped pages it came from: the copy replaces them."""
        by_buft: dict[tuple[str, int], list[Candidate]] = {}
        for c in candidates:
            if c.name in chosen:
                by_buft.setdefault(chosen[c.name], []).append(c)
        for (buft_name, buft), group in by_buft.items():
            ctx = ggml.new_context(len(group) + 1)
            self._ctxs.append(ctx)
            made = {}
            for c in group:
                made[c.name] = _new_tensor(ctx, c.info.ggml_type, c.info.shape)
                ggml.set_name(made[c.name], c.name.encode())
            buffer = ggml.backend_alloc_ctx_tensors_from_buft(ctx, buft)
            if not buffer:
                raise MemoryError(f"cannot allocate {sum(c.info.n_bytes for c in group) / 1e6:.0f} MB for "
                                  f"the weights ({buft_name})")
            self._buffers.append(buffer)
            ggml.backend_buffer_set_usage(buffer, ggml.BUFFER_USAGE_WEIGHTS)
            for c in group:
                if buft_name == "CPU_REPACK" and not ggml.tensor_view(made[c.name]).extra:
                    raise RuntimeError(f"ggml has no repacked layout for {c.name}")  # ggml would abort on the copy
                ggml.backend_tensor_set(made[c.name], gguf.tensor_address(c.info), 0, c.info.n_bytes)
                gguf.release_pages([c.info])
                self.placed[c.name] = buft_name
            self.tensors.update(made)

    def close(self) -> None:
        for buffer in self._buffers:
            ggml.backend_buffer_free(buffer)
        for ctx in self._ctxs:
            ggml.free(ctx)
        self._buffers, self._ctxs = [], []


def _new_tensor(ctx: int, ggml_type: int, shape: tuple[int, ...]) -> int:
    if len(shape) == 2:
        return ggml.new_tensor_2d(ctx, ggml_type, *shape)
    return ggml.new_tensor_3d(ctx, ggml_type, *shape)
