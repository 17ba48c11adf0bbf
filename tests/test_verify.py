"""Spot checks of trunk results (``--verify P``, swarmctl/asker/verify.py).

In process: the tolerance against the engine's own batched-vs-incremental differences and against
lies; the verifying trunk over a fake link (honest and lying) gives the honest tokens and names the
liar. With real processes: a swarm whose only trunk lies (SWARMCTL_TEST_CORRUPT), caught by
``swarmctl ask --verify 1`` which still prints the honest answer; an honest swarm gives the same
answer with and without --verify and is accused of nothing.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine
from kernels.spec import SliceSpec
from net.messages import as_dict
from net.wire import DType
from plans.plan import Plan, StageAssignment
from swarmctl.asker.head_tail import Asker, InprocTrunk, TrunkResult, generate_all
from swarmctl.asker.verify import REL_TOLERANCE, VerifyingTrunk, judge
from tests.conftest import N_THREADS
from harness.swarm import Swarm, swarmctl

GREEDY = SamplingParams(temperature=0)
K = 4  # head layers
PROMPTS = ["Once upon a time, in a lighthouse by a cold grey sea,", "The three primary colours are"]


# --- the tolerance ---

def _trunk_rows(model, n_decode: int = 24):
    """The trunk's inputs and outputs for a short greedy generation, step by step (prompt, then one
    token at a time), as an honest trunk computes them."""
    with GGUFFile(model) as gguf:
        n = gguf_layers(gguf)
        head = SliceEngine(gguf, SliceSpec(0, K, has_embedding=True), n_threads=N_THREADS)
        trunk = SliceEngine(gguf, SliceSpec(K, n - K), n_threads=N_THREADS)
        tail = SliceEngine(gguf, SliceSpec(n - K, n, has_lm_head=True), n_threads=N_THREADS)
        try:
            from kernels.tokenizer import Tokenizer

            tokens, pos, ins, outs = Tokenizer(model).encode_prompt(PROMPTS[0]), 0, [], []
            for _ in range(n_decode):
                x = head.forward(b"r", start_pos=pos, tokens=tokens)
                y = trunk.forward(b"r", start_pos=pos, hidden=x)
                logits = tail.forward(b"r", start_pos=pos, hidden=y)
                ins.append(x)
                outs.append(y)
                pos += len(tokens)
                tokens = [int(np.argmax(logits[-1]))]
            batched = SliceEngine(gguf, SliceSpec(K, n - K), n_threads=N_THREADS)
            try:
                recomputed = batched.forward(b"v", start_pos=0, hidden=np.concatenate(ins))
            finally:
                batched.close()
            return np.concatenate(ins), np.concatenate(outs), recomputed
        finally:
            for engine in (head, trunk, tail):
                engine.close()


def gguf_layers(gguf: GGUFFile) -> int:
    from kernels.spec import ModelSpec

    return ModelSpec.from_gguf(gguf).n_layer


@pytest.fixture(scope="module")
def rows(bundled_model):
    return _trunk_rows(bundled_model)


def test_batched_recomputation_differs_a_little_and_passes(rows):
    """The premise of the tolerance: a batched catch-up is not bit-identical to the trunk's one-token
    steps (so an exact comparison would accuse honest trunks), but it stays well inside it."""
    _, honest, recomputed = rows
    assert not np.array_equal(honest, recomputed)
    verdict = judge(honest, recomputed)
    assert verdict.ok, verdict.describe()
    assert verdict.worst_rel < REL_TOLERANCE / 2


@pytest.mark.parametrize("lie", ["noise", "scaled", "echo", "nan", "shape"])
def test_lies_fail_the_tolerance(rows, lie):
    x, honest, recomputed = rows
    rng = np.random.default_rng(0)
    rms = np.sqrt(np.mean(honest.astype(np.float64) ** 2, axis=1, keepdims=True))
    got = {"noise": honest + (rng.standard_normal(honest.shape) * 0.2 * rms).astype(np.float32),
           "scaled": honest * 1.2,
           "echo": x,  # activations sent back without running the layers
           "nan": np.where(np.arange(honest.shape[1]) == 7, np.nan, honest).astype(np.float32),
           "shape": honest[:-1]}[lie]
    verdict = judge(got, recomputed)
    assert not verdict.ok
    assert verdict.bad_rows >= 1


# --- the verifying trunk over a fake link ---

class FakeLink:
    """What VerifyingTrunk needs of a SwarmLink, over one in-process stage named ``member``; with
    ``corrupt`` it lies like SWARMCTL_TEST_CORRUPT does."""

    def __init__(self, gguf: GGUFFile, plan: Plan, *, corrupt: float = 0.0, member: str = "fake-trunk") -> None:
        self.trunk = InprocTrunk(gguf, [SliceSpec(*plan.trunk_range)], n_threads=N_THREADS, max_context=512)
        self.plan = plan
        self.dtype = DType.F32
        self.member = member
        self.corrupt = corrupt
        self.history: dict[bytes, list] = {}
        self.reports: list[dict] = []
        self.forwarded = 0
        self.released: list[bytes] = []

    async def forward(self, rid, hidden, start_pos, *, rewind=False, verify=False):
        self.forwarded += 1
        result = await self.trunk.forward(rid, hidden, start_pos, rewind=rewind, verify=verify)
        steps = [(p, h) for p, h in self.history.get(rid, []) if p < start_pos]
        self.history[rid] = steps + [(start_pos, np.array(hidden, dtype=np.float32))]
        if self.corrupt:
            out = result.hidden
            rms = np.sqrt(np.mean(out.astype(np.float64) ** 2, axis=1, keepdims=True))
            noise = np.random.default_rng().standard_normal(out.shape) * self.corrupt * rms
            result = TrunkResult((out + noise).astype(np.float32), result.hops, result.round_trip_s)
        return result

    async def release(self, rid):
        self.released.append(rid)
        self.history.pop(rid, None)
        await self.trunk.release(rid)

    def sent_steps(self, rid):
        return list(self.history.get(rid, []))

    def route_members(self, rid):
        return [self.member]

    async def report(self, message):
        self.reports.append(as_dict(message))  # as the host would read it

    def close(self):
        self.trunk.close()


def _plan(gguf: GGUFFile, n_layer: int, member: str = "fake-trunk") -> Plan:
    return Plan(version=3, model_name="m", n_layer=n_layer, head_layers=K,
                layer_hashes=[gguf.layer_hash(i) for i in range(n_layer)],
                stages=[StageAssignment(member, "127.0.0.1:1", K, n_layer - K, ready=True)])


@pytest.fixture(scope="module")
def asker(bundled_model):
    a = Asker(bundled_model, K, n_threads=N_THREADS, max_context=512)
    yield a
    a.close()


def _generate(asker: Asker, trunk, prompts=PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    async def run():
        return [(await generate_all(asker, asker.tokenizer.encode_prompt(p), trunk, max_tokens=max_tokens,
                                    sampling=GREEDY, ignore_eos=True)).tokens for p in prompts]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def honest_tokens(asker):
    link = FakeLink(asker.gguf, _plan(asker.gguf, asker.spec.n_layer))
    try:
        return _generate(asker, link)
    finally:
        link.close()


def test_an_honest_trunk_checked_on_every_step_gives_the_same_tokens_and_no_alarm(asker, honest_tokens):
    link = FakeLink(asker.gguf, _plan(asker.gguf, asker.spec.n_layer))
    verifier = VerifyingTrunk(link, asker.gguf, share=1.0, n_threads=N_THREADS, max_context=512)
    try:
        assert _generate(asker, verifier) == honest_tokens
        assert verifier.stats.checked == verifier.stats.steps == link.forwarded > 0
        assert verifier.stats.mismatches == 0 and not link.reports and not verifier.suspects
        assert verifier.stats.local_steps == 0
    finally:
        verifier.close()
        link.close()


def test_a_share_checks_some_steps_and_catches_up_in_batches(asker, honest_tokens):
    link = FakeLink(asker.gguf, _plan(asker.gguf, asker.spec.n_layer))
    verifier = VerifyingTrunk(link, asker.gguf, share=0.3, n_threads=N_THREADS, max_context=512)
    try:
        assert [t[:12] for t in _generate(asker, verifier, max_tokens=24)] == honest_tokens
        assert 0 < verifier.stats.checked < verifier.stats.steps  # (P(none or all of 48 drawn) < 1e-7)
        assert verifier.stats.mismatches == 0 and not link.reports
    finally:
        verifier.close()
        link.close()


def test_a_lying_trunk_is_caught_reported_and_the_request_finishes_here(asker, honest_tokens):
    lying = FakeLink(asker.gguf, _plan(asker.gguf, asker.spec.n_layer), corrupt=0.3)
    try:
        assert _generate(asker, lying) != honest_tokens  # the lie changes the answer unchecked
    finally:
        lying.close()
    link = FakeLink(asker.gguf, _plan(asker.gguf, asker.spec.n_layer), corrupt=0.3)
    verifier = VerifyingTrunk(link, asker.gguf, share=1.0, n_threads=N_THREADS, max_context=512)
    try:
        first = _generate(asker, verifier, prompts=PROMPTS[:1])
        assert first == honest_tokens[:1]  # the same tokens as the honest trunk: same steps, same kernels
        assert verifier.suspects == {"fake-trunk"}
        assert [r["type"] for r in link.reports] == ["bad_result"]
        assert link.reports[0]["members"] == ["fake-trunk"] and link.reports[0]["plan_version"] == 3
        assert link.reports[0]["rel_error"] > REL_TOLERANCE
        assert link.forwarded == 1  # caught on the first step; every later step ran here
        # A later request whose route passes the liar runs here from its first step.
        second = _generate(asker, verifier, prompts=PROMPTS[1:])
        assert second == honest_tokens[1:]
        assert link.forwarded == 1 and len(link.reports) == 1
        assert verifier.stats.local_steps == 2 * 12
    finally:
        verifier.close()
        link.close()


def test_a_wrong_result_later_in_a_request_is_replayed_here_bit_for_bit(asker, honest_tokens):
    """The trunk lies from its 5th step on: the request moves here mid-way, its earlier steps
    replayed as they were sent, and the tokens stay the honest ones."""
    link = FakeLink(asker.gguf, _plan(asker.gguf, asker.spec.n_layer))
    honest_forward = link.forward

    async def lies_later(rid, hidden, start_pos, **flags):
        link.corrupt = 0.3 if link.forwarded >= 4 else 0.0
        return await honest_forward(rid, hidden, start_pos, **flags)

    link.forward = lies_later
    verifier = VerifyingTrunk(link, asker.gguf, share=1.0, n_threads=N_THREADS, max_context=512)
    try:
        assert _generate(asker, verifier, prompts=PROMPTS[:1]) == honest_tokens[:1]
        assert verifier.stats.mismatches == 1 and link.forwarded == 5
        assert verifier.stats.local_steps == 12 - 4
        assert link.released  # the swarm's copy of the request was let go when it moved
    finally:
        verifier.close()
        link.close()


class FakeRoute:
    """A route of several in-process stages (one SliceEngine each) whose stage ``liar`` adds noise
    to what it sends on; ``lies_to_checks``: also to a re-check of it alone (run_stage), else it
    answers those honestly."""

    def __init__(self, gguf: GGUFFile, plan: Plan, *, liar: int, lies_to_checks: bool = True) -> None:
        self.plan = plan
        self.dtype = DType.F32
        self.liar, self.lies_to_checks = liar, lies_to_checks
        self.engines = [SliceEngine(gguf, SliceSpec(s.start, s.stop), n_threads=N_THREADS, max_context=512)
                        for s in plan.stages]
        self.history: dict[bytes, list] = {}
        self.reports: list[dict] = []
        self.checked: list[int] = []  # the stages re-checked alone

    def _run(self, i, rid, hidden, start_pos, lie: bool) -> np.ndarray:
        x = self.engines[i].forward(rid, start_pos=start_pos, hidden=np.asarray(hidden, np.float32))
        if i == self.liar and lie:
            rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True))
            x = (x + np.random.default_rng().standard_normal(x.shape) * 0.3 * rms).astype(np.float32)
        return x

    async def forward(self, rid, hidden, start_pos, *, rewind=False, verify=False):
        out = hidden
        for i in range(len(self.engines)):
            out = self._run(i, rid, out, start_pos, lie=True)
        steps = [(p, h) for p, h in self.history.get(rid, []) if p < start_pos]
        self.history[rid] = steps + [(start_pos, np.array(hidden, dtype=np.float32))]
        return TrunkResult(out, (), 0.0)

    async def run_stage(self, stage, steps):
        self.checked.append(stage)
        rid = os.urandom(16)
        try:
            for p, h in steps:
                out = self._run(stage, rid, h, p, lie=self.lies_to_checks)
            return out
        finally:
            self.engines[stage].release(rid)

    async def release(self, rid):
        self.history.pop(rid, None)
        for engine in self.engines:
            engine.release(rid)

    def sent_steps(self, rid):
        return list(self.history.get(rid, []))

    def route_members(self, rid):
        return [s.member for s in self.plan.stages]

    async def report(self, message):
        self.reports.append(as_dict(message))

    def close(self):
        for engine in self.engines:
            engine.close()


def _route_plan(gguf: GGUFFile, n_layer: int, members: tuple[str, ...]) -> Plan:
    bounds = np.linspace(K, n_layer - K, len(members) + 1).astype(int)
    return Plan(version=3, model_name="m", n_layer=n_layer, head_layers=K,
                layer_hashes=[gguf.layer_hash(i) for i in range(n_layer)],
                stages=[StageAssignment(name, "127.0.0.1:1", int(a), int(b), ready=True)
                        for name, a, b in zip(members, bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("liar", [0, 1, 2])
def test_a_route_of_three_is_rechecked_stage_by_stage_and_only_the_liar_is_named(asker, honest_tokens, liar):
    members = ("alpha", "beta", "gamma")
    link = FakeRoute(asker.gguf, _route_plan(asker.gguf, asker.spec.n_layer, members), liar=liar)
    verifier = VerifyingTrunk(link, asker.gguf, share=1.0, n_threads=N_THREADS, max_context=512)
    try:
        assert _generate(asker, verifier, prompts=PROMPTS[:1]) == honest_tokens[:1]
        assert verifier.suspects == {members[liar]}
        assert [(r["members"], r["attributed"]) for r in link.reports] == [([members[liar]], True)]
        assert link.checked == [0, 1, 2]
    finally:
        verifier.close()
        link.close()


def test_a_liar_that_answers_the_recheck_honestly_gets_nobody_else_named(asker, honest_tokens):
    """It cannot be told apart then: the whole route is named, as without a re-check, never the
    honest neighbour alone."""
    members = ("alpha", "beta")
    link = FakeRoute(asker.gguf, _route_plan(asker.gguf, asker.spec.n_layer, members), liar=1,
                     lies_to_checks=False)
    verifier = VerifyingTrunk(link, asker.gguf, share=1.0, n_threads=N_THREADS, max_context=512)
    try:
        assert _generate(asker, verifier, prompts=PROMPTS[:1]) == honest_tokens[:1]
        assert verifier.suspects == set(members)
        assert [(r["members"], r["attributed"]) for r in link.reports] == [(list(members), False)]
    finally:
        verifier.close()
        link.close()


def test_the_askers_copy_of_the_trunk_layers_must_be_the_swarms(asker):
    plan = _plan(asker.gguf, asker.spec.n_layer)
    plan.layer_hashes[K + 3] = "0" * 64
    link = FakeLink(asker.gguf, plan)
    try:
        with pytest.raises(EngineError, match=f"differs from the swarm's .* in layer {K + 3}"):
            VerifyingTrunk(link, asker.gguf, share=0.5)
        with pytest.raises(EngineError, match="share"):
            VerifyingTrunk(link, asker.gguf, share=0.0)
    finally:
        link.close()


# --- real processes: a lying trunk, an honest one ---

ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "16")
PROMPT = "The three primary colours are"


def _stage_members(swarm: Swarm) -> list[str]:
    return [m["name"] for m in swarm.status().get("members", []) if m["layers"]]


def _wait_serving(swarm: Swarm, name: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = swarm.status()
        if status.get("complete") and _stage_members(swarm) == [name]:
            return status
        time.sleep(0.3)
    raise AssertionError(f"{name} never became the only stage: {swarm.status()}")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A host, an asker, and two trunks that take turns holding every trunk layer: "honest", then "liar"."""
    s = Swarm(tmp_path_factory.mktemp("verify"))
    try:
        s.init()
        s.start_host()
        s.wait_host()
        s.join("honest")
        s.join("liar")
        s.join("asker", role="asker")
        s.start_trunk("honest", capture=False)
        _wait_serving(s, "honest")
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def honest_answer(swarm):
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_honest_swarm_answers_the_same_with_verify_and_is_accused_of_nothing(swarm, honest_answer):
    r = swarmctl(swarm.homes["asker"], *ASK, "--verify", "1", PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == honest_answer
    assert "wrong result" not in r.stderr
    honest = next(m for m in swarm.status()["members"] if m["name"] == "honest")
    assert honest["bad_results"] == 0


def test_a_lying_trunk_is_caught_reported_and_the_answer_is_the_honest_one(swarm, honest_answer):
    node = next(n for n in swarm.nodes if n.home == swarm.homes["honest"])
    node.stop()
    os.environ["SWARMCTL_TEST_CORRUPT"] = "0.3"  # read by the liar's process when it starts
    try:
        swarm.start_trunk("liar", capture=False)
    finally:
        del os.environ["SWARMCTL_TEST_CORRUPT"]
    _wait_serving(swarm, "liar")

    unchecked = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert unchecked.returncode == 0, unchecked.stderr
    assert unchecked.stdout != honest_answer  # the lie reaches the user unchecked

    checked = swarmctl(swarm.homes["asker"], *ASK, "--verify", "1", PROMPT)
    assert checked.returncode == 0, checked.stderr
    assert "trunk liar returned a wrong result (verified locally" in checked.stderr
    assert checked.stdout == honest_answer  # replayed on this machine: the honest tokens

    liar = next(m for m in swarm.status()["members"] if m["name"] == "liar")
    assert liar["bad_results"] == 1 and liar["bad_result_reporters"] == 1
    assert liar["layers"] is not None and liar["health"] == "ready"  # one asker's word evicts nobody
