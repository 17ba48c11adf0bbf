"""The sampler: greedy, seeded temperature sampling, top-k and top-p limits."""

from __future__ import annotations

import numpy as np

from kernels.sampling import Sampler, SamplingParams


def logits_fixture() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal(1000).astype(np.float32) * 3


def test_greedy_is_argmax():
    logits = logits_fixture()
    assert Sampler(SamplingParams(temperature=0))(logits) == int(np.argmax(logits))


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = logits_fixture()
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    seq_a = [a(logits) for _ in range(50)]
    assert seq_a == [b(logits) for _ in range(50)]
    c = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, seed=43))
    assert seq_a != [c(logits) for _ in range(50)]


def test_top_k_never_leaves_the_k_likeliest():
    logits = logits_fixture()
    top5 = set(np.argsort(-logits)[:5].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, top_p=1.0, seed=1))
    drawn = {s(logits) for _ in range(300)}
    assert drawn <= top5 and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, seed=2))
    drawn = {s(logits) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


def test_temperature_follows_the_distribution():
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3))
    counts = np.bincount([s(logits) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.7, 0.2, 0.1], atol=0.03)
