"""Figures a trunk reads about itself for its ``stats`` reply (``net.messages.Stats``, built by
``TrunkService.stats`` from the parts that keep each figure): its memory, what this machine can
offer, and the recent batches."""

from __future__ import annotations

import time
from pathlib import Path


def proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_memory() -> int:
    """What this machine can offer (MemAvailable), or 8 GB where /proc/meminfo cannot say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def batch_window(runner, window_s: float) -> list[list]:
    since = time.time() - window_s
    return [[b.started, b.seconds, b.tokens, [rid.hex()[:8] for rid in b.request_ids]]
            for b in (runner.stats.recent if runner else ()) if b.started >= since]
