"""An uplink's budget for the model bytes a node serves (a trunk's layers to members fetching
them, the host's slices): every chunk waits its turn, all streams together, so that serving the
model never takes more of a home connection than its owner gave it."""

from __future__ import annotations

import asyncio

from net import clock


class UploadBudget:
    """Bytes per second for everything a node serves of the model: each chunk waits its turn."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0  # when what was let go so far has gone out at the budget's rate

    @classmethod
    def from_mbit(cls, mbit: float | None) -> "UploadBudget | None":
        """A budget of ``mbit`` Mbit/s; None for None (no budget: as fast as the link goes)."""
        return None if mbit is None else cls(mbit * 1e6 / 8)

    def wait_s(self, n: int, now: float) -> float:
        """Seconds from ``now`` until ``n`` more bytes may go, booking them: what was let go before
        must have gone out at the budget's rate first."""
        start = max(now, self._free_at)
        self._free_at = start + n / self.bytes_per_s
        return start - now

    async def take(self, n: int) -> None:
        wait = self.wait_s(n, clock.now())
        if wait > 0:
            await asyncio.sleep(wait)
