"""Make-before-break, with no I/O: the host's decisions about plans that load and members that wait.

A new plan either replaces the one in use at once, or, while that one serves, is *staged*: sent to
its trunks to load beside it, and published once every stage of it is ready (``next_step``). This
table decides, from the times it is given:

- when a staged plan is given up (``staged_by``: ``staged_deadline_s`` after it was staged),
- when a published plan's stages must be ready (``ready_by``: counted per member from when it
  stopped being ready in the plan in use, through re-plans; plans/hysteresis.py
  ``ready_deadline_s``), and a stage whose layer check is under way gets ``checking_grace_s`` more,
  one whose fetch keeps advancing ``fetch_stall_s`` past its latest progress,
- which members are left out of plans and until when (``holds``): one that missed a deadline, or
  that came back right after leaving, longer each time (plans/hysteresis.py ``Backoff``),
- plan versions: each issued once, never again, also by a restarted host (``issue``).

The keeper (``swarmctl/host/planning.py``) does the I/O: it re-plans, pushes plans, sets a timer
for ``due()``, writes what a member is refused with onto its TrunkInfo (plan_members.py), and feeds
this table the events:

    a plan staged               ``staged(now)``
    the staged plan ended       ``staging_ended()``          published or dropped
    the plan in use changed     ``track(unready, now)``      its unready members and their bytes
    the timer                   ``staged_overdue(now)``, ``ready_due(now)``, ``ended_holds(now)``
    a ready deadline passed     ``overdue(plan, unready, proving, now)``  who is late, and why
    a member missed             ``miss(name, why, now)``     the hold that leaves it out
    a member registered         ``registered(name, now, replaced, free, settle_s)``
    a member left               ``left(name, now)``
    a member's fetch progressed ``fetch_progress(name, done, now)``  its ready deadline moves on
    holds over                  ``release(names)``

Nothing here reads a clock or touches a connection: tests/test_staging_core.py drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, NamedTuple

from plans.hysteresis import MISSED_HOLD_S, READY_BASE_S, REJOIN_HOLD_S, Backoff, ready_deadline_s
from plans.layout import ModelLayout
from plans.plan import ExpertAssignment, Plan

TRIAL_VERSIONS = 2**40  # trial plans' private versions count from here (never a public plan's)


class Hold(NamedTuple):
    """A member left out of plans for a while (plans/hysteresis.py Backoff): it is refused with
    ``why`` until ``until`` (the keeper's clock); ``missed``: it missed a deadline (else it rejoined
    right after leaving)."""

    until: float
    why: str
    missed: bool


class Unready(NamedTuple):
    """A member of a plan that is not ready: what it is to load, and its weight bytes."""

    what: str
    size: int


@dataclass
class StagingSettings:
    """How long plans get to load (the keeper reads them from the environment: planning.py)."""

    staged_deadline_s: float = 600.0
    ready_deadline_s: float = READY_BASE_S
    # a member whose fetch of what it was given keeps advancing is not late while it does: it is
    # given ``fetch_stall_s`` past its latest progress, as long as it fetches at least
    # ``fetch_floor_bytes_s`` on average and claims no more than twice what it was given (Kimi's trunk share at
    # 20 Mbit/s is about 29 h of fetching, far past a deadline priced at a local reload)
    fetch_stall_s: float = 120.0
    fetch_floor_bytes_s: float = 250e3
    checking_grace_s: float = 10.0
    missed_hold_s: float = MISSED_HOLD_S
    rejoin_hold_s: float = REJOIN_HOLD_S


@dataclass
class Rejoin:
    """What a registration decides: ``hold`` refuses the member (None: planned as any other);
    ``waiting``: it is a hold it got before, still running (else a new one, for coming back quickly)."""

    hold: Hold | None = None
    waiting: bool = False


def next_step(plan: Plan, staged: Plan | None, candidate: Plan, present: Collection[str]) -> str:
    """What to do with a new plan (``candidate``, with a new version) given the plan in use, the one
    staged, and the members there now (registered, connected, not refused): "drop" the staged plan
    (the candidate is the plan in use again), "stage" the candidate, or "publish" it at once."""
    if staged is not None and candidate.assignments() == plan.assignments():
        return "drop"
    return "stage" if can_stage(plan, candidate, present) else "publish"


def can_stage(old: Plan, new: Plan, present: Collection[str]) -> bool:
    """A plan that serves, every one of whose members is still there, keeps serving while a new
    one loads (make-before-break). Not where expert nodes are planned (an expert node holds one
    assignment at a time), nor for a plan that cannot serve anyway."""
    return bool(old.stages and new.stages and old.complete and not old.experts and not new.experts) and all(
        s.member in present for s in old.stages)


def unready(plan: Plan, layout: ModelLayout, registered: Collection[str]) -> dict[str, Unready]:
    """``plan``'s stages and expert assignments that are not ready, of members ``registered``."""
    start, stop = plan.trunk_range
    experts = sum(layout.expert_bytes[start:stop]) if layout.expert_bytes else 0
    found = {}
    for a in [*plan.stages, *plan.experts]:
        if a.ready or a.member not in registered:
            continue
        if isinstance(a, ExpertAssignment):
            found[a.member] = Unready(f"experts [{a.start}, {a.stop})", experts * (a.stop - a.start)
                                      // max(1, plan.n_expert))
        else:
            found[a.member] = Unready(f"layers [{a.start}, {a.stop})", layout.range_bytes(a.start, a.stop))
    return found


@dataclass
class FetchSeen:
    """A member's fetch as its progress reports show it: the first report's time and bytes, and
    the latest report that advanced."""

    first_at: float
    first_done: int
    last_at: float
    done: int

    def rate(self) -> float:
        return (self.done - self.first_done) / (self.last_at - self.first_at) if self.last_at > self.first_at else 0.0


@dataclass
class Staging:
    settings: StagingSettings = field(default_factory=StagingSettings)
    issued: int = 0  # the last version issued (staged, published, or given up)
    staged_by: float | None = None  # when the staged plan is given up
    ready_by: float | None = None  # when the first unready member of the plan in use is due
    unready_since: dict[str, float] = field(default_factory=dict)  # member → since when, in the plan in use
    holds: dict[str, Hold] = field(default_factory=dict)
    left_at: dict[str, float] = field(default_factory=dict)  # member → when its registration ended
    fetches: dict[str, FetchSeen] = field(default_factory=dict)  # unready members' fetches, as reported
    missed: Backoff = field(init=False)  # members whose stage missed its deadline
    flapped: Backoff = field(init=False)  # members that rejoined right after leaving (the first time free)

    def __post_init__(self) -> None:
        self.missed = Backoff(self.settings.missed_hold_s)
        self.flapped = Backoff(self.settings.rejoin_hold_s, free=1)

    # --- versions ---

    def restarted(self, last: int) -> int:
        """The first version of a host whose last issued one was ``last`` (0: none ever): one past it,
        so its plan with no stages yet shares no number with one a trunk may hold."""
        self.issued = last + 1 if last else 0
        return self.issued

    def issue(self, base: int) -> int:
        """A version for a new plan made from the plan of version ``base``: never one issued before."""
        self.issued = max(self.issued, base) + 1
        return self.issued

    # --- a staged plan ---

    def staged(self, now: float) -> None:
        self.staged_by = now + self.settings.staged_deadline_s

    def staging_ended(self) -> None:
        self.staged_by = None

    def staged_overdue(self, now: float) -> bool:
        """The staged plan's deadline passed (it is given up: ``give_up``)."""
        return self.staged_by is not None and now >= self.staged_by

    def give_up(self, staged: Plan | None, version: int, now: float) -> dict[str, Hold]:
        """The staged plan of ``version`` did not get ready in time: each member that did not load
        its stage is left out for a while (none if ``staged`` is another plan by now)."""
        self.staged_by = None
        if staged is None or staged.version != version:
            return {}
        return {s.member: self.miss(s.member, f"did not load layers [{s.start}, {s.stop}) of plan v{version} "
                                              f"within {self.settings.staged_deadline_s:.0f} s", now)
                for s in staged.stages if not s.ready}

    # --- the published plan's deadlines ---

    def deadline(self, name: str, size: int) -> float:
        """When ``name``, given ``size`` weight bytes to load, is late: its deadline priced at a
        local reload, or later while its fetch keeps advancing (``fetch_progress``)."""
        by = self.unready_since[name] + ready_deadline_s(size, self.settings.ready_deadline_s)
        seen = self.fetches.get(name)
        if seen is not None and seen.done <= 2 * size and seen.rate() >= self.settings.fetch_floor_bytes_s:
            by = max(by, seen.last_at + self.settings.fetch_stall_s)
        return by

    def fetch_progress(self, name: str, done: int, now: float) -> None:
        """``name`` says its fetch has ``done`` bytes: only an advance counts."""
        seen = self.fetches.get(name)
        if seen is None:
            self.fetches[name] = FetchSeen(now, done, now, done)
        elif done > seen.done:
            seen.last_at, seen.done = now, done

    def track(self, members: Mapping[str, Unready], now: float) -> None:
        """The plan in use's unready ``members`` now: each keeps the time it was first unready (a
        re-plan gives nobody a new deadline); the first of them is due at ``ready_by``."""
        self.unready_since = {name: self.unready_since.get(name, now) for name in members}
        self.fetches = {name: seen for name, seen in self.fetches.items() if name in members}
        self.ready_by = min((self.deadline(name, u.size) for name, u in members.items()), default=None)

    def ready_due(self, now: float) -> bool:
        return self.ready_by is not None and now >= self.ready_by

    def overdue(self, version: int, members: Mapping[str, Unready], proving: Collection[str],
                now: float) -> dict[str, str]:
        """{member: why} of the plan in use's unready ``members`` past their deadline; one whose layer
        check for this plan is under way (``proving``) is given ``checking_grace_s`` more."""
        late, due = {}, []
        for name, u in members.items():
            since = self.unready_since.setdefault(name, now)
            by = self.deadline(name, u.size)
            if by > now:
                due.append(by)
            elif name in proving:
                due.append(now + self.settings.checking_grace_s)
            else:
                late[name] = f"was given {u.what} of plan v{version} and was not ready {now - since:.0f} s later"
        self.ready_by = min(due, default=None)
        return late

    # --- members left out for a while ---

    def hold(self, name: str, why: str, seconds: float, missed: bool, now: float) -> Hold:
        hold = self.holds[name] = Hold(now + seconds, f"{why}; left out of plans for {seconds:.0f} s", missed)
        return hold

    def miss(self, name: str, why: str, now: float) -> Hold:
        """``name`` missed a deadline: left out, longer at each miss in a row."""
        return self.hold(name, why, self.missed.strike(name, now), True, now)

    def registered(self, name: str, now: float, replaced: bool, free: bool, settle_s: float) -> Rejoin:
        """``name`` registered (``replaced``: over a registration of its own; ``free``: not refused
        for another reason): one still waiting out a hold is refused again, one that left less than
        ``settle_s`` ago is left out for a while (the first quick return is free: a restart)."""
        left = now if replaced else self.left_at.pop(name, None)
        hold = self.holds.get(name)
        if not free:
            return Rejoin()
        if hold is not None and hold.until > now:
            return Rejoin(hold, waiting=True)
        if left is not None and now - left < settle_s:
            wait = self.flapped.strike(name, now)
            if wait > 0:
                return Rejoin(self.hold(name, f"rejoined {now - left:.0f} s after leaving", wait, False, now))
        return Rejoin()

    def left(self, name: str, now: float) -> None:
        self.left_at[name] = now
        self.fetches.pop(name, None)

    def held(self, name: str, refused: str | None) -> bool:
        """``name`` (refused with ``refused`` now; None: not registered) is refused by its hold."""
        hold = self.holds.get(name)
        return hold is not None and refused is not None and refused == hold.why

    def waiting(self, refusals: Mapping[str, str], missed: bool) -> list[str]:
        """The registered members (``refusals``: name → what each is refused with) refused by their
        hold: those that rejoined too soon, and with ``missed`` those that missed a deadline too."""
        return [name for name, hold in self.holds.items()
                if self.held(name, refusals.get(name)) and (missed or not hold.missed)]

    def ended_holds(self, now: float) -> list[str]:
        return [name for name, hold in self.holds.items() if hold.until <= now]

    def release(self, names: Collection[str]) -> None:
        for name in names:
            del self.holds[name]

    def due(self) -> float | None:
        """When the keeper's timer has something to do next, or None."""
        dues = [t for t in (self.staged_by, self.ready_by) if t is not None]
        return min([*dues, *(hold.until for hold in self.holds.values())], default=None)
