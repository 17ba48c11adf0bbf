"""What the simulator samples while a run plays, for the invariants that hold over time rather than
at the end: whether the host's plan is complete (every trunk layer on a ready stage), and whether
any member holds more at a stage than its budget there allows.

Sampled every SAMPLE_S of virtual time from the simulator's own task; it reads the running
services' objects (the host's plan keeper, each trunk's budget and engine) and changes nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

SAMPLE_S = 0.25  # virtual seconds between samples


@dataclass
class PlanSpan:
    """When the host's plan was complete: the first sample it was complete at (None: never yet)
    since ``since``, and whether it was at the last sample."""

    since: float
    complete_at: float | None = None
    complete_now: bool = False


@dataclass
class Watch:
    """Samples ``host()`` (the running HostService, or None while the host is down) and
    ``trunks()`` (name → the running TrunkService) from ``now()`` on."""

    host: Callable[[], object | None]
    trunks: Callable[[], dict]
    now: Callable[[], float]
    over_budget: list[str] = field(default_factory=list)  # the first sample of each member over a limit
    after_faults: PlanSpan | None = None  # from when the last fault stopped
    _seen: set[tuple[str, str, str]] = field(default_factory=set)

    def faults_over(self) -> None:
        self.after_faults = PlanSpan(self.now())
        self._sample_plan()

    async def run(self) -> None:
        while True:
            self._sample_plan()
            self._sample_budgets()
            await asyncio.sleep(SAMPLE_S)

    def _sample_plan(self) -> None:
        span = self.after_faults
        if span is None:
            return
        host = self.host()
        span.complete_now = host is not None and host.plan.complete
        if span.complete_now and span.complete_at is None:
            span.complete_at = self.now()

    def _sample_budgets(self) -> None:
        for name, service in sorted(self.trunks().items()):
            budget, engine = service.held.budget, service.held.engine
            limits = budget.limits
            stats = budget.stats()
            for member, usage in stats["members"].items():
                if usage["requests"] > limits.member_requests:
                    self._over(name, member, "requests", f"{usage['requests']} requests, its limit {limits.member_requests}")
                if usage["kv_bytes"] > limits.member_kv_bytes:
                    self._over(name, member, "kv", f"{usage['kv_bytes']} bytes of KV, its limit {limits.member_kv_bytes}")
            if budget.total_kv_bytes > limits.total_kv_bytes:
                self._over(name, "*", "total", f"{budget.total_kv_bytes} bytes of KV charged, the stage's limit "
                                               f"{limits.total_kv_bytes}")
            charged = budget.n_requests + sum(u["kept_prefixes"] for u in stats["members"].values())
            if engine is not None and engine.n_requests > charged:
                # a request the engine holds that no member is charged for escapes every budget
                self._over(name, "*", "uncharged", f"the engine holds {engine.n_requests} requests, "
                                                   f"{charged} charged to members (kept prefixes included)")

    def _over(self, trunk: str, member: str, what: str, detail: str) -> None:
        if (trunk, member, what) not in self._seen:
            self._seen.add((trunk, member, what))
            self.over_budget.append(f"at {self.now():.2f} {trunk} holds for {member}: {detail}")
