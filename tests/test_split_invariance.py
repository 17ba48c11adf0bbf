"""Logits are bit-identical however the model is cut: 1, 2, 3 or 5 slices at random cut points.

Same kernels, same steps (a prefill and a few decode steps), so nothing less than identical bits
is acceptable.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from tests.conftest import N_THREADS

PROMPT = [504, 1296, 3003, 14797, 359, 2382, 28, 2654, 284]  # "The three primary colours are red, green and"
DECODE = [1789, 30, 378]  # " language. The" (any tokens will do: the same ones go to every split)


def slices_at(cuts: list[int], n_layer: int) -> list[SliceSpec]:
    bounds = [0, *cuts, n_layer]
    return [SliceSpec(a, b, has_embedding=(a == 0), has_lm_head=(b == n_layer)) for a, b in zip(bounds, bounds[1:])]


def run_steps(engines: list[SliceEngine]) -> list[np.ndarray]:
    """Prefill, then decode steps; the logits of every step."""
    rid = secrets.token_bytes(16)
    out, pos, new = [], 0, PROMPT
    try:
        for step in range(1 + len(DECODE)):
            x = engines[0].forward(rid, start_pos=pos, tokens=new)
            for engine in engines[1:]:
                x = engine.forward(rid, start_pos=pos, hidden=x)
            out.append(x)
            pos += len(new)
            new = DECODE[step:step + 1]
        return out
    finally:
        for engine in engines:
            engine.release(rid)


@pytest.fixture(scope="module")
def gguf(bundled_model):
    with GGUFFile(bundled_model) as f:
        yield f


@pytest.fixture(scope="module")
def whole_model_steps(gguf):
    spec = ModelSpec.from_gguf(gguf)
    with SliceEngine(gguf, SliceSpec(0, spec.n_layer, True, True), n_threads=N_THREADS, max_context=64) as e:
        return run_steps([e])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_cuts_give_identical_logits(gguf, whole_model_steps, data):
    n_layer = ModelSpec.from_gguf(gguf).n_layer
    n_slices = data.draw(st.sampled_from([2, 3, 5]), label="slices")
    cuts = sorted(data.draw(st.lists(st.integers(1, n_layer - 1), min_size=n_slices - 1,
                                     max_size=n_slices - 1, unique=True), label="cuts"))
    engines = [SliceEngine(gguf, s, n_threads=N_THREADS, max_context=64) for s in slices_at(cuts, n_layer)]
    try:
        for want, got in zip(whole_model_steps, run_steps(engines)):
            np.testing.assert_array_equal(got, want)
    finally:
        for e in engines:
            e.close()


def test_each_slice_maps_only_its_own_tensors(gguf):
    spec = ModelSpec.from_gguf(gguf)
    trunk = SliceEngine(gguf, SliceSpec(10, 20), n_threads=1)
    head = SliceEngine(gguf, SliceSpec(0, 4, has_embedding=True), n_threads=1)
    try:
        assert all(name.startswith("blk.") and 10 <= int(name.split(".")[1]) < 20
                   for name in trunk.weights.tensor_names)
        assert trunk.weights.n_bytes == sum(spec.layer_bytes[10:20])
        assert "token_embd.weight" in head.weights.tensor_names
        assert "output_norm.weight" not in head.weights.tensor_names
        assert head.weights.n_bytes == spec.embedding_bytes + sum(spec.layer_bytes[:4])
    finally:
        trunk.close()
        head.close()
