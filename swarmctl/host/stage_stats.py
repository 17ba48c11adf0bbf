"""What the host asks the plan's stages for over their register connections: their own ``stats``
(swarmctl/trunk/service.py), read for the requests a stage holds now and for its record of who
re-checked it."""

from __future__ import annotations

import asyncio
import logging

from net import messages as m
from net.wire import WireError
from plans.plan import Plan

from .trunks import TrunkInfo, Trunks

log = logging.getLogger("swarmctl.host")

STATS_TIMEOUT_S = 5.0  # how long the host waits for a stage's stats (a re-plan waits on it)
EVIDENCE_TIMEOUT_S = 5.0  # how long the host waits for an accused stage's record (its stats)


async def stage_requests(plan: Plan, trunks: Trunks) -> int:
    """Requests ``plan``'s stages hold now (each stage's own ``stats``): a re-plan on speed waits
    until there are none (swarmctl/host/planning.py). Raises when a stage cannot say."""
    held = 0
    for stage in list(plan.stages):
        trunk = trunks.get(stage.member)
        if trunk is None or not trunk.conn.is_open:
            continue
        reply = await trunk.conn.request(m.encode(m.GetStats()), timeout=STATS_TIMEOUT_S)
        held += m.decode(reply.body, m.Stats).routes
    return held


async def one_stage_record(trunk: TrunkInfo) -> dict[str, list[int]]:
    """The stage's own record of who re-checked it (swarmctl/trunk/one_stage.py); {} when it does
    not answer in time or at all."""
    try:
        reply = await trunk.conn.request(m.encode(m.GetStats()), timeout=EVIDENCE_TIMEOUT_S)
        return m.decode(reply.body, m.Stats).one_stage
    except (ConnectionError, asyncio.TimeoutError, WireError, m.Refused) as e:
        log.info("no record of re-checks from trunk %s: %s", trunk.conn.peer_name, e)
        return {}
