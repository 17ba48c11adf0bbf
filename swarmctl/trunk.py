"""The trunk role: serve a slice of layers for the swarm.

A trunk registers with the host, receives the plan, checks its own copy of the model against the
host's per-layer hashes, loads its layer range and serves it. Each request arrives on its own
stream from the previous hop (the asker, or the previous stage); its output goes straight to the
next stage, or, from the last stage, to the asker's results stream. Errors travel back along the
request's streams as ERROR packets. KV caches live per request id until END or an idle timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kernels.errors import EngineError, RequestStateError
from kernels.experts import ExpertEngine, rows_for
from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine, Step
from kernels.spec import SliceSpec
from kernels.speed import SpeedTracker, measure_speed, worth_reporting
from net.endpoint import Address, close, connect_member, serve_member
from net.identity import REVOKED_REASON, is_revocation, verify_member
from net.protocol import StreamClosedError, SwarmProtocol
from net.wire import (ActivationPacket, DType, ExpertCall, ExpertCallKind, Frame, FrameType, Hop, PacketKind,
                      WireError, decode_control, decode_expert_call, decode_packet, encode_control,
                      encode_expert_call, encode_packet)
from plans.plan import Plan, PlanError, StageAssignment
from plans.planner import Constraints
from swarmctl.batching import BatchRunner, EngineClosedError, compute_thread
from swarmctl.budget import Limits, MemberBudget
from swarmctl.home import SwarmHome
from swarmctl.models import resolve_model
from swarmctl.log_limit import LogLimit
from swarmctl.layer_proof import CHALLENGES, ProofError, Prover
from swarmctl.request_locks import RequestLocks

log = logging.getLogger("swarmctl.trunk")

SEND_BACKLOG = 8 * 1024 * 1024  # bytes unacknowledged per stream before a sender waits
PING_INTERVAL = 1.0  # the host marks a trunk down after a few silent seconds
RECONNECT_INTERVAL = 2.0


def results_key(member: str, session: str) -> str:
    """Where a request's results go: one asker *process* (``session``, a random token it sends
    with its subscription and as its packets' reply_to) of one authenticated member. Several
    processes of one member (two terminals, ``serve`` next to ``ask``) each get their own; the
    member part always comes from the certificate of the connection, never from the packet."""
    return f"{member}/{session}"


def valid_session(session: object) -> bool:
    return isinstance(session, str) and 0 < len(session) <= 64 and all(c in "0123456789abcdef" for c in session)


class RemoteExpertError(EngineError):
    """An expert node failed a call; the request can be replayed once the plan moves on."""


@dataclass
class Route:
    """One request as this stage sees it: where packets come from, and the stream onward."""

    in_conn: SwarmProtocol
    in_stream: int
    reply_to: str
    out_conn: SwarmProtocol | None = None  # the next stage's connection when out_stream was opened
    out_stream: int | None = None
    last_active: float = field(default_factory=time.monotonic)


async def _quiet_ping(conn: SwarmProtocol) -> None:
    try:
        await asyncio.wait_for(conn.ping(), 5)
    except (ConnectionError, asyncio.TimeoutError):
        pass


async def _round_trip_ms(conn: SwarmProtocol, pings: int = 3) -> float:
    """Median of a few QUIC pings on a live connection."""
    times = []
    for _ in range(pings):
        t0 = time.perf_counter()
        await asyncio.wait_for(conn.ping(), 5)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def _corrupted(out: np.ndarray, scale: float) -> np.ndarray:
    """Test-only (SWARMCTL_TEST_CORRUPT): the rows plus Gaussian noise of ``scale`` times their RMS."""
    rms = np.sqrt(np.mean(np.square(out, dtype=np.float64), axis=1, keepdims=True))
    return (out + np.random.default_rng().standard_normal(out.shape) * scale * rms).astype(np.float32)


class TrunkService:
    def __init__(self, home: SwarmHome, *, memory: int | None = None, n_threads: int | None = None,
                 idle_timeout: float = 300.0, capture_dir: Path | None = None, advertise: str | None = None) -> None:
        self.home = home
        self.config = home.load_config()
        self.creds = home.credentials()
        self.name = self.creds.name
        self.model_path = resolve_model(self.config.model)
        self.slices_dir = home.path / "slices"  # layers fetched from the swarm when the model file is missing
        self.ms_per_layer_token: float | None = None  # the figure the host has
        self.speed = SpeedTracker()  # refreshes it: from served batches, or measured again if contended
        self.rtt_ms: float | None = None
        self.fetched_bytes = 0
        self._fetch_frames: dict[int, asyncio.Queue] = {}  # host stream → frames of a slice transfer
        self._loop: asyncio.AbstractEventLoop | None = None
        self.memory = memory or available_memory()
        self.n_threads = n_threads
        self.idle_timeout = idle_timeout
        self.capture_dir = capture_dir
        self.advertise = Address.parse(advertise) if advertise else None
        self.peak_kv_bytes = 0
        self.plan: Plan | None = None
        self.stage: StageAssignment | None = None
        self.engine: SliceEngine | None = None
        self.runner: BatchRunner | None = None  # batches the engine's steps (continuous batching)
        self.experts: ExpertEngine | None = None  # when the plan makes this trunk an expert node
        self.expert_conns: dict[str, SwarmProtocol] = {}  # a stage's links to the expert nodes
        self.expert_rows_served = 0
        self.expert_call_bytes = 0  # expert calls sent and answered (a stage) or served (an expert node)
        self.activation_bytes_sent = 0
        self.gguf: GGUFFile | None = None
        self.routes: dict[bytes, Route] = {}
        self.connections: set[SwarmProtocol] = set()  # every open connection, ours and our peers'
        self._request_streams: dict[SwarmProtocol, set[int]] = {}  # streams that carried request packets
        self.subscribers: dict[str, tuple[SwarmProtocol, int]] = {}  # results_key → an asker's results stream
        self.host_conn: SwarmProtocol | None = None
        self.plan_stream: int | None = None
        self.next_conn: SwarmProtocol | None = None
        self.next_member: str | None = None
        self.address: Address | None = None
        self.fatal: str | None = None  # set when this trunk cannot serve; run() reports it
        self.on_fatal: Callable[[], None] = lambda: None
        self._locks = RequestLocks()  # one request's packets run in order
        self.budget = MemberBudget(Limits(0, 0, 0, "no layers loaded"))  # requests and KV per member
        self._refusals = LogLimit(log)
        self._failed_streams: set[tuple[int, int, bytes]] = set()  # a request refused (retry) on a stream
        self._tasks: set[asyncio.Task] = set()
        self._executor = compute_thread()  # loading and unloading happen on the compute thread too
        self._prover = Prover(self._proof_sources, n_threads)  # answers the host's layer checks
        self._loading: asyncio.Task | None = None
        self._ready_sent: tuple[int, int, int] | None = None  # (plan version, start, stop) last confirmed
        self._capture_seq = 0
        # Test-only fault injection, like SWARMCTL_TEST_FETCH_CRASH_AFTER: a dishonest trunk that adds
        # Gaussian noise of this size (relative to each output row's RMS) to what it sends on, for the
        # spot-check tests and benchmark (swarmctl/verify.py). Unset or 0 in any real run.
        self._test_corrupt = float(os.environ.get("SWARMCTL_TEST_CORRUPT") or 0)
        self._server = None

    # --- lifecycle ---

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        if self.model_path.exists():
            loop = asyncio.get_running_loop()
            self.ms_per_layer_token = await loop.run_in_executor(self._executor, self._measure_speed)
            log.info("this machine runs one layer of %s in %.2f ms per token", self.model_path.name,
                     self.ms_per_layer_token)
        else:
            log.info("no model file at %s: layers will be fetched from the swarm", self.model_path)
        listen = Address.parse(self.config.listen)
        self._server = await serve_member(listen, self.creds, self, client_check=self._check_member)
        self.address = Address(listen.host, self._server._transport.get_extra_info("sockname")[1])
        log.info("trunk %s listening on %s", self.name, self.address)
        tasks = [asyncio.ensure_future(self._keep_host_link(stop)), asyncio.ensure_future(self._reap_idle())]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        for conn in (self.host_conn, self.next_conn):
            if conn is not None:
                await close(conn, "trunk shutting down")
        if self._server is not None:
            self._server.close()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._unload)

    def _measure_speed(self, model: Path | None = None, layer: int | None = None) -> float:
        """On the compute thread: repeats, after a warm-up, with the repeats that other processes
        starved left out (kernels/speed.py)."""
        with GGUFFile(model or self.model_path) as gguf:
            measurement = measure_speed(gguf, n_threads=self.n_threads, layer=layer)
        self.speed.measured(measurement)
        log.info("measured %s", measurement.describe())
        return measurement.ms_per_layer_token

    def _refresh_speed(self) -> None:
        """Keep the host's figure current (it re-plans only on a material change: plans/hysteresis.py):
        a stage from the single-token batches it serves; a trunk that serves nothing and whose
        measurement had to share the CPU, by measuring again while it is idle."""
        runner, stage = self.runner, self.stage
        if runner is not None and stage is not None and not (self.plan and self.plan.experts):
            self.speed.observe(runner.stats.recent, stage.stop - stage.start)
            self._report_speed(self.speed.serving_report(self.ms_per_layer_token), "while serving")
        elif stage is None and self.experts is None and self.model_path.exists() and self.speed.take_remeasure():
            self._spawn(self._remeasure_speed())

    async def _remeasure_speed(self) -> None:
        figure = await asyncio.get_running_loop().run_in_executor(self._executor, self._measure_speed)
        if not self.speed.contended or self.ms_per_layer_token is None or figure < self.ms_per_layer_token:
            self._report_speed(figure, "measured again")  # (a contended figure only bounds the speed from above)

    def _report_speed(self, figure: float | None, how: str) -> None:
        if worth_reporting(figure, self.ms_per_layer_token):
            log.info("%s: %.3f ms per layer (the host had %s)", how, figure,
                     f"{self.ms_per_layer_token:.3f}" if self.ms_per_layer_token else "none")
            self.ms_per_layer_token = figure
            self._spawn(self._tell_host({"type": "speed", "ms_per_layer_token": figure}))

    def _check_member(self, cert) -> None:
        revoked = frozenset(self.plan.revoked_serials) if self.plan else frozenset()
        verify_member(cert, self.creds.ca_cert, revoked)

    # --- the host link ---

    async def _keep_host_link(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.host_conn is None or not self.host_conn.is_open:
                if self.host_conn is not None and is_revocation(self.host_conn.close_reason):
                    self._revoked()
                    return
                try:
                    await self._register()
                except (ConnectionError, asyncio.TimeoutError, OSError) as e:
                    reason = str(e) or (self.host_conn.close_reason if self.host_conn else "") or type(e).__name__
                    if is_revocation(reason):
                        self._revoked()
                        return
                    log.warning("cannot reach the host: %s (retrying)", reason)
                    await asyncio.sleep(RECONNECT_INTERVAL)
                    continue
            try:
                await asyncio.wait_for(self.host_conn.ping(), PING_INTERVAL)
            except (ConnectionError, asyncio.TimeoutError):
                continue
            # Links this trunk opened to its peers stay warm too: an idle QUIC connection closes after
            # IDLE_TIMEOUT, and the next request would meet it closing and have to reroute.
            for conn in (self.next_conn, *self.expert_conns.values()):
                if conn is not None and conn.is_open:
                    self._spawn(_quiet_ping(conn))
            self._refresh_speed()
            await asyncio.sleep(PING_INTERVAL)

    def _revoked(self) -> None:
        """The host revoked this member: retrying cannot help, so the trunk stops and says why."""
        self.fatal = "the host revoked this member's certificate; ask the host for a new invite to rejoin"
        log.error("%s", self.fatal)
        self.on_fatal()

    async def _register(self) -> None:
        self._ready_sent = None  # a (re)connected host needs to hear it again
        errors = []
        for text in self.config.host_addresses:
            try:
                conn = await connect_member(Address.parse(text), self.creds, self.config.host_name, self)
                break
            except (ConnectionError, OSError) as e:
                errors.append(str(e))
        else:
            raise ConnectionError("; ".join(errors) or "no host address")
        self.host_conn = conn
        self.rtt_ms = await _round_trip_ms(conn)
        self.plan_stream = conn.open_stream()
        reply = await conn.request(encode_control({
            "type": "register", "listen": str(self.advertise or self.address), "memory": self.memory,
            "ms_per_layer_token": self.ms_per_layer_token, "device": "cpu", "rtt_ms": self.rtt_ms,
        }), stream_id=self.plan_stream)
        message = decode_control(reply.body)
        if message.get("type") == "error":  # e.g. an asker's certificate: retrying cannot help
            self.fatal = f"the host refused this trunk: {message.get('message')}"
            log.error("%s", self.fatal)
            self.on_fatal()
            return
        self._host_message(message)

    def _host_message(self, message: dict) -> None:
        if message.get("type") == "plan":
            self._apply_plan(Plan.from_dict(message["plan"]))
        elif message.get("type") == "error":
            log.error("host: %s", message.get("message"))

    def _apply_plan(self, plan: Plan) -> None:
        try:
            plan.check_experts()  # a placement that leaves experts unplaced is refused before anything runs
        except PlanError as e:
            log.error("refusing plan v%d: %s", plan.version, e)
            return
        self.plan = plan
        revoked = set(plan.revoked_serials)
        for conn in list(self.connections):  # every one: a member may hold several (a trunk and asks)
            if conn.peer_cert is not None and conn.peer_cert.serial_number in revoked:
                conn.close_with(REVOKED_REASON)
        if self.engine is not None:
            self.budget.limits = self._budget_limits()  # the planned context and concurrency may have moved
        stage = plan.stage_for(self.name)
        expert = plan.expert_for(self.name)
        if self._loading is not None and not self._loading.done() and self._loading is not asyncio.current_task():
            return  # the load in progress re-reads the plan when it finishes (and calls this again)
        if expert is not None:
            self._loading = asyncio.ensure_future(self._load_experts(expert))
            return
        if stage is None:
            if self.stage is not None:
                log.info("plan v%d gives this trunk no layers", plan.version)
            self.stage = None
            return
        self._loading = asyncio.ensure_future(self._load(stage))

    async def _load_experts(self, expert) -> None:
        """Expert parallelism: hold experts [start, stop) of every MoE trunk layer, serve calls."""
        loop = asyncio.get_running_loop()
        start, stop = self.plan.trunk_range
        held = self.experts is not None and (self.experts.first, self.experts.last, self.experts.layers) == \
            (expert.start, expert.stop, range(start, stop))
        if not held:
            self._drop_all_routes("the plan changed")
            if self.runner is not None:
                await self.runner.aclose("this trunk now serves experts")
            await loop.run_in_executor(self._executor, self._unload)
            self.stage = None
            try:
                model = self.model_path
                if not model.exists():
                    raise EngineError("an expert node needs the model file (expert slices are not fetched yet)")
                await loop.run_in_executor(self._executor, self._load_expert_engine, model, range(start, stop),
                                           expert.start, expert.stop)
            except EngineError as e:
                log.error("%s", e)
                await self._tell_host({"type": "refuse", "reason": str(e)})
                return
        latest = self.plan.expert_for(self.name)
        if latest is None or (latest.start, latest.stop) != (expert.start, expert.stop):
            self._apply_plan(self.plan)
            return
        if self._ready_sent != (self.plan.version, -expert.start - 1, expert.stop):
            self._ready_sent = (self.plan.version, -expert.start - 1, expert.stop)
            await self._tell_host({"type": "ready", "plan_version": self.plan.version})
            log.info("serving experts [%d, %d) of layers [%d, %d) under plan v%d", expert.start, expert.stop,
                     start, stop, self.plan.version)

    def _load_expert_engine(self, model: Path, layers: range, first: int, last: int) -> None:
        gguf = GGUFFile(model)
        try:
            mismatched = [i for i in layers if gguf.layer_hash(i) != self.plan.layer_hashes[i]]
            if mismatched:
                raise EngineError(f"this trunk's copy of the model ({model.name}) differs from the host's in layers "
                                  f"{mismatched[0]}..{mismatched[-1]}; refusing to serve them")
            self.experts = ExpertEngine(gguf, layers, first, last, n_threads=self.n_threads)
            self.gguf = gguf
        except BaseException:
            gguf.close()
            raise

    def _remote_experts(self, layer: int, x: np.ndarray, selected: np.ndarray) -> np.ndarray:
        """On the compute thread, for a stage whose experts live elsewhere: send each expert node
        the rows routed to its experts (concurrently, over the event loop) and gather the outputs."""
        future = asyncio.run_coroutine_threadsafe(self._call_experts(layer, x, selected), self._loop)
        try:
            return future.result(timeout=60)
        except (ConnectionError, OSError, asyncio.TimeoutError, TimeoutError) as e:
            raise RemoteExpertError(f"an expert node did not answer: {e}") from None

    async def _call_experts(self, layer: int, x: np.ndarray, selected: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], selected.shape[1], x.shape[1]), dtype=np.float32)

        async def ask(assignment) -> None:
            rows, slots = rows_for(selected, assignment.start, assignment.stop)
            if rows.size == 0:
                return
            conn = self.expert_conns.get(assignment.member)
            if conn is None or not conn.is_open:
                conn = await connect_member(Address.parse(assignment.address), self.creds, assignment.member, self)
                self.expert_conns[assignment.member] = conn
            request = encode_expert_call(ExpertCall(ExpertCallKind.REQUEST, layer, x[rows], selected[rows, slots]))
            reply_frame = await conn.request(request, timeout=30)
            reply = decode_expert_call(reply_frame.body)
            if reply.kind != ExpertCallKind.REPLY or reply.data.shape != (rows.size, x.shape[1]):
                raise RemoteExpertError(f"expert node {assignment.member}: {reply.message or 'a malformed reply'}")
            out[rows, slots] = reply.data
            self.expert_call_bytes += len(request) + len(reply_frame.body)

        await asyncio.gather(*(ask(a) for a in self.plan.experts))
        return out

    async def _serve_expert_call(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        try:
            call = decode_expert_call(frame.body)
            if conn.peer_role != "trunk":
                raise EngineError(f"expert calls come from stages; {conn.peer_name} joined as {conn.peer_role}")
            if call.kind != ExpertCallKind.REQUEST or self.experts is None:
                raise EngineError("this trunk is not serving experts" if self.experts is None else "not a request")
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, self.experts.forward, call.layer, call.data,
                                                call.expert_ids)
            reply = encode_expert_call(ExpertCall(ExpertCallKind.REPLY, call.layer, result))
            self.expert_rows_served += result.shape[0]
            self.expert_call_bytes += len(frame.body) + len(reply)
        except (EngineError, WireError) as e:
            log.warning("expert call from %s refused: %s", conn.peer_name, e)
            reply = encode_expert_call(ExpertCall(ExpertCallKind.ERROR, 0, np.empty((0, 0), np.float32), None, str(e)))
        if conn.is_open:
            conn.send(stream_id, reply, end=True)

    async def _load(self, stage: StageAssignment) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        mode = bool(self.plan.experts)  # experts elsewhere?
        same = self.engine is not None and (self.engine.slice.start, self.engine.slice.stop) == \
            (stage.start, stage.stop) and (self.engine.remote_experts is not None) == mode
        if not same:
            self._drop_all_routes("the plan changed")
            if self.runner is not None:
                await self.runner.aclose("this stage is loading other layers")
            try:
                model = await self._model_for(stage)
                await loop.run_in_executor(self._executor, self._load_engine, stage, model)
                if self.ms_per_layer_token is None:  # measure now that the layers are here; next plan uses it
                    self.ms_per_layer_token = await loop.run_in_executor(self._executor, self._measure_slice, model,
                                                                         stage)
                    await self._tell_host({"type": "speed", "ms_per_layer_token": self.ms_per_layer_token})
            except (EngineError, asyncio.TimeoutError, ConnectionError) as e:
                self.fatal = str(e)
                log.error("%s", e)
                await self._tell_host({"type": "refuse", "reason": str(e)})
                self.on_fatal()
                return
        self.stage = stage
        latest = self.plan.stage_for(self.name) if self.plan else None
        if latest is None or (latest.start, latest.stop) != (stage.start, stage.stop):
            self._apply_plan(self.plan)  # the plan moved on while we loaded (maybe to experts, or to nothing)
            return
        if self._ready_sent != (self.plan.version, stage.start, stage.stop):
            self._ready_sent = (self.plan.version, stage.start, stage.stop)
            await self._tell_host({"type": "ready", "plan_version": self.plan.version})
            log.info("serving layers [%d, %d) under plan v%d", stage.start, stage.stop, self.plan.version)
            self._spawn(self._measure_peers(self.plan))

    async def _model_for(self, stage: StageAssignment) -> Path:
        """Our model file, or a slice file with the stage's layers, fetched from the host if need be."""
        if self.model_path.exists():
            return self.model_path
        from swarmctl.distribution import fetch_slice

        if self.host_conn is None or not self.host_conn.is_open:
            raise EngineError("no model file and no host to fetch layers from")
        stream_id = self.host_conn.open_stream()
        frames: asyncio.Queue = asyncio.Queue()
        self._fetch_frames[stream_id] = frames
        crash_after = os.environ.get("SWARMCTL_TEST_FETCH_CRASH_AFTER")  # fault injection for the resume test
        try:
            path, received = await fetch_slice(
                self.host_conn, frames, stream_id, self.slices_dir, model_hash=self.plan.model_hash,
                start=stage.start, stop=stage.stop, layer_hashes=self.plan.layer_hashes,
                on_progress=lambda have, total: log.info("fetching layers [%d, %d): %.1f / %.1f MB (%.0f%%)",
                                                         stage.start, stage.stop, have / 1e6, total / 1e6,
                                                         100 * have / total),
                stop_after_bytes=int(crash_after) if crash_after else None)
        finally:
            self._fetch_frames.pop(stream_id, None)
        self.fetched_bytes += received
        log.info("layers [%d, %d) ready in %s (%.1f MB received)", stage.start, stage.stop, path.name, received / 1e6)
        return path

    def _load_engine(self, stage: StageAssignment, model: Path) -> None:
        """In the engine thread: check the model file against the host's hashes, then load."""
        self._unload()
        gguf = GGUFFile(model)
        try:
            mismatched = [i for i in range(stage.start, stage.stop)
                          if gguf.layer_hash(i) != self.plan.layer_hashes[i]]
            if mismatched:
                raise EngineError(f"this trunk's copy of the model ({model.name}) differs from the "
                                  f"host's ({self.plan.model_name}) in layers {mismatched[0]}..{mismatched[-1]}; "
                                  "refusing to serve them")
            self.engine = SliceEngine(gguf, SliceSpec(stage.start, stage.stop), n_threads=self.n_threads,
                                      remote_experts=self._remote_experts if self.plan.experts else None)
            self.budget = MemberBudget(self._budget_limits())  # a new engine holds no request yet
            self.runner = BatchRunner(self.engine)
            self.gguf = gguf
        except BaseException:
            gguf.close()
            raise

    async def _measure_peers(self, plan: Plan) -> None:
        """Round trips to the plan's other stages, reported to the host for its next plan."""
        links = {}
        for stage in plan.stages:
            if stage.member == self.name:
                continue
            try:
                conn = await connect_member(Address.parse(stage.address), self.creds, stage.member, self)
            except (ConnectionError, OSError):
                continue
            try:
                links[stage.member] = {"rtt_ms": await _round_trip_ms(conn)}
            except (ConnectionError, asyncio.TimeoutError):
                pass
            finally:
                await close(conn)
        if links:
            await self._tell_host({"type": "links", "links": links})

    def _measure_slice(self, model: Path, stage: StageAssignment) -> float:
        return self._measure_speed(model, stage.start)

    def _unload(self) -> None:
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.budget = MemberBudget(Limits(0, 0, 0, "no layers loaded"))  # its requests went with it
        if self.gguf is not None:
            self.gguf.close()
            self.gguf = None

    async def _tell_host(self, message: dict) -> None:
        if self.host_conn is not None and self.host_conn.is_open:
            try:
                await self.host_conn.request(encode_control(message), timeout=10)
            except (ConnectionError, asyncio.TimeoutError) as e:
                log.warning("host did not answer %s: %s", message["type"], e)

    # --- ConnectionHandler ---

    def connection_made(self, conn: SwarmProtocol) -> None:
        log.debug("connection from %s", conn.peer_name)
        self.connections.add(conn)

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self.connections.discard(conn)
        self._request_streams.pop(conn, None)
        for rid, route in list(self.routes.items()):
            if route.in_conn is conn:
                self._spawn(self._release(rid, route=route))
            elif route.out_conn is conn and route.out_stream is not None:
                self._send_error(route.in_conn, route.in_stream, rid, f"next stage {conn.peer_name} went away",
                                 retry=True)
                route.out_stream = None
                self._spawn(self._release(rid, route=route))
        if conn is self.next_conn:
            self.next_conn = self.next_member = None
        for name, (sub_conn, _) in list(self.subscribers.items()):
            if sub_conn is conn:
                del self.subscribers[name]

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        self._spawn(self._stream_closed(conn, stream_id))

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if conn is self.host_conn and stream_id in self._fetch_frames:
            self._fetch_frames[stream_id].put_nowait(frame)
            return
        self._capture("recv", frame)
        if frame.type == FrameType.CONTROL:
            self._control(conn, stream_id, frame)
            return
        if frame.type == FrameType.DATA:  # an expert call (expert parallelism)
            self._spawn(self._serve_expert_call(conn, stream_id, frame))
            return
        try:
            packet = decode_packet(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        if packet.kind == PacketKind.ERROR:  # coming back from a next stage (nobody else sends errors here)
            self._from_next_stage(conn, stream_id, packet)
            return
        self._request_streams.setdefault(conn, set()).add(stream_id)
        self._spawn(self._handle_safely(conn, stream_id, packet, time.perf_counter()))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("unexpected error while handling a packet: %r", task.exception())

    def _control(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        try:
            message = decode_control(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        if conn is self.host_conn and stream_id == self.plan_stream:
            self._host_message(message)
        elif message["type"] in CHALLENGES:  # the host checks we hold our layers, and times us
            self._spawn(self._answer_challenge(conn, stream_id, message))
        elif message["type"] == "subscribe":
            session = message.get("session")
            if not valid_session(session):
                conn.send(stream_id, encode_control({"type": "error", "message": "subscribe needs a session "
                                                     "(1 to 64 lowercase hex digits)"}), end=True)
                return
            key = results_key(conn.peer_name, session)
            old = self.subscribers.get(key)
            if old is not None and old != (conn, stream_id) and old[0].is_open:
                old[0].finish(old[1])  # the asker re-subscribed (a new plan): the old stream ends, or it leaks
            self.subscribers[key] = (conn, stream_id)
            conn.send(stream_id, encode_control({"type": "ok"}))
        elif message["type"] == "probe":  # a peer measuring our link
            conn.send(stream_id, encode_control({"type": "ok"}), end=True)
        elif message["type"] == "stats":
            conn.send(stream_id, encode_control({"type": "stats", **self.stats()}), end=True)
        else:
            conn.send(stream_id, encode_control({"type": "error", "message": "unknown request"}), end=True)

    async def _answer_challenge(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """Only our host may ask (anyone else could use us to time or read the model); the answer
        is computed on the compute thread, between batches (swarmctl/layer_proof.py)."""
        if conn is not self.host_conn:
            reply = {"type": "error", "message": f"only the host sends {message['type']!r}"}
        else:
            try:
                reply = await asyncio.get_running_loop().run_in_executor(self._executor, self._prover.answer, message)
            except ProofError as e:
                reply = {"type": "error", "message": str(e), "missing": e.missing}
            except Exception as e:  # noqa: BLE001 - the edge: answer the host, carry on serving
                log.exception("answering the host's %s failed", message["type"])
                reply = {"type": "error", "message": f"{type(e).__name__}: {e}"[:300]}
        if conn.is_open:
            try:
                conn.send(stream_id, encode_control(reply), end=True)
            except StreamClosedError:
                pass

    def _proof_sources(self) -> list[Path]:
        """Files that may hold the layers the host asks about: the one loaded, then the model file."""
        loaded = self.gguf.path if self.gguf is not None else None
        return [p for p in (loaded, self.model_path) if p is not None and p.exists()]

    def _from_next_stage(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket) -> None:
        route = self.routes.get(packet.request_id)
        # Only errors about the request's current route go back; one from a route it abandoned
        # (the request started over on a new stream) answers a packet nobody waits for.
        if route is not None and route.out_conn is conn and route.out_stream == stream_id:
            self._send(route.in_conn, route.in_stream, packet)
            route.out_stream = None
        conn.finish(stream_id)  # this stream is given up: we end our side, and the next stage then ends its own

    def stats(self, window_s: float = 10.0) -> dict:
        """A snapshot for status views, `swarmctl top` and tests (read on the event loop).
        ``recent_batches``: [started (unix time), seconds, tokens, [request id prefixes]] of the
        batches in the last ``window_s`` seconds; ``requests``: what this stage holds now."""
        runner, engine = self.runner, self.engine
        since = time.time() - window_s
        recent = [[b.started, b.seconds, b.tokens, [rid.hex()[:8] for rid in b.request_ids]]
                  for b in (runner.stats.recent if runner else ()) if b.started >= since]
        requests = [{"id": rid.hex()[:8], "position": engine.position_of(rid) if engine else 0,
                     "idle_s": time.monotonic() - route.last_active} for rid, route in self.routes.items()]
        return {
            "recent_batches": recent, "requests_detail": requests, "time": time.time(),
            "name": self.name, "layers": [self.stage.start, self.stage.stop] if self.stage else None,
            "requests": engine.n_requests if engine else 0, "routes": len(self.routes),
            "kv_bytes": engine.kv_bytes if engine else 0, "queue_depth": runner.queue_depth if runner else 0,
            "batches": runner.stats.batches if runner else 0, "steps": runner.stats.steps if runner else 0,
            "tokens": runner.stats.tokens if runner else 0, "busy_s": runner.stats.busy_s if runner else 0.0,
            "largest_batch": runner.stats.largest_batch if runner else 0,
            "tensor_bytes": engine.weights.n_bytes if engine else (self.experts.n_bytes if self.experts else 0),
            "peak_kv_bytes": self.peak_kv_bytes,
            "budget": self.budget.stats(),  # requests and KV held per member, the limits, refusals
            "open_streams": sum(c.open_streams for c in self.connections if c.is_open),
            "request_locks": len(self._locks),
            "rss": _proc_status("VmRSS"), "peak_rss": _proc_status("VmHWM"), "fetched_bytes": self.fetched_bytes,
            "role": "experts" if self.experts else ("stage" if self.stage else "idle"),
            "expert_range": [self.experts.first, self.experts.last] if self.experts else None,
            "expert_rows_served": self.expert_rows_served, "expert_call_bytes": self.expert_call_bytes,
            "activation_bytes_sent": self.activation_bytes_sent,
            "ms_per_layer_token": self.ms_per_layer_token,
        }

    # --- the data path ---

    async def _handle_safely(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket,
                             arrived: float) -> None:
        """A bug met while handling a packet answers the sender (who replays the request, within its
        deadline) instead of leaving it waiting for a packet that never comes."""
        try:
            await self._handle(conn, stream_id, packet, arrived)
        except Exception as e:  # noqa: BLE001 - logged in full; the node and its other requests carry on
            log.exception("request %s: unexpected error", packet.request_id.hex()[:8])
            self._refuse(conn, stream_id, packet.request_id, f"internal error at {self.name}: {type(e).__name__}",
                         retry=True)

    async def _handle(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket, arrived: float) -> None:
        rid = packet.request_id
        async with self._locks.hold(rid):
            if (id(conn), stream_id, rid) in self._failed_streams:
                return  # the sender is already rerouting: later packets on this stream answer nothing
            if packet.kind == PacketKind.END:
                route = self.routes.get(rid)
                if route is not None and route.in_conn is conn and route.in_stream == stream_id:
                    await self._release(rid, forward=True)  # (an END on an abandoned stream ends nothing)
                conn.finish(stream_id)  # both sides ended: QUIC can forget the stream
                return
            if packet.kind not in (PacketKind.PREFILL, PacketKind.DECODE):
                self._refuse(conn, stream_id, rid, f"a trunk does not accept {packet.kind.name} packets")
                return
            problem, retry = self._check_packet(packet)
            if problem:
                self._refuse(conn, stream_id, rid, problem, retry=retry)
                return
            route = self.routes.get(rid)
            is_first = self.stage.start == self.plan.head_layers
            if not is_first and conn.peer_name != self._previous_member():
                # Only an asker's packets enter at the first stage; later stages take the stage before.
                self._refuse(conn, stream_id, rid, f"layers [{self.stage.start}, {self.stage.stop}) take activations "
                                                   "only from the stage before them in the plan")
                return
            if route is not None and (route.in_conn is not conn or route.in_stream != stream_id):
                if packet.start_pos != 0:
                    self._refuse(conn, stream_id, rid, "request id is in use on another stream", retry=True)
                    return
                self._close_out_stream(rid, route)  # a request starting over (replayed after a failure) on a new stream
                route = None
            if route is None:
                route = Route(conn, stream_id, results_key(conn.peer_name, packet.reply_to) if is_first
                              else packet.reply_to)
            route.last_active = time.monotonic()
            problem = self._admit(rid, route, packet)
            if problem:  # (not worth a retry: the same request would be over the same budget elsewhere)
                self._refuse(conn, stream_id, rid, problem)
                return
            submitted = time.perf_counter()
            runner, engine, budget = self.runner, self.engine, self.budget
            try:
                out, timing = await runner.run(Step(rid, packet.start_pos,
                                                    hidden=np.asarray(packet.data, dtype=np.float32)))
            except EngineError as e:
                budget.settle(rid, engine.kv_bytes_of(rid), engine.has_request(rid))
                if self.runner is runner and engine.has_request(rid) and rid not in self.routes \
                        and not isinstance(e, EngineClosedError):
                    await self._release(rid)  # a first step that failed after its cache was made: nothing keeps it
                # A request this stage lost (it restarted, or is reloading) can be replayed from the start.
                self._refuse(conn, stream_id, rid, str(e),
                             retry=isinstance(e, (RequestStateError, EngineClosedError, RemoteExpertError)))
                return
            budget.settle(rid, engine.kv_bytes_of(rid), engine.has_request(rid))  # the engine's real figure
            if self.runner is not runner:
                # The plan changed while this step computed: its layers are gone from here, and so is
                # the request's cache. The sender starts it over on the new route.
                self._refuse(conn, stream_id, rid, f"the plan changed (now v{self.plan.version})", retry=True)
                return
            self.routes[rid] = route
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.engine.kv_bytes)
            if self._test_corrupt:  # test-only (SWARMCTL_TEST_CORRUPT, in __init__): lie about the result
                out = _corrupted(out, self._test_corrupt)
            hop = Hop(self.name, int((timing.queued_s + submitted - arrived) * 1e6), int(timing.compute_s * 1e6),
                      timing.batch_requests)
            await self._pass_on(route, packet, out, hop)

    def _previous_member(self) -> str | None:
        return next((s.member for s in self.plan.stages if s.stop == self.stage.start), None)

    def _admit(self, rid: bytes, route: Route, packet: ActivationPacket) -> str:
        """Charge the KV this step leaves the request holding to the member who asked, before it
        runs; over that member's budget, why not. The first stage takes the member from the
        connection's certificate, later stages from reply_to ("member/session"), which only the
        stage before them can send: a member is bounded at every stage, not only the first."""
        member = route.reply_to.partition("/")[0]
        needed = self.engine.kv_bytes_after(rid, packet.start_pos + int(packet.data.shape[0]))
        problem = self.budget.admit(rid, member, needed)
        return f"over budget at {self.name}: {problem}" if problem else ""

    def _budget_limits(self) -> Limits:
        """What one member may hold here: derived from what the plan reserves at this stage
        (plan_concurrent requests × plan_context tokens) and what this node offered (swarmctl/budget.py)."""
        engine, plan = self.engine, self.plan
        room = self.memory - engine.weights.n_bytes - Constraints().reserve_bytes
        return Limits.derive(kv_bytes_per_position=engine.kv_bytes_per_position,
                             smallest_cache_bytes=engine.kv_bytes_after(b"", 1),
                             context_tokens=min(plan.context_tokens, engine.max_context),
                             concurrent=plan.max_concurrent, room_bytes=room)

    def _check_packet(self, packet: ActivationPacket) -> tuple[str, bool]:
        """What is wrong with a packet, if anything, and whether a resend under a newer plan may work."""
        if self._loading is not None and not self._loading.done():
            return f"the plan changed (now v{self.plan.version}): this stage is loading other layers", True
        if self.stage is None or self.runner is None or self.plan is None:
            return "this trunk is not serving any layers right now", True
        if packet.plan_version != self.plan.version:
            return f"stale plan: packet has version {packet.plan_version}, the swarm is at {self.plan.version}", True
        if packet.layer_index != self.stage.start:
            return (f"this stage runs layers [{self.stage.start}, {self.stage.stop}), not layer {packet.layer_index}",
                    False)
        if packet.data.ndim != 2 or packet.data.shape[1] != self.engine.spec.n_embd:
            return (f"activations of shape {list(packet.data.shape)} do not fit: expected "
                    f"[n_tokens, {self.engine.spec.n_embd}]"), False
        return "", False

    async def _pass_on(self, route: Route, packet: ActivationPacket, out: np.ndarray, hop: Hop) -> None:
        rid = packet.request_id
        is_last = self.stage.stop == self.plan.trunk_range[1]
        onward = ActivationPacket(PacketKind.RESULT if is_last else packet.kind, rid, self.plan.version,
                                  self.stage.stop, packet.start_pos, out, packet.dtype, route.reply_to,
                                  hops=(*packet.hops, hop))
        if is_last:
            sub = self.subscribers.get(route.reply_to)
            if sub is None or not sub[0].is_open:
                self._refuse(route.in_conn, route.in_stream, rid, f"asker {route.reply_to.split('/')[0]!r} has no "
                                                                  "results stream open at the last stage", retry=True)
                return
            await self._send_and_drain(sub[0], sub[1], onward)
            return
        try:
            conn = await self._next_stage_conn()
        except (ConnectionError, OSError) as e:
            self._refuse(route.in_conn, route.in_stream, rid, f"cannot reach the next stage: {e}", retry=True)
            return
        if route.out_stream is None or route.out_conn is not conn:
            self._close_out_stream(rid, route)
            route.out_conn, route.out_stream = conn, conn.open_stream()
        await self._send_and_drain(conn, route.out_stream, onward)

    async def _next_stage_conn(self) -> SwarmProtocol:
        nxt = self.plan.next_stage(self.stage)
        if nxt is None:
            raise ConnectionError("the plan has no stage after this one")
        if self.next_conn is not None and self.next_conn.is_open and self.next_member == nxt.member:
            return self.next_conn
        if self.next_conn is not None:
            await close(self.next_conn, "plan changed")
        self.next_conn = await connect_member(Address.parse(nxt.address), self.creds, nxt.member, self)
        self.next_member = nxt.member
        return self.next_conn

    async def _release(self, rid: bytes, forward: bool = False, route: Route | None = None) -> None:
        """Free a request, and end its stream onward: with an END when ``forward`` (the request is
        over), else just closed (the next stage frees what that stream held). With ``route``, only
        if that is still the request's route: the request may have started over on a new stream
        since (a reroute), and then it must live on."""
        if route is not None:
            async with self._locks.hold(rid):
                if self.routes.get(rid) is not route:
                    return
                self.routes.pop(rid, None)
                if self.runner is not None:
                    await self.runner.call(self.engine.release, rid)
                self.budget.release(rid)
        else:  # (the caller holds the request's lock)
            route = self.routes.pop(rid, None)
            if self.runner is not None:
                await self.runner.call(self.engine.release, rid)
            self.budget.release(rid)
        if route is not None:
            self._close_out_stream(rid, route, end_request=forward)

    def _close_out_stream(self, rid: bytes, route: Route, end_request: bool = False) -> None:
        """End our side of a request's stream to the next stage, with an END packet first when the
        request is over. Every stream must end on both sides, or QUIC's stream limit (128 per peer
        in aioquic) runs out and the link stalls."""
        conn, stream_id = route.out_conn, route.out_stream
        route.out_stream = None
        if conn is None or stream_id is None or not conn.is_open:
            return
        if end_request:
            end = ActivationPacket(PacketKind.END, rid, self.plan.version if self.plan else 0,
                                   self.stage.stop if self.stage else 0, 0, np.empty((0, 0), np.float32))
            try:
                conn.send(stream_id, encode_packet(end), end=True)
                return
            except StreamClosedError:
                pass
        conn.finish(stream_id)

    async def _stream_closed(self, conn: SwarmProtocol, stream_id: int) -> None:
        """The sender ended a stream. If it was a request's (after its END, or abandoned on a reroute
        or a plan change), whatever this stage still holds for it goes, the end is passed on, and
        our side of the stream ends too. Other streams (a results subscription, a control or
        expert call being answered) end our side when they answer."""
        if stream_id not in self._request_streams.get(conn, ()):
            return
        for rid, route in list(self.routes.items()):
            if route.in_conn is conn and route.in_stream == stream_id:
                await self._release(rid, route=route)
        self._request_streams.get(conn, set()).discard(stream_id)
        conn.finish(stream_id)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, self.idle_timeout))
            now = time.monotonic()
            for rid, route in list(self.routes.items()):
                if now - route.last_active > self.idle_timeout:
                    log.info("request %s idle for %.0fs: freeing its cache", rid.hex()[:8], now - route.last_active)
                    # Tell the sender: should it ever come back, it starts over.
                    self._send_error(route.in_conn, route.in_stream, rid, "idle too long: this stage freed its cache",
                                     retry=True)
                    self._spawn(self._release(rid, route=route))

    def _drop_all_routes(self, reason: str) -> None:
        for rid, route in list(self.routes.items()):
            self._send_error(route.in_conn, route.in_stream, rid, reason, retry=True)
            self._close_out_stream(rid, route)
        self.routes.clear()

    # --- sending ---

    def _refuse(self, conn: SwarmProtocol, stream_id: int, rid: bytes, reason: str, retry: bool = False) -> None:
        self._refusals.warning("request %s from %s refused: %s", rid.hex()[:8], conn.peer_name, reason)
        self._send_error(conn, stream_id, rid, reason, retry)
        if retry:
            self._failed_streams.add((id(conn), stream_id, rid))
            if len(self._failed_streams) > 10_000:  # a bound, not a policy: old entries are long dead
                self._failed_streams.clear()

    def _send_error(self, conn: SwarmProtocol, stream_id: int, rid: bytes, message: str, retry: bool = False) -> None:
        """An error leaves the stream open on our side: the sender may already have sent its next
        step on it, and that step must be answered too (a stream we had ended could not carry the
        answer, and the sender would wait until its deadline). The sender ends the stream when it
        gives up on it, and then so do we (``_stream_closed``)."""
        error = ActivationPacket(PacketKind.ERROR, rid, self.plan.version if self.plan else 0, 0, 0,
                                 np.empty((0, 0), np.float32), DType.F32, "", message, retry=retry)
        self._send(conn, stream_id, error)

    def _send(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket, end: bool = False) -> None:
        if conn.is_open:
            data = encode_packet(packet)
            self.activation_bytes_sent += len(data)
            self._capture("send", Frame(FrameType.ACTIVATION, data[5:]))
            try:
                conn.send(stream_id, data, end=end)
            except StreamClosedError as e:  # the peer reset it (it gave up on the request): nobody to tell
                log.info("%s", e)

    async def _send_and_drain(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket) -> None:
        self._send(conn, stream_id, packet)
        await conn.drain(stream_id, SEND_BACKLOG)

    def _capture(self, direction: str, frame: Frame) -> None:
        """With --capture DIR, keep every frame this stage receives and sends, exactly as bytes:
        what a curious member running this stage could see."""
        if self.capture_dir is None:
            return
        self._capture_seq += 1
        kind = frame.type.name.lower()
        (self.capture_dir / f"{self._capture_seq:06d}-{direction}-{kind}.bin").write_bytes(frame.body)
