"""The plan and what it is made from: the trunks' descriptors, the speeds each is planned with,
and the askers that follow it. Re-planning and pushing a new plan happen here and only here."""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
from typing import Awaitable, Callable, NamedTuple

from net import clock
from net import messages as m
from net.protocol import SwarmProtocol
from plans.hysteresis import (MAX_DEFER_S, MISSED_HOLD_S, READY_BASE_S, REJOIN_HOLD_S, SPEED_FACTOR, Backoff,
                              ReplanGate, SpeedDecision, decide_on_links, decide_on_speed, ready_deadline_s,
                              replan_gain, sticky_links, sticky_speed)
from plans.layout import ModelLayout
from plans.nodes import Link, NodeDescriptor
from plans.plan import ExpertAssignment, Plan, StageAssignment
from plans.options import OPTIONS, PlannerSettings
from plans.planner import PlanError, add_expert_calls, place_experts, plan_layers
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.node.membership import accounts

from .trunks import Trunks

log = logging.getLogger("swarmctl.host")

DEFAULT_MS_PER_LAYER = 1.0  # for a trunk that could not measure yet (it has no model file)
IDLE_RECHECK_S = 10.0  # a re-plan on speed waiting for the stages to be idle asks them again this often
# A staged plan whose stages are not all ready this long after it was sent is given up: the members
# that did not load are left out (tests set SWARMCTL_STAGED_DEADLINE_S).
STAGED_DEADLINE_S = float(os.environ.get("SWARMCTL_STAGED_DEADLINE_S", "600"))
# A published plan's stages get this long to be ready, plus their bytes' loading time
# (plans/hysteresis.py ready_deadline_s): the swarm is incomplete meanwhile (tests set
# SWARMCTL_READY_DEADLINE_S). A stage whose layer check is under way when it is due gets
# CHECKING_GRACE_S more, as often as it takes: the check has its own deadline.
READY_DEADLINE_S = float(os.environ.get("SWARMCTL_READY_DEADLINE_S", str(READY_BASE_S)))
CHECKING_GRACE_S = 10.0
TRIAL_VERSIONS = 2**40  # trial plans' private versions count from here (never a public plan's)


