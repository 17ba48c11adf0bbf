"""One timer on the event loop at a time, set to a time on a caller's clock (the keeper's clock is a
test's to move: with no loop running, nothing is set and the test calls the callback itself)."""

from __future__ import annotations

import asyncio
from typing import Callable


class Alarm:
    def __init__(self, clock: Callable[[], float], callback: Callable[[], None]) -> None:
        self.clock = clock  # called each time (a test may replace the owner's clock after this is made)
        self.callback = callback
        self._handle: asyncio.TimerHandle | None = None

    def set(self, due: float | None) -> None:
        """Call back at ``due`` (a little after: the due thing is due then), replacing any earlier
        setting; None: not at all."""
        self.cancel()
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._handle = loop.call_later(max(0.0, due - self.clock()) + 0.01, self._ring)

    def _ring(self) -> None:
        self._handle = None
        self.callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
