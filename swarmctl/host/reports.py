"""What askers tell the host about their routes: recoveries after a failure, and wrong results
their spot checks caught. Counted and shown in status; what the host does about a wrong result
found stage by stage is HostService's (service.py: a check of its own, and two invites' word)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from net.messages import BadResult
from swarmctl.log_limit import LogLimit

log = logging.getLogger("swarmctl.host")


@dataclass
class Recovery:
    recoveries: int = 0
    replayed_bytes: int = 0
    last_recovery_s: float | None = None
    last_marked_down: str | None = None  # (set by the host's liveness watcher)



@dataclass
class AskerReports:
    recovery: Recovery = field(default_factory=Recovery)
    bad_results: dict[str, dict[str, int]] = field(default_factory=dict)  # accused → {accuser: reports}
    attributed: dict[str, set[str]] = field(default_factory=dict)  # accused → accusers who found it stage by stage
    _log: LogLimit = field(default_factory=lambda: LogLimit(log))  # a flood of reports must not fill the disk

    def recovered(self, recovery_s: float, replayed_bytes: int) -> None:
        """An asker rerouted a request after a failure: how long it took, how much it replayed."""
        self.recovery.recoveries += 1
        self.recovery.replayed_bytes += replayed_bytes
        self.recovery.last_recovery_s = recovery_s

    def bad_result(self, accuser: str, report: BadResult, serving: set[str]) -> list[str]:
        """An asker recomputed a step itself (swarmctl/asker/verify.py) and its route's result was wrong.
        Counted per accused member and accuser, logged, shown in status. One asker's word removes
        no trunk: the host cannot check the claim (it never sees the asker's activations), so a
        lying asker could otherwise evict honest trunks one by one. The accuser already routes
        around the trunk for itself; the operator decides (``swarmctl revoke``), or askers of two
        invites who found the same member stage by stage do (HostService). Returns the members
        counted (those serving, the accuser never)."""
        counted = sorted({m[:64] for m in report.members} & serving - {accuser})
        for name in counted:
            by = self.bad_results.setdefault(name, {})
            by[accuser] = by.get(accuser, 0) + 1
        for name in counted if report.attributed else ():
            self.attributed.setdefault(name, set()).add(accuser)
        tally = "; ".join(f"{n}: {self.reports_on(n)} reports from {len(self.bad_results[n])} members"
                          for n in counted) or "ignored"
        self._log.warning("%s reports a wrong result from %s (plan v%s, relative error %s): %s",
                          accuser, " / ".join(counted) or "no serving member",
                          report.plan_version, f"{report.rel_error:.3g}" if report.rel_error is not None else "?", tally)
        return counted

    def reports_on(self, name: str) -> int:
        return sum(self.bad_results.get(name, {}).values())

    def reporters_of(self, name: str) -> int:
        return len(self.bad_results.get(name, {}))

    def found_by(self, name: str) -> set[str]:
        """The members whose re-check stage by stage named ``name`` (on its own answer)."""
        return set(self.attributed.get(name, ()))
