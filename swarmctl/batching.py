"""Continuous batching for one slice engine.

Coroutines submit steps (one request's new tokens) and await the output. Whenever the engine is
free, everything waiting (up to a token budget) runs as one ``forward_batch`` in the engine's own
thread, so decode steps of many requests share their matmuls, and a prefill shares a batch with
decodes. A step that fails its checks fails alone; the rest of the batch runs.

Which steps go first is fair by member (``fair_batch``): members take turns, one step each, the
one served least recently first, so a member with a hundred steps queued delays another member's
step by at most one batch, not by its whole queue (issue 30 item 1).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kernels.errors import EngineError
from kernels.slice import SliceEngine, Step

DEFAULT_MAX_BATCH_TOKENS = 1024

# All engines of a process compute on one thread. ggml parallelises each graph with OpenMP, and
# an OpenMP team belongs to the thread that started it: engines on separate threads would each
# keep a team whose idle threads spin and steal the cores from the team doing the work (measured:
# 38 against 95 tokens/s for the same model on 2 cores).
_COMPUTE_THREAD: concurrent.futures.ThreadPoolExecutor | None = None


def compute_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _COMPUTE_THREAD
    if _COMPUTE_THREAD is None:
        # The compute thread needs the GIL between kernels (inputs, outputs); while the event loop
        # runs Python (QUIC) it waits up to the switch interval, 5 ms by default, per handover.
        # Measured: an asker's head step took 13.9 ms instead of 1.2 under WAN traffic.
        sys.setswitchinterval(0.0005)
        _COMPUTE_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggml")
    return _COMPUTE_THREAD


class EngineClosedError(EngineError):
    """The engine stopped (a stage reloading other layers) while the step waited."""


@dataclass
class StepTiming:
    """Where one step's time at this engine went."""

    queued_s: float  # waiting for the engine
    compute_s: float  # the batch's forward pass
    batch_requests: int  # requests in that batch
    batch_tokens: int


@dataclass
class _Pending:
    step: Step
    n_tokens: int
    future: asyncio.Future
    member: str = ""  # whose request it is: steps are taken by turns per member
    submitted: float = field(default_factory=time.perf_counter)


def fair_batch(pending: list[_Pending], max_tokens: int, last_turn: dict[str, int]) -> list[_Pending]:
    """The steps of the next batch: members take turns (the one whose last turn is oldest first,
    then by its oldest step), one step each per round, each member's own steps in the order they
    came; at most one step per request, and within ``max_tokens`` unless a step is alone."""
    queues: dict[str, list[_Pending]] = {}
    for p in pending:  # (pending is in arrival order, so each queue is too)
        queues.setdefault(p.member, []).append(p)
    order = sorted(queues, key=lambda member: (last_turn.get(member, -1), queues[member][0].submitted))
    batch: list[_Pending] = []
    seen: set[bytes] = set()
    budget = max_tokens
    progress = True
    while progress:
        progress = False
        for member in order:
            queue = queues[member]
            for i, p in enumerate(queue):
                if p.step.key in seen or (batch and p.n_tokens > budget):
                    continue  # a request's next step waits for this one; an oversize step for the next batch
                batch.append(queue.pop(i))
                seen.add(p.step.key)
                budget -= p.n_tokens
                progress = True
                break
    return batch


@dataclass(frozen=True)
class BatchRecord:
    """One batch, for occupancy views: when it ran (wall clock) and which requests were in it."""

    started: float  # time.time()
    seconds: float
    request_ids: tuple[bytes, ...]
    tokens: int
    # this process's CPU time over the batch: a batch that got too little of it was starved by
    # other processes, and says nothing about this machine's speed (kernels/speed.py)
    cpu_s: float | None = None


@dataclass
class RunnerStats:
    batches: int = 0
    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    largest_batch: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=1024))  # BatchRecord, newest last


