"""Tiny random-weight GGUFs (llama, qwen2, qwen3; F32 and quantized) against llama-cpp-python,
plus a numpy float32 reference of one block on F32 weights."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec
import asyncio

from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split
from tests.conftest import N_THREADS, TINY_CONFIGS, make_oracle, run_split
from harness.oracle import judge, oracle_greedy, oracle_logits

PROMPTS = ["Hello, my name is", "The weather today", "import numpy as np"]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_model_matches_oracle(tiny_model, name):
    path = tiny_model(name)
    llm = make_oracle(path)
    client = Asker(path, 1, n_threads=N_THREADS, max_context=512)
    trunk = InprocTrunk(client.gguf, u_split(client.spec.n_layer, 1, 2).trunk, n_threads=N_THREADS, max_context=512)
    engines = [client.head, *trunk.engines, client.tail]
    try:
        for prompt in PROMPTS:
            tokens = client.tokenizer.encode_prompt(prompt)
            ours = asyncio.run(generate_all(client, tokens, trunk, max_tokens=16,
                                            sampling=SamplingParams(temperature=0))).tokens
            theirs = oracle_greedy(llm, tokens, 16)
            verdict = judge(tokens, ours, theirs, lambda t: run_split(engines, t), llm)
            assert verdict.passes, f"{name} / {prompt!r}: {verdict.explain()}"
    finally:
        trunk.close()
        client.close()
        llm.close()


@pytest.mark.parametrize("name", ["qwen2-q4_1", "qwen3-q8_0", "llama-moe-q8_0", "qwen3moe-q8_0", "deepseek2-q8_0",
                                  "deepseek2-q4_1"])
def test_tiny_model_split_invariance(tiny_model, name):
    path = tiny_model(name)
    with GGUFFile(path) as gguf:
        whole = SliceEngine(gguf, SliceSpec(0, 4, True, True), n_threads=N_THREADS)
        parts = [SliceEngine(gguf, s, n_threads=N_THREADS) for s in
                 (SliceSpec(0, 1, has_embedding=True), SliceSpec(1, 3), SliceSpec(3, 4, has_lm_head=True))]
        try:
            tokens = [10, 200, 3000, 40000, 5]
            np.testing.assert_array_equal(run_split(parts, tokens), run_split([whole], tokens))
        finally:
            for e in [whole, *parts]:
                e.close()


@pytest.mark.parametrize("name, kv_row", [("deepseek2-f32", 32 + 16), ("deepseek2-q8_0", 32 + 16),
                                          ("deepseek2-q4_1", 32 + 16), ("deepseek2-unsplit-q8_0", 4 * (48 + 32))])
def test_deepseek2_logits_are_llama_cpps_bit_for_bit(tiny_model, name, kv_row):
    """Beyond the oracle rule: latent attention, group routing, shared experts and YaRN mirror
    llama.cpp's graph op for op, so a prefill's logits are its exact bits (measured: max |diff| 0)."""
    path = tiny_model(name)
    llm = make_oracle(path)
    try:
        with GGUFFile(path) as gguf, SliceEngine(gguf, SliceSpec(0, 4, True, True), n_threads=N_THREADS) as engine:
            tokens = [1, 504, 3000, 200, 17, 900, 33]
            np.testing.assert_array_equal(run_split([engine], tokens), oracle_logits(llm, tokens))
            # the cache holds each token's latent + RoPE part (32 + 16 f16 values) per layer, no V; the
            # unsplit form 4 heads of K (48) and V (32)
            engine.forward(b"k" * 16, start_pos=0, tokens=tokens)
            assert engine.kv_bytes == 256 * kv_row * 2 * 4  # one padded block of 256 cells, 4 layers
            engine.release(b"k" * 16)
    finally:
        llm.close()


# --- numpy float32 reference of one llama block ---------------------------------------------

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_norm(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """llama's RoPE (ggml mode 0): rotate adjacent pairs (2i, 2i+1). x: [n, heads, head_dim]."""
    d = x.shape[-1]
    theta = pos[:, None].astype(np.float64) * base ** (-np.arange(0, d, 2) / d)  # [n, d/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out.astype(np.float32)


