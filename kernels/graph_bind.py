"""A kept graph rebound to other requests' KV caches: one graph serves every batch of its shape.

A graph reaches a request's cache only through views of the cache's tensors: the cells a step
writes (set_rows, and the transposed V's reshape) and the cells it attends (view_4d, then permute
or transpose). ggml gives every view the data address of its root tensor plus an offset, and
both the offset and the strides come from the shape (the cache's capacity, n_kv, the head sizes),
never from which request it is. So pointing a graph's views at another cache of the same capacity
gives exactly the graph a fresh build for that cache gives: the same operators over the same
strides, other addresses. A rebind is a few struct writes per view; a build is thousands of ctypes
calls and a new allocator, and batches whose set of requests keeps changing paid it on most steps.

Only a graph one backend runs whole is rebound (kernels.slice decides): the CPU backend reads a
view's address when it computes, while a scheduler that splits a graph between devices keeps its
own copies of tensors that cross, made for the caches it was placed with.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from . import ggml
from .kv_cache import KVCache

K_TENSOR, V_TENSOR = 0, 1


@dataclass
class _View:
    """One graph tensor that views a cache tensor."""

    tensor: ggml.TensorStruct
    kind: int  # K_TENSOR or V_TENSOR: which of the layer's cache tensors it views
    layer: int
    offset: int  # bytes from the root tensor's data (ggml's view_offs)
    src_is_root: bool  # its src[0] is the cache tensor itself (a first view, not a view of a view)


def _cache_tensors(cache: KVCache):
    """(kind, layer, tensor) for each of a cache's K and V tensors."""
    for kind, tensors in ((K_TENSOR, cache.k), (V_TENSOR, cache.v)):
        for il, t in tensors.items():
            yield kind, il, t


class KVViews:
    """The views of each request slot's cache in one graph, recorded while it is built, and the
    cache allocation each slot is bound to now."""

    def __init__(self, caches: list[KVCache | None]) -> None:
        self._views: list[list[_View]] = [[] for _ in caches]
        self._bound = [c.serial if c is not None else 0 for c in caches]
        # a cache tensor's address → (slot, kind, layer), for recording
        self._roots: dict[int, tuple[int, int, int]] = {}
        for slot, cache in enumerate(caches):
            if cache is None:
                continue
            for kind, il, t in _cache_tensors(cache):
                self._roots[t] = (slot, kind, il)

    def record(self, tensor: int) -> int:
        """Note ``tensor`` (a view of some slot's cache, or of a view of it) and return it."""
        t = ggml.tensor_view(tensor)
        root = self._roots.get(t.view_src)
        if root is None:
            raise ValueError(f"{ggml.get_name(tensor).decode()} is not a view of a cache tensor in this graph")
        slot, kind, il = root
        self._views[slot].append(_View(t, kind, il, t.view_offs, t.src[0] == t.view_src))
        return tensor

    @property
    def n_views(self) -> int:
        return sum(len(v) for v in self._views)

    def recorded(self) -> set[int]:
        """Addresses of the recorded tensors (the tests compare them with a scan of the graph)."""
        return {ctypes.addressof(v.tensor) for views in self._views for v in views}

    def bind(self, caches: list[KVCache | None]) -> int:
        """Point each slot's views at ``caches[slot]`` (same capacity as the one it was built
        with: the graph's shape says so). Slots already bound to that allocation are left alone.
        Returns how many slots were rebound."""
        rebound = 0
        for slot, cache in enumerate(caches):
            if cache is None or self._bound[slot] == cache.serial:
                continue
            roots = {}
            for kind, il, t in _cache_tensors(cache):
                s = ggml.tensor_view(t)
                roots[kind, il] = (t, s.data, s.buffer)
            for v in self._views[slot]:
                root, data, buffer = roots[v.kind, v.layer]
                v.tensor.view_src = root
                v.tensor.data = data + v.offset
                v.tensor.buffer = buffer
                if v.src_is_root:
                    v.tensor.src[0] = root
            self._bound[slot] = cache.serial
            rebound += 1
        return rebound


def cache_views_in(graph: int, caches: list[KVCache | None]) -> set[int]:
    """Every node of ``graph`` whose data lies in one of ``caches``' tensors (a slow scan: what
    ``KVViews`` must have recorded, for the tests)."""
    roots = {t for c in caches if c is not None for _, _, t in _cache_tensors(c)}
    found = set()
    for i in range(ggml.graph_n_nodes(graph)):
        node = ggml.graph_node(graph, i)
        if ggml.tensor_view(node).view_src in roots:
            found.add(node)
    return found
