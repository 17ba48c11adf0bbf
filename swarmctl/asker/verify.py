"""Spot checks of the trunk's results: ``--verify P`` on the asker.

A trunk holds the asker's activations and could return anything: the layer checks at the host
prove it *holds* the layers, not that it *runs* them. With ``--verify P`` the asker recomputes a
random share P of the trunk's steps itself and compares:

    VerifyingTrunk(link, gguf, share=P)   # wraps the SwarmLink; the Asker sees a Trunk as before

The asker has the whole model file (it checks that its trunk layers match the swarm's hashes
before it trusts its own recomputation), so it keeps a SliceEngine over the trunk's layers
[K, L-K): verification runs here, where a trunk cannot see which steps are checked (no traffic
tells it; the choice comes from ``secrets``). That suits small models; a trunk too large for the
asker cannot be checked this way (no two trunks hold the same layers in today's plans, so there is
no second trunk to ask).

How a step is checked. The verifier keeps its own KV cache for each request, filled from the
steps the link sent (``SwarmLink.sent_steps``: the head's activations, which the asker computed
itself, so the cache is right whatever the trunk did). When a step is drawn, the steps not yet
run here are run as one batched pass (a catch-up), and the rows of the drawn step are compared
with what the trunk returned.

Why a tolerance, and why this one. The trunk ran the same steps one by one (a prompt chunk, then
single-token decodes); the catch-up runs them as one batch. ggml picks its matmul kernels by the
batch's shape, so a batched pass sums in another order than a one-token pass: now and then a value
differs in its last bit (measured: a few rows per layer, about 5e-4 of the row's largest value),
and 22 layers of attention and MLP amplify such flips. On SmolLM2 (trunk [4, 26); 4 prompts x 150
tokens and 2 chat prompts x 500 tokens; catch-ups of 1 to ~40 steps; f32 and f16 on the wire) an
honest trunk's rows differed from the recomputation by up to 4.9 % in relative L2 norm, cosine
similarity down to 0.9989, and the difference did not grow along the 500 tokens (the trunk's
inputs are the asker's own, so errors do not feed back). The oracle's logit threshold (cosine >=
0.9999) therefore cannot be used on hidden states computed in another order. Another machine's
kernels (AVX2 vs AVX-512 vs NEON, a GPU) reorder sums the same way (not measured here). A row
passes when

    ||trunk - local|| <= REL_TOLERANCE * ||local||   (0.10: twice the worst honest difference)
    cosine(trunk, local) >= MIN_COSINE               (0.995: 4.5 x the worst honest 1 - cosine)

and every value is finite. Noise of relative size s adds about s to the first figure: a trunk that
perturbs its rows by more than ~10 % (garbage, echoed activations, a much coarser quantization) is
caught on each checked step; subtler perturbations pass. With P = 1 the catch-up is a single step
mirrored exactly, and the two agree bit for bit on the same kernels (measured).

What it costs. A checked step at position s needs the trunk's KV for every position before it, so
for any P > 0 the asker ends up running the trunk's layers over (nearly) every position of a
request; a smaller P only batches that work into fewer, larger passes. P sets the chance of
catching a wrong step, not the cost (benchmarks/bench_verify.py: on this 2-core machine the
single-stream decode rate fell to 0.76-0.78 of unchecked for P = 0.1, 0.5 and 1 alike).

A mismatch: the route's members are marked bad here and reported to the host (``bad_result``).
With several stages, the route is first re-checked stage by stage (``_attribute``): the request's
steps up to the drawn one are computed here one stage at a time (every stage's clean input and
output), and each stage is sent its clean input as a new request that comes back from that stage
alone; the stages whose answers are wrong are named (``attributed``). A stage is named only on its
own answer, so a liar cannot get an honest neighbour named; one that lies only now and then, or only
to requests that pass on through it, can come out of the re-check clean, and then every member of
the route is named, as before. The host counts reports and shows them in status; a named stage's
report counts only if that stage recorded this asker's re-check steps (swarmctl/trunk/one_stage.py),
and then makes the host check the stage itself on its serving path (swarmctl/host/recheck.py): only
a failed check of the host's takes it out, askers' word never does (swarmctl/host/reports.py). The
asker routes around the members it caught either way. The request is replayed on
another route: this machine. Its steps, exactly as they were sent, run again on a fresh local cache (the
same steps and kernels as an honest trunk: the same bits), the drawn step's correct output is
returned, and the request goes on here to its end. Later requests whose route passes through a
member marked bad run here from the start. Steps not drawn are not checked: with P < 1 a wrong
step is caught with probability P, and tokens sampled from earlier unchecked steps stay as they
were. ``share=0`` is not wrapped at all (``swarmctl ask`` without ``--verify`` is unchanged).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from kernels.slice import Placement, SliceEngine, Step
from kernels.spec import SliceSpec
from net import messages as m
from net.wire import DType, Hop
from swarmctl.asker.head_tail import TrunkResult
from swarmctl.asker.plan_watch import SwarmError
from swarmctl.batching import BatchRunner

log = logging.getLogger("swarmctl.asker.verify")

REL_TOLERANCE = 0.10
MIN_COSINE = 0.995
CATCH_UP_CHUNK = 512  # tokens per verification pass (the asker's prefill chunk): bounds its graph's memory
ATTRIBUTION_TIMEOUT_S = 60.0  # each part of the re-check stage by stage (see _attribute)
LOCAL_STAGE = "asker (verified route)"  # the hop name of steps this machine ran in place of the trunk


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rows: int
    bad_rows: int
    worst_rel: float  # largest ||trunk - local|| / ||local|| over the rows
    worst_cosine: float  # smallest cosine similarity over the rows

    def describe(self) -> str:
        return (f"{self.bad_rows} of {self.rows} rows off: relative error {self.worst_rel:.3g} "
                f"(tolerance {REL_TOLERANCE}), cosine {self.worst_cosine:.5f} (at least {MIN_COSINE})")


def judge(trunk_rows: np.ndarray, local_rows: np.ndarray, *, rel_tolerance: float = REL_TOLERANCE,
          min_cosine: float = MIN_COSINE) -> Verdict:
    """Compare a trunk's rows with the asker's recomputation, row by row (module docstring)."""
    got = np.asarray(trunk_rows, dtype=np.float64)
    want = np.asarray(local_rows, dtype=np.float64)
    if got.shape != want.shape or got.ndim != 2:
        return Verdict(False, int(want.shape[0]) if want.ndim else 0, int(want.shape[0]) if want.ndim else 0,
                       float("inf"), -1.0)
    finite = np.isfinite(got).all(axis=1)
    got = np.where(np.isfinite(got), got, 0.0)
    norm_want = np.linalg.norm(want, axis=1)
    norm_got = np.linalg.norm(got, axis=1)
    tiny = np.finfo(np.float32).tiny
    rel = np.linalg.norm(got - want, axis=1) / np.maximum(norm_want, tiny)
    cos = (got * want).sum(axis=1) / np.maximum(norm_got * norm_want, tiny)
    cos = np.where((norm_got == 0) & (norm_want == 0), 1.0, cos)
    rel = np.where(finite, rel, np.inf)
    bad = ~finite | (rel > rel_tolerance) | (cos < min_cosine)
    return Verdict(not bad.any(), len(want), int(bad.sum()), float(rel.max(initial=0.0)),
                   float(cos.min(initial=1.0)))


class VerifiableLink(Protocol):
    """What the verifier needs of the link (``SwarmLink``): the Trunk interface, the plan, what
    the link sent for each request, and a way to tell the host."""

    plan: object
    dtype: DType

    async def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int, *, rewind: bool = False,
                      verify: bool = False) -> TrunkResult: ...

    async def release(self, request_id: bytes) -> None: ...

    def sent_steps(self, request_id: bytes) -> list[tuple[int, np.ndarray]]: ...

    def route_members(self, request_id: bytes) -> list[str]: ...

    async def report(self, message: m.Message) -> None: ...

    async def run_stage(self, stage: int, steps: list[tuple[int, np.ndarray]]) -> np.ndarray: ...


@dataclass
class VerifyStats:
    steps: int = 0  # trunk steps that came back from the swarm
    checked: int = 0  # of those, recomputed here and compared
    mismatches: int = 0
    checked_tokens: int = 0  # tokens the verification passes ran (catch-ups included)
    check_s: float = 0.0  # wall time of the verification passes
    local_steps: int = 0  # steps run here in place of a trunk caught lying
    worst_rel_ok: float = 0.0  # the largest relative error that still passed


@dataclass
class _State:
    local: bool = False  # moved to this machine after a mismatch
    checked_pos: int = 0  # positions the verification cache holds


@dataclass
class Accusation:
    members: tuple[str, ...]
    plan_version: int
    verdict: Verdict
    at: float = field(default_factory=time.time)


class VerifyingTrunk:
    """A Trunk that forwards to the swarm and spot-checks a share of the steps (module docstring)."""

    steps_in_flight = 1  # (a check, and a move here after a mismatch, follow a request step by step)

    def __init__(self, link: VerifiableLink, gguf: GGUFFile, *, share: float, n_threads: int | None = None,
                 max_context: int | None = None) -> None:
        if not 0.0 < share <= 1.0:
            raise EngineError(f"--verify takes a share of steps in (0, 1], not {share}")
        self.link = link
        self.share = share
        start, stop = link.plan.trunk_range
        self.layers = (start, stop)
        check_trunk_layers(gguf, link.plan)
        self.gguf, self.n_threads, self.max_context = gguf, n_threads, max_context  # (for a re-check stage by stage)
        # the kernels and attention the trunks compute with (the plan's), so an honest trunk's rows are the same bits
        self.placement = Placement(kernels=getattr(link.plan, "kernels", "plain"),
                                   attention=getattr(link.plan, "attention", "plain"))
        self.engine = SliceEngine(gguf, SliceSpec(start, stop), n_threads=n_threads, max_context=max_context,
                                  placement=self.placement)
        self.runner = BatchRunner(self.engine)
        self.stats = VerifyStats()
        self.suspects: set[str] = set()  # members caught returning a wrong result (this process's view)
        self.accusations: list[Accusation] = []
        self._requests: dict[bytes, _State] = {}
        self._draw = secrets.SystemRandom()  # not predictable by a trunk
        self._reports: set[asyncio.Task] = set()

    # --- the Trunk interface ---

    async def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int, *, rewind: bool = False,
                      verify: bool = False) -> TrunkResult:
        state = self._requests.setdefault(request_id, _State())
        if not state.local and self.suspects.intersection(self.link.route_members(request_id)):
            await self._move_here(request_id, state, start_pos)  # its route passes a trunk caught lying
        if state.local:
            return await self._local_step(request_id, hidden, start_pos, verify)
        result = await self.link.forward(request_id, hidden, start_pos, rewind=rewind, verify=verify)
        self.stats.steps += 1
        if self._draw.random() >= self.share:
            return result
        members = self.link.route_members(request_id)  # the route that computed it
        verdict = await self._check(request_id, state, start_pos, len(hidden), result.hidden)
        if verdict.ok:
            self.stats.worst_rel_ok = max(self.stats.worst_rel_ok, verdict.worst_rel)
            return result
        found = await self._attribute(request_id, start_pos) if len(members) > 1 else []
        self._accuse(found or members, verdict, attributed=bool(found))
        await self._move_here(request_id, state, start_pos)
        return await self._local_step(request_id, hidden, start_pos, verify)

    async def release(self, request_id: bytes) -> None:
        self._requests.pop(request_id, None)
        for key in (_check_key(request_id), _local_key(request_id)):
            await self.runner.call(self.engine.release, key)
        await self.link.release(request_id)

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait (a bounded time) for reports to the host still on their way: call before closing the link."""
        if self._reports:
            await asyncio.wait(list(self._reports), timeout=timeout)

    def close(self) -> None:
        self.runner.close()
        self.engine.close()

    # --- checking ---

    async def _check(self, rid: bytes, state: _State, start_pos: int, n: int, got: np.ndarray) -> Verdict:
        """Run the steps this cache lacks, up to and including the drawn one, in one catch-up, and
        compare the drawn step's rows. The steps come from the link: what it sent, in order."""
        begin = min(state.checked_pos, start_pos)  # (a request that rewound restarts from there)
        steps = [(p, h) for p, h in self.link.sent_steps(rid) if p >= begin]
        if not steps or steps[0][0] != begin or steps[-1][0] != start_pos:
            raise EngineError(f"cannot verify request {rid.hex()[:8]}: the link's record of its steps is "
                              f"incomplete")
        x = self.link.dtype.as_received(np.concatenate([h for _, h in steps]))  # what the trunk received
        t0 = time.perf_counter()
        outs = []
        for a in range(0, len(x), CATCH_UP_CHUNK):
            out, _ = await self.runner.run(Step(_check_key(rid), begin + a, hidden=x[a:a + CATCH_UP_CHUNK],
                                                rewind=True))
            outs.append(out)
        state.checked_pos = begin + len(x)
        local = self._sent_on(len(self.link.plan.stages) - 1, np.concatenate(outs)[-n:])  # what an honest trunk sends back
        self.stats.check_s += time.perf_counter() - t0
        self.stats.checked += 1
        self.stats.checked_tokens += len(x)
        return judge(got, local)

    async def _attribute(self, rid: bytes, start_pos: int) -> list[str]:
        """Which stages of a route of several returned wrong rows: the request's steps up to the
        drawn one are computed here stage by stage (every stage's clean input and output), and
        each stage is sent its clean input as a new request that comes back from it alone
        (ONE_STAGE); the stages whose rows are wrong are named. Empty when none is (a stage that lies
        only now and then, or only to requests that pass on through it), or a re-check failed: a
        stage is only ever named on its own answer, so one that lies cannot get another named."""
        stages = list(self.link.plan.stages)
        steps = [(p, h) for p, h in self.link.sent_steps(rid) if p <= start_pos]
        if not steps or steps[0][0] != 0 or steps[-1][0] != start_pos:
            return []
        wrong = []
        try:
            inputs = await asyncio.wait_for(self._stage_inputs(steps, stages), ATTRIBUTION_TIMEOUT_S)
            for i, stage in enumerate(stages):
                chunks = [(a, inputs[i][a:a + CATCH_UP_CHUNK]) for a in range(0, len(inputs[i]), CATCH_UP_CHUNK)]
                got = await asyncio.wait_for(self.link.run_stage(i, chunks), ATTRIBUTION_TIMEOUT_S)
                want = inputs[i + 1][chunks[-1][0]:]
                if not judge(got, want).ok:
                    wrong.append(stage.member)
        except (EngineError, SwarmError, ConnectionError, OSError, asyncio.TimeoutError) as e:
            log.warning("could not re-check the route stage by stage: %s", e)
            return []
        return wrong

    async def _stage_inputs(self, steps: list[tuple[int, np.ndarray]], stages: list) -> list[np.ndarray]:
        """Every stage's input for positions [0, end of the drawn step), and the last stage's
        output, computed here on engines of each stage's layers (made for this and closed)."""
        x = self.link.dtype.as_received(np.concatenate([h for _, h in steps]))
        inputs = [x]
        for i, stage in enumerate(stages):
            engine = SliceEngine(self.gguf, SliceSpec(stage.start, stage.stop), n_threads=self.n_threads,
                                 max_context=self.max_context, placement=self.placement)
            runner = BatchRunner(engine)
            try:
                outs = []
                for a in range(0, len(x), CATCH_UP_CHUNK):
                    out, _ = await runner.run(Step(b"attribute", a, hidden=x[a:a + CATCH_UP_CHUNK]))
                    outs.append(out)
            finally:
                runner.close()
                engine.close()
            x = self._sent_on(i, np.concatenate(outs))
            inputs.append(x)
        return inputs

    def _sent_on(self, stage: int, x: np.ndarray) -> np.ndarray:
        """Stage ``stage``'s output rows as the next hop delivers them (in the plan's dtype for it)."""
        stages = getattr(self.link.plan, "stages", [])
        dtype = stages[stage].send_dtype if 0 <= stage < len(stages) else DType.F32
        return dtype.as_received(x)

    def _accuse(self, members: list[str], verdict: Verdict, attributed: bool = False) -> None:
        self.stats.mismatches += 1
        version = int(getattr(self.link.plan, "version", -1))
        self.suspects.update(members)
        self.accusations.append(Accusation(tuple(members), version, verdict))
        who = f"trunk {members[0]}" if len(members) == 1 else f"one of the trunks {', '.join(members)}"
        how = "; found by re-checking the route stage by stage" if attributed else ""
        log.warning("%s returned a wrong result (verified locally: %s%s); reported to the host; the request "
                    "continues on this machine", who, verdict.describe(), how)
        report = m.BadResult(members=list(members), plan_version=version, layers=list(self.layers),
                             rows=verdict.rows, bad_rows=verdict.bad_rows, rel_error=_json_float(verdict.worst_rel),
                             cosine=_json_float(verdict.worst_cosine), attributed=attributed)
        task = asyncio.ensure_future(self.link.report(report))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    # --- another route: this machine ---

    async def _move_here(self, rid: bytes, state: _State, start_pos: int) -> None:
        """Replay the request's steps before ``start_pos`` here, one by one as they were sent (the
        same bits an honest trunk would have), and let go of the swarm's copy."""
        steps = [(p, h) for p, h in self.link.sent_steps(rid) if p < start_pos]
        await self.runner.call(self.engine.release, _check_key(rid))
        for p, h in steps:
            await self.runner.run(Step(_local_key(rid), p, hidden=h))
        state.local = True
        await self.link.release(rid)

    async def _local_step(self, rid: bytes, hidden: np.ndarray, start_pos: int, verify: bool = False) -> TrunkResult:
        t0 = time.perf_counter()
        out, timing = await self.runner.run(Step(_local_key(rid), start_pos, hidden=np.asarray(hidden, np.float32),
                                                 rewind=True, verify=verify))
        self.stats.local_steps += 1
        hop = Hop(LOCAL_STAGE, int(timing.queued_s * 1e6), int(timing.compute_s * 1e6), timing.batch_requests)
        return TrunkResult(out, (hop,), time.perf_counter() - t0)


def check_trunk_layers(gguf: GGUFFile, plan) -> None:
    """The verifier trusts its own copy of the trunk's layers: they must be the swarm's."""
    start, stop = plan.trunk_range
    hashes = plan.layer_hashes
    for layer in range(start, stop):
        if layer >= len(hashes) or gguf.layer_hash(layer) != hashes[layer]:
            raise EngineError(f"--verify recomputes the trunk's layers on this machine, but your copy of the "
                              f"model differs from the swarm's ({plan.model_name}) in layer {layer}; use --model "
                              f"with the swarm's GGUF")


def _check_key(rid: bytes) -> bytes:
    return b"check:" + bytes(rid)


def _local_key(rid: bytes) -> bytes:
    return b"local:" + bytes(rid)


def _json_float(x: float) -> float | None:
    return round(x, 6) if np.isfinite(x) else None
