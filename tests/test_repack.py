"""Repacked weights (issue 13).

The oracle loads llama-cpp-python with plain weight buffers: its default puts the weights the CPU
backend can repack in an "extra" buffer type (CPU_REPACK, or AMX, whose matmul dies with SIGILL
on some Intel CPUs), while the engine computes on plain buffers unless asked to repack. With
``repack=True`` the engine uses ggml's CPU_REPACK buffer type as llama.cpp does, and then its
logits equal llama-cpp-python's default (repacked) path bit for bit.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kernels.backend import REPACK_BUFFER_TYPE, cpu_extra_buffer_types
from kernels.gguf_file import GGUFFile
from kernels.oracle_llama import last_logits, load_llama
from kernels.slice import Placement, SliceEngine
from kernels.spec import SliceSpec
from kernels.tokenizer import Tokenizer
from tests.conftest import N_THREADS, make_oracle, run_split
from harness.oracle import oracle_greedy, oracle_logits
from harness.tiny_models import TinyConfig, write_tiny_model

REPACKED = Placement(kernels="repack")

ROOT = Path(__file__).resolve().parents[1]
# every matrix Q4_0 (a type ggml repacks on AVX2 and NEON CPUs), 8-row multiples throughout
Q4_0_UNTIED = TinyConfig(arch="llama", qtype="Q4_0", tied_output=False, seed=11)
Q4_0_TIED = TinyConfig(arch="llama", qtype="Q4_0", tied_output=True, seed=12)
PROMPTS = ["Hello, my name is", "The weather today", "import numpy as np"]


@pytest.fixture(scope="module")
def q4_0_models(tmp_path_factory, bundled_model) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("repack")
    return {"untied": write_tiny_model(d / "llama-q4_0.gguf", Q4_0_UNTIED, bundled_model),
            "tied": write_tiny_model(d / "llama-q4_0-tied.gguf", Q4_0_TIED, bundled_model)}


@contextmanager
def llama_log():
    """llama.cpp's log lines while the block runs (kernels.tokenizer routes them to logging)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("llama.cpp")
    handler, level = Collect(logging.DEBUG), logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def extra_buffer_names() -> list[str]:
    return sorted(set(cpu_extra_buffer_types()) | {"CPU_REPACK", "AMX", "KLEIDIAI"})


def test_oracle_loads_plain_weight_buffers(q4_0_models):
    with llama_log() as lines:
        llm = make_oracle(q4_0_models["untied"])
    try:
        assert llm.model_params.use_extra_bufts is False
        buffers = [line for line in lines if "model buffer size" in line]
        assert buffers, "llama.cpp's load log was not captured"
        assert all("CPU_Mapped" in line for line in buffers), buffers
        log = "\n".join(lines)
        assert not [name for name in extra_buffer_names() if name in log], buffers
        # a prompt through the quantized matmuls: what died with SIGILL on AMX CPUs
        llm.eval(list(range(100, 140)))
        assert np.isfinite(np.asarray(llm.scores[39])).all()
    finally:
        llm.close()


def test_the_oracle_keeps_routed_experts_where_it_is_told(tiny_model):
    """``load_llama(keep_on_cpu=...)`` is llama.cpp's ``--override-tensor PATTERN=CPU`` (the
    baseline a split member is compared with: benchmarks/bench_split_member.py): llama.cpp says it
    placed exactly the routed expert tensors by the override, and on the CPU the logits are the
    plain oracle's."""
    model = tiny_model("deepseek2-q8_0")
    with llama_log() as lines:
        split = load_llama(model, keep_on_cpu="_exps", n_ctx=64, n_threads=N_THREADS)
    plain = load_llama(model, n_ctx=64, n_threads=N_THREADS)
    try:
        overridden = sorted(line.split()[1] for line in lines if "buffer type overridden" in line)
        with GGUFFile(model) as gguf:
            experts = sorted(name for name in gguf.tensors if "_exps." in name)
        assert experts and overridden == experts, lines
        logits = []
        for llm in (split, plain):
            llm.eval(list(range(100, 112)))
            logits.append(last_logits(llm).copy())
        assert np.abs(logits[0]).max() > 0 and np.array_equal(*logits)
    finally:
        split.close()
        plain.close()


def test_llama_cpp_default_would_repack_here(q4_0_models):
    """The control for the test above: on this CPU llama-cpp-python's default loading uses an
    extra buffer type, so that test fails if the oracle goes back to the default. (Loads only:
    evaluating could die with SIGILL on an AMX CPU.)"""
    if not cpu_extra_buffer_types():
        pytest.skip("this CPU backend offers no extra buffer types: loading is plain either way")
    with llama_log() as lines:
        llm = load_llama(q4_0_models["untied"], repack=True, n_ctx=64)
    llm.close()
    log = "\n".join(lines)
    assert [name for name in cpu_extra_buffer_types() if name in log], [
        line for line in lines if "buffer" in line]


