"""What applying the host's plans takes at a trunk, decided with no I/O.

The trunk's ``Assignment`` (swarmctl/trunk/assignment.py) loads layers or experts on the compute
thread and talks to the host; every choice it makes on the way is here, as a function of the plan
and of what the trunk holds, so that tests can drive a trunk's whole life of plans without a model,
a thread or a socket:

- which plan is taken (one that leaves experts unplaced is refused) and whether a plan the host
  staged is still wanted (``accept``, ``prepare``, ``staged_wanted``);
- what the plan gives this trunk: a stage, experts, or nothing, or to wait for the load under way,
  which re-reads the plan when it ends (``next_load``);
- whether a load *replaces* the layers held (steps are refused meanwhile: ``swapping``) or only
  re-confirms them, and whether the layers loaded beside the served ones for a staged plan can be
  taken over (``start_stage_load``);
- after a load: whether the plan moved on meanwhile (load again), or the host hears ``ready``,
  once per plan version and assignment (``after_load``, ``confirm``); a plan that arrived while
  that ``ready`` was on its way is taken up after it (``moved_since``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from plans.plan import ExpertAssignment, Plan, PlanError, StageAssignment


@dataclass(frozen=True)
class Confirmed:
    """What the host last heard ``ready`` for."""

    plan_version: int
    role: str  # "stage" or "experts"
    start: int  # layers (a stage) or experts (an expert node)
    stop: int


@dataclass(frozen=True)
class HeldLayers:
    """The layers a stage engine holds: [start, stop), and whether it calls routed experts on
    expert nodes (an engine built for the other case cannot serve the plan)."""

    start: int
    stop: int
    remote_experts: bool
    kernels: str = "plain"  # the weights' kernels (plans/options: kernels); other kernels load again
    attention: str = "plain"  # plain or flash (plans/options: attention); the other builds the engine again


@dataclass(frozen=True)
class HeldExperts:
    """The experts an expert node holds: [first, last) of each of ``layers``."""

    first: int
    last: int
    layers: range
    kernels: str = "plain"


@dataclass(frozen=True)
class Accepted:
    refusal: str = ""  # why the plan was refused ("" : taken)
    give_up_staged: bool = False  # the host gave up the staged plan being prepared: drop what was loaded for it


class LoadKind(Enum):
    WAIT = "wait"  # a load is under way: it re-reads the plan when it ends
    STAGE = "stage"
    EXPERTS = "experts"
    NOTHING = "nothing"  # the plan gives this trunk no layers


@dataclass(frozen=True)
class Load:
    kind: LoadKind
    stage: StageAssignment | None = None
    expert: ExpertAssignment | None = None


@dataclass(frozen=True)
class StageLoad:
    replaces: bool  # the layers held go (steps refused meanwhile); else they are only re-confirmed
    take_standby: bool  # the staged plan's layers, loaded beside the served ones, become the served ones


@dataclass(frozen=True)
class AfterLoad:
    """What follows a load: load again (the plan moved on meanwhile), or tell the host ``ready``
    for ``confirmed`` under ``plan``, serving ``latest`` (the layers as the newest plan has them)."""

    again: bool
    plan: Plan | None = None
    latest: StageAssignment | ExpertAssignment | None = None
    confirmed: Confirmed | None = None


def same_range(a, b) -> bool:
    return (a.start, a.stop) == (b.start, b.stop)


def room_for_both(held_bytes: int, needed_bytes: int, reserve_bytes: int, memory: int) -> bool:
    """Whether a staged stage's engine fits beside the one in use (its weights and the KV its
    requests hold) within what this trunk offers."""
    return held_bytes + needed_bytes + reserve_bytes <= memory


class AssignmentCore:
    def __init__(self, name: str) -> None:
        self.name = name
        self.plan: Plan | None = None  # the plan taken (the one served once loaded)
        # True while a load replaces the layers held (steps are refused meanwhile); a plan that
        # keeps them only re-confirms them, and steps run on through that.
        self.swapping = False
        self._confirmed: Confirmed | None = None
        self._preparing: int | None = None  # the staged plan version being prepared

    # --- plans ---

    def accept(self, plan: Plan) -> Accepted:
        """Take a plan the host pushed, unless it cannot run as written."""
        try:
            plan.check_experts()
        except PlanError as e:
            return Accepted(refusal=str(e))
        self.plan = plan
        given_up = self._preparing not in (None, plan.version, plan.next_version)
        if given_up:
            self._preparing = None
        return Accepted(give_up_staged=given_up)

    def prepare(self, staged: Plan) -> StageAssignment | None:
        """The stage of a staged plan to load beside the one served, or None: the plan gives this
        trunk none, it is being prepared already, or it is no newer than the plan taken."""
        stage = staged.stage_for(self.name)
        if stage is None or self._preparing == staged.version or \
                (self.plan is not None and staged.version <= self.plan.version):
            return None
        self._preparing = staged.version
        return stage

    def staged_wanted(self, version: int) -> bool:
        """Whether the staged plan ``version`` is still being prepared: not given up, nor published
        before this trunk was ready (the host's deadline)."""
        return self._preparing == version and (self.plan is None or self.plan.version < version)

    def still_preparing(self, version: int) -> bool:
        """Whether the host should hear that the staged plan ``version`` cannot be loaded here."""
        return self._preparing == version

    def next_load(self, loading_elsewhere: bool) -> Load:
        """What the plan taken gives this trunk. ``loading_elsewhere``: a load is under way (not
        the caller): it re-reads the plan when it ends."""
        if loading_elsewhere:
            return Load(LoadKind.WAIT)
        expert = self.plan.expert_for(self.name)
        if expert is not None:
            return Load(LoadKind.EXPERTS, expert=expert)
        stage = self.plan.stage_for(self.name)
        return Load(LoadKind.STAGE, stage=stage) if stage is not None else Load(LoadKind.NOTHING)

    # --- a stage ---

    @staticmethod
    def serves_already(held: HeldLayers | None, stage: StageAssignment, staged: Plan | None = None) -> bool:
        """A staged plan's stage that the engine in use serves as it is (same layers, experts in
        it, and the ``staged`` plan's kernels and attention): nothing to load beside it, only
        ``ready`` to say."""
        return held is not None and same_range(held, stage) and not held.remote_experts and (
            staged is None or (held.kernels, held.attention) == (staged.kernels, staged.attention))

    def start_stage_load(self, stage: StageAssignment, held: HeldLayers | None,
                         standby: tuple[int, StageAssignment] | None) -> StageLoad:
        """Loading ``stage`` of the plan taken, with ``held`` in the engine and ``standby`` (the
        staged plan's version and stage) loaded beside it: sets ``swapping`` when the layers held
        go (``load_ended`` clears it)."""
        remote = bool(self.plan.experts)  # routed experts elsewhere?
        same = held is not None and same_range(held, stage) and held.remote_experts == remote and \
            (held.kernels, held.attention) == (self.plan.kernels, self.plan.attention)  # (else: load again)
        usable = standby is not None and standby[0] == self.plan.version and same_range(standby[1], stage)
        if not same:
            self.swapping = True
        return StageLoad(replaces=not same, take_standby=usable)

    def load_ended(self) -> None:
        self.swapping = False

    # --- an expert node ---

    def holds_experts(self, held: HeldExperts | None, expert: ExpertAssignment, trunk_range: tuple[int, int]) -> bool:
        """Whether the experts held are the ones ``expert`` names, of every trunk layer, under the
        plan's kernels."""
        return held is not None and (held.first, held.last, held.layers, held.kernels) == \
            (expert.start, expert.stop, range(*trunk_range), self.plan.kernels)

    # --- after a load ---

    def after_load(self, loaded: StageAssignment | ExpertAssignment) -> AfterLoad:
        """``loaded`` is in place: if the plan taken meanwhile gives this trunk something else
        (other layers, experts, nothing), load again; else the host hears ``ready`` for it."""
        role = "experts" if isinstance(loaded, ExpertAssignment) else "stage"
        plan = self.plan
        latest = None if plan is None else (plan.expert_for(self.name) if role == "experts"
                                            else plan.stage_for(self.name))
        if latest is None or not same_range(latest, loaded):
            return AfterLoad(again=True)
        return AfterLoad(again=False, plan=plan, latest=latest,
                         confirmed=Confirmed(plan.version, role, loaded.start, loaded.stop))

    def confirm(self, confirmed: Confirmed) -> bool:
        """Whether to tell the host ``ready`` for ``confirmed``: once per plan version and assignment."""
        if self._confirmed == confirmed:
            return False
        self._confirmed = confirmed
        return True

    def host_reconnected(self) -> None:
        self._confirmed = None  # a (re)connected host needs to hear ``ready`` again

    def moved_since(self, plan: Plan) -> bool:
        """A plan taken while the load that served ``plan`` told the host it was ready: it was left
        to that load (``next_load`` waits while one runs), so it is applied now, or this trunk
        would serve the old assignment under the new plan's version (seen: a wire dtype changed by
        `config` while the layers stayed, and the stage kept sending the old one)."""
        return self.plan is not plan
