"""Slices on a real GPU backend, against llama-cpp-python on the same backend and GGUF.

These run where the installed llama-cpp-python has a GPU backend and a device answers: the
environment `scripts/gpu-env.sh vulkan` builds here, with ``GGML_VK_VISIBLE_DEVICES=0`` so that
ggml-vulkan takes Mesa's lavapipe (a Vulkan driver that runs on the CPU, so its memory is a
device buffer like a GPU's, not the GGUF's map). Elsewhere every test is skipped with one line.

    scripts/gpu-env.sh vulkan && GGML_VK_VISIBLE_DEVICES=0 .venv-gpu/bin/python -m pytest -q tests/test_gpu_devices.py
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kernels.devices import available_devices
from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from tests.conftest import decode_logits, run_split
from tests.oracle import judge_logits

GPUS = [d for d in available_devices() if not d.is_cpu]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not GPUS, reason="no GPU backend in this llama-cpp-python build (scripts/gpu-env.sh builds one)")]

PROMPTS = ["The capital of France is"]
N_GENERATE = 6
# On lavapipe these crash the process (a segfault inside ggml-vulkan's graph compute, after a run
# of requests whose KV caches and compute buffers were freed and made anew); not understood yet,
# see issue 16's note. Each passes its first steps, and the single-step tests below pass.
LAVAPIPE_CRASHES = pytest.mark.skipif(bool(GPUS) and "llvmpipe" in GPUS[0].description,
                                      reason="segfaults in ggml-vulkan on lavapipe (issue 16's note); for a real GPU")


@pytest.fixture(scope="module")
def device():
    return GPUS[0]


@pytest.fixture(scope="module")
def gguf(bundled_model):
    with GGUFFile(bundled_model) as f:
        yield f


ORACLE_SCRIPT = """
import json, sys
import numpy as np
from kernels.oracle_llama import load_llama
from tests.oracle import oracle_greedy, oracle_logits
path, prompt, n, gpu_layers, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = load_llama(path, n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, n_gpu_layers=gpu_layers)
ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
theirs = oracle_greedy(llm, ids, n)
np.savez(out, ids=np.array(ids), theirs=np.array(theirs), logits=oracle_logits(llm, ids + theirs))
"""


def oracle_run(model, prompt: str, n: int, on_device: bool, tmp_path) -> tuple[list[int], list[int], np.ndarray]:
    """llama-cpp-python's greedy tokens and teacher-forced logits, in a process of its own: with
    its own Vulkan instance in this process beside ours, ggml-vulkan crashed (lavapipe)."""
    import subprocess
    import sys

    out = tmp_path / "oracle.npz"
    subprocess.run([sys.executable, "-c", ORACLE_SCRIPT, str(model), prompt, str(n), "-1" if on_device else "0",
                    str(out)], check=True, capture_output=True, timeout=600, cwd=Path(__file__).parent.parent)
    data = np.load(out)
    return [int(t) for t in data["ids"]], [int(t) for t in data["theirs"]], data["logits"]


def _engines(gguf, device, cuts: list[int]) -> list[SliceEngine]:
    n = ModelSpec.from_gguf(gguf).n_layer
    bounds = [0, *cuts, n]
    return [SliceEngine(gguf, SliceSpec(a, b, has_embedding=a == 0, has_lm_head=b == n), n_threads=2,
                        max_context=512, device=device) for a, b in zip(bounds, bounds[1:])]


def _greedy(engines: list[SliceEngine], prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(run_split(engines, tokens, outputs="last")[-1])))
    return tokens[len(prompt):]


# Logits for every position come one decode step at a time (tests/conftest.decode_logits), not
# from one prefill that keeps every row: on lavapipe the LM head over 10 or more rows at once
# corrupted the heap with exact-size compute buffers (llama.cpp reserves its buffer for 512 tokens,
# which would hide an out-of-bounds write). `ask` and `serve` only ever keep the last row.


@pytest.fixture(scope="module")
def on_device(gguf, device):
    whole, sliced = _engines(gguf, device, []), _engines(gguf, device, [4, 15, 26])
    yield whole, sliced
    for engine in whole + sliced:
        engine.close()


def test_weights_live_on_the_device(on_device, device):
    whole, _ = on_device
    (engine,) = whole
    assert engine.backend.name == device.label
    assert set(engine.weights.uploaded) == set(engine.weights.tensor_names)
    assert engine.weights.copied_bytes >= engine.weights.n_bytes


@LAVAPIPE_CRASHES
@pytest.mark.parametrize("prompt", PROMPTS)
def test_device_slices_follow_the_oracle_rule(on_device, bundled_model, prompt, tmp_path):
    """As four slices on the device, against llama-cpp-python on the same device."""
    _, sliced = on_device
    ids, theirs, ref = oracle_run(bundled_model, prompt, N_GENERATE, True, tmp_path)
    ours = _greedy(sliced, ids, N_GENERATE)
    verdict = judge_logits(ids, ours, theirs, decode_logits(sliced, ids + theirs), ref)
    assert verdict.passes, verdict.explain()


@LAVAPIPE_CRASHES
def test_whole_model_on_the_device_follows_the_oracle_rule(on_device, bundled_model, tmp_path):
    (engine,) = on_device[0]
    ids, theirs, ref = oracle_run(bundled_model, PROMPTS[0], N_GENERATE, True, tmp_path)
    ours = _greedy([engine], ids, N_GENERATE)
    verdict = judge_logits(ids, ours, theirs, decode_logits([engine], ids + theirs), ref)
    assert verdict.passes, verdict.explain()


def test_one_slice_equals_four_slices_on_the_device(on_device):
    whole, sliced = on_device
    tokens = [1, 504, 3458, 282, 4649, 314, 3217, 30, 378, 1326, 282, 2463, 314]
    a, b = decode_logits(whole, tokens), decode_logits(sliced, tokens)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cosine.min() >= 0.9999 and np.array_equal(a.argmax(1), b.argmax(1))
    if not np.array_equal(a, b):  # said, not failed: the backend may pick kernels by shape
        print(f"one vs four slices on {whole[0].backend.name}: max |diff| {np.abs(a - b).max():.3g}")


def test_partial_offload_follows_all_on_device(gguf, device, on_device):
    """A --gpu-memory that holds only 3 of the trunk slice's 11 layers: those 3 on the device, the
    other 8 and their KV cache on the CPU, one scheduler running the split graph; its output
    against the same slice all on the device."""
    spec = ModelSpec.from_gguf(gguf)
    budget = sum(spec.layer_bytes[4:7]) + 3 * 2 * 2 * spec.n_embd_kv * 512 + 1
    trunk = SliceSpec(4, 15)
    partial = SliceEngine(gguf, trunk, n_threads=2, max_context=512, device=device, gpu_memory=budget)
    full = SliceEngine(gguf, trunk, n_threads=2, max_context=512, device=device)
    head = on_device[1][0]
    try:
        assert partial.backend.device_layers == range(4, 7)
        assert partial.placement() == f"{device.label} for layers [4, 7), cpu for [7, 15)"
        assert full.backend.device_layers is None
        tokens = [1, 504, 3458, 282, 4649, 314, 3217, 30]
        x = run_split([head], tokens, outputs="all")
        rid = b"partial"
        outs = []
        for engine in (partial, full):
            outs.append(engine.forward(rid, start_pos=0, hidden=x, outputs="all"))
            engine.release(rid)
        a, b = outs
        # Hidden states (not logits), 8 of 11 layers on the CPU's kernels instead of the device's:
        # close, not equal (lavapipe: min cosine 0.99969 over the 8 rows, seen).
        cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert cosine.min() >= 0.999, cosine
    finally:
        partial.close()
        full.close()


@LAVAPIPE_CRASHES
def test_device_and_cpu_slices_mix(gguf, device, bundled_model, tmp_path):
    """Stages on the device and on the CPU in one chain, as a swarm with one GPU trunk and one CPU
    trunk runs it: the oracle rule against llama-cpp-python on the CPU."""
    n = ModelSpec.from_gguf(gguf).n_layer
    specs = [SliceSpec(0, 4, has_embedding=True), SliceSpec(4, 15), SliceSpec(15, 26), SliceSpec(26, n, has_lm_head=True)]
    devices = [None, device, None, None]
    engines = [SliceEngine(gguf, s, n_threads=2, max_context=512, device=d) for s, d in zip(specs, devices)]
    try:
        ids, theirs, ref = oracle_run(bundled_model, PROMPTS[0], N_GENERATE, False, tmp_path)
        ours = _greedy(engines, ids, N_GENERATE)
        verdict = judge_logits(ids, ours, theirs, decode_logits(engines, ids + theirs), ref)
        assert verdict.passes, verdict.explain()
    finally:
        for engine in engines:
            engine.close()


def test_environment_names_the_device():
    """A reminder in the output of which device these results are for."""
    print(f"devices: {', '.join(f'{d.label} ({d.description})' for d in available_devices())}; "
          f"GGML_VK_VISIBLE_DEVICES={os.environ.get('GGML_VK_VISIBLE_DEVICES')}")
    assert GPUS
