"""The host's liveness watch: a trunk that falls silent (killed, asleep, off the network) is
marked down within seconds, and the plan moves to the survivors."""

from __future__ import annotations

import asyncio
import logging

from net.liveness import SILENCE_LIMIT, SilenceClock

from .planning import PlanKeeper
from .reports import Recovery
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")


async def watch_trunks(trunks: Trunks, planning: PlanKeeper, recovery: Recovery) -> None:
    clock = SilenceClock(1.0)
    while True:
        await asyncio.sleep(clock.interval)
        clock.tick()
        for name, trunk in list(trunks.items()):
            silent = clock.silence(trunk.conn)
            if silent > SILENCE_LIMIT:
                log.warning("trunk %s silent for %.1fs: marked down", name, silent)
                recovery.last_marked_down = name
                trunk.conn.close_with("silent too long")
                if trunks.get(name) is trunk:
                    del trunks[name]
                    try:
                        planning.replan()
                    except Exception:  # noqa: BLE001 - the watcher must outlive any one bad plan
                        log.exception("re-planning after %s went silent failed", name)
