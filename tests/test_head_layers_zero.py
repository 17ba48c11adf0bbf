"""--head-layers 0: the asker keeps only the embedding and the LM head, every layer runs on the
trunks (issue 29, item 1).

The last trunk stage then holds the model's last layer. It used to keep only the final row there
(as a slice with the LM head does), so the asker's layerless tail got one row for a prompt of n
positions ("request has 1 positions; cannot continue at 7"), and a stage whose experts live on
other nodes read n rows from a one-row output (ggml's "tensor read out of bounds": abort()).
Only the slice that makes the logits drops rows now. (The swarm runs this in tests/test_fuzz.py.)

And a plan change that took a stage's layers away while one of its steps computed made the
stage pass the output on from a stage of None (item 5's AttributeError in ``_pass_on``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import TensorBoundsError
from kernels.experts import ExpertEngine, LocalExperts
from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from kernels.tokenizer import Tokenizer
from net.wire import ActivationPacket, Frame, FrameType, PacketKind, decode_packet, encode_packet
from plans.plan import Plan, StageAssignment
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split
from swarmctl.batching import BatchRunner
from swarmctl.trunk.budget import MemberBudget
from swarmctl.asker.speculate import speculation_for
from swarmctl.trunk.assignment import Assignment
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.requests import StageRequests
from swarmctl.trunk.results import ResultStreams
from tests.conftest import N_THREADS, run_split
from harness.oracle import judge, oracle_greedy

PROMPTS = ["The three primary colours are", "Once upon a time, in a land far away, there lived"]
MAX_TOKENS = 16


def _greedy(model: Path, head_layers: int, prompt: str, *, speculate: str = "off") -> list[int]:
    """Greedy tokens through an in-process U of ``head_layers`` at each end and two trunk stages."""
    async def run() -> list[int]:
        asker = Asker(model, head_layers, n_threads=N_THREADS, max_context=256)
        trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, head_layers, 2).trunk, n_threads=N_THREADS,
                            max_context=asker.max_context)
        try:
            gen = await generate_all(asker, asker.tokenizer.encode_prompt(prompt), trunk, max_tokens=MAX_TOKENS,
                                     sampling=SamplingParams(temperature=0), speculation=speculation_for(speculate))
            return gen.tokens
        finally:
            trunk.close()
            asker.close()

    return asyncio.run(run())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_head_layers_zero_answers_as_head_layers_one_and_the_oracle(bundled_model, oracle, prompt):
    zero = _greedy(bundled_model, 0, prompt)  # before the fix: "request has 1 positions; cannot continue at 7"
    assert zero == _greedy(bundled_model, 1, prompt)
    # A speculative check carries several rows through the stage that holds the last layer.
    assert _greedy(bundled_model, 0, prompt, speculate="ngram") == zero

    prompt_ids = Tokenizer(bundled_model).encode_prompt(prompt)
    with GGUFFile(bundled_model) as gguf:
        n = ModelSpec.from_gguf(gguf).n_layer
        engines = [SliceEngine(gguf, s, n_threads=N_THREADS, max_context=256)
                   for s in (SliceSpec(0, 0, has_embedding=True), SliceSpec(0, n // 2), SliceSpec(n // 2, n),
                             SliceSpec(n, n, has_lm_head=True))]
        try:
            verdict = judge(prompt_ids, zero, oracle_greedy(oracle, prompt_ids, MAX_TOKENS),
                            lambda tokens: run_split(engines, tokens), oracle)
        finally:
            for e in engines:
                e.close()
    assert verdict.passes, verdict.explain()


def test_a_trunk_slice_that_ends_the_model_passes_every_row_on(bundled_model):
    """[k, L) without the LM head returns one row per position; the layerless tail then gives the
    logits the whole model gives, bit for bit (a quantized model: the same kernels per row)."""
    with GGUFFile(bundled_model) as gguf:
        n = ModelSpec.from_gguf(gguf).n_layer
        whole = SliceEngine(gguf, SliceSpec(0, n, True, True), n_threads=N_THREADS, max_context=64)
        split = [SliceEngine(gguf, s, n_threads=N_THREADS, max_context=64)
                 for s in (SliceSpec(0, 0, has_embedding=True), SliceSpec(0, n), SliceSpec(n, n, has_lm_head=True))]
        rid = b"r" * 16
        try:
            tokens = [504, 1296, 3003, 14797, 359, 2382, 28]
            x = split[1].forward(rid, start_pos=0, hidden=split[0].forward(rid, start_pos=0, tokens=tokens))
            assert x.shape == (len(tokens), ModelSpec.from_gguf(gguf).n_embd)
            logits = split[2].forward(rid, start_pos=0, hidden=x)
            np.testing.assert_array_equal(logits, whole.forward(rid, start_pos=0, tokens=tokens))
            for pos, token in enumerate([1789, 30, 378], start=len(tokens)):  # decode continues at 7, 8, 9
                x = split[1].forward(rid, start_pos=pos, hidden=split[0].forward(rid, start_pos=pos, tokens=[token]))
                np.testing.assert_array_equal(split[2].forward(rid, start_pos=pos, hidden=x),
                                              whole.forward(rid, start_pos=pos, tokens=[token]))
        finally:
            for e in (whole, *split):
                e.close()


@pytest.mark.parametrize("name", ["qwen3moe-q8_0", "deepseek2-f32"])
def test_remote_experts_on_the_models_last_layer(tiny_model, name):
    """The stage of a --head-layers 0 swarm with expert nodes: layers [1, L) to the end of the
    model, its experts elsewhere. Before the fix this aborted the process (a segment read 7 rows
    from a 1-row output). Same bits as the stage running its own experts."""
    with GGUFFile(tiny_model(name)) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        trunk = SliceSpec(1, spec.n_layer)
        holders = [ExpertEngine(gguf, trunk.layers, a, b, n_threads=N_THREADS) for a, b in ((0, 3), (3, spec.n_expert))]
        local = SliceEngine(gguf, trunk, n_threads=N_THREADS)
        split = SliceEngine(gguf, trunk, n_threads=N_THREADS, remote_experts=LocalExperts(holders))
        try:
            rng = np.random.default_rng(2)
            x = rng.standard_normal((7, spec.n_embd)).astype(np.float32)
            got = split.forward(b"a" * 16, start_pos=0, hidden=x)
            assert got.shape == (7, spec.n_embd)
            np.testing.assert_array_equal(got, local.forward(b"a" * 16, start_pos=0, hidden=x))
            step = rng.standard_normal((1, spec.n_embd)).astype(np.float32)
            np.testing.assert_array_equal(split.forward(b"a" * 16, start_pos=7, hidden=step),
                                          local.forward(b"a" * 16, start_pos=7, hidden=step))
        finally:
            for engine in (local, split, *holders):
                engine.close()


def test_a_copy_that_does_not_fit_a_tensor_raises_instead_of_aborting(bundled_model):
    """The last line of defence: ggml checks a copy's bounds with GGML_ASSERT (abort()); ours raise."""
    from kernels import ggml

    ctx = ggml.new_context(1)
    try:
        t = ggml.new_tensor_1d(ctx, ggml.TYPE_F32, 4)
        with pytest.raises(TensorBoundsError):
            ggml.copy_out(t, np.empty(5, np.float32))
        with pytest.raises(TensorBoundsError):
            ggml.copy_in(t, np.empty(8, np.float32)[::2])  # not contiguous
    finally:
        ggml.free(ctx)


