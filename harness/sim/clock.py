"""An asyncio event loop on a virtual clock: ``loop.time()`` is simulated time, and when nothing
is ready to run, the loop jumps to its next timer instead of sleeping (an hour of idle swarm costs
no wall time). Product code that reads the clock through its loop (aioquic's timers do, and every
``asyncio.sleep``/``wait_for``) runs unchanged.

Work handed to threads (``run_in_executor``: the engine's compute thread, ``asyncio.to_thread``)
runs inline by default, taking no virtual time; with ``inline_threads = False`` it runs on its
thread and freezes the clock until it comes back. Either way a thread's wall time never leaks
into virtual time.
"""

from __future__ import annotations

import asyncio
import heapq
import selectors
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from harness.sim.network import CURRENT_NODE, SimNetwork

# Virtual time starts here (not 0: product code treats 0.0 as "never", e.g. a step's sent_at).
EPOCH = 1000.0
# Each turn of the loop takes this much virtual time, as a real loop's turns take real time: code
# that re-arms a timer for "now" (a pacer with nothing left to wait for) moves on instead of
# spinning at one instant forever (seed 202 did, at 0.647 s).
ITERATION_S = 1e-6
# A loop with nothing scheduled, no thread at work and no I/O would wait forever: it waits this
# long in real time for I/O it cannot see (a real socket a node opened), then reports being stuck.
STUCK_POLL_S = 0.05
# The wall-time limit is read every this many turns of the loop, not every turn (a run takes
# tens of thousands of turns; reading the clock was a cost of its own).
WALL_CHECK_TURNS = 256


def _threads() -> str:
    """Where every other thread is (for a run that hung on one)."""
    import sys
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    return "; ".join(f"{names.get(ident, ident)} at " + " < ".join(
        f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(traceback.extract_stack(frame)[-4:]))
        for ident, frame in sys._current_frames().items() if ident != threading.get_ident())


class WallLimit(RuntimeError):
    """A run took longer in real time than it may (``VirtualClockLoop.limit_wall``)."""


