"""One simulated run: a fresh swarm (host, trunks, askers) on a virtual-clock loop and the
simulated network, the schedule's asks and faults played at their virtual times, then the
invariants checked (harness/sim/invariants.py). Everything a run does is in its event log, with
the virtual time and the node it happened on."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field

from harness.sim.clock import LoopWaits, VirtualClockLoop, WallLimit
from harness.sim.headers import HEADERS
from harness.sim.network import CURRENT_NODE, Conditions, NetStats, SimNetwork
from harness.sim.probes import SMALL_PROBES
from harness.sim.schedule import Ask, Fault, Schedule
from harness.sim.standin import engines
from harness.sim.watch import PlanSpan, Watch
from harness.sim.world import FIGURES, HOST_BOUNDS, TRUNK_MEMORY, NodeComputeThreads, Template, WorldSpec, free_udp_port, \
    kill_node, move_host, run_as, seeded_randomness, udp_free
from kernels.errors import EngineError
from kernels.sampling import SamplingParams
from net import messages as m
from net.endpoint import close
from net.liveness import IDLE_TIMEOUT
from net.protocol import RequestOnlyHandler
from swarmctl.node.home import SwarmHome

ASK_TIMEOUT_S = 120.0  # each ask's whole deadline (the link's per-step deadline is the same)
READY_BOUND_S = 300.0  # how long the swarm may take to serve at first
SETTLE_S = 25.0  # after the last ask and the last fault: for the stages to free what they held
PLAN_BOUND_S = 30.0  # once the faults stop, the host's plan is complete again within this (a trunk lives)
IDLE_TIMEOUT_S = 20.0  # a stage frees a request idle this long (swarmctl run trunk's idle timeout, shortened)
WALL_LIMIT_S = 60.0  # a run still going after this much real time is stopped and reported (a livelock)
MID_CALL_WAIT_S = 20.0  # an 'expert_kill' waits this long at most for a stage to call its expert nodes
STOP_BOUND_S = 10.0  # a trunk told to stop (Ctrl-C) has stopped within this, once it can run
STOPPED_POLL_S = 0.1  # how often a Ctrl-C to a SIGSTOPped trunk looks whether it was continued
STALL_ARMED_S = 30.0  # a 'stall' hangs the trunk's next load within this long, if it loads at all
SWARM_STARTS_S = 1.0  # virtual seconds after the loop's start: the host and trunks start then in every run
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class AskResult:
    ask: Ask
    tokens: list[int] | None = None
    error: str = ""
    error_type: str = ""
    started: float = 0.0  # virtual seconds since the swarm first served
    ended: float | None = None


@dataclass
class RunResult:
    schedule: Schedule
    asks: list[AskResult]
    reference: dict[tuple, list[int]]
    failures: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    virtual_s: float = 0.0
    wall_s: float = 0.0
    net: NetStats | None = None
    revoked_at: float | None = None
    leftovers: dict[str, dict] = field(default_factory=dict)  # live trunk → what it still holds
    crashes: list[str] = field(default_factory=list)  # unhandled exceptions and logged tracebacks
    plan: PlanSpan | None = None  # when the plan was complete again after the faults stopped
    over_budget: list[str] = field(default_factory=list)  # members found holding more than a budget allows
    trunks_alive: list[str] = field(default_factory=list)  # at the end
    left_running: list[str] = field(default_factory=list)  # what a trunk stopped cleanly left behind
    planned: list[str] | None = None  # the members in the host's plan at the end (None: no host then)
    held_out: dict[str, str] = field(default_factory=dict)  # members the host leaves out of plans at the end, why

    @property
    def ok(self) -> bool:
        return not self.failures


class _RunLog(logging.Handler):
    """The product's log records, stamped with virtual time and node, into the run's event log."""

    def __init__(self, run: "SimRun", level: int) -> None:
        super().__init__(level)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        node = CURRENT_NODE.get() or "-"
        self.run.event(f"{node:>8} {record.levelname.lower():7} {record.name}: {record.getMessage()}")
        if record.exc_info and record.levelno >= logging.ERROR:
            self.run.result.crashes.append(f"{node}: {record.getMessage()}: {record.exc_info[1]!r}")


class SimRun:
    def __init__(self, schedule: Schedule, spec: WorldSpec = WorldSpec(), *, verbose: bool = False,
                 compute: str = "tiny") -> None:
        """``compute``: "tiny" (the real engine on the tiny model) or "stand-in" (harness/sim/standin.py)."""
        self.schedule, self.spec, self.verbose, self.compute = schedule, spec, verbose, compute
        self.template = Template.of(spec)
        self.result = RunResult(schedule, [AskResult(a) for a in schedule.asks], {})
        self.loop = VirtualClockLoop()
        # A mixture-of-experts stage's compute thread waits on the loop for its expert calls: real
        # threads, the clock moving on while every busy thread waits on the loop (LoopWaits)
        self.loop.inline_threads = not spec.expert_nodes
        self.compute_threads = NodeComputeThreads(not self.loop.inline_threads)
        self.network = SimNetwork(self.loop, random.Random(schedule.seed), schedule.conditions)
        self.loop.network = self.network
        self.t0 = 0.0  # virtual time the swarm first served
        self.trunks: dict = {}  # name → its running TrunkService
        self.stops: dict[str, asyncio.Event] = {}
        self.serving: dict[str, asyncio.Task] = {}  # trunk → the task running its service
        self.links: dict = {}
        self.trunk_of: dict = {}  # asker → what its asks run through (its link, or a verifier around it)
        self.asker = None
        self.killed: set[str] = set()  # nodes killed at some point of the run
        self.running: set[str] = set()  # host and trunks started and not killed since
        self.revoke_pending = False  # revoked while the host was down or frozen: counted from when it hears again
        self.host_service = None  # the running HostService (None while the host is down)
        self.host_started = -math.inf  # when the host last started again (virtual s since the swarm served)
        self.watch = Watch(lambda: self.host_service, lambda: self.trunks, lambda: self.loop.time() - self.t0)

    def event(self, text: str) -> None:
        self.result.log.append(f"{self.loop.time() - self.t0:9.3f} {text}")

    # --- running it ---

    def play(self) -> RunResult:
        wall = time.perf_counter()
        root = self.template.copy_homes()
        self.homes = {p.name: SwarmHome(p) for p in (root / "homes").iterdir()}
        # (another process took the template's port, or may, forked after the template was made beside
        # others: a port free now; two forked workers both found the template's free and one's host
        # could not bind it)
        if self.template.pid != os.getpid() or not udp_free(self.template.host_address):
            move_host(self.homes, f"127.0.0.2:{free_udp_port('127.0.0.2')}")
        handler = _RunLog(self, logging.INFO if self.verbose else logging.WARNING)
        logging.getLogger().addHandler(handler)
        levels = {name: logging.getLogger(name).level for name in ("", "quic")}
        logging.getLogger().setLevel(logging.INFO if self.verbose else logging.WARNING)
        logging.getLogger("quic").setLevel(logging.WARNING)
        self.loop.set_exception_handler(self._unhandled)
        self.loop.limit_wall(WALL_LIMIT_S)
        try:
            with engines(self.compute), HEADERS, LoopWaits(self.loop), self.compute_threads:
                self.loop.run_until_complete(self._prepare())  # (before the seed's draws: the first run's only)
                self.loop.jump_to(self.loop.start + SWARM_STARTS_S)
                churn = any(f.kind == "churn" for f in self.schedule.faults)
                with FIGURES.of(self.spec, churn), HOST_BOUNDS.of(self.spec, churn), SMALL_PROBES, \
                        seeded_randomness(self.schedule.seed):
                    self.loop.run_until_complete(self._main())
        except WallLimit as e:
            busy = sorted({repr(h)[:160] for h in [*list(self.loop._ready)[:10], *self.loop._scheduled[:5]]})
            self.result.crashes.append(f"the run did not finish: {e}; running: {busy}")
            self.event(f"ABORTED: {e}")
        finally:
            self.loop.wall_deadline = 0.0
            self._teardown()
            logging.getLogger().removeHandler(handler)
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            shutil.rmtree(root, ignore_errors=True)
        self.result.virtual_s = self.loop.time() - self.t0
        self.result.wall_s = time.perf_counter() - wall
        self.result.net = self.network.stats
        from harness.sim.invariants import check
        self.result.failures = check(self.result, self.spec)
        return self.result

    def _unhandled(self, loop, context: dict) -> None:
        exception = context.get("exception")
        if isinstance(exception, (asyncio.CancelledError, KeyboardInterrupt)):
            return
        where = CURRENT_NODE.get() or "-"
        if context.get("message", "").startswith("Task was destroyed") and where in self.killed:
            return  # (its clean-up after the kill, collected with the loop: nothing the product left behind)
        self.result.crashes.append(f"{where}: {context.get('message')}: {exception!r}")
        self.event(f"{where:>8} UNHANDLED {context.get('message')}: {exception!r}")

    async def _prepare(self) -> None:
        """The askers' engine, made before the seed's draws (its first load in a process draws
        random bytes of its own)."""
        from swarmctl.asker.head_tail import Asker

        self.asker = Asker(self.template.model, self.spec.head_layers, n_threads=1)
        # The fault-free tokens, here: the clock is set to the swarm's start after this, so a run
        # that computed them and one that found them cached play alike.
        self.result.reference = await self._reference({(a.prompt, a.max_tokens) for a in self.schedule.asks})

    async def _main(self) -> None:
        self._start_host()
        for name in self.spec.trunk_names:
            self._start_trunk(name)
        await self._open_links()
        self.t0 = self.loop.time()
        self.event("the swarm serves: " + ", ".join(f"{s.member}[{s.start},{s.stop})"
                                                     for s in next(iter(self.links.values())).plan.stages))
        watching = asyncio.ensure_future(self.watch.run())
        faults = asyncio.gather(*[asyncio.ensure_future(self._fault(f)) for f in self.schedule.faults])
        asks = [run_as(r.ask.asker, self._ask(r)) for r in self.result.asks]
        await faults
        self.network.heal()
        self.network.down.clear()
        self.network.slow.clear()
        self.watch.faults_over()
        faults_over = self.loop.time()
        self.event(f"faults over (the plan must be complete within {PLAN_BOUND_S:.0f} s)")
        await asyncio.gather(*asks)
        self.event(f"all asks over; waiting {SETTLE_S:.0f} s for the stages to free what they hold")
        await asyncio.sleep(max(SETTLE_S, faults_over + PLAN_BOUND_S - self.loop.time()))
        watching.cancel()
        span = self.result.plan = self.watch.after_faults
        self.event(f"the plan was complete again {span.complete_at - span.since:.2f} s after the faults stopped"
                   if span.complete_at is not None else "the plan was never complete again after the faults stopped")
        self.result.over_budget = self.watch.over_budget
        self.result.trunks_alive = sorted(self.trunks)
        if self.host_service is not None:
            plan = self.host_service.plan
            self.result.planned = sorted({s.member for s in plan.stages} | {e.member for e in plan.experts})
            self.result.held_out = {name: hold.why for name, hold in self.host_service.planning.staging.holds.items()
                                    if hold.until > self.loop.time()}
            self.result.held_out.update({name: trunk.refused for name, trunk in self.host_service.trunks.items()
                                         if trunk.refused})  # (a failed check of the host's: refused a while)
        self.result.leftovers = {name: self._held(service) for name, service in self.trunks.items()
                                 if name not in self.network.down and not service.fatal}

    async def _reference(self, wanted: set[tuple]) -> dict[tuple, list[int]]:
        """Each (prompt, max_tokens)'s tokens from the same engine with the trunk's layers in this process."""
        from kernels.gguf_file import GGUFFile
        from swarmctl.asker.head_tail import InprocTrunk, u_split

        cached = _REFERENCE.setdefault((self.spec, self.compute), {})
        missing = [w for w in sorted(wanted) if w not in cached]
        if missing:
            gguf = GGUFFile(self.template.model)
            trunk = InprocTrunk(gguf, u_split(self.spec.n_layer, self.spec.head_layers, 1).trunk, n_threads=1,
                                max_context=self.asker.max_context)
            try:
                for prompt, max_tokens in missing:
                    cached[(prompt, max_tokens)] = [t async for t in self.asker.generate(
                        list(prompt), trunk, max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)]
            finally:
                trunk.close()
                gguf.close()
        return {w: cached[w] for w in wanted}

    # --- nodes ---

    def _start_host(self) -> None:
        from swarmctl.host.service import HostService

        async def serve(stop: asyncio.Event) -> None:  # (run_host, keeping the service for the watch)
            service = HostService(self.homes["host"])
            await service.start()
            self.host_service = service
            try:
                await stop.wait()
            finally:
                service.close()

        if "host" in self.running:  # (two restarts overlapped: this one restarts the other's)
            self._kill("host")
        self.running.add("host")
        self.network.down.discard("host")
        self.host_started = self.loop.time() - self.t0 if self.t0 else -math.inf
        self._host_hears_again()
        self.stops["host"] = asyncio.Event()
        run_as("host", serve(self.stops["host"]))

    def _start_trunk(self, name: str) -> None:
        from swarmctl.trunk import TrunkService
        from swarmctl.trunk.context import TrunkOptions

        async def serve() -> None:
            service = TrunkService(self.homes[name], TrunkOptions(memory=TRUNK_MEMORY, n_threads=1,
                                                                   idle_timeout=IDLE_TIMEOUT_S), stop)
            self.trunks[name] = service
            await service.run()
            if service.fatal:
                self.event(f"{name:>8} stopped: {service.fatal}")

        if name in self.running:
            self._kill(name)
        self.running.add(name)
        self.network.down.discard(name)
        stop = self.stops[name] = asyncio.Event()
        self.serving[name] = run_as(name, serve())

    async def _open_links(self) -> None:
        from swarmctl.asker.link import SwarmLink

        async def open_link(name: str):
            return await SwarmLink.open(self.homes[name], ready_timeout=READY_BOUND_S, min_stages=self.spec.stages,
                                        request_timeout=ASK_TIMEOUT_S)

        for name in self.spec.askers:
            self.links[name] = self.trunk_of[name] = await run_as(name, open_link(name))
            if self.spec.verify:  # (swarmctl ask --verify P: the asker checks that share of its steps)
                from swarmctl.asker.verify import VerifyingTrunk

                self.trunk_of[name] = VerifyingTrunk(self.links[name], self.asker.gguf, share=self.spec.verify,
                                                     n_threads=1, max_context=self.asker.max_context)

    def _kill(self, node: str) -> None:
        if node in self.loop.stopped:  # (its unread datagrams die with it; its tasks are cancelled below)
            self._continue(node, read=False)
        if node == "host":
            self.host_service = None
        self.killed.add(node)
        self.running.discard(node)
        kill_node(self.loop, self.network, node)
        self.network.down.add(node)
        self.trunks.pop(node, None)

    @staticmethod
    def _held(service) -> dict:
        stats = service.stats()
        return {"requests": stats.requests, "routes": stats.routes, "kv_bytes": stats.kv_bytes,
                "request_locks": stats.request_locks, "budget_requests": service.held.budget.n_requests,
                "budget_kv_bytes": service.held.budget.total_kv_bytes}

    # --- asks and faults ---

    async def _ask(self, result: AskResult) -> None:
        await asyncio.sleep(result.ask.at)
        result.started = self.loop.time() - self.t0
        self.event(f"{result.ask.asker:>8} ask {result.started:.2f}: {result.ask.describe()}")
        try:
            result.tokens = [t async for t in self.asker.generate(
                list(result.ask.prompt), self.trunk_of[result.ask.asker], max_tokens=result.ask.max_tokens,
                sampling=GREEDY, timeout=ASK_TIMEOUT_S, ignore_eos=True)]
        except EngineError as e:
            result.error, result.error_type = str(e), type(e).__name__
        except Exception as e:  # noqa: BLE001 - any other is what the invariants report
            result.error, result.error_type = str(e) or repr(e), type(e).__name__
        result.ended = self.loop.time() - self.t0
        outcome = f"{len(result.tokens)} tokens" if result.tokens is not None else \
            f"error ({result.error_type}): {result.error}"
        self.event(f"{result.ask.asker:>8} ask from {result.started:.2f} ended: {outcome}")

    async def _fault(self, fault: Fault) -> None:
        await asyncio.sleep(fault.at)
        self.event(f"   fault {fault.describe()}")
        net = self.network
        if fault.kind in ("kill", "restart", "host_restart"):
            self._kill(fault.node)
            if fault.kind == "kill":
                return
            await asyncio.sleep(fault.lasts)
            self.event(f"   fault over: {fault.node} starts again from its home")
            self._start_host() if fault.node == "host" else self._start_trunk(fault.node)
        elif fault.kind == "rejoin":
            await self._rejoin(fault)
        elif fault.kind == "join":
            if fault.node not in self.running:
                self._start_trunk(fault.node)
        elif fault.kind == "expert_kill":
            mid_call = await self._next_expert_call()
            node = self._expert_node(fault.node)
            if node is None:
                self.event("   no expert node in the plan now: nothing to kill")
                return
            self.event(f"   kill -9 of the expert node {node}, " + ("mid-call" if mid_call else
                       f"no stage having called an expert node within {MID_CALL_WAIT_S:.0f} s"))
            self._kill(node)
            await asyncio.sleep(fault.lasts)
            self.event(f"   fault over: {node} starts again from its home")
            self._start_trunk(node)
        elif fault.kind in ("lie", "wrong"):  # (the stage's test hook: noise on every result it passes on)
            service = self.trunks.get(fault.node)
            if service is not None:
                service.requests._test_corrupt = 1.0
                await asyncio.sleep(fault.lasts)
                service.requests._test_corrupt = 0.0
        elif fault.kind == "revoke":
            await run_as("host-cli", self._revoke(fault.node))
        elif fault.kind == "stop":
            await self._stop(fault)
        elif fault.kind == "stall":
            await self._stall(fault)
        elif fault.kind == "churn":  # (what its stage reports from its batches: FixedFigures)
            FIGURES.slower[fault.node] = fault.factor
            await asyncio.sleep(fault.lasts)
            self.event(f"   fault over: {fault.describe()}")
            FIGURES.slower.pop(fault.node, None)
        elif fault.kind in ("freeze", "slow", "partition"):
            if fault.kind == "freeze":
                net.down.add(fault.node)
            elif fault.kind == "slow":
                net.slow[fault.node] = fault.extra_delay
            else:
                net.partition(fault.node, fault.other)
            await asyncio.sleep(fault.lasts)
            self.event(f"   fault over: {fault.describe()}")
            if fault.kind == "freeze":
                net.down.discard(fault.node)
                self._host_hears_again()
            elif fault.kind == "slow":
                net.slow.pop(fault.node, None)
            else:
                net.heal(fault.node, fault.other)

    async def _stall(self, fault: Fault) -> None:
        """The trunk's next read of the layers it is given (its model file, or a slice it fetches),
        within STALL_ARMED_S, hangs for ``lasts``, and any other meanwhile: a load for the plan in use
        or a staged one starts and does not end, so the host's deadline for it can pass. (The service
        running now only: a restart ends it.)"""
        service = self.trunks.get(fault.node)
        if service is None:
            return
        fetch, hung, over = service.held.fetch, asyncio.Event(), asyncio.Event()
        real = fetch.stage_file

        async def stalled(*args, **kwargs):
            hung.set()
            await over.wait()
            return await real(*args, **kwargs)

        fetch.stage_file = stalled
        try:
            await asyncio.wait_for(hung.wait(), STALL_ARMED_S)
            self.event(f"   {fault.node}'s load hangs for {fault.lasts:.1f} s")
            await asyncio.sleep(fault.lasts)
            self.event(f"   fault over: {fault.describe()}")
        except asyncio.TimeoutError:
            self.event(f"   {fault.node} loaded nothing within {STALL_ARMED_S:.0f} s: nothing stalled")
        finally:
            fetch.stage_file = real
            over.set()

    async def _stop(self, fault: Fault) -> None:
        """SIGSTOP, then SIGCONT after ``lasts``: none of the node's code runs meanwhile, its timers
        included, and what reaches its sockets waits there; then it reads that and every timer that
        came due fires at once. (Skipped for a node not running, or stopped already.)"""
        node = fault.node
        if node in self.loop.stopped or node not in self.running:
            return
        self.loop.stop_node(node)
        self.network.stop(node)
        await asyncio.sleep(fault.lasts)
        if node not in self.loop.stopped:  # (killed meanwhile)
            return
        self.event(f"   fault over: {fault.describe()}")
        self._continue(node)
        self._host_hears_again()

    def _continue(self, node: str, read: bool = True) -> None:
        """SIGCONT, in the order a real loop sees it: the callbacks that were ready run first, then
        the node reads what waited in its sockets (``read``), then its overdue timers fire (they
        reach the ready queue at the end of the next turn, behind both)."""
        self.loop.continue_node(node)
        self.network.go_on(node, read=read)

    async def _rejoin(self, fault: Fault) -> None:
        """What a user's Ctrl-C does to 'swarmctl run trunk' (its stop event, swarmctl/commands/run.py),
        then, after the pause, the same command from the same home."""
        name = fault.node
        if name not in self.running:
            return
        serving = self.serving[name]
        self.stops[name].set()
        # A SIGSTOPped process takes its Ctrl-C when it is continued, so the bound counts from then
        # (seed 40347: 'stop trunk-1 for 17.4 s', then 'rejoin trunk-1' 0.08 s later). (A kill
        # continues it first.)
        while name in self.loop.stopped:
            await asyncio.sleep(STOPPED_POLL_S)
        try:  # (the service closes its connections, tells the host, frees its engine)
            await asyncio.wait_for(asyncio.shield(serving), STOP_BOUND_S)
        except asyncio.CancelledError:
            if not serving.cancelled():
                raise
            # Killed while stopping, by another fault (seed 50059 with 6 faults: a 'restart' of the
            # same trunk), whose turn it now is: this Ctrl-C's process is gone.
            self.event(f"   {name} was killed while it stopped: no rejoin")
            return
        except asyncio.TimeoutError:
            self.result.left_running.append(f"{name} was still stopping {STOP_BOUND_S:.0f} s after it was told to")
            self._kill(name)
        except Exception as e:  # noqa: BLE001 - its own crash is reported by the loop's handler; say so here too
            self.result.crashes.append(f"{name}: stopping raised {e!r}")
        self.running.discard(name)
        self.trunks.pop(name, None)
        await self._process_exits(name)
        await asyncio.sleep(fault.lasts)
        self.event(f"   fault over: {name} starts again from its home")
        if name not in self.running:  # (another fault may have started it meanwhile)
            self._start_trunk(name)

    async def _process_exits(self, name: str) -> None:
        """What follows ``run()`` returning in 'swarmctl run trunk': asyncio.run cancels the tasks
        still pending and waits for them, and the process's sockets close as it exits. (Tasks a
        trunk's shutdown leaves pending, such as a request's handler still sending, are the
        process's to end, not the service's: the log names them.)"""
        current = asyncio.current_task()
        left = [t for t in self.loop.node_tasks.get(name, {}).values() if not t.done() and t is not current]
        if left:
            self.event(f"{name:>8} exits with {len(left)} tasks pending, cancelled as asyncio.run does: "
                       + ", ".join(sorted({t.get_coro().__qualname__ for t in left})))
            for task in left:
                task.cancel()
            await asyncio.wait(left, timeout=1.0)
        kill_node(self.loop, self.network, name)

    async def _next_expert_call(self) -> bool:
        """Until a stage's compute thread next waits on an expert call (within MID_CALL_WAIT_S):
        whether one did. (Told on that thread as it hands the loop the call; set here on the
        loop, after the call's coroutine, which has sent its first datagrams by then.)"""
        called = self.loop.create_future()
        threads = self.loop.threads

        def waits() -> None:
            self.loop.call_soon_threadsafe(lambda: called.done() or called.set_result(True))

        threads.on_wait.append(waits)
        try:
            return await asyncio.wait_for(called, MID_CALL_WAIT_S)
        except asyncio.TimeoutError:
            return False
        finally:
            threads.on_wait.remove(waits)

    def _expert_node(self, wanted: str) -> str | None:
        """``wanted`` if the host's plan has it as an expert node, the plan's first one otherwise."""
        host = self.host_service
        experts = [e.member for e in host.plan.experts] if host is not None else []
        experts = [e for e in experts if e in self.running]
        return wanted if wanted in experts else (experts[0] if experts else None)

    def _host_hears(self) -> bool:
        return "host" in self.running and "host" not in self.network.down and "host" not in self.loop.stopped

    def _host_hears_again(self) -> None:
        """A revocation made while the host was down, frozen or stopped counts from when it runs and hears
        again: until then neither it nor anyone it tells can act on it."""
        if self.revoke_pending and self._host_hears():
            self.result.revoked_at, self.revoke_pending = self._revocation_counts_from(), False

    def _revocation_counts_from(self) -> float:
        """Now, or, after a host restart, once the members can have noticed it: they keep their
        connections to the old process until QUIC's idle timeout (net/liveness.py IDLE_TIMEOUT),
        and hear nothing from the new one, the revocation included, before they register again."""
        return max(self.loop.time() - self.t0, self.host_started + IDLE_TIMEOUT)

    async def _revoke(self, name: str) -> None:
        """What 'swarmctl revoke NAME' does on the host's machine: the record, then the running host."""
        from swarmctl.reaching.host_addresses import connect_host
        from swarmctl.node.membership import revoke

        home = self.homes["host"]
        revoke(home, name)
        if self._host_hears():
            self.result.revoked_at = self._revocation_counts_from()
        else:  # (down or frozen: nobody can learn of it before the host can tell them; counted from then)
            self.revoke_pending = True
        try:
            conn = await connect_host(home.load_config(), home.credentials(), RequestOnlyHandler())
        except ConnectionError as e:  # (it refuses the member as it starts again: counted from then)
            self.event(f"host-cli revoke: the host did not answer ({e})")
            self.result.revoked_at, self.revoke_pending = None, True
            self._host_hears_again()
            return
        try:
            await conn.request(m.encode(m.Revoked()), timeout=5)
        except (ConnectionError, asyncio.TimeoutError) as e:
            self.event(f"host-cli revoke: {e}")
        finally:
            await close(conn)

    def _teardown(self) -> None:
        for node in list(self.loop.node_tasks):
            kill_node(self.loop, self.network, node)
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.limit_wall(10.0)
        try:
            self.loop.run_until_complete(asyncio.sleep(1.0))
        except WallLimit:
            pass  # (reported already: the run itself did not finish)
        for trunk in self.trunk_of.values():
            if trunk not in self.links.values():
                trunk.close()
        if self.asker is not None:
            self.asker.close()
        self.loop.close()
        self.compute_threads.close()


_REFERENCE: dict[tuple[WorldSpec, str], dict[tuple, list[int]]] = {}  # fault-free tokens, per process and compute


def play(schedule: Schedule, spec: WorldSpec = WorldSpec(), *, verbose: bool = False,
         compute: str = "tiny") -> RunResult:
    return SimRun(schedule, spec, verbose=verbose, compute=compute).play()
