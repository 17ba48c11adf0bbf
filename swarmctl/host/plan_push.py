"""Telling members the plan: every trunk on its register stream, every asker that watches, and a
trunk on trial its trial plan alone. Only sends; which plan is whose is the keeper's (planning.py)."""

from __future__ import annotations

import logging

from net import messages as m
from net.protocol import SwarmProtocol
from plans.plan import Plan, StageAssignment
from swarmctl.node.home import SwarmHome
from swarmctl.node.membership import accounts

from .staging import TRIAL_VERSIONS
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")


def trial_plan(plan: Plan, number: int, name: str, listen: str, start: int, stop: int) -> Plan:
    """Trial ``number``: ``plan`` with one stage, ``name``'s layers [start, stop), under a private
    version (never a public plan's)."""
    trial = Plan.from_dict(plan.to_dict())
    trial.version = TRIAL_VERSIONS + number
    trial.stages = [StageAssignment(name, listen, start, stop)]
    trial.experts, trial.warnings = [], ["a trial: prove these layers, then you are planned"]
    return trial


class PlanSender:
    def __init__(self, home: SwarmHome, trunks: Trunks) -> None:
        self.home = home
        self.trunks = trunks
        self.watchers: list[tuple[SwarmProtocol, int]] = []  # askers following the plan
        self.trials = 0  # trial plans sent (each numbers its private version)

    def push(self, plan: Plan, staged: Plan | None, only: str | None = None) -> None:
        """``plan`` to every trunk (or to ``only``) on its register stream, and to every watcher;
        ``staged`` too, after it, to its trunks. Not to a trunk on trial: it holds its trial plan
        until it proved itself (a trunk takes the last plan it was sent)."""
        plan.accounts = accounts(self.home.members())  # (a join since the last push may add one)
        frame = m.encode(m.PlanPush(plan=plan.to_dict()))
        staged_frame = None
        if staged is not None:
            staged.accounts = plan.accounts
            staged_frame = m.encode(m.PlanPush(plan=staged.to_dict()))
        for name, trunk in self.trunks.items():
            if (only is None or name == only) and trunk.conn.is_open and trunk.trial is None:
                trunk.conn.send(trunk.plan_stream, frame)
                if staged_frame is not None and staged.stage_for(name) is not None:
                    trunk.conn.send(trunk.plan_stream, staged_frame)  # (after the plan in use: it loads beside it)
        if only is None:
            self.watchers = [(c, sid) for c, sid in self.watchers if c.is_open]
            for conn, stream_id in self.watchers:
                conn.send(stream_id, frame)

    def watch(self, conn: SwarmProtocol, stream_id: int, plan: Plan) -> None:
        """``conn`` gets ``plan`` now (on ``stream_id``) and every plan pushed after."""
        self.watchers.append((conn, stream_id))
        if conn.is_open:
            conn.send(stream_id, m.encode(m.PlanPush(plan=plan.to_dict())))

    def send_trial(self, plan: Plan, name: str, start: int, stop: int) -> None:
        """Trunk ``name`` gets a trial plan of its own made from ``plan``: layers [start, stop) to load
        and prove (checks.py); the plan in use stays."""
        trunk = self.trunks[name]
        self.trials += 1
        trial = trial_plan(plan, self.trials, name, trunk.listen, start, stop)
        trunk.trial = (trial.version, start, stop)
        log.info("trunk %s has proved nothing yet: sent a trial with layers [%d, %d) to load and prove; the "
                 "plan in use (v%d) stays", name, start, stop, plan.version)
        trunk.conn.send(trunk.plan_stream, m.encode(m.PlanPush(plan=trial.to_dict())))