class VirtualSelector(selectors.BaseSelector):
    """The loop's real selector (its self-pipe wakes it when a thread finishes), with ``select``
    advancing the virtual clock instead of sleeping."""

    def __init__(self) -> None:
        self.real = selectors.DefaultSelector()
        self.loop: VirtualClockLoop | None = None

    def register(self, fileobj, events, data=None):
        return self.real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self.real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self.real.modify(fileobj, events, data)

    def get_map(self):
        return self.real.get_map()

    def close(self) -> None:
        self.real.close()

    def select(self, timeout: float | None = None):
        loop = self.loop
        if loop is None:
            return self.real.select(0)
        loop.turns += 1
        if not loop.turns % WALL_CHECK_TURNS:
            loop.check_wall()
        loop._now += ITERATION_S
        if loop.stopped and loop.hold_stopped():  # (the timeout was worked out with them: look again)
            return []
        if loop.threads.jobs and loop.threads.computing(loop.stopped):  # the clock stands still until the thread is back
            if timeout == 0:
                return self.real.select(0)
            # (until the thread wakes the loop, or the wall-time limit passes: a thread whose result
            # never comes back is reported, not waited for forever)
            events = self.real.select(loop.wall_left())
            if not events:
                loop.check_wall()
            return events
        if timeout == 0:  # callbacks are ready: real I/O waits for the loop's next idle turn (a syscall saved)
            return []
        events = self.real.select(0)
        if events:
            return events
        if timeout is None:  # nothing scheduled at all: only real I/O could wake us
            loop.stuck_polls += 1
            return self.real.select(STUCK_POLL_S)
        loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = EPOCH) -> None:
        selector = VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = self.start = start
        self.wall_limit = 0.0
        self.wall_deadline = 0.0  # time.perf_counter() past which the loop raises WallLimit (0: never)
        # Executor calls run inline, on the loop's own thread, by default: a thread's work then ends
        # at the same point of the run on every replay (with real threads, how many turns of the
        # loop ran meanwhile depended on this machine's speed). A compute thread that waits on
        # the loop (a mixture-of-experts stage calling remote experts) needs real threads (False).
        self.inline_threads = True
        self.threads_busy = 0  # executor calls not yet back on the loop
        self.threads = ThreadJobs(self._write_to_self)  # those calls: started or queued, waiting on the loop or not
        self.turns = 0  # turns of the loop so far
        self.stuck_polls = 0  # times the loop had nothing at all to wait for (see STUCK_POLL_S)
        self.network: SimNetwork | None = None  # where datagram endpoints bind (None: the kernel)
        # node → the tasks it started, oldest first (a kill cancels them in that order on every
        # replay: a WeakSet's order is that of the tasks' addresses)
        self.node_tasks: dict[str, NodeTasks] = {}
        self.set_task_factory(self._new_task)
        # Nodes stopped as by SIGSTOP: none of their callbacks or timers runs until they go on;
        # node → (its ready callbacks, its timers), held out of the loop's queues meanwhile
        self.stopped: set[str] = set()
        self._held: dict[str, tuple[list[asyncio.Handle], list[asyncio.TimerHandle]]] = {}

    def _new_task(self, loop, coro, **kwargs) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        node = kwargs["context"].get(CURRENT_NODE, "") if kwargs.get("context") else CURRENT_NODE.get()
        tasks = self.node_tasks.get(node)
        if tasks is None:  # (not setdefault: an object made for every task was a cost of its own)
            tasks = self.node_tasks[node] = NodeTasks()
        tasks.add(task)
        return task

    async def create_datagram_endpoint(self, protocol_factory, local_addr=None, remote_addr=None, *, sock=None,
                                       **kwargs):
        """Bound on the simulated network: the node's real socket only reserves its port."""
        if self.network is None:
            return await super().create_datagram_endpoint(protocol_factory, local_addr, remote_addr, sock=sock,
                                                          **kwargs)
        protocol = protocol_factory()
        transport = self.network.bind(protocol, sock, local_addr)
        protocol.connection_made(transport)
        return transport, protocol

    def stop_node(self, node: str) -> None:
        """SIGSTOP: from the next turn of the loop, nothing of ``node``'s runs (what its sockets
        receive meanwhile is the network's to hold: SimNetwork.stop)."""
        self.stopped.add(node)
        self._held.setdefault(node, ([], []))

    def continue_node(self, node: str) -> None:
        """SIGCONT: its callbacks run again, first those that were ready, then its timers, every
        one that came due meanwhile at once."""
        self.stopped.discard(node)
        ready, timers = self._held.pop(node, ([], []))
        self._ready.extend(ready)
        for timer in timers:
            heapq.heappush(self._scheduled, timer)

    def hold_stopped(self) -> bool:
        """Moves the stopped nodes' callbacks and timers out of the loop's queues (each runs in
        its node's context, CURRENT_NODE); True if any moved."""
        ready, held_ready = self._partition(self._ready, 0)
        timers, held_timers = self._partition(self._scheduled, 1)
        if held_ready:
            self._ready = type(self._ready)(ready)
        if held_timers:
            self._scheduled = timers
            heapq.heapify(self._scheduled)
        return bool(held_ready or held_timers)

    def _partition(self, handles, which: int) -> tuple[list, int]:
        """``handles`` not of a stopped node, and how many of a stopped node's went to its held
        list ``which`` (0: ready callbacks, 1: timers)."""
        kept, held = [], 0
        for handle in handles:
            node = handle._context.get(CURRENT_NODE, "")
            if node in self.stopped:
                self._held[node][which].append(handle)
                held += 1
            else:
                kept.append(handle)
        return kept, held

    def limit_wall(self, seconds: float) -> None:
        self.wall_limit, self.wall_deadline = seconds, time.perf_counter() + seconds

    def wall_left(self) -> float | None:
        """Real seconds until the wall-time limit (None: no limit)."""
        return max(0.0, self.wall_deadline - time.perf_counter()) if self.wall_deadline else None

    def check_wall(self) -> None:
        if self.wall_deadline and time.perf_counter() > self.wall_deadline:
            raise WallLimit(f"still running after {self.wall_limit:g} s of wall time, at virtual "
                            f"{self.time() - self.start:.3f} s (a livelock, or a thread that never came back: "
                            f"{self.threads_busy} out; {_threads()})")

    def time(self) -> float:
        return self._now

    def jump_to(self, when: float) -> None:
        """The clock set forward to ``when`` (a run's swarm starts at the same instant whatever
        the loop did before it)."""
        if when < self._now:
            raise ValueError(f"the clock is at {self._now}, past {when}")
        self._now = when

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds

    def run_in_executor(self, executor, func, *args):
        if self.inline_threads:  # run now, on the loop's thread: when it returns cannot depend on this machine
            future = self.create_future()
            try:
                future.set_result(func(*args))
            except Exception as e:  # noqa: BLE001 - the caller's to handle, as from a thread
                future.set_exception(e)
            return future
        job = self.threads.submitted(executor if executor is not None else self._default_executor, CURRENT_NODE.get())
        future = super().run_in_executor(executor, self.threads.run, job, func, *args)
        self.threads_busy += 1
        future.add_done_callback(lambda _future: self._thread_back(job))
        return future

    def _thread_back(self, job: "_Job") -> None:
        self.threads_busy -= 1
        self.threads.back(job)


class NodeTasks:
    """A node's tasks, oldest first, held weakly (a finished task is not kept for a kill that may
    never come). Weak references in a list, not a WeakValueDictionary: a run starts thousands of
    tasks, and the dictionary's bookkeeping for each (a keyed reference with its callback) cost
    more than starting the task did."""

    PRUNE_FLOOR = 64  # dead references are cleared out once there are this many, or as many as the live ones

    def __init__(self) -> None:
        self._refs: list[weakref.ref[asyncio.Task]] = []
        self._prune_at = self.PRUNE_FLOOR

    def add(self, task: asyncio.Task) -> None:
        self._refs.append(weakref.ref(task))
        if len(self._refs) >= self._prune_at:  # (amortised: the list stays within twice the live tasks)
            self._refs = [ref for ref in self._refs if ref() is not None]
            self._prune_at = max(self.PRUNE_FLOOR, 2 * len(self._refs))

    def values(self) -> list[asyncio.Task]:
        """The tasks still alive, oldest first."""
        return [task for ref in self._refs if (task := ref()) is not None]


