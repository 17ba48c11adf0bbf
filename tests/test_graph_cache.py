"""The slice engine's graph cache: each placed graph owns its allocator, and no path leaks one
(a failed allocation, an eviction, a release, a clear)."""

from __future__ import annotations

import pytest

from kernels import graph_cache
from kernels.graph_cache import GraphCache, place


class OneBackend:
    """Where the graphs go: one CPU backend that runs them whole (no scheduler), its allocators
    made and freed through ggml (counted by the fixture below)."""

    @staticmethod
    def scheduler_for(graph) -> None:
        return None

    @staticmethod
    def new_gallocr() -> int:
        return graph_cache.ggml.gallocr_new(0)

    @staticmethod
    def release_gallocr(galloc: int) -> None:
        graph_cache.ggml.gallocr_free(galloc)


class FakeGraph:
    def __init__(self) -> None:
        self.graph = object()
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def allocators(monkeypatch):
    """ggml's gallocr, counted: which allocators exist now."""
    live: set[int] = set()
    made = iter(range(1, 10**6))
    fits = {"ok": True}

    def new(buffer_type):
        galloc = next(made)
        live.add(galloc)
        return galloc

    def free(galloc):
        live.remove(galloc)  # a double free raises KeyError

    monkeypatch.setattr(graph_cache.ggml, "gallocr_new", new)
    monkeypatch.setattr(graph_cache.ggml, "gallocr_free", free)
    monkeypatch.setattr(graph_cache.ggml, "gallocr_alloc_graph", lambda galloc, graph: fits["ok"])
    return live, fits


def test_a_graph_that_does_not_fit_frees_its_allocator_and_itself(allocators):
    live, fits = allocators
    fits["ok"] = False
    graph = FakeGraph()
    with pytest.raises(MemoryError):
        place(graph, None, OneBackend())
    assert live == set() and graph.closed


def test_evicted_dropped_and_cleared_graphs_free_their_allocators(allocators):
    live, _ = allocators
    cache: GraphCache[str] = GraphCache(capacity=2)
    graphs = {name: FakeGraph() for name in "abcd"}
    for name in "abc":
        cache.put(name, place(graphs[name], None, OneBackend()))
    assert len(cache) == 2 and graphs["a"].closed and len(live) == 2  # the least recently used went
    assert cache.get("b") is not None  # b is now the most recent...
    cache.put("d", place(graphs["d"], None, OneBackend()))
    assert graphs["c"].closed and not graphs["b"].closed  # ...so c went
    cache.drop_where(lambda key: key == "b")
    assert graphs["b"].closed and len(live) == 1
    cache.clear()
    assert live == set() and all(g.closed for g in graphs.values())


@pytest.mark.parametrize("remote", [False, True], ids=["whole slice", "remote-expert segments"])
def test_an_engine_whose_graph_does_not_fit_keeps_no_allocator(tmp_path, monkeypatch, remote):
    """Through the engine, with ggml's real allocator: a graph that does not fit raises MemoryError
    and leaves no allocator behind (the segment path once leaked one); the next step runs."""
    import numpy as np

    from kernels.slice import SliceEngine
    from kernels.spec import SliceSpec
    from swarmctl.model_files.models import default_model_path
    from harness.tiny_models import TinyConfig, write_tiny_model

    real_new, real_free, real_alloc = graph_cache.ggml.gallocr_new, graph_cache.ggml.gallocr_free, \
        graph_cache.ggml.gallocr_alloc_graph
    live: set[int] = set()
    fits = {"ok": False}

    def new(buffer_type):
        galloc = real_new(buffer_type)
        live.add(galloc)
        return galloc

    def free(galloc):
        live.remove(galloc)
        real_free(galloc)

    monkeypatch.setattr(graph_cache.ggml, "gallocr_new", new)
    monkeypatch.setattr(graph_cache.ggml, "gallocr_free", free)
    monkeypatch.setattr(graph_cache.ggml, "gallocr_alloc_graph", lambda g, graph: fits["ok"] and real_alloc(g, graph))
    config = TinyConfig(n_expert=4, n_expert_used=2) if remote else TinyConfig()
    path = write_tiny_model(tmp_path / "tiny.gguf", config, default_model_path())
    if remote:
        slice_spec, step = SliceSpec(1, 3), {"hidden": np.ones((3, config.n_embd), np.float32)}
        kwargs = {"remote_experts": lambda il, rows, selected: np.zeros((*selected.shape, config.n_embd), np.float32)}
    else:
        slice_spec, step, kwargs = SliceSpec(0, 4, True, True), {"tokens": [1, 2, 3]}, {}
    with SliceEngine.open(path, slice_spec, n_threads=1, **kwargs) as engine:
        with pytest.raises(MemoryError, match="cannot allocate the compute graph"):
            engine.forward(b"r", start_pos=0, **step)
        assert live == set()
        fits["ok"] = True
        engine.forward(b"r", start_pos=0, **step)
        assert live  # the step's graphs are kept for the next
    assert live == set()