# --- the plan changes while a step computes (item 5's race) ---

class _Conn:
    """The asker's side of one connection, in memory: what the stage sends is kept."""

    peer_name = "asker"
    is_open = True

    def __init__(self) -> None:
        self.sent: list[tuple[int, ActivationPacket]] = []

    def send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        self.sent.append((stream_id, decode_packet(data[5:])))

    def finish(self, stream_id: int) -> None:
        pass

    async def drain(self, stream_id: int, backlog: int) -> None:
        pass

    def reject_stream(self, stream_id: int, reason: str) -> None:
        raise AssertionError(reason)


class _PlanChangesDuringStep:
    """The stage's runner, with a plan arriving while a step computes: ``Assignment.apply`` of a
    plan that gives this trunk no layers sets its stage to None at once (the runner lives on)."""

    def __init__(self, runner: BatchRunner, held: Assignment, plan: Plan) -> None:
        self.runner, self.held, self.plan = runner, held, plan

    async def run(self, step, member: str = ""):
        out = await self.runner.run(step, member)
        self.held.plan = self.plan
        self.held.apply()
        assert self.held.stage is None and self.held.runner is self
        return out

    async def call(self, fn, *args):
        return await self.runner.call(fn, *args)


def _plan(version: int, member: str, n_layer: int) -> Plan:
    return Plan(version=version, model_name="m", n_layer=n_layer, head_layers=1,
                stages=[StageAssignment(member, "127.0.0.1:1", 1, n_layer - 1, ready=True)])


def test_a_plan_that_takes_the_stage_away_mid_step_gets_a_retry_not_a_crash(tiny_model, caplog, tmp_path):
    """Before the fix the stage passed the output on from ``self.held.stage``, None by then:
    AttributeError, logged with its traceback as an unexpected error."""
    path = tiny_model("llama-f32")

    async def scenario() -> list[tuple[int, ActivationPacket]]:
        tasks: list[asyncio.Task] = []
        spawn = lambda coro: tasks.append(asyncio.ensure_future(coro))  # noqa: E731
        with GGUFFile(path) as gguf, ThreadPoolExecutor(1) as executor:
            n_layer = ModelSpec.from_gguf(gguf).n_layer
            ctx = TrunkContext(name="trunk-a", creds=None, config=None, model_path=path, slices_dir=tmp_path,
                               memory=1 << 30, n_threads=N_THREADS, device=None, executor=executor,
                               loop=asyncio.get_running_loop(), handler=None, spawn=spawn, connect=None,
                               connect_host=None)
            held = Assignment(ctx, events=None, host=None, speed=None, remote_experts=None)
            held.plan = _plan(1, "trunk-a", n_layer)
            held.stage = held.plan.stages[0]
            held.engine = SliceEngine(gguf, SliceSpec(1, n_layer - 1), n_threads=N_THREADS)
            held.budget = MemberBudget(held.budget_limits())
            held.runner = _PlanChangesDuringStep(BatchRunner(held.engine), held, _plan(2, "trunk-b", n_layer))
            stage = StageRequests(ctx, held, ResultStreams(), capture=lambda *a: None)
            conn = _Conn()
            session = secrets.token_hex(8)
            stage.results.subscribe(conn, 3, session)
            x = np.random.default_rng(0).standard_normal((3, held.engine.spec.n_embd)).astype(np.float32)
            packet = ActivationPacket(PacketKind.PREFILL, secrets.token_bytes(16), 1, 1, 0, x, reply_to=session)
            try:
                stage.packet_frame(conn, 0, Frame(FrameType.ACTIVATION, encode_packet(packet)[5:]))
                while tasks:
                    await tasks.pop()
            finally:
                held.runner.runner.close()
                held.engine.close()
            return conn.sent

    with caplog.at_level(logging.WARNING, logger="swarmctl.trunk"):
        sent = asyncio.run(scenario())
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert len(sent) == 1
    stream_id, answer = sent[0]
    assert stream_id == 0 and answer.kind == PacketKind.ERROR and answer.retry, answer
    assert "the plan changed (now v2)" in answer.message
