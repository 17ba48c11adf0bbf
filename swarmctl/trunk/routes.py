"""The route table: which streams carry each request through this stage, with no I/O.

A request enters on a stream from the previous hop (the asker or the stage before) and, unless
this is the last stage, leaves on a stream to the next stage. Every stream must end on both
sides, or QUIC's stream limit (128 per peer in aioquic) runs out and the link stalls; five of
the trunk's past bugs were a path that forgot one. So every event that ends a request or a
stream (an END, a refusal, an error coming back, a reset, a lost connection, a plan change, an
idle reap) is a method here that changes the table and *returns* what to do about it, as
``Action`` values; the trunk's data path (``swarmctl/trunk/requests.py``) carries them out.
Tests drive the table directly, like aioquic's ``QuicConnection``.

The connection objects are only compared and stored here (``is``, ``peer_name``), never used,
and the table reads no clock: a step's arrival and the idle reap are given ``now`` (the trunk's
shell reads net/clock.now()).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Union

from swarmctl.trunk.request_locks import RequestLocks

Conn = Any  # a net.protocol.SwarmProtocol; only identity and peer_name are read here

MAX_FAILED_STREAMS = 10_000  # a bound, not a policy: refused streams older than this are long dead


@dataclass
class DraftChecks:
    """A request's speculative steps as a stage sees them: a VERIFY step of n positions carries
    n - 1 drafts, and where the next step starts says how many the asker kept (the asker's own
    count is the true one; this is what ``top`` can show without asking it)."""

    drafted: int = 0
    accepted: int = 0
    _open: tuple[int, int] | None = None  # (start, positions) of the last VERIFY step

    def step(self, start_pos: int, n_positions: int, verify: bool) -> None:
        if self._open is not None:
            checked_start, n = self._open
            self.drafted += n - 1
            self.accepted += min(n - 1, max(0, start_pos - checked_start - 1))
        self._open = (start_pos, n_positions) if verify and n_positions > 1 else None


@dataclass(eq=False)
class Route:
    """One request as this stage sees it: where its packets come from, and its stream onward."""

    in_conn: Conn
    in_stream: int
    reply_to: str  # "member/session": the results stream at the last stage
    last_active: float  # when its last step arrived (the clock the table's caller passes as ``now``)
    out_conn: Conn | None = None  # the next stage's connection when out_stream was opened
    out_stream: int | None = None
    checks: DraftChecks = field(default_factory=DraftChecks)

    def arrives_on(self, conn: Conn, stream_id: int) -> bool:
        return self.in_conn is conn and self.in_stream == stream_id

    def leaves_on(self, conn: Conn) -> bool:
        """Whether the request already has an open stream on ``conn`` to the next stage."""
        return self.out_stream is not None and self.out_conn is conn


# --- what the table asks its owner to do ---

@dataclass(frozen=True, eq=False)
class SendError:
    """Answer a request's sender with an ERROR packet; the stream stays open (the sender may have
    sent its next step on it already, and that one needs an answer too)."""

    conn: Conn
    stream_id: int
    request_id: bytes
    message: str
    retry: bool


@dataclass(frozen=True, eq=False)
class PassBack:
    """Send a packet (an error from the next stage) back to the request's sender."""

    conn: Conn
    stream_id: int
    packet: Any  # net.wire.ActivationPacket


@dataclass(frozen=True)
class Keep:
    """An END that asks to keep the request's cells [0, positions) as the prefix ``prefix``."""

    prefix: bytes
    positions: int


@dataclass(frozen=True, eq=False)
class EndOnward:
    """Tell the next stage the request is over (an END packet), and end our side of the stream."""

    conn: Conn
    stream_id: int
    request_id: bytes
    keep: Keep | None = None  # ... and to keep its cells as a prefix, as this stage does


@dataclass(frozen=True, eq=False)
class FinishStream:
    """End our side of a stream (the peer frees what the stream held when it sees the end)."""

    conn: Conn
    stream_id: int


@dataclass(frozen=True, eq=False)
class FreeRequest:
    """Free the request's KV cache and its member's budget (the caller holds its lock)."""

    request_id: bytes


