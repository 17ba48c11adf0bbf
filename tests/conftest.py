"""Shared, expensive fixtures: the bundled model, the oracle, tiny models. Built once per session."""

from __future__ import annotations

import compileall
import os
import secrets
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from harness.tiny_models import TINY_CONFIGS, write_tiny_model
from kernels.threads import THREADS_ENV, usable_cores
from kernels.slice import SliceEngine
from swarmctl.model_files.models import default_model_path
from tests import markers

# One compute thread in this process and, through $SWARMCTL_THREADS, in every process a test starts
# without --threads. A local swarm is three or four such processes on this machine's cores; with
# every one taking every core, their ggml threads wait at barriers for one another: the 64-request
# test of test_pipelining.py took 107 s of CPU in 59 s at two threads, 55 s in 45 s at one.
N_THREADS = 1
os.environ.setdefault(THREADS_ENV, str(N_THREADS))

# `python -m pytest -q -n auto` (README) runs the tests in worker processes, a test module's tests
# all in one worker (pyproject's --dist loadfile), where they share its module fixtures.
MAX_WORKERS = 4  # each worker holds a model or two and starts local swarms of 3-4 processes


def pytest_xdist_auto_num_workers(config):
    return min(usable_cores(), MAX_WORKERS)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once, in the process that starts the workers
        # Every process a test starts imports the project's modules. Where bytecode is not written
        # (PYTHONDONTWRITEBYTECODE) each would compile them again, some 0.2 s of CPU a process;
        # compiled here once, they are read.
        root = Path(__file__).resolve().parent.parent
        for package in ("swarmctl", "kernels", "net", "plans", "harness", "tests", "benchmarks"):
            compileall.compile_dir(root / package, quiet=2, workers=1)


# --- marks: swarm, netns, slow (tests/markers.py); `-m "not slow"` runs the fast tests alone ---

_process_watch = markers.ProcessWatch()
sys.addaudithook(_process_watch.audit)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        markers.mark(item)
    markers.leave_out_heavy(config, items)
    markers.long_modules_first(items)


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
