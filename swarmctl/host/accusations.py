"""What members report against others, and askers' recoveries: ``recovered`` (counted for
status), ``unanswered`` (a stage's calls to a member went unanswered: judged by the host's own
link, liveness.py) and ``bad_result`` (an asker's spot check caught a wrong result: judged by the
evidence rule of reports.py, and then only by the host's own check, checks.py and recheck.py)."""

from __future__ import annotations

import asyncio
import logging

from net import messages as m
from net.protocol import SwarmProtocol

from .checks import ClaimChecks
from .liveness import unanswered
from .planning import PlanKeeper
from .replies import ok
from .reports import AskerReports
from .stage_stats import one_stage_record
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")


class Accusations:
    def __init__(self, trunks: Trunks, planning: PlanKeeper, checks: ClaimChecks, reports: AskerReports) -> None:
        self.trunks, self.planning, self.checks, self.reports = trunks, planning, checks, reports

    def recovered(self, conn: SwarmProtocol, stream_id: int, message: m.Recovered) -> None:
        self.reports.recovered(message.recovery_s, message.replayed_bytes)
        ok(conn, stream_id)

    def unanswered(self, conn: SwarmProtocol, stream_id: int, message: m.Unanswered) -> None:
        """A stage's expert calls to a member went unanswered: judged by our own link now."""
        unanswered(message.member, conn.peer_name, self.trunks, self.planning, self.reports.recovery)
        ok(conn, stream_id)

    def bad_result(self, conn: SwarmProtocol, stream_id: int, message: m.BadResult) -> None:
        """An asker's spot check caught a wrong result. A report naming a whole route is counted
        for status only. One whose re-check stage by stage named a member counts only with the
        accused stage's own record of the accuser's re-check steps (reports.py), and then only
        makes the host check the member itself (checks.py, recheck.py): the host's own check
        decides, never the askers' word, from however many invites."""
        plan = self.planning.plan
        serving = {s.member for s in plan.stages} | set(self.trunks)
        if not message.attributed:
            ok(conn, stream_id, counted=self.reports.bad_result(conn.peer_name, message, serving))
            return
        if conn.peer_name in self.reports.judging:  # one report of a member's judged at a time: the
            ok(conn, stream_id, counted=[])  # host asks the accused stage once per report
            return
        self.reports.judging.add(conn.peer_name)
        asyncio.ensure_future(self._attributed(conn, stream_id, message, serving))

    async def _attributed(self, conn: SwarmProtocol, stream_id: int, message: m.BadResult, serving: set[str]) -> None:
        counted = []
        try:
            for name in AskerReports.named(conn.peer_name, message, serving):
                trunk = self.trunks.get(name)
                if trunk is None or trunk.refused or self.planning.plan.stage_for(name) is None:
                    continue
                record = await one_stage_record(trunk)
                if self.trunks.get(name) is not trunk:
                    continue
                if self.reports.found(conn.peer_name, self.planning.plan.account(conn.peer_name), name,
                                      trunk.registered_at, message, record):
                    counted.append(name)
                    self.checks.recheck(name, trunk)
        except Exception:  # noqa: BLE001 - the edge, as in HostService.frame_received: the host carries on
            log.exception("bad_result from %s: unexpected error", conn.peer_name)
        finally:
            self.reports.judging.discard(conn.peer_name)
            ok(conn, stream_id, counted=counted)
