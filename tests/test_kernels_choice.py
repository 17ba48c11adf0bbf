"""The swarm's `kernels` choice in the engine: plain weights, or the CPU's repacked buffer types.

The oracle for each choice is llama.cpp's own load on the same GGUF and CPU: ``plain`` gives
exactly llama-cpp-python's logits and greedy tokens with ``use_extra_bufts=False``, ``repack``
exactly its default (repacked) load, on the bundled model (Q4_1), a tiny Q4_0 llama and a tiny Q4_0
mixture of experts whose routed experts are repacked too. Where the CPU offers no extra buffer
types the repacked half says so and skips; where it offers AMX it skips too: llama.cpp's default
then puts weights in AMX buffers (our ``amx`` choice, not ``repack``), and its AMX matmul has
crashed this process on AMX Xeons (kernels/backend.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.oracle import oracle_greedy, oracle_logits
from harness.tiny_models import TinyConfig, write_tiny_model
from kernels import ggml
from kernels.backend import AMX_BUFFER_TYPE, KERNELS, cpu_device, cpu_extra_buffer_types, describe_kernels, \
    kernel_buffer_types
from kernels.experts import ExpertEngine, LocalExperts
from kernels.gguf_file import GGUFFile, TensorInfo
from kernels.oracle_llama import load_llama
from kernels.slice import Placement, SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from kernels.tokenizer import Tokenizer
from kernels.weight_bufts import Candidate, choose
from tests.conftest import N_THREADS, run_split
from tests.test_repack import _greedy  # (greedy decode on one engine, as there)

MOE_Q4_0 = TinyConfig(arch="qwen3moe", qtype="Q4_0", n_expert=8, n_expert_used=2, tied_output=False, seed=21)
LLAMA_Q4_0 = TinyConfig(arch="llama", qtype="Q4_0", tied_output=False, seed=22)
PROMPTS = ["The three primary colours are", "import numpy as np"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, bundled_model) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kernels")
    return {"bundled": bundled_model, "llama-q4_0": write_tiny_model(d / "llama-q4_0.gguf", LLAMA_Q4_0, bundled_model),
            "moe-q4_0": write_tiny_model(d / "qwen3moe-q4_0.gguf", MOE_Q4_0, bundled_model)}


def _needs_repack() -> None:
    offered = cpu_extra_buffer_types()
    if not offered:
        pytest.skip("this CPU backend offers no extra buffer types: repack is plain here")
    if AMX_BUFFER_TYPE in offered:
        pytest.skip("llama.cpp's default load uses AMX on this CPU (the `amx` choice), and its AMX matmul has "
                    "crashed on AMX Xeons: not run here")


def _same_as_llama_cpp(path: Path, kernels: str) -> dict[str, str]:
    """Assert that our whole-model logits and 12 greedy tokens under ``kernels`` equal llama.cpp's
    own load (plain: use_extra_bufts=False; repack: its default), bit for bit; returns what the
    engine repacked (tensor name → buffer type)."""
    with GGUFFile(path) as gguf:
        n_layer = ModelSpec.from_gguf(gguf).n_layer
        engine = SliceEngine(gguf, SliceSpec(0, n_layer, True, True), n_threads=N_THREADS, max_context=512,
                             placement=Placement(kernels=kernels))
        llm = load_llama(path, repack=kernels != "plain", n_ctx=512, n_threads=N_THREADS,
                         n_threads_batch=N_THREADS, logits_all=True)
        try:
            tokenizer = Tokenizer(path)
            for prompt in PROMPTS:
                tokens = tokenizer.encode_prompt(prompt)
                np.testing.assert_array_equal(run_split([engine], tokens), oracle_logits(llm, tokens))
                assert _greedy(engine, tokens, 12) == oracle_greedy(llm, tokens, 12)
            return engine.weights.repacked_into
        finally:
            llm.close()
            engine.close()


@pytest.mark.parametrize("name", ["bundled", "llama-q4_0", "moe-q4_0"])
def test_plain_kernels_equal_llama_cpp_without_extra_buffers(models, name):
    assert _same_as_llama_cpp(models[name], "plain") == {}


@pytest.mark.parametrize("name", ["bundled", "llama-q4_0", "moe-q4_0"])
def test_repack_kernels_equal_llama_cpp_default_load(models, name):
    _needs_repack()
    placed = _same_as_llama_cpp(models[name], "repack")
    with GGUFFile(models[name]) as gguf:
        types = {info.type_name for n, info in gguf.tensors.items() if len(info.shape) >= 2 and n != "token_embd.weight"}
        experts = {n for n in gguf.tensors if "_exps." in n}
    if name == "bundled":
        # (Q4_1 has no CPU_REPACK layout: nothing moves, on this CPU as in llama.cpp's own default)
        assert types == {"Q4_1"} or placed, types
    else:
        assert placed and set(placed.values()) <= {n for n, _ in kernel_buffer_types("repack")}
        if name == "moe-q4_0":
            assert experts and experts <= set(placed), "the routed experts are repacked too"


def test_experts_held_apart_are_repacked_as_the_stage_would(models):
    """A stage whose experts live on two expert nodes (repacked slabs) gives the bits of the same
    stage holding them itself (repacked whole)."""
    _needs_repack()
    tokens = [10, 200, 3000, 40000, 5, 77, 123]
    with GGUFFile(models["moe-q4_0"]) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        trunk = SliceSpec(1, spec.n_layer - 1)
        head = SliceEngine(gguf, SliceSpec(0, 1, has_embedding=True), n_threads=N_THREADS)
        whole = SliceEngine(gguf, trunk, n_threads=N_THREADS, placement=Placement(kernels="repack"))
        half = spec.n_expert // 2
        holders = [ExpertEngine(gguf, trunk.layers, a, b, n_threads=N_THREADS, kernels="repack")
                   for a, b in ((0, half), (half, spec.n_expert))]
        apart = SliceEngine(gguf, trunk, n_threads=N_THREADS, remote_experts=LocalExperts(holders),
                            placement=Placement(kernels="repack"))
        try:
            assert all(len(h.repacked) == 3 * len(trunk.layers) for h in holders), [h.repacked for h in holders]
            x = head.forward(b"r", start_pos=0, tokens=tokens)
            a = whole.forward(b"r", start_pos=0, hidden=x)
            b = apart.forward(b"r", start_pos=0, hidden=x)
            assert np.abs(a).max() > 0
            np.testing.assert_array_equal(a, b)
        finally:
            for e in (head, whole, apart, *holders):
                e.close()


def test_each_weight_falls_back_to_plain_where_ggml_refuses_it():
    """The choice is per tensor, by ggml's own supports_op: a Q4_0 matrix whose rows come in
    eights is taken (AVX2 / NEON layouts), one with 12 rows, or a Q4_1 one, stays plain."""
    bufts = kernel_buffer_types("repack")
    if not bufts:
        pytest.skip("this CPU backend offers no extra buffer types: repack is plain here")

    def cand(name: str, qtype: int, rows: int) -> Candidate:
        return Candidate(TensorInfo(name, (64, rows), qtype, 0, 0), name)

    chosen = choose([cand("eights", ggml.TYPE_Q4_0, 16), cand("twelve", ggml.TYPE_Q4_0, 12),
                     cand("q4_1", ggml.TYPE_Q4_1, 16)], bufts, cpu_device())
    assert "twelve" not in chosen and "q4_1" not in chosen
    assert "eights" in chosen  # (skip above: a CPU with extra types has a Q4_0 layout: AVX2 or NEON)


def test_kernel_choices_and_what_they_fall_back_to():
    assert KERNELS == ("plain", "repack", "amx") and kernel_buffer_types("plain") == []
    assert AMX_BUFFER_TYPE not in {n for n, _ in kernel_buffer_types("repack")}
    with pytest.raises(ValueError, match="kernels must be one of plain, repack, amx"):
        kernel_buffer_types("fast")
    for k in KERNELS:
        line = describe_kernels(k)
        assert line.startswith(f"kernels {k}:") and "\n" not in line
    if not cpu_extra_buffer_types():
        assert "weights stay plain" in describe_kernels("repack")
