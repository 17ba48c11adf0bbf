"""Rerouting and stall detection, with no I/O: given ``now``, what the asker's link does next.

The link (``swarmctl/asker/link.py``) reads the clock, sends and receives; the decisions are
made here, from what it tells them, like the replay table (``swarmctl/asker/replay.py``) decides
what to resend:

    a step out, waiting             ``StallClock.overdue(now, per_row_s, policy)``  its stall limit, once overdue
    a step's route failed           ``StepFailures.failed(now)``   False: past its deadline, give up
    waiting for a route after it    ``RouteWait.decide(now, plan)``   Follow, GIVE_UP, or None: wait on
    a move to the newest plan       ``needs_move(...)``            False: another step's move already did it
    a plan's stages do not answer   ``policy.retry_reach(now, deadline)``
    an error packet                 ``answer_verdict(retry, resuming)``  the request's answer, or a reroute
    a closed connection, a refusal  ``refusal(reason)``            for good (every request ends), or None
    a keep-alive tick               ``on_tick(waiting, silences, policy)``  Silent(member), CHECK_STALLS, None

Every timing lives in ``ReroutePolicy`` (the tests shorten some).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from net.identity import REVOKED_REASON, is_revocation
from net.liveness import SILENCE_LIMIT


class RouteFailed(Exception):
    """The route broke, not the request: reroute and replay."""


class PrefixLost(RouteFailed):
    """A stage of a resumed request's first route does not hold its kept prefix (evicted,
    restarted, replanned): the same route replays the steps from position 0, at once."""


@dataclass(frozen=True)
class ReroutePolicy:
    """The link's timings, in one place."""

    # A step whose route answers pings but not the step is resent on a fresh route after the larger
    # of stall_min_s and stall_factor times what the plan expects its rows (and those ahead of it)
    # to take; twice that at each further stall of the same step. Nothing should lose a step on a
    # live route; this bounds what it costs if something does (else it waits for its deadline).
    stall_min_s: float = 30.0
    stall_factor: float = 20.0
    no_plan_grace_s: float = 20.0  # how long to wait for the swarm to become whole again before giving up
    stage_retry_s: float = 1.0  # a stage that did not answer as the link opened is tried again after this
    same_route_retry_s: float = 2 * SILENCE_LIMIT  # a route that failed on a plan that stays: tried again after this
    silence_limit_s: float = SILENCE_LIMIT  # a stage silent this long fails the steps out over at once
    connect_attempts: int = 3  # to a new plan's first and last stage, before the step's route counts as failed
    connect_pause_s: float = 0.5  # between those attempts

    def retry_reach(self, now: float, deadline: float) -> bool:
        """Whether a plan's stages that did not answer are tried again (else the failure stands)."""
        return now + self.stage_retry_s <= deadline


@dataclass
class StallClock:
    """Stall detection for one step out: when it was last sent, and the rows its route runs
    before its answer (its own, and its request's ahead of it)."""

    sent_at: float = 0.0  # 0: not sent yet
    rows: int = 0
    patience: float = 1.0  # doubled at each stall (a stage that is only slow is not asked again and again)

    def sent(self, now: float, rows: int) -> None:
        self.sent_at, self.rows = now, rows

    def overdue(self, now: float, per_row_s: float, policy: ReroutePolicy) -> float | None:
        """Its stall limit (policy.stall_min_s, or stall_factor times ``per_row_s`` for its rows,
        times its patience) when it has waited longer than that, else None; the patience doubles then."""
        if not self.sent_at:
            return None
        limit = max(policy.stall_min_s, policy.stall_factor * per_row_s * self.rows) * self.patience
        if now - self.sent_at <= limit:
            return None
        self.patience *= 2
        return limit


@dataclass
class StepFailures:
    """One step's route failures: the first one's time, against the step's deadline."""

    deadline: float
    failed_at: float | None = None
    move_error: str = ""  # why the last move to a new route failed, if one did (said when it gives up)

    def failed(self, now: float) -> bool:
        """A route failure at ``now``; False when the step is past its deadline (it gives up)."""
        self.failed_at = self.failed_at or now
        return now <= self.deadline

    def recovery_s(self, now: float) -> float | None:
        """As its answer came: how long the failover took (None: it never failed)."""
        return None if self.failed_at is None else now - self.failed_at


class PlanLike(Protocol):
    version: int
    complete: bool


@dataclass(frozen=True)
class Follow:
    """Move to plan ``version``; ``force``: the plan that failed, again (new connections all the same:
    the old ones may be dead without knowing it yet)."""

    version: int
    force: bool


GIVE_UP = "give up"  # RouteWait: no complete plan in time (the swarm cannot serve the model)


class RouteWait:
    """After a route failure on plan ``failed_version``: the host's next complete plan, or, if the
    plan stays the same (a link that dropped and came back), the same route again after a pause;
    within the step's deadline and a grace for a swarm that has lost capacity."""

    def __init__(self, policy: ReroutePolicy, now: float, deadline: float, failed_version: int) -> None:
        self.failed_version = failed_version
        self.retry_same_at = now + policy.same_route_retry_s
        self.give_up_at = min(deadline, now + policy.no_plan_grace_s)

    def decide(self, now: float, latest: PlanLike | None) -> Follow | str | None:
        """Follow a plan, GIVE_UP, or None: wait for the next plan (or a pause) and ask again."""
        if latest is not None and latest.complete and \
                (latest.version != self.failed_version or now > self.retry_same_at):
            return Follow(latest.version, force=latest.version == self.failed_version)
        if now > self.give_up_at:
            return GIVE_UP
        return None


def already_moved(moved_at: float, since: float) -> bool:
    """Whether the stage connections moved after ``since`` (a failure): requests failing together
    move once; moving again would close the connections the first one's replay went out on."""
    return moved_at > since


def needs_move(*, force: bool, latest_version: int | None, plan_version: int, alive: bool) -> bool:
    """Whether to move to the newest plan (or, with ``force``, reconnect on the same one)."""
    return force or latest_version != plan_version or not alive


class Answer(enum.Enum):
    REFUSED = "refused"  # a stage refused the request: that is its answer (no route would do better)
    REROUTE = "reroute"  # a stage asks to retry: the request's steps out move to a new route
    REPLAY = "replay"  # a resumed request's first route lacks its kept prefix: replay from 0 on it


def answer_verdict(retry: bool, resuming: bool) -> Answer:
    """What an error packet that answers a request's step means."""
    if not retry:
        return Answer.REFUSED
    return Answer.REPLAY if resuming else Answer.REROUTE


def refusal(reason: str) -> str | None:
    """A refusal for good (a revocation: every stage and the host refuse this member, so a reroute
    would meet it again until the deadline), said from the refusal on; None for anything a new
    route may get past."""
    if not is_revocation(reason):
        return None
    return f"the swarm refused the request: {reason[reason.index(REVOKED_REASON):]}"


@dataclass(frozen=True)
class Silent:
    """A stage gone silent while steps wait on it: fail them all over now."""

    member: str


CHECK_STALLS = "check stalls"  # on_tick: the stages answer pings; fail over the steps that stalled


def on_tick(waiting: bool, silences: list[tuple[str, float]], policy: ReroutePolicy) -> Silent | str | None:
    """Each keep-alive tick: ``silences`` the first and last stage's (member, seconds since heard)."""
    if not waiting:
        return None
    silent = [member for member, seconds in silences if seconds > policy.silence_limit_s]
    return Silent(silent[0]) if silent else CHECK_STALLS
