"""The trunk's link to the host: register, keep the link (and this trunk's own links) alive,
tell the host things, and receive its plans.

The host pushes plans on the stream the trunk registered on; a revocation closes the connection
with a reason that says so, and then retrying cannot help, so the trunk stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import msgspec

from net import messages as m
from net.dispatch import Dispatcher
from net.endpoint import close
from net.identity import is_revocation
from net.liveness import IDLE_TIMEOUT, PING_INTERVAL, SilenceClock
from net.ping import quiet_ping, round_trip_ms
from net.protocol import SwarmProtocol
from net.wire import Frame, WireError, decode_control
from plans.plan import Plan
from swarmctl.trunk.context import TrunkContext, TrunkEvents

log = logging.getLogger("swarmctl.trunk")

RECONNECT_INTERVAL = 2.0
REVOKED = "the host revoked this member's certificate; ask the host for a new invite to rejoin"


class HostLink:
    def __init__(self, ctx: TrunkContext, events: TrunkEvents) -> None:
        self.config = ctx.config
        self.creds = ctx.creds
        self.handler = ctx.handler  # the trunk: frames on the host connection go to it first
        self.conn: SwarmProtocol | None = None
        self.plan_stream: int | None = None  # where the host pushes plans
        self.rtt_ms: float | None = None
        self._events = events
        self._connect = ctx.connect_host  # from the trunk's swarm socket once it has one (swarmctl/reaching/reach.py)
        self._spawn = ctx.spawn
        self._fetches: dict[int, asyncio.Queue] = {}  # host stream → frames of a slice transfer
        self._given_up: SwarmProtocol | None = None  # a connection closed for the host's silence (_host_silent)
        self._registered: SwarmProtocol | None = None  # the connection the host last accepted our registration on
        # What the host sends on the plan stream (net/dispatch.py); handlers take (fatal, message).
        self.from_host = Dispatcher({
            m.PlanPush: lambda fatal, push: events.plan_received(Plan.from_dict(push.plan)),
            m.PunchWith: lambda fatal, peer: events.peer_coming(peer),
            m.RelayEnd: lambda fatal, peer: events.peer_coming(peer),
            m.Error: self._host_error})

    @property
    def is_open(self) -> bool:
        return self.conn is not None and self.conn.is_open

    async def keep(self, stop: asyncio.Event, registration: Callable[[], m.Register],
                   peers: Callable[[], Iterable[SwarmProtocol | None]], on_tick: Callable[[], None]) -> None:
        """Register, and re-register whenever the link drops; ping the host and ``peers`` (links
        this trunk opened: an idle QUIC connection closes after IDLE_TIMEOUT, and the next
        request would meet it closing and have to reroute); ``on_tick`` once a second."""
        silence = SilenceClock(PING_INTERVAL)
        while not stop.is_set():
            silence.tick()
            # (a connection whose registration failed, e.g. timed out over a slow link, is open but
            # the host does not count this trunk: register again; before, it was pinged forever,
            # out of every plan: the simulator's seed 74 with five faults)
            if not self.is_open or self.conn is not self._registered or self._host_silent(silence):
                if self.conn is not None and is_revocation(self.conn.close_reason):
                    self._events.fail(REVOKED)
                    return
                try:
                    await self._register(registration)
                except (ConnectionError, asyncio.TimeoutError, OSError) as e:
                    reason = str(e) or (self.conn.close_reason if self.conn else "") or type(e).__name__
                    if is_revocation(reason):
                        self._events.fail(REVOKED)
                        return
                    log.warning("cannot reach the host: %s (retrying)", reason)
                    if self.conn is not None and self.conn.is_open:
                        self.conn.close_with(f"registering failed: {reason}")
                    await asyncio.sleep(RECONNECT_INTERVAL)
                    continue
            try:
                await asyncio.wait_for(self.conn.ping(), PING_INTERVAL)
            except (ConnectionError, asyncio.TimeoutError):
                continue
            for conn in peers():
                if conn is not None and conn.is_open:
                    self._spawn(quiet_ping(conn))
            on_tick()
            await asyncio.sleep(PING_INTERVAL)

    def _host_silent(self, silence: SilenceClock) -> bool:
        """The host has not been heard for IDLE_TIMEOUT: its connection is given up here, not
        left to QUIC, whose idle timeout is at least three probe timeouts of the round trip it
        measured. After 10 s of 2-second datagrams (the simulator's seed 68, a slow member) that
        was 46 s: the host restarted meanwhile, and this trunk kept pinging the old process's
        connection and stayed out of the new one's plans for 46 s instead of 8."""
        if self.conn is self._given_up:
            return True  # (closing; registering again failed so far)
        quiet = silence.silence(self.conn)
        if quiet <= IDLE_TIMEOUT:
            return False
        log.warning("the host has been silent for %.0f s: registering again", quiet)
        self._given_up = self.conn
        self.conn.close_with(f"silent for {quiet:.0f} s")
        return True

    async def _register(self, registration: Callable[[], m.Register]) -> None:
        # (the advertised addresses only, even on the host's own machine)
        conn = await self._connect(self.config.host_addresses)
        self.conn = conn
        self.rtt_ms = await round_trip_ms(conn)
        self.plan_stream = conn.open_stream()
        reply = await conn.request(m.encode(msgspec.structs.replace(registration(), rtt_ms=self.rtt_ms)),
                                   stream_id=self.plan_stream)
        self.received(decode_control(reply.body), fatal=True)
        self._registered = conn

    def received(self, message: dict, fatal: bool = False) -> None:
        """A message the host sent on the plan stream: a plan, or an error (``fatal``: the answer to
        registering, e.g. for an asker's certificate, where retrying cannot help)."""
        try:
            parsed = self.from_host.parse(message)
        except WireError as e:
            log.error("host sent %s", e)
            return
        self.from_host.dispatch(parsed, fatal)

    def _host_error(self, fatal: bool, error: m.Error) -> None:
        if fatal:
            self._events.fail(f"the host refused this trunk: {error.message}")
        else:
            log.error("host: %s", error.message)

    def is_plan_stream(self, conn: SwarmProtocol, stream_id: int) -> bool:
        return conn is self.conn and stream_id == self.plan_stream

    def is_host(self, conn: SwarmProtocol) -> bool:
        return conn is self.conn

    async def tell(self, message: m.Message) -> None:
        if self.is_open:
            try:
                await self.conn.request(m.encode(message), timeout=10)
            except (ConnectionError, asyncio.TimeoutError) as e:
                log.warning("host did not answer %s: %s", type(message).__name__, e)

    # --- slice transfers (swarmctl/model_files/distribution.py) arrive on host streams we opened ---

    def open_fetch(self) -> tuple[int, asyncio.Queue]:
        stream_id = self.conn.open_stream()
        frames: asyncio.Queue = asyncio.Queue()
        self._fetches[stream_id] = frames
        return stream_id, frames

    def close_fetch(self, stream_id: int) -> None:
        self._fetches.pop(stream_id, None)

    def take_frame(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> bool:
        """Whether the frame belongs to a slice transfer (and was queued for it)."""
        if conn is self.conn and stream_id in self._fetches:
            self._fetches[stream_id].put_nowait(frame)
            return True
        return False

    async def close(self) -> None:
        if self.conn is not None:
            await close(self.conn, "trunk shutting down")
