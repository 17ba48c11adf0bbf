"""How long a peer has been silent, by a clock that only runs while we could have heard it.

Silence is measured from the last datagram a connection received. If our own event loop did not
run for a while (the machine suspended, swapped, or starved of CPU), the peer's datagrams wait
unread in the socket, and the naive measure blames the peer for our own absence: a host that
stalled for 6 s woke up and marked every trunk down. A watcher ticks this clock once per round;
a round that came late restarts the count, so only silence we were awake for counts.
"""

from __future__ import annotations

import asyncio

from .protocol import SwarmProtocol

LATE_BY = 1.0  # a round this much later than its interval means our loop stalled


class SilenceClock:
    def __init__(self, interval: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.interval = interval
        self._last_tick = self._loop.time()
        self.awake_since = self._last_tick

    def tick(self) -> bool:
        """Call once per watcher round; False when this round came late (our loop had stalled)."""
        now = self._loop.time()
        late = now - self._last_tick > self.interval + LATE_BY
        if late:
            self.awake_since = now
        self._last_tick = now
        return not late

    def silence(self, conn: SwarmProtocol) -> float:
        """Seconds since the peer was last heard, not counting a stall of our own."""
        return self._loop.time() - max(conn.last_heard, self.awake_since)
