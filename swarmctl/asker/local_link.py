"""The asker's link to a swarm started on this machine (swarmctl/node/local_swarm.py), once it is ready.

The swarm was started here, so readiness is waited for rather than raced: the host's ready file,
then a plan over every trunk, with progress logged every few seconds (shown with -v). The wait ends
early only when a node exited, or after the local swarm's bound.
"""

from __future__ import annotations

import logging
import time

from swarmctl.asker.link import SwarmLink
from swarmctl.node.local_swarm import READY_BOUND_S, LocalSwarm

log = logging.getLogger("swarmctl.local")


async def open_local_link(swarm: LocalSwarm, *, bound: float = READY_BOUND_S, **kwargs) -> SwarmLink:
    """``SwarmLink.open`` on ``swarm``'s asker home once the swarm says it is ready (``kwargs`` go
    to it); EngineError when a node exited, or ``bound`` seconds after the swarm started."""
    deadline = await swarm.wait_host(bound)
    trunks = "its trunk to load its layers" if swarm.n_trunks == 1 else \
        f"its {swarm.n_trunks} trunks to load their layers"
    log.info("local swarm: waiting for %s", trunks)
    link = await SwarmLink.open(swarm.asker_home, ready_timeout=max(1.0, deadline - time.monotonic()),
                                alive_check=swarm.progress(trunks), **kwargs)
    log.info("local swarm ready after %.1f s", time.monotonic() - swarm.started)
    return link
