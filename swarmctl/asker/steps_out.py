"""The asker's steps out, on the I/O side: the future each one's coroutine waits on, what it
cost on the wire, and failing them over. The replay table (``swarmctl/asker/replay.py``) keeps
what to resend; the stall clock (``swarmctl/asker/link_core.py``) when to."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Iterable

from net import clock
from net.wire import ActivationPacket, PacketKind
from swarmctl.asker.plan_watch import SwarmError
from swarmctl.asker.link_core import ReroutePolicy, RouteFailed, StallClock
from swarmctl.asker.replay import Conn, OpenRoute


@dataclass
class StepOut:
    """A step out. A route failure fails ``result`` and puts a fresh one in its place at once, so an
    answer that a replay brings back before the step's coroutine woke up still finds it."""

    result: asyncio.Future
    route: OpenRoute | None = field(default=None, init=False)  # where it was last sent
    failures: int = field(default=0, init=False)  # route failures it was told of (one may come while it is handed over)
    sent_bytes: int = field(default=0, init=False)  # its frame as sent, and its result's as received (for the trace)
    received_bytes: int = field(default=0, init=False)
    received_at: float = field(default=0.0, init=False)  # time.perf_counter() as the result's frame arrived
    stall: StallClock = field(default_factory=StallClock, init=False)

    def sent(self, route: OpenRoute, now: float, rows: int) -> None:
        self.route = route
        self.stall.sent(now, rows)

    async def answer(self, deadline: float, timeout_s: float) -> ActivationPacket:
        """The step's result, as it arrives (a route failure raises RouteFailed; a refusal, or no
        answer by ``deadline``, SwarmError)."""
        try:
            result = await asyncio.wait_for(asyncio.shield(self.result), max(0.1, deadline - clock.now()))
        except asyncio.TimeoutError:
            raise SwarmError(f"the swarm did not answer within {timeout_s:.0f}s") from None
        if result.kind == PacketKind.ERROR:
            raise SwarmError(f"the swarm refused the request: {result.message}")
        return result

    def overdue(self, now: float, per_row_s: float, policy: ReroutePolicy) -> float | None:
        if self.route is None or self.result.done():
            return None
        return self.stall.overdue(now, per_row_s, policy)


class StepsOut:
    """Request → start position → its step out."""

    def __init__(self) -> None:
        self._steps: dict[bytes, dict[int, StepOut]] = {}

    def add(self, rid: bytes, start_pos: int) -> StepOut:
        step = self.of(rid, create=True)[start_pos] = StepOut(asyncio.get_running_loop().create_future())
        return step

    def of(self, rid: bytes, create: bool = False) -> dict[int, StepOut]:
        return self._steps.setdefault(rid, {}) if create else self._steps.get(rid, {})

    def get(self, rid: bytes, start_pos: int) -> StepOut | None:
        return self.of(rid).get(start_pos)

    def done(self, rid: bytes, start_pos: int, step: StepOut) -> None:
        """The step's coroutine is over (answered, failed, or given up)."""
        if self.get(rid, start_pos) is step:
            del self._steps[rid][start_pos]

    def drop(self, rid: bytes) -> None:
        self._steps.pop(rid, None)

    def fail(self, reason: str, rids: Iterable[bytes], on: OpenRoute | None = None,
             failure: type[RouteFailed] = RouteFailed) -> None:
        """Fail over the steps out of ``rids``; ``on``: only those sent on that route (another of
        the request's steps may be on a new one already)."""
        loop = asyncio.get_running_loop()
        for rid in list(rids):
            for step in self.of(rid).values():
                if on is not None and step.route != on:
                    continue
                if not step.result.done():
                    step.failures += 1
                    step.result.set_exception(failure(reason))
                    step.result.exception()  # (seen: its coroutine may be rerouting already, not awaiting it)
                    step.result = loop.create_future()

    def end_all(self, error: Exception) -> None:
        """Every step out ends with ``error`` (a refusal for good)."""
        for steps in self._steps.values():
            for step in steps.values():
                if not step.result.done():
                    step.result.set_exception(error)
                    step.result.exception()  # (its coroutine may be between awaits, not awaiting it)

    def answer(self, rid: bytes, packet: ActivationPacket, error: bool, received_at: float,
               received_bytes: int) -> None:
        """A result answers the step at its position; an error answers every step of the request."""
        for pos, step in self.of(rid).items():
            if (error or pos == packet.start_pos) and not step.result.done():
                if not error:
                    step.received_at, step.received_bytes = received_at, received_bytes
                step.result.set_result(packet)

    def stalled(self, rids: Iterable[bytes], now: float, per_row_s: float,
                policy: ReroutePolicy) -> list[tuple[bytes, StepOut, float]]:
        """Per request, its first step out past its stall limit: (request, step, limit)."""
        found = []
        for rid in rids:
            for step in self.of(rid).values():
                limit = step.overdue(now, per_row_s, policy)
                if limit is not None:
                    found.append((rid, step, limit))
                    break
        return found

    def routes_over(self, conn: Conn) -> list[tuple[bytes, OpenRoute]]:
        """The routes over ``conn`` that steps out were sent on, with their requests."""
        return [(rid, route) for rid, steps in self._steps.items()
                for route in dict.fromkeys(s.route for s in steps.values()  # (each once, in the order sent)
                                           if s.route is not None and s.route.conn is conn)]
