"""How many compute threads a process uses where it is not told: read from the environment and
the process's CPU affinity, without loading ggml (the CLI checks it before any command runs)."""

from __future__ import annotations

import os

from .errors import EngineError

# Caps every process's compute threads where --threads is not given, as OMP_NUM_THREADS does for
# OpenMP programs: several swarmctl processes on one machine (a local swarm, a test run) each
# taking every core make their ggml threads wait at barriers for one another.
THREADS_ENV = "SWARMCTL_THREADS"


def default_threads() -> int:
    """Compute threads where none are given: $SWARMCTL_THREADS, else every core this process may
    run on (its affinity, as taskset or a container's cpuset sets it)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:  # (set but empty: as if unset)
        if not value.isdigit() or int(value) < 1:
            raise EngineError(f"{THREADS_ENV}={value!r}: give a whole number of threads, 1 or more")
        return int(value)
    return usable_cores()


def usable_cores() -> int:
    """The cores this process may run on: its affinity, as taskset or a container's cpuset sets it."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)
