"""A kept graph rebound to whichever requests a batch holds (kernels.graph_bind): the bits of a
fresh build for those requests, and far fewer builds when the set of requests keeps changing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kernels.gguf_file import GGUFFile
from kernels.graph import GraphShape, RequestShape, build_slice_graph
from kernels.graph_bind import cache_views_in
from kernels.kv_cache import KVCache, pad_cells
from kernels.slice import Placement, SliceEngine, Step
from kernels.spec import ModelSpec, SliceSpec
from tests.conftest import N_THREADS

MODELS = [("bundled", "plain"), ("bundled", "flash"), ("qwen3-q8_0", "plain"), ("deepseek2-q4_1", "plain")]


def _path(name: str, bundled_model, tiny_model):
    return bundled_model if name == "bundled" else tiny_model(name)


@pytest.mark.parametrize("model,attention", MODELS)
def test_every_view_of_a_cache_is_recorded(bundled_model, tiny_model, model, attention):
    """What a rebind moves is every node that reads or writes a cache: a scan of the graph finds
    no other (a view made without recording would keep pointing at the first request's cells)."""
    with GGUFFile(_path(model, bundled_model, tiny_model)) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        with SliceEngine(gguf, SliceSpec(0, spec.n_layer, True, True), n_threads=N_THREADS,
                         placement=Placement(attention=attention)) as engine:
            caches = [KVCache(engine.backend, engine.slice.layers, spec.kv_widths, 512, flash=engine.flash)
                      for _ in range(3)]
            try:
                for c in caches:
                    c.reserve(40)
                requests = (RequestShape(1, pad_cells(20), 1, 0, kv_cells=caches[0].capacity),
                            RequestShape(3, pad_cells(30), 1, 0, rowwise=True, kv_cells=caches[1].capacity),
                            RequestShape(5, pad_cells(5), 5, 0, kv_cells=caches[2].capacity))
                graph = build_slice_graph(spec, engine.slice, engine.weights, caches,
                                          GraphShape(requests, (), flash=engine.flash))
                try:
                    found = cache_views_in(graph.graph, caches)
                    assert found and graph.kv_views.recorded() == found
                finally:
                    graph.close()
            finally:
                for c in caches:
                    c.close()


def _input(spec: ModelSpec, seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, min(spec.n_vocab, 40000), n)]


def _run(engine: SliceEngine, spec: ModelSpec, seed: int) -> list[np.ndarray]:
    """Batches of a changing set of requests (1 to 4 of 6, shuffled; requests leave and new ones
    join with prompts), every request's logits in the order they came."""
    rng = random.Random(seed)
    live = {f"r{i}".encode(): 0 for i in range(6)}
    fresh = iter(f"n{i}".encode() for i in range(100))
    outs = []
    for tick in range(40):
        batch = rng.sample(sorted(live), rng.choice((1, 2, 3, 4)))
        steps = [Step(rid, live[rid], tokens=_input(spec, tick * 10 + k, 1 if live[rid] else 3 + k))
                 for k, rid in enumerate(batch)]
        outs += engine.forward_batch(steps)
        for step in steps:
            live[step.key] += len(step.tokens)
        if tick % 9 == 8:  # one leaves, one joins
            gone = rng.choice(sorted(live))
            engine.release(gone)
            del live[gone]
            live[next(fresh)] = 0
    return outs


@pytest.mark.parametrize("model,attention", MODELS)
def test_rebound_graphs_give_the_bits_of_fresh_builds(bundled_model, tiny_model, model, attention):
    with GGUFFile(_path(model, bundled_model, tiny_model)) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        whole = SliceSpec(0, spec.n_layer, True, True)
        placement = Placement(attention=attention)
        with SliceEngine(gguf, whole, n_threads=N_THREADS, placement=placement) as engine:
            rebound = _run(engine, spec, 3)
            stats = engine.stats
        # the reference: graphs kept by the requests they were built for (how an engine whose
        # backend splits graphs between devices keeps them), so each request set builds its own
        with SliceEngine(gguf, whole, n_threads=N_THREADS, placement=placement) as engine:
            engine.rebind_graphs = False
            fresh = _run(engine, spec, 3)
            assert engine.stats.graph_rebinds == 0 and engine.stats.graph_builds > stats.graph_builds
    assert len(rebound) == len(fresh)
    for i, (got, want) in enumerate(zip(rebound, fresh)):
        np.testing.assert_array_equal(got, want, err_msg=f"{model} {attention} step {i}")
    assert stats.graph_rebinds > 0
    assert stats.graph_builds < stats.calls / 2  # shapes recur; request sets rarely do
