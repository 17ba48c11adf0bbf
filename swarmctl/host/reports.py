"""What askers tell the host about their routes: recoveries after a failure, and wrong results
their spot checks caught. Counted and shown in status; what the host does about a wrong result is
Accusations' and ClaimChecks' (accusations.py, checks.py): a check of its own, never the askers' word.

Which accusations count. An asker that re-checked its route stage by stage names
the stage whose own answer was wrong (``attributed``). The host counts such a report against a
member only when

- the member is a stage of the host's plan now, is not the accuser, and is not refused; and
- the accused stage's own record (its ``stats``: ``one_stage``, swarmctl/trunk/one_stage.py),
  read by the host over the stage's connection to it, shows one-stage steps computed there for the
  accuser's account (its invite: Plan.account) under the plan version the report names, more of
  them than when the host last counted a report of that account against this registration of the
  member. One re-check, one counted report: steps are evidence once.

So a report needs the accuser to have sent the accused stage steps of its own, under its own
certificate and on its own budget there; a message to the host alone is not enough. A counted
report only makes the host check the member itself (recheck.py); it evicts nobody, from however
many invites. Reports the evidence does not back are answered and logged, and not counted. The
host judges one attributed report of each member's at a time (it asks the accused stage for its
record once per report); one that comes while another is judged is not counted.

A report that names a whole route (``attributed`` false: the re-check stage by stage found no
single stage, or the route had one) is counted for status as before, with no evidence asked, and
never acted on.

Every report ages out: status and the host count only those of the last ``REPORT_WINDOW_S``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from net.clock import now
from net.messages import BadResult
from swarmctl.node.log_limit import LogLimit

log = logging.getLogger("swarmctl.host")

REPORT_WINDOW_S = 600.0  # a report older than this no longer counts
MAX_TIMES = 64  # report times kept per accused member and accuser (the newest)


@dataclass
class Recovery:
    recoveries: int = 0
    replayed_bytes: int = 0
    last_recovery_s: float | None = None
    last_marked_down: str | None = None  # (set by the host's liveness watcher)



@dataclass
class AskerReports:
    recovery: Recovery = field(default_factory=Recovery)
    # accused → {accuser: the clock's time of each counted report, oldest first}
    bad_results: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # accused → {accuser: when it last found it stage by stage, with evidence}
    attributed: dict[str, dict[str, float]] = field(default_factory=dict)
    # (accused, its registration) → {account: the accused's one-stage steps for it when last counted}
    evidence_used: dict[tuple[str, float], dict[str, int]] = field(default_factory=dict)
    judging: set[str] = field(default_factory=set)  # accusers with an attributed report being judged (one each)
    window_s: float = REPORT_WINDOW_S
    clock: Callable[[], float] = now  # the loop's (net/clock.py)
    _log: LogLimit = field(default_factory=lambda: LogLimit(log))  # a flood of reports must not fill the disk

    def recovered(self, recovery_s: float, replayed_bytes: int) -> None:
        """An asker rerouted a request after a failure: how long it took, how much it replayed."""
        self.recovery.recoveries += 1
        self.recovery.replayed_bytes += replayed_bytes
        self.recovery.last_recovery_s = recovery_s

    @staticmethod
    def named(accuser: str, report: BadResult, serving: set[str]) -> list[str]:
        """The members a report names that could count: those serving, the accuser never."""
        return sorted({m[:64] for m in report.members} & serving - {accuser})

    def bad_result(self, accuser: str, report: BadResult, serving: set[str]) -> list[str]:
        """A report that names a whole route (module docstring): counted for status, acted on by
        nobody. Returns the members counted."""
        counted = self.named(accuser, report, serving)
        for name in counted:
            self._count(name, accuser)
        self._told(accuser, report, counted, "")
        return counted

    def found(self, accuser: str, account: str, name: str, registration: float, report: BadResult,
              one_stage: dict[str, list[int]]) -> bool:
        """An attributed report against ``name`` (a stage now, not the accuser: the caller checked),
        judged by the evidence rule (module docstring): ``one_stage`` is the accused stage's own
        record as it answered the host, ``registration`` tells this registration of it from an
        earlier one. Counted (and True) only when the record backs it."""
        entry = one_stage.get(account) if isinstance(one_stage, dict) else None
        steps, version = _entry(entry)
        used = self.evidence_used.setdefault((name, registration), {})
        backed = steps > used.get(account, 0) and version == report.plan_version
        why = "" if backed else (f"not counted: {name} computed no re-check steps of {account}'s under plan "
                                 f"v{report.plan_version} since the last report counted")
        if backed:
            used[account] = steps
            self._count(name, accuser)
            self.attributed.setdefault(name, {})[accuser] = self.clock()
        self._forget_registrations(name, registration)
        self._told(accuser, report, [name], why)
        return backed

    def reports_on(self, name: str) -> int:
        return sum(len(self._recent(times)) for times in self.bad_results.get(name, {}).values())

    def reporters_of(self, name: str) -> int:
        return sum(1 for times in self.bad_results.get(name, {}).values() if self._recent(times))

    def found_by(self, name: str) -> set[str]:
        """The members whose re-check stage by stage named ``name`` lately, with evidence."""
        since = self.clock() - self.window_s
        return {accuser for accuser, at in self.attributed.get(name, {}).items() if at >= since}

    # --- keeping the tallies ---

    def _count(self, name: str, accuser: str) -> None:
        now = self.clock()
        by = self.bad_results.setdefault(name, {})
        by[accuser] = [*self._recent(by.get(accuser, [])), now][-MAX_TIMES:]
        for other in [a for a, times in by.items() if not self._recent(times)]:  # (aged out: forgotten)
            del by[other]

    def _recent(self, times: list[float]) -> list[float]:
        since = self.clock() - self.window_s
        return [t for t in times if t >= since]

    def _forget_registrations(self, name: str, current: float) -> None:
        for key in [k for k in self.evidence_used if k[0] == name and k[1] != current]:
            del self.evidence_used[key]

    def _told(self, accuser: str, report: BadResult, named: list[str], why: str) -> None:
        tally = "; ".join(f"{n}: {self.reports_on(n)} reports from {self.reporters_of(n)} members in the last "
                          f"{self.window_s:.0f} s" for n in named) or "ignored"
        self._log.warning("%s reports a wrong result from %s (plan v%s, relative error %s%s): %s%s",
                          accuser, " / ".join(named) or "no serving member", report.plan_version,
                          f"{report.rel_error:.3g}" if report.rel_error is not None else "?",
                          ", found stage by stage" if report.attributed else "", tally, f" ({why})" if why else "")


def _entry(entry: object) -> tuple[int, int]:
    """(steps, plan version) of a stage's record for one account; (0, -1) for anything else."""
    if isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in entry):
        return entry[0], entry[1]
    return 0, -1
