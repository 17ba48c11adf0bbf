"""What the plan gives this trunk, loaded: a stage's layers or an expert node's experts.

Applying a plan checks it (a placement that leaves experts unplaced is refused before anything
runs), then loads in the background on the compute thread: fetch the slice from the host when
the model file is missing, open it once with every layer checked against the host's hashes,
build the engine. A plan that arrives mid-load is re-read when the load ends. When the layers
are in place, the host hears ``ready`` once per (plan version, assignment).

Make-before-break: a plan the host *staged* (``Plan.staged``) is loaded beside the one served: its
layers fetched and checked and, where this trunk's memory holds both, its engine built in a
``Standby``, while the engine in use serves on. When the host publishes that plan, the standby
takes over at once; a trunk that could not hold both builds the engine then, from the checked file.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kernels.backend import describe_kernels
from kernels.errors import EngineError
from kernels.experts import ExpertEngine
from kernels.gguf_file import GGUFFile
from kernels.slice import Placement, RemoteExperts, SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from net import messages as m
from plans.plan import ExpertAssignment, Plan, PlanError, StageAssignment
from plans.planner import Constraints
from swarmctl.batching import BatchRunner
from swarmctl.trunk.budget import Limits, MemberBudget
from swarmctl.model_files.fetch_progress import FetchProgress
from swarmctl.trunk.context import TrunkContext, TrunkEvents
from swarmctl.trunk.host_link import HostLink
from swarmctl.trunk.layer_share import LayerShare, PeerFetches
from swarmctl.trunk.speed_report import SpeedReport

log = logging.getLogger("swarmctl.trunk")

NO_LAYERS = Limits(0, 0, 0, "no layers loaded")


@dataclass(frozen=True)
class Confirmed:
    """What the host last heard ``ready`` for."""

    plan_version: int
    role: str  # "stage" or "experts"
    start: int  # layers (a stage) or experts (an expert node)
    stop: int


@dataclass
class Standby:
    """The next plan's stage, loaded beside the one served (``engine`` None: no room for both yet)."""

    version: int
    stage: StageAssignment
    model: Path
    gguf: GGUFFile | None = None
    engine: SliceEngine | None = None

    def close(self) -> None:
        """On the compute thread."""
        if self.engine is not None:
            self.engine.close()
        if self.gguf is not None:
            self.gguf.close()
        self.engine = self.gguf = None


def open_checked(model: Path, layers: range, plan: Plan) -> GGUFFile:
    """Open the model (or slice) file, refusing it unless every layer we are to serve hashes to
    what the host's copy does."""
    gguf = GGUFFile(model)
    try:
        mismatched = [i for i in layers if gguf.layer_hash(i) != plan.layer_hashes[i]]
        if mismatched:
            raise EngineError(f"this trunk's copy of the model ({model.name}) differs from the "
                              f"host's ({plan.model_name}) in layers {mismatched[0]}..{mismatched[-1]}; "
                              "refusing to serve them")
    except BaseException:
        gguf.close()
        raise
    return gguf


