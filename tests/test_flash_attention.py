"""Flash attention in the engine (``Placement(attention="flash")``), against llama.cpp's own.

The oracle is llama-cpp-python loaded with ``flash_attn=True`` (plain weight buffers, as the
engine's ``kernels plain``): our whole-model logits and greedy tokens equal its, bit for bit, on
the bundled model (llama, Q4_1) and tiny qwen2 / qwen3 (grouped heads) / qwen3moe models, and a
deepseek2 of an older conversion (unsplit ``attn_kv_b``: ordinary multi-head attention); every
decode step's logits too past a cache's growth and at 512 cells, where ggml's CPU kernel splits a
one-row step's cells between the threads. Flash attention changes the bits (the plain engine
differs from this oracle), so both halves can fail. A batch and a speculative check (rows one at
a time) give each request the bits it gets alone, as under plain attention. Latent attention
(deepseek2's MLA, a cache without V) stays plain.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.oracle import oracle_greedy, oracle_logits
from kernels.gguf_file import GGUFFile
from kernels.oracle_llama import last_logits, load_llama
from kernels.slice import Placement, SliceEngine, Step
from kernels.spec import ModelSpec, SliceSpec
from kernels.tokenizer import Tokenizer
from tests.conftest import N_THREADS, run_split
from tests.test_repack import _greedy

FLASH = Placement(attention="flash")
PROMPTS = ["The three primary colours are", "import numpy as np"]
TINY = ["qwen2-q4_1", "qwen3-f32", "qwen3moe-q8_0", "deepseek2-unsplit-q8_0"]


def _whole(gguf: GGUFFile, placement: Placement = FLASH, max_context: int = 512) -> SliceEngine:
    n_layer = ModelSpec.from_gguf(gguf).n_layer
    return SliceEngine(gguf, SliceSpec(0, n_layer, True, True), n_threads=N_THREADS, max_context=max_context,
                       placement=placement)


def _flash_oracle(path: Path, n_ctx: int = 512, **kwargs):
    return load_llama(path, n_ctx=n_ctx, n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=True, **kwargs)


def _model(name: str, bundled_model: Path, tiny_model) -> Path:
    return bundled_model if name == "bundled" else tiny_model(name)


@pytest.mark.parametrize("name", ["bundled", *TINY])
def test_flash_equals_llama_cpp_with_flash_attention(name, bundled_model, tiny_model):
    path = _model(name, bundled_model, tiny_model)
    llm = _flash_oracle(path, logits_all=True)
    tokenizer = Tokenizer(path)
    with GGUFFile(path) as gguf, _whole(gguf) as engine:
        assert engine.flash
        for prompt in PROMPTS:
            tokens = tokenizer.encode_prompt(prompt)
            np.testing.assert_array_equal(run_split([engine], tokens), oracle_logits(llm, tokens))
            assert _greedy(engine, tokens, 12) == oracle_greedy(llm, tokens, 12)
    llm.close()


def test_plain_attention_differs_from_the_flash_oracle(bundled_model):
    """The choice matters to the bits: what makes it a swarm-wide setting."""
    llm = _flash_oracle(bundled_model, logits_all=True)
    tokens = Tokenizer(bundled_model).encode_prompt(PROMPTS[0])
    with GGUFFile(bundled_model) as gguf, _whole(gguf, Placement()) as engine:
        assert not engine.flash
        assert not np.array_equal(run_split([engine], tokens), oracle_logits(llm, tokens))
    llm.close()


@pytest.mark.slow  # the bundled model past a cache growth: 4 s
def test_flash_decode_steps_past_a_cache_growth(bundled_model):
    """A 250-token prompt (256 cells), then one-token steps to position 270: the cache grows to
    512 cells (its untransposed V copied over) and every step attends over 512, where ggml splits
    the cells between the threads; each step's logits are llama.cpp's at the same threads."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(100, 40000, 250)]
    llm = _flash_oracle(bundled_model, n_ctx=1024, n_batch=512)
    with GGUFFile(bundled_model) as gguf, _whole(gguf, max_context=1024) as engine:
        ours = engine.forward("r", start_pos=0, tokens=prompt)[-1]
        llm.reset()
        llm.eval(prompt)
        np.testing.assert_array_equal(ours, last_logits(llm))
        tokens = list(prompt)
        for _ in range(20):
            tokens.append(int(np.argmax(ours)))
            ours = engine.forward("r", start_pos=len(tokens) - 1, tokens=tokens[-1:])[-1]
            llm.eval(tokens[-1:])
            np.testing.assert_array_equal(ours, last_logits(llm), err_msg=f"position {len(tokens) - 1}")
        assert engine.kv_bytes_of("r") == 512 * engine.kv_bytes_per_position
    llm.close()


def test_flash_batch_and_speculative_rows_get_the_bits_of_single_steps(bundled_model):
    a = Tokenizer(bundled_model).encode_prompt(PROMPTS[0])
    b = Tokenizer(bundled_model).encode_prompt(PROMPTS[1])
    with GGUFFile(bundled_model) as gguf, _whole(gguf) as engine:
        alone = [engine.forward(rid, start_pos=0, tokens=t) for rid, t in (("a", a), ("b", b))]
        for rid in ("a", "b"):
            engine.release(rid)
        together = engine.forward_batch([Step("a", 0, a), Step("b", 0, b)])
        for x, y in zip(alone, together):
            np.testing.assert_array_equal(x, y)
        # four one-token steps against one checked step of the same four rows
        steps = [int(np.argmax(together[0][-1]))] + [11, 22, 33]
        singles = [engine.forward("a", start_pos=len(a) + i, tokens=[t])[-1] for i, t in enumerate(steps)]
        checked = engine.forward_batch([Step("a", len(a), steps, outputs="all", rewind=True, verify=True)])[0]
        np.testing.assert_array_equal(np.array(singles), checked)


def test_latent_attention_stays_plain(tiny_model):
    with GGUFFile(tiny_model("deepseek2-q8_0")) as gguf, _whole(gguf) as flash, _whole(gguf, Placement()) as plain:
        assert not flash.flash
        tokens = [5, 77, 123, 999, 4]
        np.testing.assert_array_equal(run_split([flash], tokens), run_split([plain], tokens))


def test_an_unknown_attention_is_refused(tiny_model):
    with GGUFFile(tiny_model("qwen2-q4_1")) as gguf, pytest.raises(ValueError, match="attention must be one of"):
        _whole(gguf, Placement(attention="fast"))
