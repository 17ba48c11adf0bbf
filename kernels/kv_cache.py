"""Per-request key/value cache for the layers of one slice.

Layout mirrors llama.cpp's cache without flash attention, so that attention runs the same ggml
operations on the same data layout and gives the same bits:

    K per layer: [k_width, capacity] f16, one row per cell (cell i holds position i)
    V per layer: [capacity, v_width] f16, transposed: one row per channel

Latent attention (deepseek2's MLA) keeps no V (``v_width`` 0): a K row is the token's compressed
latent plus its RoPE part, and attention reads the values from the latent, as llama.cpp does.

Capacity grows in steps of ``KV_CELL_PAD`` cells up to the request's context bound; growing copies
the filled cells into the larger tensors (a handful of times per request, never per token).
"""

from __future__ import annotations

import numpy as np

from . import ggml
from .backend import Backend
from .errors import ContextOverflowError
from .spec import KV_CELL_PAD


def pad_cells(n: int) -> int:
    return -(-n // KV_CELL_PAD) * KV_CELL_PAD


def grown_capacity(capacity: int, n_tokens: int, max_tokens: int) -> int:
    """Cells a cache of ``capacity`` cells has once it made room for positions [0, n_tokens):
    padded steps, doubling, never past the context bound. (Admission control predicts with it.)"""
    if n_tokens <= capacity:
        return capacity
    return min(pad_cells(max_tokens), max(pad_cells(n_tokens), 2 * capacity))


class KVCache:
    def __init__(self, backend: Backend, layers: range, widths: tuple[int, int], max_tokens: int) -> None:
        """``widths``: (K, V) values per cell per layer (ModelSpec.kv_widths); V 0: no V tensors."""
        self.backend = backend
        self.layers = layers
        self.k_width, self.v_width = widths
        self.max_tokens = max_tokens  # the context bound: positions [0, max_tokens)
        self.n_filled = 0  # positions [0, n_filled) hold valid keys and values
        self.capacity = 0  # cells allocated per layer (a multiple of KV_CELL_PAD)
        self.k: dict[int, int] = {}  # layer → tensor
        self.v: dict[int, int] = {}
        self._allocations: list[tuple[int, int]] = []  # (ggml context, backend buffer) per place
        self.generation = 0  # bumps on every reallocation; graphs built on older tensors are stale

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
                        v[il] = ggml.new_tensor_2d(ctx, ggml.TYPE_F16, capacity, self.v_width)
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
        for ctx, buffer in old_allocations:
            _free(ctx, buffer)

    def _copy_cells(self, old_k: dict, old_v: dict, old_capacity: int, new_k: dict, new_v: dict,
                    new_capacity: int) -> None:
        n = self.n_filled
        row = self.k_width * 2
        for il in self.layers:
            k_bytes = np.empty(n * row, dtype=np.uint8)
            ggml.backend_tensor_get(old_k[il], k_bytes.ctypes.data, 0, k_bytes.nbytes)
            ggml.backend_tensor_set(new_k[il], k_bytes.ctypes.data, 0, k_bytes.nbytes)
            if not self.v_width:
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


def _free(ctx: int, buffer: int) -> None:
    if buffer:
        ggml.backend_buffer_free(buffer)
    if ctx:
        ggml.free(ctx)
