"""Throughput probes: a few hundred KiB on one stream of a live, mutually authenticated QUIC
connection, timed to the receiver's acknowledgement. The same on every node that answers them.

    prober → peer   CONTROL probe {"n_bytes": N}, then DATA (N bytes), end of stream
    peer → prober   CONTROL ok once all N bytes arrived (or error: refused), end of stream

From sending to the ``ok`` takes about one round trip plus N bytes at the prober's upload rate,
so the rate is N / (elapsed − round trip): the direction the prober sends activations in. A probe
this small on a fresh long path is still in congestion-control slow start, so on a WAN it reads low
(pessimistic, which is the side the planner should err on); on a LAN it is close.

The receiver bounds what a peer makes it take (``ProbeSink``): a probe announced over
MAX_PROBE_BYTES is refused before its bytes count, a stream that carries more than it announced is
reset, one probe per connection is in flight at a time, and a refusal costs the connection nothing.
(A single frame is still buffered whole before anyone sees it: that bound is the protocol's
``max_frame`` and member buffer budget, net/protocol.py.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from . import clock
from . import messages as m
from .liveness import PING_TIMEOUT
from .ping import round_trip_ms
from .protocol import StreamClosedError, SwarmProtocol
from .wire import Frame, FrameType, WireError, encode_frame

PROBE_BYTES = 512 * 1024  # what a member sends to measure a link
MAX_PROBE_BYTES = 1024 * 1024  # the most a member accepts in one probe
PROBE_TIMEOUT = 20.0  # 512 KiB at 0.25 Mbit/s (a bad uplink) and then some
MAX_REFUSED_REMEMBERED = 8  # per connection: streams whose payload is dropped after a refusal


class ProbeRefused(ConnectionError):
    """The peer refused the probe (over its cap, another in flight) or does not answer probes."""


@dataclass(frozen=True)
class LinkMeasure:
    rtt_ms: float  # the median of a few pings
    bandwidth_mb_s: float  # MB (10^6 bytes) per second, prober → peer
    probe_bytes: int
    elapsed_ms: float  # from sending the probe to its acknowledgement

    def claim(self) -> m.LinkClaim:
        return m.LinkClaim(rtt_ms=min(self.rtt_ms, m.MAX_RTT_MS),
                           bandwidth_mb_s=min(self.bandwidth_mb_s, m.MAX_BANDWIDTH_MB_S))


def rate_mb_s(n_bytes: int, elapsed_ms: float, rtt_ms: float) -> float:
    """The rate of ``n_bytes`` that took ``elapsed_ms`` including one ``rtt_ms``. The round trip is
    a median of other packets, so it may exceed a quick probe's time: the transfer is then taken as
    at least a tenth of what was timed, never zero (a bounded overestimate, not infinity)."""
    transfer_ms = max(elapsed_ms - rtt_ms, elapsed_ms * 0.1, 1e-3)
    return min(n_bytes / (transfer_ms * 1e3), m.MAX_BANDWIDTH_MB_S)


async def send_probe(conn: SwarmProtocol, n_bytes: int = PROBE_BYTES, timeout: float = PROBE_TIMEOUT) -> float:
    """Send ``n_bytes`` and wait for their acknowledgement: the milliseconds it took. Raises
    ProbeRefused, ``asyncio.TimeoutError`` or ``ConnectionError``."""
    data = m.encode(m.Probe(n_bytes=n_bytes)) + encode_frame(FrameType.DATA, bytes(n_bytes))
    t0 = clock.now()  # (the network's time, not this machine's: the loop's clock, net/clock.py)
    try:
        reply = await conn.request(data, timeout=timeout)
        elapsed_ms = (clock.now() - t0) * 1e3
        m.decode(reply.body, m.Ok)
    except m.Refused as e:
        raise ProbeRefused(f"{conn.peer_name or 'the peer'} refused the probe: {e}") from None
    except WireError as e:
        raise ProbeRefused(f"{conn.peer_name or 'the peer'} does not answer probes: {e}") from None
    return elapsed_ms


async def measure_link(conn: SwarmProtocol, n_bytes: int = PROBE_BYTES, pings: int = 3,
                       timeout: float = PROBE_TIMEOUT) -> LinkMeasure:
    """Round trip (pings) then throughput (one probe) on a live connection."""
    rtt = await round_trip_ms(conn, pings, min(timeout, PING_TIMEOUT))
    elapsed = await send_probe(conn, n_bytes, timeout)
    return LinkMeasure(rtt, rate_mb_s(n_bytes, elapsed, rtt), n_bytes, elapsed)


class ProbeSink:
    """The answering side, for a ``ConnectionHandler``: ``start`` on a parsed ``probe`` message,
    ``take_data`` first for every DATA frame (True: it was a probe's), and ``stream_ended`` /
    ``connection_lost`` to forget."""

    def __init__(self, cap: int = MAX_PROBE_BYTES) -> None:
        self.cap = cap
        self._pending: dict[tuple[SwarmProtocol, int], int] = {}  # (conn, stream) → bytes still expected
        self._refused: dict[SwarmProtocol, list[int]] = {}  # streams whose payload we drop, per connection
        self.bytes_taken = 0

    def start(self, conn: SwarmProtocol, stream_id: int, probe: m.Probe) -> None:
        if probe.n_bytes == 0:  # a bare probe: answered at once (a round trip)
            self._answer(conn, stream_id, m.Ok())
            return
        if probe.n_bytes > self.cap:
            self._refuse(conn, stream_id, f"a probe of {probe.n_bytes} bytes is over the cap of {self.cap}")
            return
        if any(c is conn for c, _ in self._pending):
            self._refuse(conn, stream_id, "another probe from this connection is in flight")
            return
        self._pending[(conn, stream_id)] = probe.n_bytes

    def take_data(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> bool:
        if frame.type != FrameType.DATA:
            return False
        key = (conn, stream_id)
        if key not in self._pending:
            return stream_id in self._refused.get(conn, ())
        left = self._pending[key] - len(frame.body)
        if left < 0:
            del self._pending[key]
            conn.reject_stream(stream_id, "the probe carried more bytes than it announced")
            return True
        self.bytes_taken += len(frame.body)
        if left == 0:
            del self._pending[key]
            self._answer(conn, stream_id, m.Ok())
        else:
            self._pending[key] = left
        return True

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        if self._pending.pop((conn, stream_id), None) is not None:
            self._answer(conn, stream_id, m.Error(message="the probe ended before its bytes"))
        refused = self._refused.get(conn)
        if refused and stream_id in refused:
            refused.remove(stream_id)

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self._refused.pop(conn, None)
        for key in [k for k in self._pending if k[0] is conn]:
            del self._pending[key]

    def _refuse(self, conn: SwarmProtocol, stream_id: int, reason: str) -> None:
        refused = self._refused.setdefault(conn, [])
        refused.append(stream_id)
        del refused[:-MAX_REFUSED_REMEMBERED]
        self._answer(conn, stream_id, m.Error(message=reason))

    @staticmethod
    def _answer(conn: SwarmProtocol, stream_id: int, reply: m.Message) -> None:
        if conn.is_open:
            try:
                conn.send(stream_id, m.encode(reply), end=True)
            except StreamClosedError:
                pass


async def measure_or_none(conn: SwarmProtocol | None, n_bytes: int = PROBE_BYTES) -> LinkMeasure | None:
    """``measure_link``, or None where the connection is gone, silent or refuses (a measurement
    that failed is left out of a report, not reported as a guess)."""
    if conn is None or not conn.is_open:
        return None
    try:
        return await measure_link(conn, n_bytes)
    except (ConnectionError, asyncio.TimeoutError):
        return None
