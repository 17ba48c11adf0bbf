"""The plan and what it is made from: the trunks' descriptors, the speeds each is planned with,
and the askers that follow it. Re-planning and pushing a new plan happen here and only here.

PlanKeeper does the I/O and applies decisions made elsewhere, each given the keeper's clock:
make-before-break's (staging.py: when a staged plan is published or given up, ready deadlines,
members held out, versions), the figures' (figures.py over plans/hysteresis.py: when a new speed
or link re-plans), which trunks a plan is made over (plan_members.py, over the planner in plans/).
It pushes plans (plan_push.py) and sets the timer."""

from __future__ import annotations

import logging
import os
from typing import Awaitable, Callable

from net import clock
from net import messages as m
from net.protocol import SwarmProtocol
from plans.hysteresis import READY_BASE_S, SPEED_FACTOR, ReplanGate
from plans.layout import ModelLayout
from plans.nodes import Link, NodeDescriptor
from plans.plan import Plan
from plans.options import OPTIONS, PlannerSettings
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.node.membership import accounts

from .figures import DEFAULT_MS_PER_LAYER, IDLE_RECHECK_S, FigureWatch, PlanInputs  # noqa: F401 (re-exported)
from .alarm import Alarm
from .plan_members import PlanMembers
from .plan_push import PlanSender
from .proposals import apply_proposal
from .staging import TRIAL_VERSIONS, Hold, Staging, StagingSettings, next_step, unready  # noqa: F401
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")

# A staged plan whose stages are not all ready this long after it was sent is given up: the members
# that did not load are left out (tests set SWARMCTL_STAGED_DEADLINE_S).
STAGED_DEADLINE_S = float(os.environ.get("SWARMCTL_STAGED_DEADLINE_S", "600"))
# A published plan's stages get this long to be ready, plus their bytes' loading time
# (plans/hysteresis.py ready_deadline_s): the swarm is incomplete meanwhile (tests set
# SWARMCTL_READY_DEADLINE_S). A stage whose layer check is under way when it is due gets
# CHECKING_GRACE_S more, as often as it takes: the check has its own deadline.
READY_DEADLINE_S = float(os.environ.get("SWARMCTL_READY_DEADLINE_S", str(READY_BASE_S)))
CHECKING_GRACE_S = 10.0


