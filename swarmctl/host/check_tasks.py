"""Running the host's checks of trunks: each check is a task of its own on the event loop; one that
raised (the host's own side: a module missing while packages were being reinstalled, a file it
could not read) is tried again with backoff, why it failed shown on the trunk meanwhile; a trunk
answers one challenge at a time, and the host times one trunk at a time. What a check asks and
what its outcome does are ClaimChecks' (checks.py, check_core.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Coroutine

from kernels.gguf_file import GGUFFile
from net import clock
from net import messages as m
from swarmctl.node import layer_proof

from .check_core import stage_serving
from .trunks import TrunkInfo

log = logging.getLogger("swarmctl.host")


class CheckTasks:
    def __init__(self, gguf: GGUFFile, retry_delay: Callable[[int], float],
                 current: Callable[[str, TrunkInfo], bool]) -> None:
        """``retry_delay``: how long after ``failures`` raised checks in a row to try again;
        ``current``: whether a trunk is still the one registered under its name."""
        self.gguf = gguf  # the host's own copy of the layers: the answers are checked against it
        self.retry_delay = retry_delay
        self.current = current
        self._timing_lock = asyncio.Lock()  # one speed probe at a time
        # one challenge per trunk at a time: a trunk keeps one probe, and a second check's probe
        # replaced the first's mid-run ("no such probe run": a model-less trunk is checked on its
        # trial layers and, as an expert node, on its experts at once)
        self._challenging: dict[int, asyncio.Lock] = {}
        self._tasks: dict[asyncio.Task, None] = {}  # (cancelled in the order they began, on every run)

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks[task] = None
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("checking a trunk failed: %r", task.exception())

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def retrying(self, name: str, trunk: TrunkInfo, check: Callable[[], Awaitable[None]],
                       wanted: Callable[[], bool]) -> None:
        """Run ``check``; where it raises (the host could not make the check, which says nothing
        about the trunk), note why on the trunk, for status, and try again later, for as long as
        the trunk is the one registered and ``wanted()`` says the check is still needed."""
        failures = 0
        while True:
            try:
                await check()
            except Exception as e:  # noqa: BLE001 - any failure of the host's own side is retried
                failures += 1
                delay = self.retry_delay(failures)
                trunk.check_failed(f"{type(e).__name__}: {e}", failures, clock.now() + delay)
                log.warning("checking trunk %s's claims failed (%s, %d time%s): trying again in %.0f s", name,
                            trunk.check_error, failures, "" if failures == 1 else "s", delay)
                await asyncio.sleep(delay)
                if self.current(name, trunk) and not trunk.refused and wanted():
                    continue
                if trunk.proving is not None and not wanted():
                    trunk.proving = None
            trunk.check_error = ""
            return

    async def challenge(self, trunk: TrunkInfo, layers: list[int], probe_layer: int | None,
                        experts: tuple[int, int] | None = None) -> layer_proof.Outcome:
        """``trunk`` proves it holds ``layers`` (and is timed on ``probe_layer``): swarmctl/node/layer_proof.py."""
        async with self._challenging.setdefault(id(trunk), asyncio.Lock()):
            return await layer_proof.challenge(trunk.conn, self.gguf, layers, probe_layer=probe_layer,
                                               claimed_ms=trunk.ms_per_layer_token, timing_lock=self._timing_lock,
                                               experts=experts)


async def ask_serving(trunk: TrunkInfo) -> bool:
    """Whether the member's stage is serving, by its own stats (check_core.py ``stage_serving``).
    One that cannot say counts as idle: the timing run finds out."""
    try:
        reply = await trunk.conn.request(m.encode(m.GetStats()), timeout=5.0)
        return stage_serving(m.decode(reply.body, m.Stats))
    except Exception as e:  # noqa: BLE001 - any failure to answer: the challenge itself will tell
        log.debug("asking a trunk whether it serves failed: %r", e)
        return False