def reference_block(x: np.ndarray, weights: dict[str, np.ndarray], spec: ModelSpec) -> np.ndarray:
    """One llama block for a prefill at positions 0..n-1. K, V and the attention probabilities
    are rounded to f16 where ggml stores or multiplies them in f16 (the F16 KV cache)."""
    n = x.shape[0]
    h = _rms_norm(x, weights["attn_norm"], spec.norm_eps)
    q = (h @ weights["wq"].T).reshape(n, spec.n_head, spec.head_dim)
    k = (h @ weights["wk"].T).reshape(n, spec.n_head_kv, spec.head_dim)
    v = (h @ weights["wv"].T).reshape(n, spec.n_head_kv, spec.head_dim)
    pos = np.arange(n)
    q, k, v = _rope_norm(q, pos, spec.rope.freq_base), _f16(_rope_norm(k, pos, spec.rope.freq_base)), _f16(v)
    group = spec.n_head // spec.n_head_kv
    out = np.zeros((n, spec.n_head, spec.head_dim), dtype=np.float32)
    causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for hd in range(spec.n_head):
        kv_head = hd // group
        scores = _f16(q[:, hd]) @ k[:, kv_head].T * spec.attention_scale + causal
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, hd] = _f16(p) @ v[:, kv_head]
    attn = out.reshape(n, -1) @ weights["wo"].T
    ffn_inp = attn + x
    h = _rms_norm(ffn_inp, weights["ffn_norm"], spec.norm_eps)
    gate, up = h @ weights["ffn_gate"].T, h @ weights["ffn_up"].T
    act = gate / (1.0 + np.exp(-gate)) * up
    return act @ weights["ffn_down"].T + ffn_inp


def test_numpy_reference_block_agrees_with_ggml(tiny_model):
    path = tiny_model("llama-f32")
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                 "ffn_norm": "ffn_norm", "ffn_gate": "ffn_gate", "ffn_up": "ffn_up", "ffn_down": "ffn_down"}
        weights = {}
        for field, stem in names.items():
            info = gguf.tensors[f"blk.2.{stem}.weight"]
            weights[field] = np.frombuffer(gguf.tensor_bytes(info), dtype=np.float32).reshape(info.shape[::-1])
        x = np.random.default_rng(3).standard_normal((7, spec.n_embd)).astype(np.float32)
        with SliceEngine(gguf, SliceSpec(2, 3), n_threads=N_THREADS) as engine:
            got = engine.forward(secrets.token_bytes(16), start_pos=0, hidden=x)
        want = reference_block(x.astype(np.float64), {k: v.astype(np.float64) for k, v in weights.items()}, spec)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
        # and the comparison can fail: a block with a wrong weight is far off
        weights["ffn_down"] = weights["ffn_down"] * 1.01
        off = reference_block(x.astype(np.float64), {k: v.astype(np.float64) for k, v in weights.items()}, spec)
        assert np.abs(off - got).max() > 1e-2


def test_oracle_rule_catches_a_different_model(tiny_model):
    """The rule has teeth: another model's tokens and logits do not pass as the oracle's."""
    llm = make_oracle(tiny_model("llama-f32"))
    client = Asker(tiny_model("llama-q8_0"), 2, n_threads=N_THREADS, max_context=512)
    try:
        tokens = client.tokenizer.encode_prompt(PROMPTS[0])
        ours = asyncio.run(generate_all(client, tokens, None, max_tokens=16,
                                        sampling=SamplingParams(temperature=0))).tokens
        verdict = judge(tokens, ours, oracle_greedy(llm, tokens, 16),
                        lambda t: run_split([client.head, client.tail], t), llm)
        assert not verdict.passes
    finally:
        client.close()
        llm.close()
