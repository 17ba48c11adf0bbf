"""How often one member may make trunks punch towards it through `reach`.

A `reach` answered with a punch makes the trunk send probes to the asker (every
net.punch.PROBE_INTERVAL for up to net.punch.PUNCH_TIMEOUT): work done on behalf of a member
the trunk never asked. Each member gets a token bucket: REACH_BURST punches at once, then
REACH_RATE_PER_S. That covers a member connecting to every stage of a plan, or `top` to every
trunk, and keeps one that asks in a loop from keeping the trunks busy punching. (Direct answers
make nobody send anything; relayed links have their own limit in rendezvous.py.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from net.clock import now

log = logging.getLogger("swarmctl.host")

REACH_RATE_PER_S = 4.0
REACH_BURST = 8


@dataclass
class TokenBucket:
    rate: float  # tokens per second
    burst: int  # the most it holds
    tokens: float = -1.0  # (-1: full, set on first use)
    at: float = 0.0  # when ``tokens`` was counted (the clock's time)

    def take(self, now: float) -> bool:
        """One token if there is one."""
        if self.tokens < 0:
            self.tokens = float(self.burst)
        else:
            self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def wait(self) -> float:
        """Seconds until the next token."""
        return max(0.0, (1.0 - self.tokens) / self.rate)


@dataclass
class ReachLimit:
    rate: float = REACH_RATE_PER_S
    burst: int = REACH_BURST
    clock: Callable[[], float] = now  # the loop's (net/clock.py)
    # member → its bucket, kept after it disconnects (reconnecting does not refill it)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # member → refusals in its current streak

    def allow(self, member: str) -> bool:
        """Whether ``member`` may have one more punch or relay now. The first refusal of a streak
        is logged (one line, not one per request); the streak ends with the next allowed one."""
        bucket = self.buckets.setdefault(member, TokenBucket(self.rate, self.burst))
        if bucket.take(self.clock()):
            streak = self.refused.pop(member, 0)
            if streak > 1:
                log.info("%s: %d punched routes were refused in a row, then it slowed down", member, streak)
            return True
        self.refused[member] = self.refused.get(member, 0) + 1
        if self.refused[member] == 1:
            log.warning("%s asks for punched routes to trunks faster than %g per second (%d at once): "
                        "refusing until it slows down", member, self.rate, self.burst)
        return False

    def retry_after(self, member: str) -> float:
        bucket = self.buckets.get(member)
        return bucket.wait() if bucket is not None else 0.0
