"""Shared, expensive fixtures: the bundled model, the oracle, tiny models. Built once per session."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from kernels.slice import SliceEngine
from swarmctl.models import default_model_path
from tests import markers
from tests.tiny_models import TinyConfig, write_tiny_model

N_THREADS = 2


# --- marks: swarm, netns, slow (tests/markers.py); `-m "not slow"` runs the fast tests alone ---

_process_watch = markers.ProcessWatch()
sys.addaudithook(_process_watch.audit)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(items):
    for item in items:
        markers.mark(item)


def pytest_runtest_setup(item):
    _process_watch.start(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    complaint = _process_watch.complaint()
    _process_watch.stop()
    if complaint is not None:
        pytest.fail(complaint, pytrace=False)
    return result


@pytest.fixture(autouse=True)
def _swarmctl_home(tmp_path, monkeypatch):
    """Every test gets its own SWARMCTL_HOME, so no test reads or writes the user's state."""
    home = tmp_path / "swarmctl-home"
    monkeypatch.setenv("SWARMCTL_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    return default_model_path()


def make_oracle(path: Path):
    from kernels.oracle_llama import load_llama

    # flash_attn=False is llama-cpp-python's default: F16 KV cache, transposed V. Our graphs mirror it.
    # Plain weight buffers (no repacking), as the engine computes; repacked AMX matmuls also die
    # with SIGILL on some CPUs (issue 13).
    return load_llama(path, n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS, logits_all=True)


@pytest.fixture(scope="session")
def oracle(bundled_model):
    return make_oracle(bundled_model)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


TINY_CONFIGS = {
    "llama-f32": TinyConfig(arch="llama", qtype="F32"),
    "llama-q8_0": TinyConfig(arch="llama", qtype="Q8_0", seed=1),
    "qwen2-f32": TinyConfig(arch="qwen2", qtype="F32", tied_output=False, seed=2),
    "qwen2-q4_1": TinyConfig(arch="qwen2", qtype="Q4_1", tied_output=False, seed=3),
    "qwen3-q8_0": TinyConfig(arch="qwen3", qtype="Q8_0", seed=4),
    "qwen3-f32": TinyConfig(arch="qwen3", qtype="F32", n_head=2, n_head_kv=1, seed=5),
    "llama-moe-q8_0": TinyConfig(arch="llama", qtype="Q8_0", n_expert=8, n_expert_used=2, seed=6),
    "qwen3moe-q8_0": TinyConfig(arch="qwen3moe", qtype="Q8_0", n_expert=8, n_expert_used=2, seed=7),
    # deepseek2 (DeepSeek-V2/V3, Kimi K2): latent attention, dense leading layers, shared experts
    "deepseek2-f32": TinyConfig(arch="deepseek2", qtype="F32", n_expert=8, n_expert_used=2, n_dense_lead=2,
                                seed=11),  # V2: Q rank, softmax gating, weights not normalised
    "deepseek2-q8_0": TinyConfig(arch="deepseek2", qtype="Q8_0", q_rank=0, n_expert=8, n_expert_used=2,
                                 sigmoid_gating=True, n_groups=4, n_group_used=2, weights_scale=2.5, yarn=True,
                                 seed=12),  # V2-Lite's plain attn_q with V3's routing and YaRN
    "deepseek2-q4_1": TinyConfig(arch="deepseek2", qtype="Q4_1", n_expert=8, n_expert_used=2, sigmoid_gating=True,
                                 n_groups=4, n_group_used=2, seed=13),  # V3 / Kimi K2
    "deepseek2-unsplit-q8_0": TinyConfig(arch="deepseek2", qtype="Q8_0", n_expert=8, n_expert_used=2,
                                         unsplit_kv_b=True, seed=14),  # an older conversion's attn_kv_b
}


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir, bundled_model):
    """tiny_model(name) → path of that tiny GGUF, written on first use."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = write_tiny_model(tiny_model_dir / f"{name}.gguf", TINY_CONFIGS[name], bundled_model)
        return cache[name]

    return get


def run_split(engines: Sequence[SliceEngine], tokens: Sequence[int], outputs: str = "all") -> np.ndarray:
    """One prefill through consecutive slices; returns the last slice's output. Frees the request."""
    rid = secrets.token_bytes(16)
    try:
        x = None
        for i, engine in enumerate(engines):
            if i == 0:
                x = engine.forward(rid, start_pos=0, tokens=list(tokens), outputs=outputs)
            else:
                x = engine.forward(rid, start_pos=0, hidden=x, outputs=outputs)
        return x
    finally:
        for engine in engines:
            engine.release(rid)


def decode_logits(engines: Sequence[SliceEngine], tokens: Sequence[int], n_prefill: int = 1) -> np.ndarray:
    """Prefill ``n_prefill`` tokens through consecutive slices, then decode the rest one at a
    time; the last row of each step (logits where the last slice has the LM head). Frees the
    request."""
    rid, rows = secrets.token_bytes(16), []
    try:
        for pos, n in [(0, n_prefill)] + [(p, 1) for p in range(n_prefill, len(tokens))]:
            x = None
            for engine in engines:
                x = engine.forward(rid, start_pos=pos, tokens=list(tokens[pos:pos + n])) if x is None else \
                    engine.forward(rid, start_pos=pos, hidden=x)
            rows.append(x[-1])
        return np.array(rows)
    finally:
        for engine in engines:
            engine.release(rid)
