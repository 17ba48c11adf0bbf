"""What the plan gives this trunk, loaded: a stage's layers or an expert node's experts.

Which plan is applied and what applying it takes (load or re-confirm, take over the standby,
load again because the plan moved on, say ``ready``) is decided in ``assignment_core`` with no
I/O; this module carries it out on the compute thread and tells the host.

Applying a plan checks it (a placement that leaves experts unplaced is refused before anything
runs), then loads in the background on the compute thread: fetch the slice from the host when
the model file is missing, open it once with every layer checked against the host's hashes,
build the engine. A plan that arrives mid-load is re-read when the load ends. When the layers
are in place, the host hears ``ready`` once per (plan version, assignment).

Make-before-break: a plan the host *staged* (``Plan.staged``) is loaded beside the one served: its
layers fetched and checked and, where this trunk's memory holds both, its engine built in a
``Standby`` (swarmctl/trunk/standby.py), while the engine in use serves on. When the host publishes
that plan, the standby takes over at once; a trunk that could not hold both builds the engine
then, from the checked file. Layers come from the swarm without a model file (layer_fetch.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from kernels.backend import describe_kernels
from kernels.errors import EngineError
from kernels.experts import ExpertEngine
from kernels.gguf_file import GGUFFile
from kernels.slice import Placement, RemoteExperts, SliceEngine
from kernels.spec import SliceSpec
from net import messages as m
from plans.plan import ExpertAssignment, Plan, StageAssignment
from plans.planner import Constraints
from swarmctl.batching import BatchRunner
from swarmctl.trunk.assignment_core import AssignmentCore, Confirmed, HeldExperts, HeldLayers, LoadKind
from swarmctl.trunk.budget import Limits, MemberBudget
from swarmctl.trunk.context import TrunkContext, TrunkEvents
from swarmctl.trunk.host_link import HostLink
from swarmctl.trunk.layer_fetch import LayerFetch
from swarmctl.trunk.speed_report import SpeedReport
from swarmctl.trunk.checked_open import open_checked
from swarmctl.trunk.standby import Standby, open_standby

log = logging.getLogger("swarmctl.trunk")

NO_LAYERS = Limits(0, 0, 0, "no layers loaded")


class Assignment:
    def __init__(self, ctx: TrunkContext, events: TrunkEvents, host: HostLink, speed: SpeedReport,
                 remote_experts: RemoteExperts | None, fetch: LayerFetch | None = None) -> None:
        """``remote_experts``: how a stage's slice calls the routed experts other nodes hold
        (ExpertClient.forward), for plans that place experts on expert nodes. ``fetch``: where
        layers come from without a model file, and what this trunk holds and serves (told to the
        host with ``ready``)."""
        self.name = ctx.name
        self.device = ctx.device  # where stage slices compute (experts stay on the CPU)
        self.model_path = ctx.model_path
        self.memory = ctx.memory
        self.n_threads = ctx.n_threads
        self.core = AssignmentCore(ctx.name)  # every decision (assignment_core.py); this class carries them out
        self.stage: StageAssignment | None = None
        self.engine: SliceEngine | None = None
        self.runner: BatchRunner | None = None  # batches the engine's steps (continuous batching)
        self.experts: ExpertEngine | None = None  # when the plan makes this trunk an expert node
        self.gguf: GGUFFile | None = None
        self.budget = MemberBudget(NO_LAYERS)  # requests and KV per member
        self.fetch = fetch if fetch is not None else LayerFetch(ctx, host)
        self._executor = ctx.executor
        self._host = host
        self._speed = speed
        self._remote_experts = remote_experts
        self._events = events
        self._spawn = ctx.spawn
        self._loading: asyncio.Task | None = None
        self.standby: Standby | None = None  # the staged plan's stage, loaded beside this one

    @property
    def plan(self) -> Plan | None:
        return self.core.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self.core.plan = plan

    @property
    def swapping(self) -> bool:
        """A load replaces the layers held: steps are refused meanwhile."""
        return self.core.swapping

    @property
    def fetched_bytes(self) -> int:
        return self.fetch.fetched_bytes

    @property
    def loading(self) -> bool:
        return self._loading is not None and not self._loading.done()

    def host_reconnected(self) -> None:
        self.core.host_reconnected()

    def accept(self, plan: Plan) -> bool:
        """Take a plan the host pushed, or refuse it (logged) if it cannot run as written."""
        accepted = self.core.accept(plan)
        if accepted.refusal:
            log.error("refusing plan v%d: %s", plan.version, accepted.refusal)
            return False
        if self.engine is not None:
            self.budget.limits = self.budget_limits()  # the planned context and concurrency may have moved
        if accepted.give_up_staged:
            self._drop_standby()
        return True

    def _held_layers(self) -> HeldLayers | None:
        engine = self.engine
        return HeldLayers(engine.slice.start, engine.slice.stop, engine.remote_experts is not None,
                          engine.weights.kernels, engine.attention) if engine is not None else None

    # --- a staged plan (make-before-break) ---

    def prepare(self, staged: Plan) -> None:
        """Load our stage of a plan the host staged, beside what we serve, and say ``ready`` for it;
        the plan in use keeps being served until the host publishes the staged one."""
        stage = self.core.prepare(staged)
        if stage is not None:
            self._spawn(self._prepare(staged, stage))

    async def _prepare(self, staged: Plan, stage: StageAssignment) -> None:
        loop = asyncio.get_running_loop()
        serving = self.core.serves_already(self._held_layers(), stage, staged)
        if not serving:
            try:
                model = await self.fetch.stage_file(stage, staged)
                standby = await loop.run_in_executor(self._executor, self._open_standby, staged, stage, model)
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                log.error("cannot load layers [%d, %d) of staged plan v%d: %s", stage.start, stage.stop,
                          staged.version, e)
                if self.core.still_preparing(staged.version):
                    await self._host.tell(m.Refuse(reason=str(e)))
                return
            if not self.core.staged_wanted(staged.version):
                # given up meanwhile, or published before this trunk was ready (the host's deadline)
                await loop.run_in_executor(self._executor, standby.close)
                return
            await loop.run_in_executor(self._executor, self._drop_standby_now)
            self.standby = standby
            log.info("layers [%d, %d) of staged plan v%d %s beside layers [%d, %d) in use", stage.start, stage.stop,
                     staged.version, "loaded" if standby.engine is not None else "fetched and checked (no room to "
                     "load them beside the ones in use: loaded at the switch)",
                     *((self.stage.start, self.stage.stop) if self.stage else (0, 0)))
        await self._host.tell(m.Ready(plan_version=staged.version,
                                      placement=self.engine.placement() if serving and self.engine else "",
                                      holds=self.fetch.holds()))

    def _open_standby(self, staged: Plan, stage: StageAssignment, model: Path) -> Standby:
        """On the compute thread (where the engine in use and the KV its requests hold are read)."""
        held = self.engine.weights.n_bytes + self.engine.kv_bytes if self.engine is not None else 0
        return open_standby(staged, stage, model, held_bytes=held, memory=self.memory,
                            build=lambda gguf: self._new_engine(gguf, stage, staged))

    def _drop_standby(self) -> None:
        if self.standby is not None:
            self._spawn(asyncio.get_running_loop().run_in_executor(self._executor, self._drop_standby_now))

    def _drop_standby_now(self) -> None:
        """On the compute thread."""
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.close()

    def apply(self) -> None:
        """Start loading what the current plan gives us, unless a load in progress will re-read it."""
        load = self.core.next_load(loading_elsewhere=self.loading and self._loading is not asyncio.current_task())
        if load.kind == LoadKind.EXPERTS:
            self._loading = asyncio.ensure_future(self._load_experts(load.expert))
        elif load.kind == LoadKind.STAGE:
            self._loading = asyncio.ensure_future(self._load_stage(load.stage))
        elif load.kind == LoadKind.NOTHING:
            if self.stage is not None:
                log.info("plan v%d gives this trunk no layers", self.plan.version)
            self.stage = None

    def budget_limits(self) -> Limits:
        """What one member may hold here: derived from what the plan reserves at this stage
        (plan_concurrent requests × plan_context tokens) and what this node offered (swarmctl/trunk/budget.py)."""
        engine, plan = self.engine, self.plan
        room = self.memory - engine.weights.n_bytes - Constraints().reserve_bytes
        return Limits.derive(kv_bytes_per_position=engine.kv_bytes_per_position,
                             smallest_cache_bytes=engine.kv_bytes_after(b"", 1),
                             context_tokens=min(plan.context_tokens, engine.max_context),
                             concurrent=plan.max_concurrent, room_bytes=room)

    # --- a stage ---

    async def _load_stage(self, stage: StageAssignment) -> None:
        loop = asyncio.get_running_loop()
        standby = self.standby
        load = self.core.start_stage_load(stage, self._held_layers(),
                                          (standby.version, standby.stage) if standby is not None else None)
        if load.replaces:
            try:
                await self._let_go("this stage is loading other layers")
                if load.take_standby:  # loaded beside the old layers while the host staged this plan
                    await loop.run_in_executor(self._executor, self._take_standby, standby)
                    model = standby.model
                else:
                    model = await self.fetch.stage_file(stage, self.plan)
                    await loop.run_in_executor(self._executor, self._open_stage, stage, model)
                if self._speed.ms_per_layer_token is None:  # measure now that the layers are here
                    await self._speed.measure_slice(model, stage.start)
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                log.error("%s", e)
                await self._host.tell(m.Refuse(reason=str(e)))
                self._events.fail(str(e))
                return
            finally:
                self.core.load_ended()
        self.stage = stage
        after = self.core.after_load(stage)
        if after.again:
            self.apply()  # the plan moved on while we loaded (maybe to experts, or to nothing)
            return
        self.stage = after.latest  # these layers as the newest plan has them (how their output travels may differ)
        if await self._confirm(after.confirmed):
            log.info("serving layers [%d, %d) under plan v%d on %s", stage.start, stage.stop, after.plan.version,
                     self.engine.placement() if self.engine else "?")
            self._spawn(self._events.serving(after.plan))
        if self.core.moved_since(after.plan):
            self.apply()

    def _take_standby(self, standby: Standby) -> None:
        """On the compute thread: the staged plan is published; its stage (loaded beside the old one
        if there was room, else now from the file already checked) becomes the one served."""
        self.standby = None
        if standby.engine is None:
            self._open_stage(standby.stage, standby.model)
            return
        self.unload()
        self.engine, self.gguf = standby.engine, standby.gguf
        self.budget = MemberBudget(self.budget_limits())
        self.runner = BatchRunner(self.engine)

    def _open_stage(self, stage: StageAssignment, model: Path) -> None:
        """On the compute thread."""
        self.unload()
        gguf = open_checked(model, range(stage.start, stage.stop), self.plan)
        try:
            self.engine = self._new_engine(gguf, stage, self.plan)
            self.budget = MemberBudget(self.budget_limits())  # a new engine holds no request yet
            self.runner = BatchRunner(self.engine)
            self.gguf = gguf
        except BaseException:
            gguf.close()
            raise

    def _new_engine(self, gguf: GGUFFile, stage: StageAssignment, plan: Plan) -> SliceEngine:
        """The engine for ``stage`` of ``plan`` (on the compute thread), the same for the stage in use
        and one loaded beside it."""
        placement = Placement(self.device, self.memory, kernels=plan.kernels, attention=plan.attention)
        engine = SliceEngine(gguf, SliceSpec(stage.start, stage.stop), n_threads=self.n_threads, placement=placement,
                             remote_experts=self._remote_experts if plan.experts else None)
        log.info("%s (%d weights repacked); %s", describe_kernels(plan.kernels), len(engine.weights.repacked),
                 engine.describe_attention())
        return engine

    # --- an expert node ---

    async def _load_experts(self, expert: ExpertAssignment) -> None:
        """Expert parallelism: hold experts [start, stop) of every MoE trunk layer, serve calls."""
        loop = asyncio.get_running_loop()
        start, stop = self.plan.trunk_range
        experts = self.experts
        held = HeldExperts(experts.first, experts.last, experts.layers, experts.kernels) if experts is not None else None
        if not self.core.holds_experts(held, expert, (start, stop)):
            await self._let_go("this trunk now serves experts")
            await loop.run_in_executor(self._executor, self.unload)
            self.stage = None
            try:
                model = await self.fetch.experts_file(expert, self.plan)
                await loop.run_in_executor(self._executor, self._open_experts, model, range(start, stop),
                                           expert.start, expert.stop)
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                log.error("%s", e)
                await self._host.tell(m.Refuse(reason=str(e)))
                return
        after = self.core.after_load(expert)
        if after.again:
            self.apply()
            return
        if await self._confirm(after.confirmed):
            log.info("serving experts [%d, %d) of layers [%d, %d) under plan v%d", expert.start, expert.stop,
                     start, stop, after.plan.version)
        if self.core.moved_since(after.plan):
            self.apply()

    def _open_experts(self, model: Path, layers: range, first: int, last: int) -> None:
        """On the compute thread. The model file is checked against the plan's layer hashes here;
        a fetched experts file was checked, chunk by chunk and against those hashes, before it took
        its name (it holds only some of each layer's bytes, so it cannot be hashed as a layer)."""
        self.unload()
        gguf = open_checked(model, layers, self.plan) if model == self.model_path else GGUFFile(model)
        try:
            self.experts = ExpertEngine(gguf, layers, first, last, n_threads=self.n_threads, kernels=self.plan.kernels)
            log.info("%s", describe_kernels(self.plan.kernels))
            self.gguf = gguf
        except BaseException:
            gguf.close()
            raise

    # --- both ---

    async def _let_go(self, why: str) -> None:
        """Before loading something else: every request here retries elsewhere, the runner ends
        (what it held is unloaded on the compute thread, first thing in the load)."""
        self._events.drop_routes("the plan changed")
        if self.runner is not None:
            await self.runner.aclose(why)

    async def _confirm(self, confirmed: Confirmed) -> bool:
        """Tell the host we are ready, once per plan version and assignment."""
        if not self.core.confirm(confirmed):
            return False
        placement = self.engine.placement() if self.engine is not None and confirmed.role == "stage" else ""
        await self._host.tell(m.Ready(plan_version=confirmed.plan_version, placement=placement,
                                      holds=self.fetch.holds()))
        return True

    def close(self) -> None:
        """On the compute thread: everything this trunk holds, the standby too."""
        self._drop_standby_now()
        self.unload()

    def unload(self) -> None:
        """On the compute thread."""
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.budget = MemberBudget(NO_LAYERS)  # its requests went with it
        if self.gguf is not None:
            self.gguf.close()
            self.gguf = None
