"""The host's liveness watch: a trunk that falls silent (killed, asleep, off the network) is
marked down within seconds, and the plan moves to the survivors. A stage whose expert calls to a
member went unanswered says so (``Unanswered``); the host then judges that member by its own
link at once, with a shorter silence: two missed pings, confirmed by the stage's failed one."""

from __future__ import annotations

import asyncio
import logging

from net.liveness import PING_INTERVAL, SILENCE_LIMIT, SilenceClock

from .planning import PlanKeeper
from .reports import Recovery
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")

# A member a stage reports unanswered is down if the host has not heard from it for this long:
# it pings every PING_INTERVAL, so two missed pings (SILENCE_LIMIT waits for four unprompted).
SUSPECT_SILENCE = 2 * PING_INTERVAL


async def watch_trunks(trunks: Trunks, planning: PlanKeeper, recovery: Recovery) -> None:
    clock = SilenceClock(1.0)
    while True:
        await asyncio.sleep(clock.interval)
        clock.tick()
        for name, trunk in list(trunks.items()):
            silent = clock.silence(trunk.conn)
            if silent > SILENCE_LIMIT:
                mark_down(name, trunks, planning, recovery, f"silent for {silent:.1f}s")


def unanswered(name: str, reporter: str, trunks: Trunks, planning: PlanKeeper, recovery: Recovery) -> bool:
    """``reporter``'s calls to ``name`` went unanswered: marked down now if the host has not heard
    from it for SUSPECT_SILENCE either (else the stage's trouble was its own link's)."""
    trunk = trunks.get(name)
    if trunk is None:
        return False
    silent = asyncio.get_running_loop().time() - trunk.conn.last_heard
    if silent <= SUSPECT_SILENCE:
        log.info("%s reports trunk %s unanswered, but the host heard it %.1fs ago", reporter, name, silent)
        return False
    mark_down(name, trunks, planning, recovery, f"unanswered by {reporter}'s calls and silent for {silent:.1f}s")
    return True


def mark_down(name: str, trunks: Trunks, planning: PlanKeeper, recovery: Recovery, why: str) -> None:
    trunk = trunks[name]
    log.warning("trunk %s %s: marked down", name, why)
    recovery.last_marked_down = name
    trunk.conn.close_with("silent too long")
    if trunks.get(name) is trunk:
        del trunks[name]
        try:
            planning.lost(name)
        except Exception:  # noqa: BLE001 - the watcher must outlive any one bad plan
            log.exception("re-planning after %s went silent failed", name)
