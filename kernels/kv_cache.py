"""Per-request key/value cache for the layers of one slice.

Layout mirrors llama.cpp's cache, so that attention runs the same ggml operations on the same
data layout and gives the same bits:

    K per layer: [k_width, capacity] f16, one row per cell (cell i holds position i)
    V per layer: [capacity, v_width] f16, transposed: one row per channel (``attention plain``)
                 [v_width, capacity] f16, one row per cell, as K (``attention flash``: what
                 ggml_flash_attn_ext reads, llama.cpp's cache with flash attention on)

Latent attention (deepseek2's MLA) keeps no V (``v_width`` 0): a K row is the token's compressed
latent plus its RoPE part, and attention reads the values from the latent, as llama.cpp does.

Capacity grows in steps of ``KV_CELL_PAD`` cells up to the request's context bound; growing copies
the filled cells into the larger tensors (a handful of times per request, never per token).
"""

from __future__ import annotations

import itertools

import numpy as np

from . import ggml
from .backend import Backend
from .errors import ContextOverflowError
from .spec import KV_CELL_PAD

# Every allocation of cache tensors gets a number no other allocation in the process gets (a
# tensor's address can be reused once freed): a kept graph bound to one knows when to rebind.
_ALLOCATIONS = itertools.count(1)

# How attention is computed (a swarm-wide choice: the two give different bits). plain: llama.cpp
# without flash attention (KQ matmul, soft_max_ext, KQV matmul over a transposed V); flash:
# ggml_flash_attn_ext, as llama.cpp with flash attention on (kernels.graph, GraphBuilder._attend).
ATTENTION = ("plain", "flash")


def pad_cells(n: int) -> int:
    return -(-n // KV_CELL_PAD) * KV_CELL_PAD


def grown_capacity(capacity: int, n_tokens: int, max_tokens: int) -> int:
    """Cells a cache of ``capacity`` cells has once it made room for positions [0, n_tokens):
    padded steps, doubling, never past the context bound. (Admission control predicts with it.)"""
    if n_tokens <= capacity:
        return capacity
    return min(pad_cells(max_tokens), max(pad_cells(n_tokens), 2 * capacity))


class KVCache:
    def __init__(self, backend: Backend, layers: range, widths: tuple[int, int], max_tokens: int,
                 flash: bool = False) -> None:
        """``widths``: (K, V) values per cell per layer (ModelSpec.kv_widths); V 0: no V tensors.
        ``flash``: V laid out as K, one row per cell, for flash attention (else transposed)."""
        self.backend = backend
        self.layers = layers
        self.k_width, self.v_width = widths
        self.v_trans = not flash
        self.max_tokens = max_tokens  # the context bound: positions [0, max_tokens)
        self.n_filled = 0  # positions [0, n_filled) hold valid keys and values
        self.capacity = 0  # cells allocated per layer (a multiple of KV_CELL_PAD)
        self.k: dict[int, int] = {}  # layer → tensor
        self.v: dict[int, int] = {}
        self._allocations: list[tuple[int, int]] = []  # (ggml context, backend buffer) per place
        self.generation = 0  # bumps on every reallocation; graphs built on older tensors are stale
        self.serial = 0  # this allocation's number, unique in the process (kernels.graph_bind)

    @property
    def n_bytes(self) -> int:
        return 2 * (self.k_width + self.v_width) * self.capacity * len(self.layers)

    def reserve(self, n_tokens: int) -> None:
        """Make room for positions [0, n_tokens), or raise if that exceeds the context bound."""
        if n_tokens > self.max_tokens:
            raise ContextOverflowError(
                f"request needs {n_tokens} positions but the context length is {self.max_tokens}"
            )
        if n_tokens <= self.capacity:
            return
        self._reallocate(grown_capacity(self.capacity, n_tokens, self.max_tokens))

    def _reallocate(self, capacity: int) -> None:
        old = (self._allocations, self.k, self.v, self.capacity)
        # One buffer per place the layers live: all on one device, or split between a GPU and the
        # CPU (partial offload: kernels.backend).
        groups: dict[int, list[int]] = {}
        for il in self.layers:
            groups.setdefault(self.backend.layer_buffer_type(il), []).append(il)
        allocations: list[tuple[int, int]] = []
        k: dict[int, int] = {}
        v: dict[int, int] = {}
        try:
            for buft, layers in groups.items():
                ctx = ggml.new_context(2 * len(layers) + 1)
                allocations.append((ctx, 0))
                for il in layers:
                    k[il] = ggml.new_tensor_2d(ctx, ggml.TYPE_F16, self.k_width, capacity)
                    ggml.set_name(k[il], f"cache_k_l{il}".encode())
                    if self.v_width:
                        v_shape = (capacity, self.v_width) if self.v_trans else (self.v_width, capacity)
                        v[il] = ggml.new_tensor_2d(ctx, ggml.TYPE_F16, *v_shape)
                        ggml.set_name(v[il], f"cache_v_l{il}".encode())
                buffer = ggml.backend_alloc_ctx_tensors_from_buft(ctx, buft)
                if not buffer:
                    raise MemoryError(f"cannot allocate the KV cache ({ggml.backend_buft_name(buft).decode()})")
                ggml.backend_buffer_clear(buffer, 0)  # zeroed: masked cells must not be NaN
                allocations[-1] = (ctx, buffer)
        except BaseException:
            for ctx, buffer in allocations:
                _free(ctx, buffer)
            raise
        old_allocations, old_k, old_v, old_capacity = old
        if self.n_filled:
            self._copy_cells(old_k, old_v, old_capacity, k, v, capacity)
        self._allocations, self.k, self.v, self.capacity = allocations, k, v, capacity
        self.generation += 1
        self.serial = next(_ALLOCATIONS)
        for ctx, buffer in old_allocations:
            _free(ctx, buffer)

    def _copy_cells(self, old_k: dict, old_v: dict, old_capacity: int, new_k: dict, new_v: dict,
                    new_capacity: int) -> None:
        n = self.n_filled
        for il in self.layers:
            _copy_rows(old_k[il], new_k[il], n * self.k_width * 2)
            if not self.v_width:
                continue
            if not self.v_trans:  # one row per cell, as K
                _copy_rows(old_v[il], new_v[il], n * self.v_width * 2)
                continue
            v_old = np.empty((self.v_width, old_capacity), dtype=np.float16)
            ggml.backend_tensor_get(old_v[il], v_old.ctypes.data, 0, v_old.nbytes)
            v_new = np.zeros((self.v_width, new_capacity), dtype=np.float16)
            v_new[:, :n] = v_old[:, :n]
            ggml.backend_tensor_set(new_v[il], v_new.ctypes.data, 0, v_new.nbytes)

    def close(self) -> None:
        for ctx, buffer in self._allocations:
            _free(ctx, buffer)
        self._allocations = []
        self.k, self.v = {}, {}
        self.capacity = self.n_filled = 0


def _copy_rows(old: int, new: int, n_bytes: int) -> None:
    """The first ``n_bytes`` of a cache tensor whose rows are cells into a larger one."""
    data = np.empty(n_bytes, dtype=np.uint8)
    ggml.backend_tensor_get(old, data.ctypes.data, 0, n_bytes)
    ggml.backend_tensor_set(new, data.ctypes.data, 0, n_bytes)


def _free(ctx: int, buffer: int) -> None:
    if buffer:
        ggml.backend_buffer_free(buffer)
    if ctx:
        ggml.free(ctx)