class BatchRunner:
    def __init__(self, engine: SliceEngine, *, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.stats = RunnerStats()
        self._pending: list[_Pending] = []
        self._executor = compute_thread()
        self._running = False
        self._closed = False
        self._batches = 0
        self._last_turn: dict[str, int] = {}  # member → the batch its last step ran in (fair_batch)

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    async def run(self, step: Step, member: str = "") -> tuple[np.ndarray, StepTiming]:
        """Submit one step of ``member``'s request; returns its output and how long it queued
        and computed."""
        if self._closed:
            raise EngineClosedError("this engine is closed")
        loop = asyncio.get_running_loop()
        n = len(step.tokens) if step.tokens is not None else int(np.asarray(step.hidden).shape[0])
        pending = _Pending(step, n, loop.create_future(), member)
        self._pending.append(pending)
        if not self._running:
            self._running = True
            loop.create_task(self._drain())
        return await pending.future

    async def call(self, fn, *args):
        """Run something else on the engine's thread, between batches (release, load, stats)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                for pending in [p for p in self._pending if p.future.done()]:
                    self._pending.remove(pending)  # cancelled while queued (a client gone): never run it
                batch = fair_batch(self._pending, self.max_batch_tokens, self._last_turn)
                if not batch:
                    continue
                self._batches += 1
                for pending in batch:
                    self._pending.remove(pending)
                    self._last_turn[pending.member] = self._batches
                if len(self._last_turn) > 4096:  # (members come and go: keep those still waiting)
                    self._last_turn = {p.member: self._last_turn.get(p.member, -1) for p in self._pending}
                # A canonical order: the same requests make the same graph shape whatever order they
                # arrived in, so the engine reuses the built graph instead of building another.
                batch.sort(key=lambda p: p.step.key)
                started, wall, cpu = time.perf_counter(), time.time(), time.process_time()
                try:
                    results = await loop.run_in_executor(self._executor, self._run_batch, [p.step for p in batch])
                except Exception as e:  # noqa: BLE001 - the executor itself failed: no step may wait forever
                    results = [EngineError(f"{type(e).__name__}: {e}")] * len(batch)
                compute, cpu_s = time.perf_counter() - started, time.process_time() - cpu
                ok = [r for r in results if not isinstance(r, Exception)]
                timing_tokens = sum(p.n_tokens for p, r in zip(batch, results) if not isinstance(r, Exception))
                self.stats.batches += 1
                self.stats.steps += len(ok)
                self.stats.tokens += timing_tokens
                self.stats.busy_s += compute
                self.stats.largest_batch = max(self.stats.largest_batch, len(ok))
                self.stats.recent.append(BatchRecord(wall, compute, tuple(
                    p.step.key for p, r in zip(batch, results) if not isinstance(r, Exception)), timing_tokens,
                    cpu_s))
                for pending, result in zip(batch, results):
                    if pending.future.done():
                        continue
                    if isinstance(result, Exception):
                        pending.future.set_exception(result)
                    else:
                        pending.future.set_result((result, StepTiming(started - pending.submitted, compute, len(ok),
                                                                      timing_tokens)))
        finally:
            self._running = False

    def _run_batch(self, steps: list[Step]) -> list[np.ndarray | Exception]:
        """In the engine thread: drop steps that fail their checks, run the rest as one batch."""
        results: list[np.ndarray | Exception | None] = [None] * len(steps)
        good = []
        for i, step in enumerate(steps):
            try:
                self.engine.check_step(step)
                good.append(i)
            except EngineError as e:
                results[i] = e
        if good:
            try:
                for i, out in zip(good, self.engine.forward_batch([steps[i] for i in good])):
                    results[i] = out
            except Exception as e:  # noqa: BLE001 - e.g. no memory for the KV cache: fail this batch, keep serving
                for i in good:
                    results[i] = e if isinstance(e, EngineError) else EngineError(f"{type(e).__name__}: {e}")
        return results  # type: ignore[return-value]

    async def aclose(self, reason: str = "the stage is reloading") -> None:
        """Fail whatever still waits and let a running batch finish; the engine is then free."""
        self._closed = True
        for pending in self._pending:
            if not pending.future.done():
                pending.future.set_exception(EngineClosedError(reason))
        self._pending.clear()
        await self.call(lambda: None)  # the compute thread has finished anything of ours it had

    def close(self) -> None:
        self._closed = True
