"""Reroute and replay, with no I/O: what the asker must resend, and what it may forget.

The stages hold each request's KV cache; the asker holds the record that can rebuild it. Every
step the swarm answered is kept here (its start position, the head's activations as sent, and
whether it was a speculative check), so that when a route breaks (a stage dies, the plan
changes, a link drops) the same steps, sent again back to back on a new route, rebuild the new
stages' cache bit for bit: the same steps through the same kernels. Then the step that failed
is sent again.

The link (``swarmctl/asker/link.py``) does the I/O and feeds this table the events:

    a step about to go out  ``begin(rid, start_pos)``   a restart or rewind cuts the record there
    a route to send it on   ``route(rid, version)``     the open stream, or None: open one
                            ``opened(...)``             records the stream; returns the steps to replay
    a step sent             ``sent(rid, start_pos)``    the result the request now waits for
    an answer               ``is_answer(...)``          whether an arriving packet is that result
                            ``answered(...)``           the step joins the record
    a failure               ``failed(rid)``             returns the stream to free (finish)
    a new plan              ``plan_changed(version)``   the requests whose waiting step must move now
    the end of a request    ``release(rid, version)``   End (say END on the stream) or Free (finish it)

and carries out what comes back, like the trunk's route table (``swarmctl/trunk/routes.py``).
Connections are only stored and compared here, never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

Conn = Any  # a net.protocol.SwarmProtocol; only identity is used here


@dataclass(frozen=True)
class SentStep:
    start_pos: int
    hidden: np.ndarray  # the activations as sent (a copy: the caller's buffer may be reused)
    verify: bool  # a speculative check: replayed as one, so the cells get the same bits


@dataclass(frozen=True)
class OpenRoute:
    """The stream a request's steps travel, on the first stage's connection of plan ``version``."""

    conn: Conn
    stream_id: int
    version: int


@dataclass
class _Record:
    history: list[SentStep] = field(default_factory=list)  # what the swarm holds, oldest first
    route: OpenRoute | None = None
    waiting_for: int | None = None  # the start position whose result the request waits for


# --- what the table asks the link to do ---

@dataclass(frozen=True)
class Free:
    """End our side of an abandoned stream (finish, no END packet): the old route's stages drop
    the request when their stream ends or the plan moves on; QUIC forgets the stream."""

    conn: Conn
    stream_id: int


@dataclass(frozen=True)
class End:
    """Send END on the request's live stream: every stage frees its cells."""

    conn: Conn
    stream_id: int


Action = Union[Free, End]


class ReplayTable:
    def __init__(self) -> None:
        self._records: dict[bytes, _Record] = {}

    def __contains__(self, rid: bytes) -> bool:
        return rid in self._records

    def __len__(self) -> int:
        return len(self._records)

    # --- a step ---

    def begin(self, rid: bytes, start_pos: int) -> None:
        """A step from ``start_pos`` is about to go out. A restart or a rewind: the stages drop the
        cells from ``start_pos`` on (the packet's position says so), and so does the record."""
        record = self._records.setdefault(rid, _Record())
        record.history = [SentStep(s.start_pos, s.hidden[:start_pos - s.start_pos], s.verify)
                          for s in record.history if s.start_pos < start_pos]

    def route(self, rid: bytes, version: int) -> OpenRoute | None:
        """The stream to send on under plan ``version``; None when a new one must be opened (none
        yet, or one of an older plan: its stages may no longer hold the request)."""
        record = self._records.get(rid)
        if record is None or record.route is None or record.route.version != version:
            return None
        return record.route

    def opened(self, rid: bytes, conn: Conn, stream_id: int, version: int) -> list[SentStep]:
        """A new stream on plan ``version``'s route: returns every step to replay on it, in order,
        before the waiting step goes again."""
        record = self._records.setdefault(rid, _Record())
        record.route = OpenRoute(conn, stream_id, version)
        record.waiting_for = None
        return list(record.history)

    def sent(self, rid: bytes, start_pos: int) -> None:
        self._records[rid].waiting_for = start_pos

    def is_answer(self, rid: bytes, conn: Conn, stream_id: int, start_pos: int, error: bool) -> bool:
        """Whether a packet that arrived is what the request waits for: the result of the step it
        sent (results of replayed steps come back too, and are not), or an error from the route it
        travels now (one from an abandoned route is old news)."""
        record = self._records.get(rid)
        if record is None or record.waiting_for is None:
            return False
        if error:
            return record.route is not None and record.route.conn is conn and record.route.stream_id == stream_id
        return start_pos == record.waiting_for

    def answered(self, rid: bytes, start_pos: int, hidden: np.ndarray, verify: bool) -> None:
        """The swarm answered the step: it now holds its cells, so the record keeps it."""
        record = self._records[rid]
        record.history.append(SentStep(start_pos, np.array(hidden, dtype=np.float32, copy=True), verify))
        record.waiting_for = None

    # --- failures ---

    def failed(self, rid: bytes) -> list[Action]:
        """The request's route broke (an error that says retry, a lost connection, a silent stage,
        a plan change): free its stream; the next step opens a new one and replays."""
        record = self._records.get(rid)
        if record is None or record.route is None:
            return []
        route, record.route = record.route, None
        record.waiting_for = None
        return [Free(route.conn, route.stream_id)]

    def plan_changed(self, version: int) -> list[bytes]:
        """A new plan: the requests waiting on a route of another plan, to fail over now rather
        than at a timeout (their stages may be reassigned under them)."""
        return [rid for rid, r in self._records.items()
                if r.waiting_for is not None and r.route is not None and r.route.version != version]

    def waiting(self) -> list[bytes]:
        """Requests with a step out (a stage gone silent or a lost connection fails them all: the
        link only knows the first and last stage's connections, and every route runs through both)."""
        return [rid for rid, r in self._records.items() if r.waiting_for is not None]

    # --- the end ---

    def release(self, rid: bytes, version: int) -> list[Action]:
        """The request is done: END on a live stream of the current plan frees it at every stage;
        a stream of an older plan is only finished (its stages dropped it with the plan)."""
        record = self._records.pop(rid, None)
        if record is None or record.route is None:
            return []
        route = record.route
        if route.version != version:
            return [Free(route.conn, route.stream_id)]
        return [End(route.conn, route.stream_id)]

    def history(self, rid: bytes) -> list[SentStep]:
        record = self._records.get(rid)
        return list(record.history) if record is not None else []