@dataclass(frozen=True, eq=False)
class KeepRequest:
    """Keep the request's cells as a prefix of its account instead of freeing them (the caller
    holds its lock); freed like ``FreeRequest`` where that cannot be done."""

    request_id: bytes
    keep: Keep
    reply_to: str  # whose account (the route's "member/session")


@dataclass(frozen=True, eq=False)
class Release:
    """Take the request's lock, then free it if ``route`` is still its route (``RouteTable.take``):
    it may have started over on another stream since, and then it lives on."""

    request_id: bytes
    route: Route


Action = Union[SendError, PassBack, EndOnward, FinishStream, FreeRequest, KeepRequest, Release]


class RouteTable:
    def __init__(self) -> None:
        self._routes: dict[bytes, Route] = {}  # request id → its route, once a step of it has run here
        self._request_streams: dict[Conn, set[int]] = {}  # streams that carried request packets
        self._failed: set[tuple[int, int, bytes]] = set()  # (connection, stream, request) refused for a retry
        self.locks = RequestLocks()  # one request's packets run in order

    def __len__(self) -> int:
        return len(self._routes)

    def __contains__(self, rid: bytes) -> bool:
        return rid in self._routes

    def get(self, rid: bytes) -> Route | None:
        return self._routes.get(rid)

    def items(self) -> Iterator[tuple[bytes, Route]]:
        return iter(list(self._routes.items()))

    # --- a request's packets ---

    def stream_carries_requests(self, conn: Conn, stream_id: int) -> None:
        self._request_streams.setdefault(conn, set()).add(stream_id)

    def open_request_streams(self, conn: Conn) -> int:
        return len(self._request_streams.get(conn, ()))

    def mark_failed(self, conn: Conn, stream_id: int, rid: bytes) -> None:
        """The request was refused on this stream with a retry: its sender is rerouting, and later
        packets on the stream answer nothing."""
        self._failed.add((id(conn), stream_id, rid))
        if len(self._failed) > MAX_FAILED_STREAMS:
            self._failed.clear()

    def has_failed(self, conn: Conn, stream_id: int, rid: bytes) -> bool:
        return (id(conn), stream_id, rid) in self._failed

    def claim(self, rid: bytes, conn: Conn, stream_id: int, start_pos: int, reply_to: str,
              now: float) -> tuple[Route | None, list[Action], str]:
        """A PREFILL or DECODE step arrived at ``now``: the route it runs on (not yet in the table: ``commit``
        puts it there once the step ran), what to do first, and why not if it cannot run. A
        request that starts over (position 0) on a new stream, replayed after a failure, gives
        up its old stream onward; any other step on a second stream is refused."""
        route = self._routes.get(rid)
        actions: list[Action] = []
        if route is not None and not route.arrives_on(conn, stream_id):
            if start_pos != 0:
                return None, [], "request id is in use on another stream"
            actions = self._close_out(rid, route)
            route = None
        if route is None:
            route = Route(conn, stream_id, reply_to, now)
        route.last_active = now
        return route, actions, ""

    def commit(self, rid: bytes, route: Route) -> None:
        self._routes[rid] = route

    def send_on(self, rid: bytes, route: Route, conn: Conn, stream_id: int) -> list[Action]:
        """The request's stream onward is now ``stream_id`` on ``conn``; a previous one ends."""
        actions = self._close_out(rid, route)
        route.out_conn, route.out_stream = conn, stream_id
        return actions

    def end(self, rid: bytes, conn: Conn, stream_id: int, keep: Keep | None = None) -> list[Action]:
        """An END packet (the caller holds the request's lock): the request is over if it came on
        the request's own stream (an END on an abandoned stream ends nothing), and the stream
        ends on our side too, since the sender ended it. ``keep``: its cells are kept as a
        prefix here and at every stage after."""
        route = self._routes.get(rid)
        actions = self.take(rid, forward=True, keep=keep) \
            if route is not None and route.arrives_on(conn, stream_id) else []
        return [*actions, FinishStream(conn, stream_id)]

    def take(self, rid: bytes, route: Route | None = None, forward: bool = False,
             keep: Keep | None = None) -> list[Action]:
        """Free a request (the caller holds its lock), and end its stream onward: with an END when
        ``forward`` (the request is over), else just finished (the next stage frees what that
        stream held). With ``route``, only if that is still the request's route. ``keep`` (with
        ``forward``): keep its cells as that prefix instead, and say so onward."""
        if route is not None and self._routes.get(rid) is not route:
            return []
        route = self._routes.pop(rid, None)
        if route is None or not forward:
            keep = None
        actions: list[Action] = [FreeRequest(rid) if keep is None else KeepRequest(rid, keep, route.reply_to)]
        if route is not None:
            actions += self._close_out(rid, route, end_request=forward, keep=keep)
        return actions

    # --- events that end streams ---

    def error_from_next_stage(self, conn: Conn, stream_id: int, packet: Any) -> list[Action]:
        """An ERROR packet came back on a stream we opened to the next stage. Only errors about the
        request's current route go back; one from a route it abandoned (the request started
        over on a new stream) answers a packet nobody waits for. Either way the stream is given
        up: we end our side, and the next stage then ends its own."""
        route = self._routes.get(packet.request_id)
        actions: list[Action] = []
        if route is not None and route.out_conn is conn and route.out_stream == stream_id:
            actions.append(PassBack(route.in_conn, route.in_stream, packet))
            route.out_stream = None
        return [*actions, FinishStream(conn, stream_id)]

    def stream_ended(self, conn: Conn, stream_id: int) -> list[Action]:
        """The sender ended (or reset) a stream. If it carried a request (after its END, or
        abandoned on a reroute or a plan change), whatever this stage still holds for it goes,
        and our side ends too. Other streams (a results subscription, a control or expert call
        being answered) end our side when they answer."""
        streams = self._request_streams.get(conn)
        if streams is None or stream_id not in streams:
            return []
        streams.discard(stream_id)
        actions: list[Action] = [Release(rid, route) for rid, route in self._routes.items()
                                 if route.arrives_on(conn, stream_id)]
        return [*actions, FinishStream(conn, stream_id)]

    def connection_lost(self, conn: Conn) -> list[Action]:
        """Requests that came on ``conn`` are freed; requests whose next stage was on it are told
        to retry (their sender reroutes) and freed."""
        self._request_streams.pop(conn, None)
        actions: list[Action] = []
        for rid, route in self._routes.items():
            if route.in_conn is conn:
                actions.append(Release(rid, route))
            elif route.out_conn is conn and route.out_stream is not None:
                actions.append(SendError(route.in_conn, route.in_stream, rid,
                                         f"next stage {conn.peer_name} went away", retry=True))
                route.out_stream = None
                actions.append(Release(rid, route))
        return actions

    def reap_idle(self, idle_timeout: float, now: float) -> list[Action]:
        """Requests silent for longer than ``idle_timeout`` at ``now`` are freed, and their senders
        told: should one ever come back, it starts over."""
        actions: list[Action] = []
        for rid, route in self._routes.items():
            if now - route.last_active > idle_timeout:
                actions.append(SendError(route.in_conn, route.in_stream, rid,
                                         "idle too long: this stage freed its cache", retry=True))
                actions.append(Release(rid, route))
        return actions

    def drop_all(self, reason: str) -> list[Action]:
        """The plan changed and this stage's layers go: every sender retries on the new route, and
        every stream onward ends (the caches go with the engine)."""
        actions: list[Action] = []
        for rid, route in self._routes.items():
            actions.append(SendError(route.in_conn, route.in_stream, rid, reason, retry=True))
            actions += self._close_out(rid, route)
        self._routes.clear()
        return actions

    @staticmethod
    def _close_out(rid: bytes, route: Route, end_request: bool = False, keep: Keep | None = None) -> list[Action]:
        conn, stream_id = route.out_conn, route.out_stream
        route.out_stream = None
        if conn is None or stream_id is None:
            return []
        return [EndOnward(conn, stream_id, rid, keep) if end_request else FinishStream(conn, stream_id)]
