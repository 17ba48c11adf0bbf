"""Figures a member reports about itself, checked before the host believes them: the right type,
finite, and within magnitudes a real machine can have. A claim outside them is refused with a
one-line reason; it never reaches the planner (a 400-digit "memory" once broke every re-plan)."""

from __future__ import annotations

import math

MAX_MEMORY = 2**50  # 1 PiB: more than any machine offers
MS_PER_LAYER = (0.001, 60_000.0)  # per token; sanity only: a fast liar is caught by measuring, not here
MAX_RTT_MS = 60_000.0
MAX_BANDWIDTH_MB_S = 1e6
MAX_LINKS = 1024


class ClaimError(ValueError):
    pass


def number(value: object, low: float, high: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClaimError(f"{what} must be a number, not {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:
        raise ClaimError(f"{what} is out of range") from None
    if not math.isfinite(x) or not low <= x <= high:
        raise ClaimError(f"{what} {x:.4g} is outside [{low:g}, {high:g}]")
    return x


def memory(value: object) -> int:
    return int(number(value, 0, MAX_MEMORY, "memory"))


def ms_per_layer(value: object) -> float | None:
    return None if value is None else number(value, *MS_PER_LAYER, "ms_per_layer_token")


def rtt_ms(value: object) -> float | None:
    return None if value is None else number(value, 0, MAX_RTT_MS, "rtt_ms")


def links(value: object) -> dict[str, tuple[float, float | None]]:
    """{peer: (rtt_ms, bandwidth_mb_s or None)}."""
    if not isinstance(value, dict) or len(value) > MAX_LINKS:
        raise ClaimError(f"links must be an object of at most {MAX_LINKS} peers")
    out = {}
    for peer, v in value.items():
        if not isinstance(v, dict):
            raise ClaimError("each link must be an object")
        bandwidth = v.get("bandwidth_mb_s")
        out[str(peer)[:64]] = (number(v.get("rtt_ms"), 0, MAX_RTT_MS, "rtt_ms"),
                               None if not bandwidth else number(bandwidth, 0, MAX_BANDWIDTH_MB_S, "bandwidth_mb_s"))
    return out
