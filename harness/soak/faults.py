"""The soak's faults, at fractions of the load's length: the first stage killed with SIGKILL and
restarted (same home, no new invite), the last stage frozen with SIGSTOP then resumed, and a new
member that joins with an invite and runs a trunk. Each opens an outage window that lasts until the
swarm is whole again, plus GRACE_S; the next fault waits for that and QUIET_S more."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

from harness.soak.config import GRACE_S, QUIET_S, RECOVERY_TIMEOUT_S, Config
from harness.soak.monitor import SwarmMonitor
from harness.soak.records import Clock, Event
from harness.soak.swarm import SoakSwarm
from harness.swarm import Node

LATE_MEMBER = "late"


class FaultInjector:
    def __init__(self, config: Config, swarm: SoakSwarm, monitor: SwarmMonitor, clock: Clock,
                 errors: list[str]) -> None:
        self.config = config
        self.swarm = swarm
        self.monitor = monitor
        self.clock = clock
        self.errors = errors  # the run's own errors, shared with the rest of the soak
        self.events: list[Event] = []
        self.frozen: set[int] = set()  # pids stopped with SIGSTOP and not yet resumed

    def schedule(self) -> list[tuple[float, Callable[[], Awaitable[Event | None]]]]:
        """(fraction of the load, fault), in order."""
        c = self.config
        plan = [(c.kill_at, self.kill_and_restart), (c.freeze_at, self.freeze)]
        if c.join:
            plan.append((c.join_at, self.join_new_member))
        return plan

    async def run(self) -> None:
        """Each fault at its time, or later once the swarm has recovered from the one before."""
        load_s = self.config.load_s
        quiet_from = 0.0
        for fraction, action in self.schedule():
            now = self.clock.now()
            await asyncio.sleep(max(0.0, fraction * load_s - now, quiet_from - now))
            if self.clock.now() >= load_s:
                self.errors.append(f"{action.__name__}: not run, the load had ended (the swarm recovered too slowly)")
                continue
            event = await action()
            if event is None:
                continue
            self.events.append(event)
            event.recovered_s = await self.monitor.whole_again()
            end = (event.recovered_s if event.recovered_s is not None else self.clock.now()) + GRACE_S
            event.window = [round(event.at_s, 2), round(end, 2)]
            quiet_from = end - GRACE_S + QUIET_S
            if event.recovered_s is None:
                event.note += f" the swarm was not whole again within {RECOVERY_TIMEOUT_S:.0f} s"

    async def _victim(self, kind: str, stage: int) -> tuple[str, Node] | None:
        """A serving trunk (``stage``: 0 the first, -1 the last) and its process, or None (an error)."""
        stages = [n for n in await self.monitor.serving_trunks() if n in self.swarm.incarnation]
        if not stages:
            self.errors.append(f"{kind}: no serving trunk found")
            return None
        victim = stages[stage]
        node = self.swarm.node(victim)
        if node is None:
            self.errors.append(f"{kind}: {victim} serves in the plan but its process is not running")
            return None
        return victim, node

    async def kill_and_restart(self) -> Event | None:
        found = await self._victim("kill", 0)
        if found is None:
            return None
        victim, node = found
        event = Event("kill", victim, self.clock.now(), note="SIGKILL")
        node.process.kill()
        node.process.wait()
        self.swarm.forget(node)
        await asyncio.sleep(self.config.restart_after_s)
        self.swarm.start_trunk(victim)  # same home, same certificate: no new invite
        event.action_done_s = self.clock.now()
        event.note += f", restarted {self.config.restart_after_s:.0f} s later"
        return event

    async def freeze(self) -> Event | None:
        found = await self._victim("freeze", -1)
        if found is None:
            return None
        victim, node = found
        process = node.process
        event = Event("freeze", victim, self.clock.now(),
                      note=f"SIGSTOP for {self.config.freeze_s:.0f} s, then SIGCONT")
        self.frozen.add(process.pid)
        process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.config.freeze_s)
        finally:
            process.send_signal(signal.SIGCONT)
            self.frozen.discard(process.pid)
        event.action_done_s = self.clock.now()
        return event

    async def join_new_member(self) -> Event | None:
        name = LATE_MEMBER
        event = Event("join", name, self.clock.now(), note="invite + join + run --role trunk")
        try:
            await asyncio.to_thread(self.swarm.join, name)
        except Exception as e:  # noqa: BLE001 - reported, the soak goes on
            self.errors.append(f"join of {name} failed: {e}")
            return None
        self.swarm.start_trunk(name)  # in the main thread, as every node is started
        event.action_done_s = self.clock.now()
        return event

    def resume_frozen(self) -> None:
        """At the end: a stopped process ignores SIGTERM until it runs again."""
        for pid in list(self.frozen):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