@dataclass(eq=False)
class _Job:
    executor: object  # (None: the loop's default executor, not made yet)
    node: str = ""  # whose code asked for it
    started: bool = False
    waiting: int = 0  # coroutines it handed the loop and waits on (LoopWaits)
    finished: bool = False  # its thread is done with it
    back: bool = False  # its result (or its caller's cancellation) is on the loop


class ThreadJobs:
    """The executor calls out on threads, for when the clock may move with real threads: not while
    one computes (or has finished and its result is not back on the loop yet), nor while one is
    queued where a worker is free to start it; yes while every one waits on the loop (LoopWaits)
    or is queued behind workers that all do (a mixture-of-experts stage's compute thread waiting
    for its expert calls, and the next batch of that stage queued behind it).

    A job is done once its thread is and its result is back on the loop, in either order: a
    caller cancelled (a killed node's task) leaves its thread running, and holding its worker,
    until the job ends (seed 14 of the moe world waited for a queued job that could not start)."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self.wake = wake  # (from a thread: the loop looks again at whether its clock may move)
        self.lock = threading.Lock()
        self.jobs: list[_Job] = []
        self.local = threading.local()  # the job a thread runs
        self.on_wait: list[Callable[[], None]] = []  # told (on the waiting thread) when a job starts to wait

    def submitted(self, executor, node: str = "") -> _Job:
        job = _Job(executor, node)
        with self.lock:
            self.jobs.append(job)
        return job

    def run(self, job: _Job, func, *args):
        """On the worker thread."""
        with self.lock:
            job.started = True
        self.local.job = job
        try:
            return func(*args)
        finally:
            self.local.job = None
            with self.lock:
                job.finished = True
                self._forget(job)
            self.wake()

    def back(self, job: _Job) -> None:
        """On the loop, once the call's result (or its cancellation) is there."""
        with self.lock:
            job.back = True
            self._forget(job)

    def _forget(self, job: _Job) -> None:
        if job.back and (job.finished or not job.started) and job in self.jobs:
            self.jobs.remove(job)  # (not started and cancelled: the executor never runs it)

    def waits(self, delta: int) -> bool:
        """The calling thread hands the loop a coroutine (+1) or has its result (-1); False when
        the thread runs no job of ours."""
        job = getattr(self.local, "job", None)
        if job is None:
            return False
        with self.lock:
            job.waiting += delta
        if delta > 0:
            for told in list(self.on_wait):
                told()
        return True

    def computing(self, stopped: set[str] | frozenset[str] = frozenset()) -> bool:
        """``stopped``: nodes stopped as by SIGSTOP, whose finished jobs' results wait with the rest
        of their callbacks (VirtualClockLoop.hold_stopped) until they go on: the clock moves meanwhile."""
        with self.lock:
            if any(job.started and not job.finished and job.waiting <= 0 for job in self.jobs):
                return True
            if any(job.finished and not job.back and job.node not in stopped for job in self.jobs):
                return True  # (its result is on its way to the loop)
            for job in self.jobs:
                if not job.started and not job.back:
                    workers = getattr(job.executor, "_max_workers", 1 << 30)
                    busy = sum(1 for j in self.jobs if j.started and not j.finished and j.executor is job.executor)
                    if busy < workers:
                        return True  # (a worker is free: it starts any moment)
            return False


class LoopWaits:
    """While on, for a loop with real threads: a thread that hands the loop a coroutine
    (``asyncio.run_coroutine_threadsafe``: a mixture-of-experts stage's compute thread calling its
    expert nodes) counts as waiting on the loop until the coroutine's result is set, and the clock
    moves on meanwhile as when no thread is out (the coroutine's datagrams need virtual time to
    arrive; with the clock frozen they never would). The waiter is counted once the coroutine is
    on the loop's queue, so the loop cannot jump ahead of it. Nothing changes for inline threads."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self.loop = loop
        self.real = asyncio.run_coroutine_threadsafe

    def __enter__(self) -> "LoopWaits":
        if not self.loop.inline_threads:
            asyncio.run_coroutine_threadsafe = self._counted
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe = self.real

    def _counted(self, coro, loop):
        future = self.real(coro, loop)
        if loop is self.loop and self.loop.threads.waits(+1):
            job = self.loop.threads.local.job
            future.add_done_callback(lambda _future: self._back(job))
            # (the loop may have looked before the count and be waiting for this thread: wake it
            # to look again, now that the clock may move)
            loop._write_to_self()
        return future

    def _back(self, job: _Job) -> None:
        with self.loop.threads.lock:
            job.waiting -= 1


def new_loop(start: float = EPOCH) -> VirtualClockLoop:
    return VirtualClockLoop(start)
