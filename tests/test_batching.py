"""A batch gives every request exactly the bits it gets alone: shared matmuls, per-request attention.

Exact for quantized weights (ggml quantizes each activation row on its own and the integer dot
products do not depend on the batch): checked here for Q4_1, Q8_0 and the bundled model. With F32
weights ggml's float matmul tiles the batch (llamafile's sgemm), so sums are taken in a different
order and logits agree only to within ~1e-3 (of values up to ~20); the test states that tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels.errors import RequestStateError
from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine, Step
from kernels.spec import ModelSpec, SliceSpec
from tests.conftest import N_THREADS

rng = np.random.default_rng(11)
PROMPTS = {  # request id → prompt tokens of different lengths
    b"a" * 16: [int(t) for t in rng.integers(100, 40000, 7)],
    b"b" * 16: [int(t) for t in rng.integers(100, 40000, 1)],
    b"c" * 16: [int(t) for t in rng.integers(100, 40000, 23)],
    b"d" * 16: [int(t) for t in rng.integers(100, 40000, 12)],
}
DECODE = [int(t) for t in rng.integers(100, 40000, 5)]


def solo(engine: SliceEngine, rid: bytes) -> list[np.ndarray]:
    outs = [engine.forward(rid, start_pos=0, tokens=PROMPTS[rid])]
    pos = len(PROMPTS[rid])
    for t in DECODE:
        outs.append(engine.forward(rid, start_pos=pos, tokens=[t]))
        pos += 1
    engine.release(rid)
    return outs


def batched(engine: SliceEngine) -> dict[bytes, list[np.ndarray]]:
    """Staggered: requests join while others decode, so prefills share batches with decodes."""
    outs: dict[bytes, list[np.ndarray]] = {rid: [] for rid in PROMPTS}
    pos = {rid: 0 for rid in PROMPTS}
    order = list(PROMPTS)
    for tick in range(len(order) + len(DECODE)):
        steps = []
        for i, rid in enumerate(order):
            k = tick - i  # request i starts at tick i
            if k == 0:
                steps.append(Step(rid, 0, tokens=PROMPTS[rid]))
            elif 0 < k <= len(DECODE):
                steps.append(Step(rid, pos[rid], tokens=[DECODE[k - 1]]))
        for step, out in zip(steps, engine.forward_batch(steps)):
            outs[step.key].append(out)
            pos[step.key] += len(step.tokens)
    for rid in PROMPTS:
        engine.release(rid)
    return outs


@pytest.mark.parametrize("model", ["bundled", "llama-f32", "qwen2-q4_1", "qwen3-q8_0", "llama-moe-q8_0",
                                   "qwen3moe-q8_0", "deepseek2-q8_0", "deepseek2-q4_1"])
def test_batched_logits_equal_solo_logits(bundled_model, tiny_model, model):
    path = bundled_model if model == "bundled" else tiny_model(model)
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        with SliceEngine(gguf, SliceSpec(0, spec.n_layer, True, True), n_threads=N_THREADS) as engine:
            alone = {rid: solo(engine, rid) for rid in PROMPTS}
            together = batched(engine)
            assert engine.stats.batched_requests > engine.stats.calls  # batches really held several
            assert engine.n_requests == 0 and engine.kv_bytes == 0
    for rid in PROMPTS:
        for step, (want, got) in enumerate(zip(alone[rid], together[rid])):
            message = f"{model} request {rid[:1]} step {step}"
            if model.endswith("f32"):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-3, err_msg=message)
            else:
                np.testing.assert_array_equal(got, want, err_msg=message)


def test_trunk_slice_batches_activations(bundled_model):
    """A mid-model slice fed activations: all rows of every request come back, bit-identical."""
    x = {rid: np.random.default_rng(i).standard_normal((len(p), 576)).astype(np.float32)
         for i, (rid, p) in enumerate(PROMPTS.items())}
    with SliceEngine.open(bundled_model, SliceSpec(4, 15), n_threads=N_THREADS) as engine:
        alone = {}
        for rid in PROMPTS:
            alone[rid] = engine.forward(rid, start_pos=0, hidden=x[rid])
            engine.release(rid)
        together = engine.forward_batch([Step(rid, 0, hidden=x[rid]) for rid in PROMPTS])
    for rid, got in zip(PROMPTS, together):
        assert got.shape == (len(PROMPTS[rid]), 576)
        np.testing.assert_array_equal(got, alone[rid])


def test_an_invalid_step_rejects_the_batch_before_anything_runs(bundled_model):
    with SliceEngine.open(bundled_model, SliceSpec(0, 4, has_embedding=True), n_threads=N_THREADS) as engine:
        engine.forward(b"x" * 16, start_pos=0, tokens=[1, 2, 3])
        with pytest.raises(RequestStateError):
            engine.forward_batch([Step(b"x" * 16, 3, tokens=[4]), Step(b"y" * 16, 5, tokens=[9])])
        assert engine.n_requests == 1  # the unknown request was not created ...
        engine.forward(b"x" * 16, start_pos=3, tokens=[4])  # ... and x still continues at 3


def test_a_batch_queued_behind_the_engine_s_close_fails_cleanly(tiny_model):
    """A trunk stopping (or reloading) closes its runner and engine on the compute thread; a batch
    the runner queued after that job ran on the closed engine, and ggml aborted the whole process
    (GGML_ASSERT(backend), found by the simulator: moe world, seed 41 with --kinds new). It now
    fails with EngineClosedError."""
    import asyncio

    from swarmctl.batching import BatchRunner, EngineClosedError, compute_thread

    engine = SliceEngine.open(tiny_model("llama-f32"), SliceSpec(0, 2, has_embedding=True), n_threads=N_THREADS)
    runner = BatchRunner(engine)

    def close_both() -> None:  # (what Assignment.unload does on the compute thread)
        runner.close()
        engine.close()

    async def scenario() -> str:
        step = asyncio.ensure_future(runner.run(Step(b"r", 0, tokens=[1, 2, 3])))
        await asyncio.sleep(0)  # (the step is queued, and the runner's batch task made, not run yet)
        compute_thread().submit(close_both).result()  # (so the batch goes to the thread after the close)
        try:
            await step
            return "ran"
        except EngineClosedError as e:
            return str(e)

    assert asyncio.run(scenario()) == "this engine is closed"


def test_an_engine_computes_on_more_threads_within_threads_and_the_same_bits(bundled_model):
    """SliceEngine.threads (the audit's table build): a batch on two threads gives every request the
    bits it gets alone on one, and the engine is back on its own count after the block."""
    with GGUFFile(bundled_model) as gguf:
        with SliceEngine(gguf, SliceSpec(0, 4, has_embedding=True), n_threads=1) as engine:
            alone = {rid: engine.forward(rid, start_pos=0, tokens=p) for rid, p in PROMPTS.items()}
            for rid in PROMPTS:
                engine.release(rid)
            with engine.threads(2):
                assert engine.backend.n_threads == 2
                together = engine.forward_batch([Step(rid, 0, tokens=p) for rid, p in PROMPTS.items()])
            assert engine.backend.n_threads == 1
    for rid, got in zip(PROMPTS, together):
        np.testing.assert_array_equal(got, alone[rid])
