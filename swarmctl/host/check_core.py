"""What the host's checks of trunks decide, with no I/O: who is left out for a failed check and
until when, wrong-result strikes, how often askers' reports may make the host check a member, the
fastest the host timed each member, when a check that raised is tried again and a trunk that
claims more than it showed is timed again, and what a layer check's outcome means.

ClaimChecks (``swarmctl/host/checks.py``) makes the checks (challenges trunks, runs the tasks,
writes onto TrunkInfo, re-plans) and feeds this table the events, each with ``now``:

    a member registered          ``left_out(name, now)``        (seconds left, what it failed) or None
    a check failed               ``fail(name, now, hold_s, what)``  the hold it is left out for
    wrong results                ``strike(name, now)``          the hold: longer at each strike
    the host's re-check passed   ``cleared(name)``              its strikes are forgotten
    an askers' report            ``may_recheck(name, now)``     at most once per ``RECHECK_EVERY_S``
    a hold's time is up          ``readmit(name, now)``         whether it is over (not renewed)
    the host timed a member      ``timed(name, ms, before)``    the figure to plan it with
    a check raised               ``retry_delay(failures)``
    a claim faster than timed    ``claims_faster(claimed, measured)``, ``reprobe_delay(reprobes)``

and a check's outcome is judged by ``ready_verdict`` (a stage said ready) and ``trial_failure`` (a
trunk on trial); ``stage_serving`` says from a stage's stats whether timing it now would take its
compute thread from requests. Nothing here reads a clock or touches a connection: tests/test_check_core.py
drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from net import messages as m
from net.messages import MS_PER_LAYER
from plans.hysteresis import SPEED_FACTOR

if TYPE_CHECKING:  # (only its fields are read: the challenge itself is check_tasks.py's)
    from swarmctl.node.layer_proof import Outcome

RECHECK_EVERY_S = 60.0  # a member named by askers' reports is checked again at most this often
FAILED_CHECK_HOLD_S = 300.0  # a member that failed a layer check is left out this long, re-registered or not
WRONG_RESULT_HOLD_S = 300.0  # ... one that returned wrong results to the host's own check: this long at first,
WRONG_RESULT_HOLD_MAX_S = 3600.0  # twice as long at each further strike, up to this
STRIKES_FORGOTTEN_S = 3600.0  # strikes this long after the latest are forgotten
REPROBES = 3  # a claim faster than the host measured is timed again this often, after 10, 20, 40 s
REPROBE_AFTER_S = 10.0
# A timing run takes the member's compute thread for a few 32-step runs: a member that serves is
# timed only once its stage has run no batch for PROBE_IDLE_S, looked at every PROBE_WAIT_S, for at
# most PROBE_WAIT_MAX_S; one that serves all the while is not timed again (its served figures,
# from the batches it runs, are what it claims, and it is planned never faster than the host timed it)
PROBE_IDLE_S = 5.0
PROBE_WAIT_S = 10.0
PROBE_WAIT_MAX_S = 600.0
RETRY_FIRST_S = 5.0  # a check that raised on the host's side is tried again after 5, 10, 20 ... s
RETRY_MAX_S = 300.0


@dataclass(frozen=True)
class CheckTimings:
    """How long the host waits between a trunk's failed checks, holds members out, and waits for a
    serving member's stage to go idle before timing it (tests shorten them)."""

    retry_first_s: float = RETRY_FIRST_S
    retry_max_s: float = RETRY_MAX_S
    failed_hold_s: float = FAILED_CHECK_HOLD_S
    wrong_hold_s: float = WRONG_RESULT_HOLD_S
    probe_wait_s: float = PROBE_WAIT_S
    probe_wait_max_s: float = PROBE_WAIT_MAX_S


class ReadyVerdict(NamedTuple):
    """What a stage's layer check says (``ready_verdict``): ``kind`` is "ready" (its stage counts),
    "failed" (left out: ``why``), "excused" (the plan moved: a miss or a late answer is forgiven
    once) or "moved" (the plan moved: the trunk confirms the new one and is checked again)."""

    kind: str
    why: str = ""


def ready_verdict(outcome: Outcome, same: bool, excused_before: bool) -> ReadyVerdict:
    """A trunk said it was ready; ``outcome`` is its layer check; ``same``: its stage is still the
    one checked. A plan that moved meanwhile excuses "not held" (the trunk may have loaded other
    layers since) and, once between two passed checks (``excused_before``), a late answer; a wrong
    answer never."""
    if not same and (outcome.missing or (outcome.timed_out and not excused_before)):
        return ReadyVerdict("excused")
    if outcome.problem or outcome.missing:
        return ReadyVerdict("failed", outcome.problem or
                            f"said it was ready with layers it does not hold ({outcome.missing})")
    return ReadyVerdict("ready" if same else "moved")