class Hold(NamedTuple):
    """A member left out of plans for a while (plans/hysteresis.py Backoff): it is refused with
    ``why`` until ``until`` (the keeper's clock); ``missed``: it missed a deadline (else it rejoined
    right after leaving)."""

    until: float
    why: str
    missed: bool


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
        # The speed each member is planned with: a new figure replaces it only when it moved past
        # its band (plans/hysteresis.py), so a wobble reshuffles no plan. Only ``adopt_speed`` and
        # ``rebase`` change it: a decision must compare the new figure with the one planned with.
        self.speed_basis: dict[str, float] = {}
        # A re-plan on speed waits until its gain was sustained and the plan in use has settled.
        self.gate = ReplanGate()
        self.clock: Callable[[], float] = clock.now
        self._look_again: asyncio.TimerHandle | None = None
        # A re-plan on speed waits while the stages hold requests: moving would replay every one of them.
        self.stage_requests = stage_requests
        self._asking: asyncio.Task | None = None
        self.watchers: list[tuple[SwarmProtocol, int]] = []  # askers following the plan
        # Trunks that proved nothing are planned only while the proven ones cannot hold the model
        # (a swarm starting up); otherwise each is sent a trial plan of its own to prove itself on.
        self.with_unproven = False
        self._trials = 0
        # Make-before-break: a plan staged to follow the one in use, loading beside it (``_stage``).
        self.staged: Plan | None = None
        self.staged_deadline_s = STAGED_DEADLINE_S
        self._staged_by: float | None = None  # when the staged plan is given up (the keeper's clock)
        # Every published plan's stages have a deadline to be ready too (``_ready_overdue``), counted
        # from when their member stopped being ready in the plan in use, through re-plans.
        self.ready_deadline_s = READY_DEADLINE_S
        self._unready_since: dict[str, float] = {}  # member → since when it is not ready in the plan in use
        self._ready_by: float | None = None  # when the first of them is due
        # Members left out for a while: one whose stage missed its deadline, one that rejoined right
        # after leaving; each again waits longer (plans/hysteresis.py Backoff).
        self.missed, self.flapped = Backoff(MISSED_HOLD_S), Backoff(REJOIN_HOLD_S, free=1)
        self.holds: dict[str, Hold] = {}
        self.left_at: dict[str, float] = {}  # member → when its registration ended (the keeper's clock)
        self._timer: asyncio.TimerHandle | None = None  # the deadlines' and holds' (``tick``)
        # Versions only grow, also past a staged plan that was given up and across a restart: each is
        # saved as it is issued, and a restarted host starts one past the last (its plan with no
        # stages yet shares no number with one a trunk may hold).
        self.issued = self._load_version()
        if self.issued:
            self.issued += 1
            self.save_version(self.issued)
        self.plan.version = self.issued
        self.plan.accounts = accounts(home.members())  # (Plan.account: one budget per invite)

    def _load_version(self) -> int:
        try:
            return int(self.home.file("plan_version").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def save_version(self, version: int | None = None) -> None:
        """A restarted host numbers on from the last version it staged or published."""
        from net.identity import write_public

        write_public(self.home.file("plan_version"), str(self.plan.version if version is None else version).encode())

    # --- the planner's inputs ---

    def descriptors(self, unproven: bool | None = None, held: bool = False) -> list[NodeDescriptor]:
        """The planner's view of the trunks that can serve: speed (its claim, never faster than the
        host timed it; the others' median until the host could time it), memory, and links (to the
        host standing in for the asker). A trunk whose claims are being checked is not planned yet,
        and one that proved nothing (TrunkInfo.proven) only while the proven ones cannot hold the
        model (``unproven``: include them or not; None: as the last re-plan had to). ``held``: with
        the members left out for a while (``holds``), as if their wait were over."""
        if unproven is None:
            unproven = self.with_unproven
        ready = [(name, t) for name, t in sorted(self.trunks.items(), key=lambda kv: kv[1].registered_at)
                 if (not t.refused or (held and self._held(name))) and not t.checking and (unproven or t.proven)]
        for name, t in ready:  # a member's first figure; later ones come through adopt_speed or rebase
            if name not in self.speed_basis and t.planning_speed is not None:
                self.speed_basis[name] = t.planning_speed
        known = [self.speed_basis[name] for name, t in ready if t.planning_speed]
        fallback = statistics.median(known) if known else DEFAULT_MS_PER_LAYER
        nodes = []
        for name, t in ready:
            links = t.planned_links()
            speed = self.speed_basis[name] if t.planning_speed else fallback
            nodes.append(NodeDescriptor(name, t.memory, speed, t.device, t.listen, links, datagram_us=t.datagram_us,
                                        ram_bytes=t.ram_bytes, ram_gb_s=t.ram_gb_s,
                                        prompt_ms_per_layer_row=t.prompt_ms_per_layer_row,
                                        fetches=t.fetches or t.fetch is not None,  # (a trunk too old to say)
                                        fetch_mb_s=t.fetch_bytes_per_s / 1e6 if t.fetch_bytes_per_s else None))
        return nodes

    def describe_nodes(self) -> list[m.NodeInfo]:
        """The descriptors in wire form (the answer to ``nodes``)."""
        return [m.NodeInfo(name=n.name, memory_bytes=n.memory_bytes, ms_per_layer_token=n.ms_per_layer_token,
                           device=n.device, address=n.address,
                           links={k: m.LinkInfo(rtt_ms=v.rtt_ms, bandwidth_mb_s=v.bandwidth_mb_s)
                                  for k, v in n.links.items()}, datagram_us=n.datagram_us,
                           ram_bytes=n.ram_bytes, ram_gb_s=n.ram_gb_s, prompt_ms_per_layer_row=n.prompt_ms_per_layer_row)
                for n in self.descriptors()]

    def rebase(self, name: str) -> None:
        """A member (re)joined or was timed at joining: plan with the figure it brings, unless it is
        within the band of the one it was planned with before (no decision: a re-plan follows)."""
        trunk = self.trunks.get(name)
        if trunk is not None and trunk.planning_speed is not None:
            self.speed_basis[name] = sticky_speed(self.speed_basis.get(name), trunk.planning_speed)

    def speed_decision(self, name: str, figure: float, factor: float = SPEED_FACTOR) -> SpeedDecision:
        nodes = self.descriptors()
        try:
            placement = place_experts(self.layout, nodes, self.constraints, self.config.expert_nodes)
        except PlanError as e:
            return SpeedDecision(True, False, f"no plan to compare with: {e}")
        current = [(s.member, s.start, s.stop) for s in self.latest.stages]
        return decide_on_speed(placement.stage_layout, placement.stage_nodes, self.constraints, current, name, figure,
                               factor=factor)

    def consider_speed(self, name: str, figure: float, source: str = "", factor: float = SPEED_FACTOR) -> None:
        """A new planning figure for ``name`` (claimed, served, or timed by the host): adopted if
        it moved past its band (``factor``), re-planned on only once that makes the plan better by
        more than moving costs, sustained (plans/hysteresis.py)."""
        self.adopt_speed(name, figure, self.speed_decision(name, figure, factor), source)

    def adopt_speed(self, name: str, figure: float, decision: SpeedDecision, source: str = "") -> None:
        if decision.adopt or name not in self.speed_basis:
            self.speed_basis[name] = figure
        (log.info if decision.adopt else log.debug)("speed of %s%s: %s", name, source, decision.reason)
        if decision.adopt:
            self._look(decision.replan)

    def reconsider(self) -> None:
        """Look again at whether a re-plan on the figures planned with now is worth it (the gate's
        timer): the gain must still be there, or the wait starts over."""
        self._look_again = None
        nodes = self.descriptors()
        current = [(s.member, s.start, s.stop) for s in self.latest.stages]
        worth = False
        if current and self.constraints.objective != "even":
            try:
                placement = place_experts(self.layout, nodes, self.constraints, self.config.expert_nodes)
                stage_nodes = {n.name for n in placement.stage_nodes}
                if all(member in stage_nodes for member, _, _ in current):
                    gain = replan_gain(placement.stage_layout, placement.stage_nodes, self.constraints, current)
                    worth = gain.worth
                    log.debug("looking again at the speeds: %s", gain.describe())
            except PlanError:
                worth = False
        self._look(worth)

    def _look(self, worth: bool) -> None:
        """One look through the gate: re-plan (once the stages are idle), or look again when the
        gain may be sustained."""
        if self.gate.look(worth, self.clock()):
            if self.stage_requests is None:
                log.info("the gain held for %.0f s: re-planning", self.gate.sustain_s)
                self.replan()
            elif self._asking is None or self._asking.done():
                self._asking = asyncio.ensure_future(self._replan_when_idle())
            return
        self._look_later(self.gate.due())

    def _look_later(self, due: float | None) -> None:
        if self._look_again is not None:
            self._look_again.cancel()
            self._look_again = None
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (no loop: a test drives ``reconsider`` itself)
            return
        self._look_again = loop.call_later(max(0.0, due - self.clock()) + 0.01, self.reconsider)

    async def _replan_when_idle(self) -> None:
        """The gain held: re-plan now if the stages hold no request; else look again in a while,
        for at most MAX_DEFER_S of a gain held under load (moving replays every request in
        flight: under steady load the swarm serves on, where it is)."""
        try:
            held = await self.stage_requests()
        except Exception as e:  # noqa: BLE001 - a stage that cannot say: it may be busy, look again
            log.debug("asking the stages what they hold failed: %r", e)
            held = -1
        since = self.gate.worth_since
        if since is None:  # the gain went away (or the plan changed) while the stages answered
            return
        if held and self.clock() - since < MAX_DEFER_S:
            log.info("the gain held for %.0f s, but the stages hold %s requests: re-planning once "
                     "they are idle", self.clock() - since, held if held > 0 else "unknown")
            self._look_later(self.clock() + IDLE_RECHECK_S)
            return
        log.info("the gain held for %.0f s: re-planning", self.clock() - since)
        self.replan()

    def close(self) -> None:
        if self._look_again is not None:
            self._look_again.cancel()
            self._look_again = None
        if self._asking is not None:
            self._asking.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def consider_links(self, name: str, claims: dict[str, Link]) -> None:
        """``name`` reports its measured links: each is planned with once it moved past the noise
        band, and the host re-plans on them only if that makes the plan materially better, and
        through the same gate as speeds: the gain sustained, the plan in use settled
        (plans/hysteresis.py), so links claimed bad and good by turns re-plan nothing."""
        trunk = self.trunks.get(name)
        if trunk is None:
            return
        nodes = self.descriptors()
        try:
            placement = place_experts(self.layout, nodes, self.constraints, self.config.expert_nodes)
        except PlanError:
            trunk.links = sticky_links(trunk.links, claims)
            return
        current = [(s.member, s.start, s.stop) for s in self.latest.stages]
        decision = decide_on_links(placement.stage_layout, placement.stage_nodes, self.constraints, current, name,
                                   claims)
        trunk.links = {peer: decision.links[peer] for peer in claims}
        (log.info if decision.replan else log.debug)("links of %s: %s", name, decision.reason)
        if decision.changed:
            self._look(decision.replan)

    # --- planning and telling ---

    def _propose(self, every_node: list[NodeDescriptor]):
        """(proposal or None for no trunks, placement) over ``every_node``; PlanError if they cannot."""
        placement = place_experts(self.layout, every_node, self.constraints, self.config.expert_nodes)
        proposal = plan_layers(placement.stage_layout, placement.stage_nodes, self.constraints) \
            if placement.stage_nodes else None
        if proposal is not None:
            add_expert_calls(proposal, placement, every_node, self.layout)
        return proposal, placement

    def _try_propose(self):
        """(proposal, placement, "") over the descriptors, or (None, None, why not)."""
        try:
            return *self._propose(self.descriptors()), ""
        except PlanError as e:
            return None, None, str(e)

    def _plan_members(self):
        """(the unproven trunks, proposal, placement, problem): with the proven trunks, or with the
        unproven too where the proven cannot serve alone (a swarm starting up)."""
        unproven = [name for name, t in self.trunks.items() if not t.refused and not t.checking and not t.proven]
        self.with_unproven = False
        proposal, placement, problem = self._try_propose()
        if unproven and proposal is None:
            self.with_unproven = True
            proposal, placement, problem = self._try_propose()
        return unproven, proposal, placement, problem

    def replan(self, also_send_to: str | None = None, force_push: bool = False) -> None:
        unproven, proposal, placement, problem = self._plan_members()
        # Members waiting out a hold are planned where the others cannot serve without them: first
        # those that only rejoined right after leaving, then those that missed a deadline.
        for missed in (False, True):
            held = [name for name, hold in self.holds.items() if self._held(name) and (missed or not hold.missed)]
            if proposal is not None or not held:
                continue
            log.warning("the others cannot serve without %s: planned before %s wait is over", ", ".join(held),
                        "its" if len(held) == 1 else "their")
            self._release(held)
            unproven, proposal, placement, problem = self._plan_members()
        if problem:
            log.warning("cannot plan: %s", problem)
        for name in unproven:  # planned as they are (the proven cannot serve alone), or sent a trial
            if self.with_unproven:
                self.trunks[name].trial = None
        if unproven and not self.with_unproven:
            self._send_trials(unproven)
        # The new plan is made from the latest one (the staged plan, if any), so versions only grow.
        base = self.latest
        candidate = Plan.from_dict(base.to_dict())
        if problem:
            candidate.warnings = [problem]
        if not self._apply(candidate, proposal, placement):
            if base is self.plan:
                self.plan = candidate  # (the same assignments: its figures and warnings are new)
            else:
                self.staged = candidate
            if force_push:
                self.push()
            elif also_send_to is not None:
                self.push(only=also_send_to)
            return
        self.issued = candidate.version = max(self.issued, base.version) + 1  # (never one issued before)
        self.save_version(candidate.version)
        if self.staged is not None and candidate.assignments() == self.plan.assignments():
            log.info("staged plan v%d dropped: the plan in use (v%d) stays", self.staged.version, self.plan.version)
            self._end_staging()
            self.push()
        elif self._can_stage(candidate):
            self._stage(candidate)
        else:
            self._publish(candidate)

    def _apply(self, plan: Plan, proposal, placement) -> bool:
        """Put a planner's proposal (None: no plan) into ``plan``; True (and a new version) if who
        serves what changed."""
        # (stages bound each member's KV by what the plan reserves there: swarmctl/trunk/budget.py)
        plan.context_tokens = self.constraints.context_tokens
        plan.max_concurrent = self.constraints.max_concurrent
        nodes = placement.stage_nodes if placement is not None else []
        experts: list[ExpertAssignment] = placement.experts if placement is not None else []
        if proposal is None:
            changed = bool(plan.stages)
            if changed:
                plan.version += 1
                plan.stages = []
        else:
            changed = plan.apply(proposal, {n.name: n.address for n in nodes})
            plan.warnings += placement.warnings
        if [(e.member, e.start, e.stop) for e in experts] != [(e.member, e.start, e.stop) for e in plan.experts]:
            if not changed:
                plan.version += 1
                for s in plan.stages:
                    s.ready = False
            plan.experts = experts
            plan.check_experts()
            changed = True
        if plan.kernels != self.constraints.kernels:  # every member reloads its weights under the new kernels
            plan.kernels = self.constraints.kernels
            if not changed:
                plan.version += 1
                for s in plan.stages:
                    s.ready = False
            for e in plan.experts:
                e.ready = False
            changed = True
        return changed

    # --- make-before-break ---

    @property
    def latest(self) -> Plan:
        """The plan staged to follow the one in use, or that one."""
        return self.staged or self.plan

    def plan_of(self, version: int) -> Plan | None:
        """The plan in use or the staged one, whichever has ``version``."""
        return next((p for p in (self.plan, self.staged) if p is not None and p.version == version), None)

    def _can_stage(self, new: Plan) -> bool:
        """A plan that serves, every one of whose members is still there, keeps serving while a new
        one loads (make-before-break). Not where expert nodes are planned (an expert node holds
        one assignment at a time), nor for a plan that cannot serve anyway."""
        old = self.plan
        return bool(old.stages and new.stages and old.complete and not old.experts and not new.experts) and all(
            (t := self.trunks.get(s.member)) is not None and t.conn.is_open and not t.refused for s in old.stages)

    def _stage(self, new: Plan) -> None:
        """Send ``new`` to its trunks to load beside the plan in use; askers switch once every stage
        of it is ready (``stage_ready``) or, past STAGED_DEADLINE_S, it is given up."""
        new.staged = True
        self.staged = new
        self.plan.next_version = new.version
        log.info("plan v%d staged: %s; v%d serves until every stage of it is ready", new.version, _describe(new),
                 self.plan.version)
        self._staged_by = self.clock() + self.staged_deadline_s
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
        left out for a while (``missed``), and the plan is made again without them."""
        self._staged_by = None
        staged = self.staged
        if staged is None or staged.version != version:
            return
        now = self.clock()
        for s in staged.stages:
            if not s.ready:
                self._hold(s.member, f"did not load layers [{s.start}, {s.stop}) of plan v{version} within "
                                     f"{self.staged_deadline_s:.0f} s", self.missed.strike(s.member, now), True)
        self.replan()
        if self.staged is not None and self.staged.version == version:  # (nothing else to plan with)
            log.warning("staged plan v%d not ready after %.0f s and no other plan: switching to it",
                        version, self.staged_deadline_s)
            self._publish(self.staged)

    def _unready(self, plan: Plan) -> dict[str, tuple[str, int]]:
        """{member: (what it is to load, its weight bytes)} of ``plan``'s stages and expert
        assignments that are not ready, of members registered now."""
        start, stop = plan.trunk_range
        experts = sum(self.layout.expert_bytes[start:stop]) if self.layout.expert_bytes else 0
        unready = {}
        for a in [*plan.stages, *plan.experts]:
            if a.ready or a.member not in self.trunks:
                continue
            if isinstance(a, ExpertAssignment):
                share = experts * (a.stop - a.start) // max(1, plan.n_expert)
                unready[a.member] = (f"experts [{a.start}, {a.stop})", share)
            else:
                unready[a.member] = (f"layers [{a.start}, {a.stop})", self.layout.range_bytes(a.start, a.stop))
        return unready

    def _track_unready(self) -> None:
        """Since when each member of the plan in use is not ready (a member that was not ready in
        the plan before either keeps its time: a re-plan gives nobody a new deadline), and when the
        first of them is due (``_ready_overdue``)."""
        now = self.clock()
        unready = self._unready(self.plan)
        self._unready_since = {name: self._unready_since.get(name, now) for name in unready}
        self._ready_by = min((self._unready_since[name] + ready_deadline_s(size, self.ready_deadline_s)
                              for name, (_, size) in unready.items()), default=None)
        self._arm()

    def _ready_overdue(self) -> None:
        """Members of the plan in use not ready by their deadline (``ready_deadline_s``): each is
        left out for a while (``missed``) if the others can serve without them, and the plan is
        made again (a proven member that never loaded kept a published plan incomplete
        until it disconnected). One whose layer check is under way is given CHECKING_GRACE_S more."""
        plan, now = self.plan, self.clock()
        late, due = {}, []
        for name, (what, size) in self._unready(plan).items():
            since = self._unready_since.setdefault(name, now)
            by = since + ready_deadline_s(size, self.ready_deadline_s)
            proving = self.trunks[name].proving
            if by > now:
                due.append(by)
            elif proving is not None and proving[0] == plan.version:
                due.append(now + CHECKING_GRACE_S)
            else:
                late[name] = f"was given {what} of plan v{plan.version} and was not ready {now - since:.0f} s later"
        self._ready_by = min(due, default=None)
        self._arm()
        if not late:
            return
        others = [n for n in self.descriptors(unproven=True, held=True) if n.name not in late]
        try:
            proposal, _ = self._propose(others)
        except PlanError:
            proposal = None
        if proposal is None:
            log.warning("plan v%d is not complete (%s), but the others cannot serve without %s: waiting",
                        plan.version, "; ".join(f"{name} {why}" for name, why in late.items()), ", ".join(late))
            return
        for name, why in late.items():
            self._hold(name, why, self.missed.strike(name, now), True)
        self.replan()

    # --- members left out for a while ---

    def registered(self, name: str, replaced: bool = False) -> None:
        """``name`` registered (``replaced``: over a registration of its own): one still waiting out a
        hold is left out again, one that left less than the settle period ago is left out for a
        while (a member that comes and goes re-plans nothing at each turn); then the plan is made
        again and sent to it."""
        now = self.clock()
        left = now if replaced else self.left_at.pop(name, None)
        trunk = self.trunks.get(name)
        hold = self.holds.get(name)
        if trunk is not None and not trunk.refused:
            if hold is not None and hold.until > now:
                trunk.refused = hold.why
                log.warning("trunk %s registered again while it waits (%s): %.0f s of its wait left", name, hold.why,
                            hold.until - now)
            elif left is not None and now - left < self.gate.settle_s:
                wait = self.flapped.strike(name, now)  # (the first quick return is free: a restart)
                if wait > 0:
                    self._hold(name, f"rejoined {now - left:.0f} s after leaving", wait, False)
        self.rebase(name)
        self.replan(also_send_to=name)

    def lost(self, name: str) -> None:
        """``name``'s registration ended (it disconnected, or was marked down): a plan without it."""
        self.left_at[name] = self.clock()
        self.replan()

    def _held(self, name: str) -> bool:
        """``name`` is registered and refused by its hold (not for another reason)."""
        hold, trunk = self.holds.get(name), self.trunks.get(name)
        return hold is not None and trunk is not None and trunk.refused == hold.why

    def _hold(self, name: str, why: str, seconds: float, missed: bool) -> None:
        """Leave ``name`` out of plans for ``seconds`` (also if it registers again meanwhile)."""
        hold = self.holds[name] = Hold(self.clock() + seconds, f"{why}; left out of plans for {seconds:.0f} s",
                                       missed)
        trunk = self.trunks.get(name)
        if trunk is not None and not trunk.refused:
            trunk.refused = hold.why
        log.warning("trunk %s %s", name, hold.why)
        self._arm()

    def _release(self, names: list[str]) -> bool:
        """End the holds of ``names``; True if one of them is registered (it can be planned now)."""
        back = [name for name in names if self._held(name)]
        for name in back:
            self.trunks[name].refused = ""
        for name in names:
            del self.holds[name]
        self._arm()
        return bool(back)

    # --- the deadlines' and holds' timer ---

    def tick(self) -> None:
        """The deadlines and holds that are due by the keeper's clock (the timer calls it; a test
        moves the clock and calls it): a staged plan or the plan in use overdue, waits that ended."""
        self._timer = None
        try:
            now = self.clock()
            if self._staged_by is not None and now >= self._staged_by:
                self._staged_overdue(self.staged.version if self.staged is not None else -1)
            if self._ready_by is not None and now >= self._ready_by:
                self._ready_overdue()
            ended = [name for name, hold in self.holds.items() if hold.until <= now]
            if ended and self._release(ended):
                log.info("%s waited long enough: planned again", ", ".join(ended))
                self.replan()
        finally:
            self._arm()

    def due(self) -> float | None:
        """When ``tick`` has something to do next (the keeper's clock), or None."""
        dues = [t for t in (self._staged_by, self._ready_by) if t is not None]
        return min([*dues, *(hold.until for hold in self.holds.values())], default=None)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        due = self.due()
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (no loop: a test moves the clock and calls ``tick`` itself)
            return
        self._timer = loop.call_later(max(0.0, due - self.clock()) + 0.01, self.tick)

    def _end_staging(self) -> None:
        self.staged = None
        self.plan.next_version = 0
        self._staged_by = None
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

    def _send_trials(self, unproven: list[str]) -> None:
        """The proven trunks hold the model, so the plan in use stays as it is: each unproven trunk
        without a trial gets a plan of its own (a private version, its stage alone) to load and
        prove (checks.py), and is planned once it has: the layers the planner would give it, or,
        where it would leave it out, the first trunk layer (proving it makes it a standby)."""
        waiting = [name for name in unproven if self.trunks[name].trial is None and self.trunks[name].conn.is_open]
        if not waiting:
            return
        lo, _ = self.plan.trunk_range
        ranges = {name: (lo, lo + 1) for name in waiting}
        try:
            would_be, _ = self._propose(self.descriptors(unproven=True))
            ranges.update({s.member: (s.start, s.stop) for s in (would_be.stages if would_be else [])
                           if s.member in ranges})
        except PlanError:
            pass
        for name, (start, stop) in ranges.items():
            trunk = self.trunks[name]
            self._trials += 1
            trial = Plan.from_dict(self.plan.to_dict())
            trial.version = TRIAL_VERSIONS + self._trials
            trial.stages = [StageAssignment(name, trunk.listen, start, stop)]
            trial.experts, trial.warnings = [], ["a trial: prove these layers, then you are planned"]
            trunk.trial = (trial.version, start, stop)
            log.info("trunk %s has proved nothing yet: sent a trial with layers [%d, %d) to load and prove; the "
                     "plan in use (v%d) stays", name, start, stop, self.plan.version)
            trunk.conn.send(trunk.plan_stream, m.encode(m.PlanPush(plan=trial.to_dict())))

    def push(self, only: str | None = None) -> None:
        """The plan to every trunk (or to ``only``) on its register stream, and to every watcher.
        Not to a trunk on trial: it holds its trial plan until it proved itself (a trunk takes the
        last plan it was sent)."""
        self.plan.accounts = accounts(self.home.members())  # (a join since the last push may add one)
        frame = m.encode(m.PlanPush(plan=self.plan.to_dict()))
        staged = None
        if self.staged is not None:
            self.staged.accounts = self.plan.accounts
            staged = m.encode(m.PlanPush(plan=self.staged.to_dict()))
        for name, trunk in self.trunks.items():
            if (only is None or name == only) and trunk.conn.is_open and trunk.trial is None:
                trunk.conn.send(trunk.plan_stream, frame)
                if staged is not None and self.staged.stage_for(name) is not None:
                    trunk.conn.send(trunk.plan_stream, staged)  # (after the plan in use: it loads beside it)
        if only is None:
            self.watchers = [(c, sid) for c, sid in self.watchers if c.is_open]
            for conn, stream_id in self.watchers:
                conn.send(stream_id, frame)

    def watch(self, conn: SwarmProtocol, stream_id: int) -> None:
        """``conn`` gets the plan now (on ``stream_id``) and every new one after."""
        self.watchers.append((conn, stream_id))
        if conn.is_open:
            conn.send(stream_id, m.encode(m.PlanPush(plan=self.plan.to_dict())))

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


def _describe(plan: Plan) -> str:
    return (", ".join(f"{s.member}[{s.start},{s.stop})" for s in plan.stages) or "no trunks") + \
        "".join(f"; experts {e.member}[{e.start},{e.stop})" for e in plan.experts) + \
        "".join(f"; {w}" for w in plan.warnings)
