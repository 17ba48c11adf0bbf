"""Figures for people: sizes and rates in units that fit the number, three significant figures at
most (the planner's warnings and the CLI's tables print through these; ``0.0 GB missing`` and
``2.56404 MB/s`` said either nothing or too much)."""

from __future__ import annotations

import math

_SIZES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))  # decimal, as --memory reads them (12G = 12 GB)


def _figure(value: float) -> str:
    """Three significant figures for a value from 1 to 999: 2.56, 25.6, 12.0, 256 (the bounds
    are where rounding would carry into a fourth figure)."""
    if value >= 99.95:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 9.995 else f"{value:.2f}"


def size(n_bytes: float) -> str:
    """Bytes in the largest unit that keeps the number at 1 or more: 12.0 GB, 340 MB, 5.20 KB, 512 B."""
    if not math.isfinite(n_bytes):
        return "unlimited"
    sign, n_bytes = ("-", -n_bytes) if n_bytes < 0 else ("", n_bytes)
    for unit, scale in _SIZES:
        if n_bytes >= scale * 0.9995:  # (999.6 MB shows as 1.00 GB, not 1000 MB)
            return f"{sign}{_figure(n_bytes / scale)} {unit}"
    return f"{sign}{n_bytes:.0f} B"


def rate(mb_per_s: float) -> str:
    """A throughput given in MB/s, to three significant figures: 2.56 MB/s, 80.0 MB/s, 512 KB/s."""
    if not math.isfinite(mb_per_s):
        return "unlimited"
    if mb_per_s >= 999.5:
        return f"{_figure(mb_per_s / 1000)} GB/s"
    if mb_per_s < 0.9995:
        return f"{_figure(mb_per_s * 1000)} KB/s" if mb_per_s * 1000 >= 0.9995 else f"{mb_per_s * 1e6:.0f} B/s"
    return f"{_figure(mb_per_s)} MB/s"
