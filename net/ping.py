"""QUIC pings for keepalive and round-trip times, the same on every node."""

from __future__ import annotations

import asyncio

from . import clock
from .liveness import PING_TIMEOUT
from .protocol import SwarmProtocol


async def quiet_ping(conn: SwarmProtocol, timeout: float = PING_TIMEOUT) -> None:
    """A keepalive: ping and ignore the outcome. Whether the peer answered is the silence watchers'
    business (``liveness.SilenceClock``), which hear every datagram, not just this answer."""
    try:
        await asyncio.wait_for(conn.ping(), timeout)
    except (ConnectionError, asyncio.TimeoutError):
        pass


async def ping_ms(conn: SwarmProtocol, timeout: float = PING_TIMEOUT) -> float:
    """One ping's round trip in milliseconds; raises ``asyncio.TimeoutError`` or ``ConnectionError``.
    Timed on the loop's clock (net/clock.py): the network's time, not this machine's."""
    t0 = clock.now()
    await asyncio.wait_for(conn.ping(), timeout)
    return (clock.now() - t0) * 1e3


async def round_trip_ms(conn: SwarmProtocol, pings: int = 3, timeout: float = PING_TIMEOUT) -> float:
    """The median of a few pings on a live connection: one slow answer does not make the link slow."""
    times = sorted([await ping_ms(conn, timeout) for _ in range(pings)])
    return times[len(times) // 2]
