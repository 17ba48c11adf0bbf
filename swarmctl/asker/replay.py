"""Reroute and replay, with no I/O: what the asker must resend, and what it may forget.

The stages hold each request's KV cache; the asker holds the record that can rebuild it. Every
step handed to the swarm is kept here (its start position, the head's activations as sent, and
whether it was a speculative check): answered ones as the request's history, the rest as its
steps out, in order (a long prompt's chunks travel the pipeline several at once). When a route
breaks (a stage dies, the plan changes, a link drops), the history, sent again back to back on a
new route, rebuilds the new stages' cache bit for bit: the same steps through the same kernels.
The steps out follow it, in order, so each waiting step gets its answer from the new route.

The link (``swarmctl/asker/link.py``) does the I/O and feeds this table the events:

    a step handed over      ``begin(rid, step)``       a restart or rewind cuts the record there
    a route to send it on   ``route(rid, version)``    the open stream, or None: open one
                            ``opened(...)``            records the stream; returns every step to send
    a step to send          ``to_send(rid, pos)``      False when a replay already sent it there
    an answer               ``is_answer(...)``         whether an arriving packet answers a step out
                            ``answered(rid, pos)``     the step joins the history
    a failure               ``failed(rid)``            returns the stream to free (finish)
    a new plan              ``plan_changed(version)``  the requests whose steps out must move now
    the end of a request    ``release(rid, version)``  End (say END on the stream) or Free (finish it)
    a kept prefix           ``resume(rid, prefix, history)``  before its first step: the stages may
                            hold the history's cells under ``prefix`` (swarmctl/asker/prefixes.py)

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
    out: list[SentStep] = field(default_factory=list)  # handed over, not answered yet, in order
    route: OpenRoute | None = None
    sent: set[int] = field(default_factory=set)  # start positions of steps out sent on ``route``
    # Steps sent on ``route`` and cut before their answer came (a window in flight that fell): their
    # results still come, in order, ahead of any later step's, and a later step may start at the
    # same position (the window after the one whose guess failed), so each is told apart by order.
    doomed: list[int] = field(default_factory=list)
    # A kept prefix the route's stages may hold the history under: the first route sends only the
    # steps out, the first naming it; any failure forgets it (the history is replayed from 0 then).
    resume: bytes = b""

    def cut(self, start_pos: int) -> None:
        """Forget the positions from ``start_pos`` on (the stages drop them too)."""
        self.doomed += [s.start_pos for s in self.out if s.start_pos >= start_pos and s.start_pos in self.sent]
        self.history = _cut(self.history, start_pos)
        self.out = _cut(self.out, start_pos)
        self.sent = {pos for pos in self.sent if pos < start_pos}


def _cut(steps: list[SentStep], start_pos: int) -> list[SentStep]:
    return [SentStep(s.start_pos, s.hidden[:start_pos - s.start_pos], s.verify) for s in steps if s.start_pos < start_pos]


def cut_steps(steps: list[SentStep], start_pos: int) -> list[SentStep]:
    """The steps that filled positions [0, start_pos), the last one cut there."""
    return _cut(steps, start_pos)


def rebuilds(steps: list[SentStep], positions: int) -> bool:
    """Whether ``steps`` fill positions [0, positions) back to back from 0 (what a kept prefix
    needs to be rebuilt on another route)."""
    ends = 0
    for step in steps:
        if step.start_pos != ends:
            return False
        ends += step.hidden.shape[0]
    return ends == positions


# --- what the table asks the link to do ---

@dataclass(frozen=True)
class Free:
    """End our side of an abandoned stream (finish, no END packet): the old route's stages drop
    the request when their stream ends or the plan moves on; QUIC forgets the stream."""

    conn: Conn
    stream_id: int


@dataclass(frozen=True)
class End:
    """Send END on the request's live stream: every stage frees its cells (or, with ``keep``,
    keeps [0, positions) as that prefix)."""

    conn: Conn
    stream_id: int
    keep: tuple[bytes, int] | None = None  # (prefix id, positions)


Action = Union[Free, End]


class ReplayTable:
    def __init__(self) -> None:
        self._records: dict[bytes, _Record] = {}

    def __contains__(self, rid: bytes) -> bool:
        return rid in self._records

    def __len__(self) -> int:
        return len(self._records)

    # --- a step ---

    def begin(self, rid: bytes, step: SentStep) -> None:
        """A step is handed to the swarm. Steps from its start position on are cut first (a
        restart or a rewind: the stages drop those cells too, the packet's position says so)."""
        record = self._records.setdefault(rid, _Record())
        record.cut(step.start_pos)
        record.out.append(SentStep(step.start_pos, np.array(step.hidden, dtype=np.float32, copy=True), step.verify))

    def resume(self, rid: bytes, prefix: bytes, history: list[SentStep]) -> None:
        """Before a request's first step: the stages may hold ``history``'s cells as ``prefix``."""
        self._records[rid] = _Record(history=list(history), resume=prefix)

    def give_up_resume(self, rid: bytes) -> None:
        """The next route replays the history from 0 instead of naming the prefix."""
        record = self._records.get(rid)
        if record is not None:
            record.resume = b""

    def resuming(self, rid: bytes) -> bytes:
        """The prefix the next route's first step names ("" when it replays the history instead)."""
        record = self._records.get(rid)
        return record.resume if record is not None else b""

    def route(self, rid: bytes, version: int) -> OpenRoute | None:
        """The stream to send on under plan ``version``; None when a new one must be opened (none
        yet, or one of an older plan: its stages may no longer hold the request)."""
        record = self._records.get(rid)
        if record is None or record.route is None or record.route.version != version:
            return None
        return record.route

    def opened(self, rid: bytes, conn: Conn, stream_id: int, version: int) -> list[SentStep]:
        """A new stream on plan ``version``'s route: returns what to send on it now, in order: the
        history (to replay), then every step out (they count as sent)."""
        record = self._records.setdefault(rid, _Record())
        record.route = OpenRoute(conn, stream_id, version)
        record.sent = {s.start_pos for s in record.out}
        record.doomed = []
        return list(record.out) if record.resume else record.history + record.out

    def to_send(self, rid: bytes, start_pos: int) -> bool:
        """Whether the step out at ``start_pos`` still has to go on the current route (a replay
        sends the steps out too, and a step cut meanwhile is not out any more); if so it counts as
        sent from now."""
        record = self._records[rid]
        if start_pos in record.sent or all(s.start_pos != start_pos for s in record.out):
            return False
        record.sent.add(start_pos)
        return True

    def is_answer(self, rid: bytes, conn: Conn, stream_id: int, start_pos: int, error: bool) -> bool:
        """Whether a packet that arrived answers a step out: the result of one of them (results of
        replayed steps come back too, and are not; nor are those of steps cut after they were
        sent), or an error from the route the request travels now (one from an abandoned route is
        old news). A result that answers is noted as arrived."""
        record = self._records.get(rid)
        if record is None or not record.out:
            return False
        if error:
            return record.route is not None and record.route.conn is conn and record.route.stream_id == stream_id
        if start_pos in record.doomed:  # the result of a step cut after it was sent: it comes first
            record.doomed.remove(start_pos)
            return False
        if all(s.start_pos != start_pos for s in record.out):
            return False
        record.sent.discard(start_pos)  # (arrived: a cut from now on has no result of it to expect)
        return True

    def answered(self, rid: bytes, start_pos: int) -> None:
        """The swarm answered the step: it now holds its cells, so the history keeps it."""
        record = self._records[rid]
        step = next(s for s in record.out if s.start_pos == start_pos)
        record.out.remove(step)
        record.sent.discard(start_pos)
        record.history.append(step)
        record.history.sort(key=lambda s: s.start_pos)  # (answers come in order; this keeps it so regardless)

    # --- failures ---

    def failed(self, rid: bytes, on: OpenRoute | None = None) -> list[Action]:
        """The request's route broke (an error that says retry, a lost connection, a silent stage,
        a plan change): free its stream; the next step opens a new one and replays. The steps out
        stay out: they go again after the replay. ``on``: the route that broke, if known (a step
        out may learn of it after another opened the next one, which stays)."""
        record = self._records.get(rid)
        if record is None or record.route is None or (on is not None and record.route != on):
            return []
        route, record.route = record.route, None
        record.sent = set()
        record.doomed = []
        record.resume = b""
        return [Free(route.conn, route.stream_id)]

    def plan_changed(self, version: int) -> list[bytes]:
        """A new plan: the requests with steps out on a route of another plan, to fail over now
        rather than at a timeout (their stages may be reassigned under them)."""
        return [rid for rid, r in self._records.items()
                if r.sent and r.route is not None and r.route.version != version]

    def waiting(self) -> list[bytes]:
        """Requests with a step out on a route (a stage gone silent or a lost connection fails
        them all: the link only knows the first and last stage's connections, and every route
        runs through both)."""
        return [rid for rid, r in self._records.items() if r.sent and r.route is not None]

    # --- the end ---

    def release(self, rid: bytes, version: int, keep: tuple[bytes, int] | None = None) -> list[Action]:
        """The request is done: END on a live stream of the current plan frees it at every stage
        (``keep``: keeps [0, positions) as that prefix); a stream of an older plan is only finished
        (its stages dropped it with the plan)."""
        record = self._records.pop(rid, None)
        if record is None or record.route is None:
            return []
        route = record.route
        if route.version != version:
            return [Free(route.conn, route.stream_id)]
        return [End(route.conn, route.stream_id, keep)]

    def history(self, rid: bytes) -> list[SentStep]:
        record = self._records.get(rid)
        return list(record.history) if record is not None else []

    def out(self, rid: bytes) -> list[SentStep]:
        record = self._records.get(rid)
        return list(record.out) if record is not None else []
