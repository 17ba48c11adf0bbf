"""Split execution of the bundled model against llama-cpp-python (the oracle) on the same GGUF.

Mirrored llama.cpp choices (see kernels/graph.py): F16 KV cache with transposed V (llama-cpp-python
runs without flash attention by default), attended KV length padded to 256 cells, the KQ product
accumulated in F32, fused soft_max_ext and swiglu_split, and on the last layer only the rows whose
logits are wanted. With these, logits come out bit-identical, not merely close.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine
import asyncio

from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split
from tests.conftest import N_THREADS, run_split
from harness.oracle import judge, oracle_greedy, oracle_logits

PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Alice Johnson was born on 14 March 1987 in",
    "Translate to French: I would like a cup of coffee.",
    "The quick brown fox",
    "1, 1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def client(bundled_model):
    """head 4 / trunk 11 + 11 / tail 4, as `swarmctl ask --transport inproc` runs it."""
    c = Asker(bundled_model, 4, n_threads=N_THREADS, max_context=512)
    split = u_split(c.spec.n_layer, 4, 2)
    assert [(s.start, s.stop) for s in split.trunk] == [(4, 15), (15, 26)]
    trunk = InprocTrunk(c.gguf, split.trunk, n_threads=N_THREADS, max_context=512)
    yield c, trunk
    trunk.close()
    c.close()


def split_logits(client, tokens: list[int]) -> np.ndarray:
    c, trunk = client
    return run_split([c.head, *trunk.engines, c.tail], tokens)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_split_matches_oracle(client, oracle, prompt):
    c, trunk = client
    tokens = c.tokenizer.encode_prompt(prompt)
    assert tokens == oracle.tokenize(prompt.encode(), add_bos=False, special=True) or tokens[0] == oracle.token_bos()
    ours = asyncio.run(generate_all(c, tokens, trunk, max_tokens=32, sampling=SamplingParams(temperature=0))).tokens
    theirs = oracle_greedy(oracle, tokens, 32)
    verdict = judge(tokens, ours, theirs, lambda t: split_logits(client, t), oracle)
    assert verdict.passes, verdict.explain()


def test_split_logits_bit_identical_to_oracle(client, oracle):
    """Stronger than the rule, and what the mirroring buys: identical bits on a whole prompt."""
    tokens = client[0].tokenizer.encode_prompt(PROMPTS[0] + " red, green and blue. Mixing them gives")
    np.testing.assert_array_equal(split_logits(client, tokens), oracle_logits(oracle, tokens))


def test_decode_across_kv_growth_matches_oracle(bundled_model, oracle):
    """A 250-token prefill then decode steps past cell 256: our cache grows (256 → 512 cells) and
    the attended length re-pads, yet every step's logits equal llama.cpp's running the same steps."""
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(100, 40000, size=262)]
    oracle.reset()
    oracle.eval(tokens[:250])
    for t in tokens[250:]:
        oracle.eval([t])
    ref = np.array(oracle.scores[:262], dtype=np.float32)
    with SliceEngine.open(bundled_model, _whole(), n_threads=N_THREADS, max_context=512) as engine:
        first = engine.forward("r", start_pos=0, tokens=tokens[:250])
        np.testing.assert_array_equal(first[0], ref[249])
        for pos in range(250, 262):
            step = engine.forward("r", start_pos=pos, tokens=[tokens[pos]])
            np.testing.assert_array_equal(step[0], ref[pos], err_msg=f"position {pos}")
        assert engine.stats.graph_builds >= 3  # prefill, decode at n_kv=256, decode at n_kv=512


def _whole():
    from kernels.spec import SliceSpec

    return SliceSpec(0, 30, has_embedding=True, has_lm_head=True)
