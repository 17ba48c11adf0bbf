"""Continuous batching for one slice engine.

Coroutines submit steps (one request's new tokens) and await the output. Whenever the engine is
free, everything waiting (up to a token budget) runs as one ``forward_batch`` in the engine's own
thread, so decode steps of many requests share their matmuls, and a prefill shares a batch with
decodes. A step that fails its checks fails alone; the rest of the batch runs.

Which steps go first is fair by member (``fair_batch``), in rows as well as in steps: the member
that has had the fewest rows computed goes first (``FairShare``: deficit round robin by rows), one
step per turn, so a member with a hundred steps queued delays another member's step by at most one
batch, not by its whole queue, and a member whose steps are huge gets no more rows
than one whose steps are small. A step of more than ``SPLIT_ROWS`` rows (an honest asker sends
prompt chunks of 512 rows; a member may send 4096 at once) runs in chunks, batch by batch, other
members' steps between them; and while others wait a member's steps fill no more than an equal
share of a batch. So a one-row step waits for at most the batch running when it came (at
most ``max_batch_tokens`` rows, SPLIT_ROWS of them from one member's huge steps) and then runs beside
a share of one: one member's 4096-row prefills kept another's 4-token ask at a stage for 52 s
instead of 2.2, each of its steps waiting out a whole prefill.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from kernels.errors import EngineError
from kernels.slice import SliceEngine, Step

DEFAULT_MAX_BATCH_TOKENS = 1024
# A step of more rows than this runs in chunks, and one member's chunks in a batch come to no more
# than this: the asker's own prompt chunk (swarmctl/asker/head_tail.py PREFILL_CHUNK), so an honest
# step is never split, and a huge one delays others no more than an honest prompt chunk does.
# Chunks are at least MIN_SPLIT_ROWS where they fill the rest of a batch (smaller ones would only
# add graph shapes).
SPLIT_ROWS = 512
MIN_SPLIT_ROWS = 64

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


@dataclass(eq=False)  # (one waiting step is itself: compared by identity, never by its arrays)
class _Pending:
    step: Step
    n_tokens: int
    future: asyncio.Future
    member: str = ""  # whose request it is: steps are taken by turns per member
    submitted: float = field(default_factory=time.perf_counter)
    split: bool = False  # may run in chunks (over a batch's rows, and its outputs can be joined)
    done: int = 0  # rows already run, in earlier chunks
    outputs: list = field(default_factory=list)  # those chunks' outputs
    compute_s: float = 0.0  # their batches' compute time

    @property
    def rows_left(self) -> int:
        return self.n_tokens - self.done

    def chunk(self, rows: int) -> Step:
        """The step that runs the next ``rows`` rows (the step itself when that is all of it)."""
        step, a = self.step, self.done
        if a == 0 and rows == self.n_tokens:
            return step
        return replace(step, start_pos=step.start_pos + a, rewind=step.rewind and a == 0,
                       tokens=None if step.tokens is None else step.tokens[a:a + rows],
                       hidden=None if step.hidden is None else step.hidden[a:a + rows])


class FairShare:
    """Rows each member has had computed here, for the order of the next batch: fewest first
    (deficit round robin by rows). A member that comes back after a pause comes back level with
    the members being served (``clock``), not ahead by all the rows it did not ask for meanwhile."""

    MAX_MEMBERS = 4096  # records kept before those level with the clock (as good as new) go

    def __init__(self) -> None:
        self._rows: dict[str, int] = {}
        self.clock = 0  # the level of the latest turn taken

    def level(self, member: str) -> int:
        return max(self._rows.get(member, 0), self.clock)

    def charge(self, member: str, rows: int) -> None:
        start = self.level(member)
        self.clock = max(self.clock, start)
        self._rows[member] = start + rows

    def forget_idle(self, waiting: set[str]) -> None:
        if len(self._rows) > self.MAX_MEMBERS:
            self._rows = {m: n for m, n in self._rows.items() if m in waiting or n > self.clock}


def _take(queue: list[_Pending], seen: set[bytes], fits: int, chunk: int, alone: bool) -> tuple[_Pending, int] | None:
    """A member's next step for a batch where ``fits`` rows are left to it (``alone``: the batch
    is empty), and how many of its rows run (of a step that may be split, at most ``chunk``): its
    own steps in the order they came, at most one per request; a step that cannot be split and
    does not fit runs only alone."""
    for p in queue:
        if p.step.key in seen:
            continue  # a request's next step waits for this one
        if p.split:
            rows = min(p.rows_left, fits, chunk)
            if rows > 0 and rows >= min(p.rows_left, MIN_SPLIT_ROWS, chunk):
                return p, rows
        elif p.rows_left <= fits or alone:
            return p, p.rows_left
    return None


def fair_batch(pending: list[_Pending], max_tokens: int, share: FairShare) -> list[tuple[_Pending, int]]:
    """The steps of the next batch, as (step, rows of it that run), charged to their members in
    ``share``: the member with the fewest rows so far takes the next turn (ties: its oldest step
    first), one step or chunk a turn, each member's own steps in the order they came; at most one
    step per request; within ``max_tokens`` rows unless a step that cannot be split is alone;
    while several members wait, a member's steps after its first take no more than an equal share
    of the batch; and a member's chunks of split steps no more than SPLIT_ROWS rows."""
    queues: dict[str, list[_Pending]] = {}
    for p in pending:  # (pending is in arrival order, so each queue is too)
        queues.setdefault(p.member, []).append(p)
    fair = max(1, max_tokens // max(1, len(queues)))  # a member's share of this batch
    taken: dict[str, int] = {}
    chunked: dict[str, int] = {}  # rows of split steps taken, by member
    batch: list[tuple[_Pending, int]] = []
    seen: set[bytes] = set()
    budget = max_tokens
    while True:
        order = sorted(queues, key=lambda m: (share.level(m), queues[m][0].submitted))
        for member in order:
            fits = budget if member not in taken else min(budget, fair - taken[member])
            chunk = min(fair, SPLIT_ROWS) - chunked.get(member, 0)
            picked = _take(queues[member], seen, fits, chunk, alone=not batch)
            if picked is not None:
                break
        else:
            return batch
        p, rows = picked
        batch.append(picked)
        seen.add(p.step.key)
        budget -= rows
        taken[member] = taken.get(member, 0) + rows
        if p.split:
            chunked[member] = chunked.get(member, 0) + rows
        share.charge(member, rows)
        queues[member].remove(p)
        if not queues[member]:
            del queues[member]


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
        self._share = FairShare()  # rows each member has had here (fair_batch)

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
        pending = _Pending(step, n, loop.create_future(), member, split=n > min(SPLIT_ROWS, self.max_batch_tokens) and self._joinable(step))
        self._pending.append(pending)
        if not self._running:
            self._running = True
            loop.create_task(self._drain())
        return await pending.future

    def _joinable(self, step: Step) -> bool:
        """Whether a step's outputs, run in chunks, join into its own: every row's activations (a
        slice without the LM head), not logits of its last row or hidden states beside them."""
        spec = self.engine.slice
        return not (spec.has_lm_head or spec.nextn or step.hidden_rows) and \
            (step.tokens is None) != (step.hidden is None)

    async def call(self, fn, *args):
        """Run something else on the engine's thread, between batches (release, load, stats)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                for pending in [p for p in self._pending if p.future.done()]:
                    self._pending.remove(pending)  # cancelled while queued (a client gone): never run it
                chosen = fair_batch(self._pending, self.max_batch_tokens, self._share)
                if not chosen:
                    continue
                self._share.forget_idle({p.member for p in self._pending})
                # A canonical order: the same requests make the same graph shape whatever order they
                # arrived in, so the engine reuses the built graph instead of building another.
                chosen.sort(key=lambda pick: pick[0].step.key)
                batch = [p for p, _ in chosen]
                steps = [p.chunk(rows) for p, rows in chosen]
                for pending, rows in chosen:
                    if rows == pending.rows_left:
                        self._pending.remove(pending)  # (a step with chunks left keeps its place)
                started, wall, cpu = time.perf_counter(), time.time(), time.process_time()
                try:
                    results = await loop.run_in_executor(self._executor, self._run_batch, steps)
                except Exception as e:  # noqa: BLE001 - the executor itself failed: no step may wait forever
                    results = [EngineError(f"{type(e).__name__}: {e}")] * len(batch)
                compute, cpu_s = time.perf_counter() - started, time.process_time() - cpu
                ok = [r for r in results if not isinstance(r, Exception)]
                timing_tokens = sum(rows for (_, rows), r in zip(chosen, results) if not isinstance(r, Exception))
                self.stats.batches += 1
                self.stats.steps += len(ok)
                self.stats.tokens += timing_tokens
                self.stats.busy_s += compute
                self.stats.largest_batch = max(self.stats.largest_batch, len(ok))
                self.stats.recent.append(BatchRecord(wall, compute, tuple(
                    p.step.key for p, r in zip(batch, results) if not isinstance(r, Exception)), timing_tokens,
                    cpu_s))
                for (pending, rows), result in zip(chosen, results):
                    if pending.future.done():
                        continue
                    if isinstance(result, Exception):
                        if pending in self._pending:
                            self._pending.remove(pending)  # (its later chunks cannot run either)
                        pending.future.set_exception(result)
                        continue
                    pending.done += rows
                    pending.outputs.append(result)
                    pending.compute_s += compute
                    if pending.rows_left == 0:
                        out = pending.outputs[0] if len(pending.outputs) == 1 else np.concatenate(pending.outputs)
                        # (queued: until its last chunk's batch began, less its earlier chunks' compute)
                        waited = started - pending.submitted - (pending.compute_s - compute)
                        pending.future.set_result((out, StepTiming(waited, pending.compute_s, len(ok),
                                                                   timing_tokens)))
        finally:
            self._running = False

    def _run_batch(self, steps: list[Step]) -> list[np.ndarray | Exception]:
        """In the engine thread: drop steps that fail their checks, run the rest as one batch."""
        if self._closed:  # (a batch queued behind the job that closed this runner and its engine: ggml
            # would abort the process on the freed backend; found by the simulator, moe seed 41)
            return [EngineClosedError("this engine is closed")] * len(steps)
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
