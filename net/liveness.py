"""Liveness: how often nodes ping, how long a silence means a peer is gone, and how long a peer
has been silent, by a clock that only runs while we could have heard it.

Silence is measured from the last datagram a connection received. If our own event loop did not
run for a while (the machine suspended, swapped, or starved of CPU), the peer's datagrams wait
unread in the socket, and the naive measure blames the peer for our own absence: a host that
stalled for 6 s woke up and marked every trunk down. A watcher ticks this clock once per round;
a round that came late restarts the count, so only silence we were awake for counts.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # net.tls reads IDLE_TIMEOUT from here, and net.protocol imports net.tls
    from .protocol import SwarmProtocol

# Each figure once, for every node. A peer is gone after SILENCE_LIMIT seconds, a few missed
# PING_INTERVALs; QUIC's own IDLE_TIMEOUT is longer, so the watchers notice a silent peer before
# QUIC closes its connection.
PING_INTERVAL = 1.0  # members ping the host, and askers their stages, this often
PING_TIMEOUT = 5.0  # how long one ping may wait for its answer
# Seconds without a datagram before a peer counts as gone: the host marks a trunk down, an asker
# with steps outstanding at a stage reroutes them.
SILENCE_LIMIT = 4.0
IDLE_TIMEOUT = 8.0  # seconds of silence before QUIC gives a connection up
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