class Assignment:
    def __init__(self, ctx: TrunkContext, events: TrunkEvents, host: HostLink, speed: SpeedReport,
                 remote_experts: RemoteExperts | None, share: LayerShare | None = None,
                 peers: PeerFetches | None = None) -> None:
        """``remote_experts``: how a stage's slice calls the routed experts other nodes hold
        (ExpertClient.forward), for plans that place experts on expert nodes. ``share``: what
        this trunk holds and serves (told to the host with ``ready``); ``peers``: fetching from
        members that hold our layers too."""
        self.name = ctx.name
        self.device = ctx.device  # where stage slices compute (experts stay on the CPU)
        self.model_path = ctx.model_path
        self.slices_dir = ctx.slices_dir  # layers fetched from the swarm when the model file is missing
        self.memory = ctx.memory
        self.n_threads = ctx.n_threads
        self.plan: Plan | None = None
        self.stage: StageAssignment | None = None
        self.engine: SliceEngine | None = None
        self.runner: BatchRunner | None = None  # batches the engine's steps (continuous batching)
        self.experts: ExpertEngine | None = None  # when the plan makes this trunk an expert node
        self.gguf: GGUFFile | None = None
        self.budget = MemberBudget(NO_LAYERS)  # requests and KV per member
        self.fetched_bytes = 0
        self._executor = ctx.executor
        self._host = host
        self._speed = speed
        self._share = share
        self._peers = peers
        self._remote_experts = remote_experts
        self._events = events
        self._spawn = ctx.spawn
        self._loading: asyncio.Task | None = None
        # True while a load replaces the layers held (steps are refused meanwhile); a plan that
        # keeps them only re-confirms them, and steps run on through that.
        self.swapping = False
        self._confirmed: Confirmed | None = None
        self.standby: Standby | None = None  # the staged plan's stage, loaded beside this one
        self._preparing: int | None = None  # the staged plan version being prepared

    @property
    def loading(self) -> bool:
        return self._loading is not None and not self._loading.done()

    def host_reconnected(self) -> None:
        self._confirmed = None  # a (re)connected host needs to hear ``ready`` again

    def accept(self, plan: Plan) -> bool:
        """Take a plan the host pushed, or refuse it (logged) if it cannot run as written."""
        try:
            plan.check_experts()
        except PlanError as e:
            log.error("refusing plan v%d: %s", plan.version, e)
            return False
        self.plan = plan
        if self.engine is not None:
            self.budget.limits = self.budget_limits()  # the planned context and concurrency may have moved
        if self._preparing not in (None, plan.version, plan.next_version):
            self._preparing = None  # the host gave the staged plan up
            self._drop_standby()
        return True

    # --- a staged plan (make-before-break) ---

    def prepare(self, staged: Plan) -> None:
        """Load our stage of a plan the host staged, beside what we serve, and say ``ready`` for it;
        the plan in use keeps being served until the host publishes the staged one."""
        stage = staged.stage_for(self.name)
        if stage is None or self._preparing == staged.version or \
                (self.plan is not None and staged.version <= self.plan.version):
            return
        self._preparing = staged.version
        self._spawn(self._prepare(staged, stage))

    async def _prepare(self, staged: Plan, stage: StageAssignment) -> None:
        loop = asyncio.get_running_loop()
        serving = self.engine is not None and (self.engine.slice.start, self.engine.slice.stop) == \
            (stage.start, stage.stop) and self.engine.remote_experts is None
        if not serving:
            try:
                model = await self._model_for(stage, staged)
                standby = await loop.run_in_executor(self._executor, self._open_standby, staged, stage, model)
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                log.error("cannot load layers [%d, %d) of staged plan v%d: %s", stage.start, stage.stop,
                          staged.version, e)
                if self._preparing == staged.version:
                    await self._host.tell(m.Refuse(reason=str(e)))
                return
            if self._preparing != staged.version or (self.plan is not None and self.plan.version >= staged.version):
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
                                      holds=self._holds()))

    def _open_standby(self, staged: Plan, stage: StageAssignment, model: Path) -> Standby:
        """On the compute thread: the staged stage's file checked and, if this trunk's memory holds it
        beside the engine in use (weights and the KV its requests hold), its engine built."""
        standby = Standby(staged.version, stage, model)
        gguf = open_checked(model, range(stage.start, stage.stop), staged)
        held = self.engine.weights.n_bytes + self.engine.kv_bytes if self.engine is not None else 0
        needed = stage.memory_used or sum(ModelSpec.from_gguf(gguf).layer_bytes[stage.start:stage.stop])
        if held + needed + Constraints().reserve_bytes > self.memory:
            gguf.close()
            return standby
        try:
            standby.engine = self._new_engine(gguf, stage, staged)
        except BaseException:
            gguf.close()
            raise
        standby.gguf = gguf
        return standby

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
        plan = self.plan
        if self.loading and self._loading is not asyncio.current_task():
            return  # the load in progress re-reads the plan when it finishes (and calls this again)
        expert = plan.expert_for(self.name)
        if expert is not None:
            self._loading = asyncio.ensure_future(self._load_experts(expert))
            return
        stage = plan.stage_for(self.name)
        if stage is None:
            if self.stage is not None:
                log.info("plan v%d gives this trunk no layers", plan.version)
            self.stage = None
            return
        self._loading = asyncio.ensure_future(self._load_stage(stage))

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
        remote = bool(self.plan.experts)  # routed experts elsewhere?
        same = self.engine is not None and (self.engine.slice.start, self.engine.slice.stop) == \
            (stage.start, stage.stop) and (self.engine.remote_experts is not None) == remote and \
            self.engine.weights.kernels == self.plan.kernels  # (new kernels: the weights load again)
        standby = self.standby
        if standby is not None and (standby.version != self.plan.version or
                                    (standby.stage.start, standby.stage.stop) != (stage.start, stage.stop)):
            standby = None
        if not same:
            self.swapping = True
            try:
                await self._let_go("this stage is loading other layers")
                if standby is not None:  # loaded beside the old layers while the host staged this plan
                    await loop.run_in_executor(self._executor, self._take_standby, standby)
                    model = standby.model
                else:
                    model = await self._model_for(stage, self.plan)
                    await loop.run_in_executor(self._executor, self._open_stage, stage, model)
                if self._speed.ms_per_layer_token is None:  # measure now that the layers are here
                    await self._speed.measure_slice(model, stage.start)
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                log.error("%s", e)
                await self._host.tell(m.Refuse(reason=str(e)))
                self._events.fail(str(e))
                return
            finally:
                self.swapping = False
        self.stage = stage
        latest = self.plan.stage_for(self.name) if self.plan else None
        if latest is None or (latest.start, latest.stop) != (stage.start, stage.stop):
            self.apply()  # the plan moved on while we loaded (maybe to experts, or to nothing)
            return
        self.stage = latest  # these layers as the newest plan has them (how their output travels may differ)
        plan = self.plan
        if await self._confirm(Confirmed(plan.version, "stage", stage.start, stage.stop)):
            log.info("serving layers [%d, %d) under plan v%d on %s", stage.start, stage.stop, plan.version,
                     self.engine.placement() if self.engine else "?")
            self._spawn(self._events.serving(plan))
        self._reapply_if_moved(plan)

    def _reapply_if_moved(self, plan: Plan) -> None:
        """A plan that arrived while this load told the host it was ready was left to the load
        (``apply`` returns while one runs): take it up now, or this trunk would serve the old
        assignment under the new plan's version (seen: a wire dtype changed by `config` while
        the layers stayed, and the stage kept sending the old one)."""
        if self.plan is not plan:
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
        engine = SliceEngine(gguf, SliceSpec(stage.start, stage.stop), n_threads=self.n_threads,
                             placement=Placement(device=self.device, gpu_memory=self.memory, kernels=plan.kernels),
                             remote_experts=self._remote_experts if plan.experts else None)
        log.info("%s (%d weights repacked)", describe_kernels(plan.kernels), len(engine.weights.repacked))
        return engine

    async def _model_for(self, stage: StageAssignment, plan: Plan) -> Path:
        """Our model file, or a slice file with the stage's layers, fetched from the host if need be."""
        if self.model_path.exists():
            return self.model_path
        from swarmctl.model_files.distribution import fetch_slice

        if not self._host.is_open:
            raise EngineError("no model file and no host to fetch layers from")
        crash_after = os.environ.get("SWARMCTL_TEST_FETCH_CRASH_AFTER")  # fault injection for the resume test
        members = self._peers.sources(self._report_source) if self._peers is not None else None
        try:
            path, received = await fetch_slice(
                self._host.conn, self._host.open_fetch, self._host.close_fetch, self.slices_dir,
                model_hash=plan.model_hash, start=stage.start, stop=stage.stop, layer_hashes=plan.layer_hashes,
                on_progress=self._progress(f"layers [{stage.start}, {stage.stop})"),
                stop_after_bytes=int(crash_after) if crash_after else None, members=members)
        finally:
            if self._peers is not None:
                await self._peers.release()
        self.fetched_bytes += received
        log.info("layers [%d, %d) ready in %s (%.1f MB received)", stage.start, stage.stop, path.name, received / 1e6)
        return path

    def _report_source(self, member: str, reason: str) -> None:
        """A member sent us a chunk that failed the host's hash: the host hears of it."""
        self._spawn(self._host.tell(m.BadSource(member=member, reason=reason[:300])))

    def _progress(self, what: str) -> Callable[[int, int], None]:
        """A fetch's ``on_progress``: a line in the log every so often with the rate and the time
        left, and the host told (status and top show it; the planner prices moves at the rate)."""
        progress = FetchProgress(what)

        def update(done: int, total: int) -> None:
            progress.update(done, total)
            if progress.log_due():
                log.info("%s", progress.line())
            if progress.report_due():
                self._spawn(self._host.tell(m.Fetching(what=what[:200], done=done, total=total,
                                                       bytes_per_s=progress.bytes_per_s, finished=progress.finished)))
        return update

    # --- an expert node ---

    async def _load_experts(self, expert: ExpertAssignment) -> None:
        """Expert parallelism: hold experts [start, stop) of every MoE trunk layer, serve calls."""
        loop = asyncio.get_running_loop()
        start, stop = self.plan.trunk_range
        held = self.experts is not None and (self.experts.first, self.experts.last, self.experts.layers,
                                             self.experts.kernels) == (expert.start, expert.stop, range(start, stop),
                                                                       self.plan.kernels)
        if not held:
            await self._let_go("this trunk now serves experts")
            await loop.run_in_executor(self._executor, self.unload)
            self.stage = None
            try:
                model = await self._experts_file(expert, self.plan)
                await loop.run_in_executor(self._executor, self._open_experts, model, range(start, stop),
                                           expert.start, expert.stop)
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                log.error("%s", e)
                await self._host.tell(m.Refuse(reason=str(e)))
                return
        latest = self.plan.expert_for(self.name)
        if latest is None or (latest.start, latest.stop) != (expert.start, expert.stop):
            self.apply()
            return
        plan = self.plan
        if await self._confirm(Confirmed(plan.version, "experts", expert.start, expert.stop)):
            log.info("serving experts [%d, %d) of layers [%d, %d) under plan v%d", expert.start, expert.stop,
                     start, stop, plan.version)
        self._reapply_if_moved(plan)

    async def _experts_file(self, expert: ExpertAssignment, plan: Plan) -> Path:
        """Our model file, or a file with just our experts of the trunk's layers, fetched if need be."""
        if self.model_path.exists():
            return self.model_path
        from swarmctl.model_files.expert_slices import fetch_experts

        if not self._host.is_open:
            raise EngineError("no model file and no host to fetch experts from")
        start, stop = plan.trunk_range
        what = f"experts [{expert.start}, {expert.stop}) of layers [{start}, {stop})"
        path, received = await fetch_experts(
            self._host.conn, self._host.open_fetch, self._host.close_fetch, self.slices_dir,
            model_hash=plan.model_hash, start=start, stop=stop, first=expert.start, last=expert.stop,
            layer_hashes=plan.layer_hashes,
            on_progress=self._progress(what))
        self.fetched_bytes += received
        log.info("%s ready in %s (%.1f MB received)", what, path.name, received / 1e6)
        return path

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
        if self._confirmed == confirmed:
            return False
        self._confirmed = confirmed
        placement = self.engine.placement() if self.engine is not None and confirmed.role == "stage" else ""
        await self._host.tell(m.Ready(plan_version=confirmed.plan_version, placement=placement, holds=self._holds()))
        return True

    def _holds(self) -> list[tuple[int, int]]:
        return self._share.holds() if self._share is not None else []

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
