"""Placed compute graphs, kept for reuse: one cache class for the slice engine's whole-slice
graphs and its per-layer segments (remote experts).

A placed graph owns its allocator (ggml's gallocr): gallocr never re-places a tensor that already
has data, so one allocator shared by graphs that take turns would leave an earlier graph pointing
into a buffer it has since reallocated. A graph split between a GPU and the CPU owns a scheduler
instead, for the same reason (a scheduler holds one graph's placement until it is reset). Placing
frees what it made when the allocation fails, and dropping a graph frees both, so no path leaks
an allocator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from . import ggml
from .graph import SliceGraph

if TYPE_CHECKING:
    from .backend import Backend
    from .graph_inputs import InputHost

K = TypeVar("K", bound=Hashable)


@dataclass
class PlacedGraph:
    """A graph ready to run: built, its tensors placed by its own allocator (or scheduler), its
    host inputs made."""

    graph: SliceGraph
    host: InputHost
    backend: Backend
    galloc: int = 0  # ggml_gallocr_t: one backend runs the whole graph
    sched: int = 0  # ggml_backend_sched_t: the graph is split between a device and the CPU

    def compute(self) -> None:
        if self.sched:
            status = ggml.backend_sched_graph_compute(self.sched, self.graph.graph)
            if status != ggml.STATUS_SUCCESS:
                raise RuntimeError(f"ggml graph compute failed (status {status})")
        else:
            self.backend.compute(self.graph.graph)

    def free(self) -> None:
        if self.sched:
            ggml.backend_sched_free(self.sched)
        if self.galloc:
            self.backend.release_gallocr(self.galloc)
        self.graph.close()


def place(graph: SliceGraph, host: InputHost, backend: Backend) -> PlacedGraph:
    """``graph`` placed in memory by an allocator of its own, or by a scheduler of its own when
    the backend splits it between a device and the CPU. If it does not fit, what was made and the
    graph are freed and MemoryError raised: nothing is left behind."""
    try:
        sched = backend.scheduler_for(graph.graph)
    except BaseException:
        graph.close()
        raise
    if sched:
        if not ggml.backend_sched_alloc_graph(sched, graph.graph):
            ggml.backend_sched_free(sched)
            graph.close()
            raise MemoryError("cannot allocate the compute graph")
        return PlacedGraph(graph, host, backend, sched=sched)
    galloc = backend.new_gallocr()
    if not galloc or not ggml.gallocr_alloc_graph(galloc, graph.graph):
        if galloc:
            backend.release_gallocr(galloc)
        graph.close()
        raise MemoryError("cannot allocate the compute graph")
    return PlacedGraph(graph, host, backend, galloc=galloc)


class GraphCache(Generic[K]):
    """Placed graphs by key, the least recently used dropped once there are more than ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[K, PlacedGraph] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> PlacedGraph | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: K, entry: PlacedGraph) -> None:
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            self._entries.pop(next(iter(self._entries))).free()

    def placed(self) -> list[PlacedGraph]:
        return list(self._entries.values())

    def drop_where(self, doomed: Callable[[K], bool]) -> None:
        for key in [k for k in self._entries if doomed(k)]:
            self._entries.pop(key).free()

    def clear(self) -> None:
        self.drop_where(lambda _: True)
