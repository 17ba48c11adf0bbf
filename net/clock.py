"""The clock the swarm's deadlines, timeouts and idle limits read: the running event loop's.

On asyncio's own loop that is time.monotonic(); under the simulator (harness/sim) it is the
simulated loop's virtual time, so one code path serves real and simulated runs. Durations that
measure this machine (compute, a trace's timeline) keep reading time.perf_counter().
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # no loop running (an I/O-free table driven by a test on its own)
        return time.monotonic()