def trial_failure(outcome: Outcome) -> str:
    """Why a trunk on trial failed its check ("": it proved its trial layers and was timed on one)."""
    if outcome.problem or outcome.missing or outcome.ms_per_layer is None:
        return outcome.problem or \
            f"said it loaded its trial layers but does not hold them ({outcome.missing or 'not timed'})"
    return ""


def stage_serving(stats: m.Stats, idle_s: float = PROBE_IDLE_S) -> bool:
    """A stage serves while steps wait at it or it began a batch within ``idle_s`` of its snapshot."""
    return stats.queue_depth > 0 or any(stats.time - batch[0] < idle_s for batch in stats.recent_batches)


def claims_faster(claimed: float | None, measured: float) -> bool:
    """A trunk's claim is faster than the host timed it by more than the noise band: time it again."""
    return claimed is not None and claimed * SPEED_FACTOR <= measured


def reprobe_delay(reprobes: int) -> float | None:
    """How long before the next timing of a trunk timed again ``reprobes`` times already; None: no more."""
    return REPROBE_AFTER_S * 2 ** reprobes if reprobes < REPROBES else None


class Held(NamedTuple):
    """A member left out for a failed check: until when (the checks' clock), and what it did."""

    until: float
    what: str


@dataclass
class CheckRecord:
    """What the host keeps between its checks of members, by name (so across rejoins): every
    time is the caller's ``now`` (ClaimChecks: net/clock.py)."""

    timings: CheckTimings = field(default_factory=CheckTimings)
    held_out: dict[str, Held] = field(default_factory=dict)  # re-registering does not shorten a hold
    strikes: dict[str, tuple[int, float]] = field(default_factory=dict)  # → (wrong-result strikes, the latest's time)
    measured_speeds: dict[str, float] = field(default_factory=dict)  # → the fastest the host timed it
    rechecked: dict[str, float] = field(default_factory=dict)  # → when an askers' report last made the host check it

    def retry_delay(self, failures: int) -> float:
        """How long before a check that raised ``failures`` times in a row is tried again."""
        return min(self.timings.retry_max_s, self.timings.retry_first_s * 2 ** (failures - 1))

    # --- holds ---

    def left_out(self, name: str, now: float) -> tuple[float, str] | None:
        """(seconds left, what it failed) while ``name`` waits out a hold, else None."""
        held = self.held_out.get(name)
        return (held.until - now, held.what) if held is not None and held.until > now else None

    def fail(self, name: str, now: float, hold_s: float | None = None, what: str = "failed a layer check") -> float:
        """``name`` is left out for ``hold_s`` (the failed-check hold unless said): how long."""
        hold_s = self.timings.failed_hold_s if hold_s is None else hold_s
        self.held_out[name] = Held(now + hold_s, what)
        return hold_s

    def strike(self, name: str, now: float) -> float:
        """``name`` returned wrong results to the host's own check: the hold, twice as long at each
        strike within ``STRIKES_FORGOTTEN_S`` of the one before, at most ``WRONG_RESULT_HOLD_MAX_S``."""
        strikes, latest = self.strikes.get(name, (0, now))
        strikes = 1 if now - latest > STRIKES_FORGOTTEN_S else strikes + 1
        self.strikes[name] = (strikes, now)
        return min(WRONG_RESULT_HOLD_MAX_S, self.timings.wrong_hold_s * 2 ** (strikes - 1))

    def cleared(self, name: str) -> None:
        self.strikes.pop(name, None)

    def readmit(self, name: str, now: float) -> bool:
        """A hold's time is up: whether ``name`` may be planned again (False: it was left out again
        meanwhile, and that hold's own end readmits it)."""
        held = self.held_out.get(name)
        if held is not None and held.until > now:
            return False
        self.held_out.pop(name, None)
        return True

    # --- askers' reports ---

    def may_recheck(self, name: str, now: float) -> bool:
        """An askers' report names ``name``: whether the host checks it now (then not again for
        ``RECHECK_EVERY_S``)."""
        if now - self.rechecked.get(name, -RECHECK_EVERY_S) < RECHECK_EVERY_S:
            return False
        self.rechecked[name] = now
        return True

    # --- timings ---

    def timed(self, name: str, ms: float, before: float | None) -> tuple[float, float]:
        """The host timed ``name`` at ``ms`` per layer (its figure so far ``before``): (this timing,
        never under the wire's floor; the figure kept, the fastest it ever timed it: interference
        only adds time, so the fastest is the machine's)."""
        figure = max(ms, MS_PER_LAYER[0])
        kept = figure if before is None or figure < before else before
        self.measured_speeds[name] = kept
        return figure, kept
