"""At most so many log lines of one kind per period: a peer that sends a flood of bad packets
must not be able to fill the disk through our log. What is held back is counted and said."""

from __future__ import annotations

import logging

from net import clock


class LogLimit:
    def __init__(self, logger: logging.Logger, per_period: int = 20, period_s: float = 10.0) -> None:
        self.logger = logger
        self.per_period = per_period
        self.period_s = period_s
        self._period_start = clock.now()
        self._logged = 0
        self.suppressed = 0  # held back in the current period

    def warning(self, message: str, *args) -> None:
        now = clock.now()  # (the loop's: net/clock.py)
        if now - self._period_start >= self.period_s:
            if self.suppressed:
                self.logger.warning("(%d more like this in the last %.0fs not logged)", self.suppressed,
                                    now - self._period_start)
            self._period_start, self._logged, self.suppressed = now, 0, 0
        if self._logged < self.per_period:
            self._logged += 1
            self.logger.warning(message, *args)
        else:
            self.suppressed += 1