class PlanKeeper:
    def __init__(self, home: SwarmHome, config: NodeConfig, layout: ModelLayout, plan: Plan, trunks: Trunks,
                 stage_requests: Callable[[], Awaitable[int]] | None = None) -> None:
        """``stage_requests``: how many requests the current stages hold (the host asks them);
        without it, a re-plan on speed does not wait for them to be idle."""
        self.home = home
        self.config = config
        self.layout = layout
        self.plan = plan
        self.trunks = trunks
        self.constraints = PlannerSettings.from_config(config).constraints()
        # Make-before-break's decisions (staging.py): deadlines, holds, versions.
        self.staging = Staging(StagingSettings(STAGED_DEADLINE_S, READY_DEADLINE_S, CHECKING_GRACE_S))
        # Which trunks a plan is made over, and the holds as their refusals (plan_members.py).
        self.members = PlanMembers(layout, config, trunks, self.staging)
        self.inputs = self.members.inputs
        self.speed_basis = self.inputs.speed_basis  # (the same dict: the speeds planned with)
        # A re-plan on speed waits until its gain was sustained and the plan in use has settled.
        self.gate = ReplanGate()
        self.clock: Callable[[], float] = clock.now
        # A re-plan on speed waits while the stages hold requests: moving would replay every one of them.
        self.stage_requests = stage_requests
        self.figures = FigureWatch(self)
        self.sender = PlanSender(home, trunks)
        # Make-before-break: a plan staged to follow the one in use, loading beside it (``_stage``).
        self.staged: Plan | None = None
        self._timer = Alarm(lambda: self.clock(), self.tick)  # the deadlines' and holds' (``tick``)
        # Versions only grow, also past a staged plan that was given up and across a restart: each is
        # saved as it is issued, and a restarted host starts one past the last.
        if self.staging.restarted(_saved_version(home)):
            self.save_version(self.staging.issued)
        self.plan.version = self.staging.issued
        self.plan.accounts = accounts(home.members())  # (Plan.account: one budget per invite)

    def save_version(self, version: int | None = None) -> None:
        """A restarted host numbers on from the last version it staged or published."""
        from net.identity import write_public

        write_public(self.home.file("plan_version"), str(self.plan.version if version is None else version).encode())

    # --- the planner's inputs, and new figures for them (figures.py) ---

    def descriptors(self, unproven: bool | None = None, held: bool = False) -> list[NodeDescriptor]:
        return self.inputs.descriptors(unproven, held)

    def rebase(self, name: str) -> None:
        self.inputs.rebase(name)

    def consider_speed(self, name: str, figure: float, source: str = "", factor: float = SPEED_FACTOR) -> None:
        self.figures.consider_speed(name, figure, source, factor)

    def consider_links(self, name: str, claims: dict[str, Link]) -> None:
        self.figures.consider_links(name, claims)

    def reconsider(self) -> None:
        """The gate's timer: is a re-plan on the figures planned with now still worth it?"""
        self.figures.reconsider()

    def close(self) -> None:
        self.figures.close()
        self._timer.cancel()

    # --- planning and telling ---

    def replan(self, also_send_to: str | None = None, force_push: bool = False) -> None:
        choice = self.members.choose(self.constraints)  # (the holds it ended: the timer again)
        self._arm()
        if choice.problem:
            log.warning("cannot plan: %s", choice.problem)
        # The proven trunks hold the model, so the plan in use stays as it is: each unproven trunk
        # without a trial gets a plan of its own to load and prove (checks.py), and is planned once
        # it has (the layers it proves on: plan_members.py).
        for name, (start, stop) in self.members.trials(choice.on_trial, self.plan, self.constraints).items():
            self.sender.send_trial(self.plan, name, start, stop)
        # The new plan is made from the latest one (the staged plan, if any), so versions only grow.
        base = self.latest
        candidate = Plan.from_dict(base.to_dict())
        if choice.problem:
            candidate.warnings = [choice.problem]
        if not apply_proposal(candidate, choice.proposal, choice.placement, self.constraints):
            if base is self.plan:
                self.plan = candidate  # (the same assignments: its figures and warnings are new)
            else:
                self.staged = candidate
            if force_push:
                self.push()
            elif also_send_to is not None:
                self.push(only=also_send_to)
            return
        candidate.version = self.staging.issue(base.version)
        self.save_version(candidate.version)
        step = next_step(self.plan, self.staged, candidate, {
            name for name, t in self.trunks.items() if t.conn.is_open and not t.refused})
        if step == "drop":
            log.info("staged plan v%d dropped: the plan in use (v%d) stays", self.staged.version, self.plan.version)
            self._end_staging()
            self.push()
        elif step == "stage":
            self._stage(candidate)
        else:
            self._publish(candidate)

    # --- make-before-break (decided in staging.py) ---

    @property
    def latest(self) -> Plan:
        """The plan staged to follow the one in use, or that one."""
        return self.staged or self.plan

    def plan_of(self, version: int) -> Plan | None:
        """The plan in use or the staged one, whichever has ``version``."""
        return next((p for p in (self.plan, self.staged) if p is not None and p.version == version), None)

    def _stage(self, new: Plan) -> None:
        """Send ``new`` to its trunks to load beside the plan in use; askers switch once every stage
        of it is ready (``stage_ready``) or, past its deadline, it is given up."""
        new.staged = True
        self.staged = new
        self.plan.next_version = new.version
        log.info("plan v%d staged: %s; v%d serves until every stage of it is ready", new.version, _describe(new),
                 self.plan.version)
        self.staging.staged(self.clock())
        self._arm()
        self.push()

    def stage_ready(self) -> None:
        """A stage became ready (checks.py): publish the staged plan once all of it is, else tell
        everyone the plan in use's readiness."""
        if self.staged is not None and self.staged.complete:
            log.info("every stage of plan v%d is ready: switching from v%d", self.staged.version, self.plan.version)
            self._publish(self.staged)
            return
        self._track_unready()
        self.push()

    def _staged_overdue(self, version: int) -> None:
        """The staged plan did not get ready in time: its members that did not load their layers are
        left out for a while, and the plan is made again without them."""
        for name, hold in self.staging.give_up(self.staged, version, self.clock()).items():
            self._refuse(name, hold)
        if self.staged is None or self.staged.version != version:
            return
        self.replan()
        if self.staged is not None and self.staged.version == version:  # (nothing else to plan with)
            log.warning("staged plan v%d not ready after %.0f s and no other plan: switching to it",
                        version, self.staging.settings.staged_deadline_s)
            self._publish(self.staged)

    def _track_unready(self) -> None:
        self.staging.track(unready(self.plan, self.layout, self.trunks), self.clock())
        self._arm()

    def _ready_overdue(self) -> None:
        """Members of the plan in use not ready by their deadline: each is left out for a while if
        the others can serve without them, and the plan is made again (a proven member that never
        loaded kept a published plan incomplete until it disconnected)."""
        plan, now = self.plan, self.clock()
        proving = {name for name, t in self.trunks.items() if t.proving is not None and t.proving[0] == plan.version}
        late = self.staging.overdue(plan.version, unready(plan, self.layout, self.trunks), proving, now)
        self._arm()
        if not late:
            return
        if not self.members.serve_without(late, self.constraints):
            log.warning("plan v%d is not complete (%s), but the others cannot serve without %s: waiting",
                        plan.version, "; ".join(f"{name} {why}" for name, why in late.items()), ", ".join(late))
            return
        for name, why in late.items():
            self._refuse(name, self.staging.miss(name, why, now))
        self.replan()

    # --- members left out for a while ---

    def registered(self, name: str, replaced: bool = False) -> None:
        """``name`` registered (``replaced``: over a registration of its own): one still waiting out a
        hold is left out again, one that left less than the settle period ago is left out for a
        while (a member that comes and goes re-plans nothing at each turn); then the plan is made
        again and sent to it."""
        now, trunk = self.clock(), self.trunks.get(name)
        rejoin = self.staging.registered(name, now, replaced, trunk is not None and not trunk.refused,
                                         self.gate.settle_s)
        if rejoin.waiting:
            trunk.refused = rejoin.hold.why
            log.warning("trunk %s registered again while it waits (%s): %.0f s of its wait left", name,
                        rejoin.hold.why, rejoin.hold.until - now)
        elif rejoin.hold is not None:
            self._refuse(name, rejoin.hold)
        self.rebase(name)
        self.replan(also_send_to=name)

    def fetch_progress(self, name: str, done: int) -> None:
        """``name``'s fetch of what it was given reached ``done`` bytes: while it keeps advancing,
        its ready deadline moves with it (staging.py)."""
        self.staging.fetch_progress(name, done, self.clock())

    def lost(self, name: str) -> None:
        """``name``'s registration ended (it disconnected, or was marked down): a plan without it."""
        self.staging.left(name, self.clock())
        self.replan()

    def _refuse(self, name: str, hold: Hold) -> None:
        """A new hold: ``name`` is refused with it (plan_members.py), and the timer set for its end."""
        self.members.refuse(name, hold)
        self._arm()

    # --- the deadlines' and holds' timer ---

    def tick(self) -> None:
        """The deadlines and holds that are due by the keeper's clock (the timer calls it; a test
        moves the clock and calls it): a staged plan or the plan in use overdue, waits that ended."""
        try:
            now = self.clock()
            if self.staging.staged_overdue(now):
                self._staged_overdue(self.staged.version if self.staged is not None else -1)
            if self.staging.ready_due(now):
                self._ready_overdue()
            ended = self.staging.ended_holds(now)
            if ended and self.members.release(ended):
                log.info("%s waited long enough: planned again", ", ".join(ended))
                self.replan()
        finally:
            self._arm()

    def due(self) -> float | None:
        """When ``tick`` has something to do next (the keeper's clock), or None."""
        return self.staging.due()

    def _arm(self) -> None:
        self._timer.set(self.due())  # (no loop: a test moves the clock and calls ``tick`` itself)

    def _end_staging(self) -> None:
        self.staged = None
        self.plan.next_version = 0
        self.staging.staging_ended()
        self._arm()

    def _publish(self, new: Plan) -> None:
        """``new`` becomes the plan in use: to every trunk and asker. Its stages that are not ready
        yet have a deadline (``_ready_overdue``)."""
        self._end_staging()
        new.staged, new.next_version = False, 0
        self.plan = new
        self.gate.plan_changed(self.clock())
        self._track_unready()
        log.info("plan v%d: %s", new.version, _describe(new))
        self.push()

    def push(self, only: str | None = None) -> None:
        """The plan (and the staged one, to its trunks) to every trunk, or to ``only``, and to every watcher."""
        self.sender.push(self.plan, self.staged, only)

    def watch(self, conn: SwarmProtocol, stream_id: int) -> None:
        """``conn`` gets the plan now (on ``stream_id``) and every new one after."""
        self.sender.watch(conn, stream_id, self.plan)

    def reconfigure(self, saved: NodeConfig) -> None:
        """The planner's settings again from node.json, and a new plan under them, pushed to everyone."""
        for option in OPTIONS:
            if option.configurable:
                setattr(self.config, option.config_field, getattr(saved, option.config_field))
        settings = PlannerSettings.from_config(self.config)
        self.constraints = settings.constraints()
        self.plan.objective = saved.objective  # also while no trunk is there to plan for
        log.info("settings changed: %s", ", ".join(f"{o.key} {getattr(settings, o.field)}" for o in OPTIONS
                                                   if o.configurable))
        self.replan(force_push=True)


def _saved_version(home: SwarmHome) -> int:
    """The last version this host issued (``PlanKeeper.save_version``), 0 for none."""
    try:
        return int(home.file("plan_version").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _describe(plan: Plan) -> str:
    return (", ".join(f"{s.member}[{s.start},{s.stop})" for s in plan.stages) or "no trunks") + \
        "".join(f"; experts {e.member}[{e.start},{e.stop})" for e in plan.experts) + \
        "".join(f"; {w}" for w in plan.warnings)