def test_tests_and_benchmarks_build_llama_only_through_load_llama():
    """A full ``Llama`` (weights, not vocab_only) anywhere but kernels/oracle_llama.py would load
    repacked weights by default."""
    call = re.compile(r"\bLlama\(")
    offenders = []
    for folder in ("tests", "benchmarks", "kernels", "swarmctl", "plans", "net"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "kernels" / "oracle_llama.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if call.search(line) and "vocab_only=True" not in line and not line.lstrip().startswith(("#", '"')):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def _needs_cpu_repack() -> None:
    extras = cpu_extra_buffer_types()
    if REPACK_BUFFER_TYPE not in extras:
        pytest.skip("this ggml build has no CPU_REPACK buffer type")


def _greedy(engine: SliceEngine, tokens: list[int], n: int) -> list[int]:
    out: list[int] = []
    logits = engine.forward("g", start_pos=0, tokens=tokens)
    try:
        while len(out) < n:
            out.append(int(np.argmax(logits[-1])))
            logits = engine.forward("g", start_pos=len(tokens) + len(out) - 1, tokens=[out[-1]])
    finally:
        engine.release("g")
    return out


def test_engine_repack_matches_llama_cpp_repacked(q4_0_models):
    _needs_cpu_repack()
    if "AMX" in cpu_extra_buffer_types():
        pytest.skip("llama.cpp's default puts Q4_0 in AMX buffers on this CPU (and can die with SIGILL): "
                    "it is no reference for CPU_REPACK here")
    path = q4_0_models["untied"]
    with SliceEngine.open(path, SliceSpec(0, 4, True, True), n_threads=N_THREADS, max_context=512,
                          placement=REPACKED) as engine:
        if not engine.weights.repacked:
            pytest.skip("ggml has no repacked Q4_0 layout for this CPU (it needs AVX2 or NEON)")
        with GGUFFile(path) as g:
            matrices = {n for n, info in g.tensors.items() if len(info.shape) == 2 and n != "token_embd.weight"}
        assert set(engine.weights.repacked) == matrices  # token_embd feeds get_rows: never repacked
        tokenizer = Tokenizer(path)
        llm = load_llama(path, repack=True, n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                         logits_all=True)
        try:
            for prompt in PROMPTS:
                tokens = tokenizer.encode_prompt(prompt)
                np.testing.assert_array_equal(run_split([engine], tokens), oracle_logits(llm, tokens))
                assert _greedy(engine, tokens, 12) == oracle_greedy(llm, tokens, 12)
        finally:
            llm.close()


def test_repacked_split_equals_repacked_whole(q4_0_models):
    """Cut into slices that each repack their own matrices: the same bits as one slice."""
    _needs_cpu_repack()
    path = q4_0_models["untied"]
    tokens = [10, 200, 3000, 40000, 5, 77, 123]
    with GGUFFile(path) as g:
        whole = SliceEngine(g, SliceSpec(0, 4, True, True), n_threads=N_THREADS, placement=REPACKED)
        parts = [SliceEngine(g, s, n_threads=N_THREADS, placement=REPACKED) for s in
                 (SliceSpec(0, 1, has_embedding=True), SliceSpec(1, 3), SliceSpec(3, 4, has_lm_head=True))]
        try:
            np.testing.assert_array_equal(run_split(parts, tokens), run_split([whole], tokens))
        finally:
            for e in [whole, *parts]:
                e.close()


def test_tied_embedding_is_repacked_only_where_nothing_looks_rows_up(q4_0_models):
    _needs_cpu_repack()
    with GGUFFile(q4_0_models["tied"]) as g:
        with SliceEngine(g, SliceSpec(3, 4, has_lm_head=True), n_threads=N_THREADS, placement=REPACKED) as tail:
            if not tail.weights.repacked:
                pytest.skip("ggml has no repacked Q4_0 layout for this CPU (it needs AVX2 or NEON)")
            assert "token_embd.weight" in tail.weights.repacked  # the LM head only multiplies by it
        with SliceEngine(g, SliceSpec(0, 4, True, True), n_threads=N_THREADS, placement=REPACKED) as whole, \
                SliceEngine(g, SliceSpec(0, 4, True, True), n_threads=N_THREADS) as plain:
            assert "token_embd.weight" not in whole.weights.repacked  # get_rows reads it too
            # the embedding lookup reads the same (mapped) bytes either way
            x = np.asarray(whole.forward("e", start_pos=0, tokens=[42, 43]))
            y = np.asarray(plain.forward("e", start_pos=0, tokens=[42, 43]))
            cos = float((x[-1] * y[-1]).sum() / np.linalg.norm(x[-1]) / np.linalg.norm(y[-1]))
            assert cos > 0.99


def test_repack_changes_nothing_for_q4_1(bundled_model):
    """ggml has no repacked Q4_1 layout: the bundled model's weights stay mapped, bits unchanged."""
    tokens = [1, 504, 3458, 282, 260, 1345]
    with SliceEngine.open(bundled_model, SliceSpec(0, 30, True, True), n_threads=N_THREADS, placement=REPACKED) as a, \
            SliceEngine.open(bundled_model, SliceSpec(0, 30, True, True), n_threads=N_THREADS) as b:
        assert a.weights.repacked == ()
        np.testing.assert_array_equal(run_split([a], tokens), run_split([b], tokens))
