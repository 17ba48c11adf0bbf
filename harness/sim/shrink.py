"""Shrinking a failing schedule: events are taken away one at a time (faults first, then asks),
and the network's impairments, for as long as the run still fails; what is left is the fewest
events that still fail, each of which is needed."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from harness.sim.network import Conditions
from harness.sim.schedule import Schedule

Fails = Callable[[Schedule], bool]


def shrink(schedule: Schedule, fails: Fails, *, report: Callable[[str], None] = lambda line: None) -> Schedule:
    """The smallest schedule found, from ``schedule`` (which must fail), that still ``fails``."""
    current = schedule
    calm = replace(current, conditions=Conditions())
    if calm.conditions != current.conditions and fails(calm):
        report("fails on a calm network too (no loss, duplication or reordering)")
        current = calm
    changed = True
    while changed:
        changed = False
        for i in range(len(current.faults)):
            candidate = current.without(current.asks, current.faults[:i] + current.faults[i + 1:])
            if fails(candidate):
                report(f"not needed: {current.faults[i].describe()}")
                current, changed = candidate, True
                break
        if changed:
            continue
        for i in range(len(current.asks)):
            if len(current.asks) == 1:
                break
            candidate = current.without(current.asks[:i] + current.asks[i + 1:], current.faults)
            if fails(candidate):
                report(f"not needed: {current.asks[i].describe()} at {current.asks[i].at:.2f}")
                current, changed = candidate, True
                break
    return current
