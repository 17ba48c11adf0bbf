"""The data path of a stage: run each request's steps on its layers and pass the result on.

Each request arrives on its own stream from the previous hop (the asker, or the previous stage);
its output goes straight to the next stage, or, from the last stage, to the asker's results
stream. Errors travel back along the request's streams as ERROR packets. KV caches live per
request id until END or an idle timeout. Which streams a request holds, and which end when, is
the route table's business (swarmctl/trunk/routes.py); this module carries out what it says.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from kernels.errors import EngineError, RequestStateError
from kernels.slice import Step
from net import clock
from net.endpoint import close
from net.protocol import StreamClosedError, SwarmProtocol
from net.wire import FRAME_HEADER, MAX_HOPS, ActivationPacket, DType, Frame, FrameType, Hop, HopCall, PacketKind, \
    WireError, decode_packet, encode_packet
from plans.plan import Plan, StageAssignment
from swarmctl.batching import EngineClosedError
from swarmctl.node.log_limit import LogLimit
from swarmctl.trunk.assignment import Assignment
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.experts import RemoteExpertError
from swarmctl.trunk.one_stage import OneStageLedger
from swarmctl.trunk.prefixes import StagePrefixes
from swarmctl.trunk.results import ResultStreams, results_key
from swarmctl.trunk.routes import (Action, EndOnward, FinishStream, FreeRequest, Keep, KeepRequest, PassBack,
                                   Release, Route, RouteTable, SendError)

log = logging.getLogger("swarmctl.trunk")

SEND_BACKLOG = 8 * 1024 * 1024  # bytes unacknowledged per stream before a sender waits


def _corrupted(out: np.ndarray, scale: float) -> np.ndarray:
    """Test-only (SWARMCTL_TEST_CORRUPT): the rows plus Gaussian noise of ``scale`` times their RMS."""
    rms = np.sqrt(np.mean(np.square(out, dtype=np.float64), axis=1, keepdims=True))
    return (out + np.random.default_rng().standard_normal(out.shape) * scale * rms).astype(np.float32)


def account_of(route: Route, plan: Plan) -> str:
    """Whose budget a request spends and whose turn it takes: its member's account (one per
    invite: Plan.account): reply_to's ("member/session"), which is bound to the sender's
    certificate wherever a request enters and only passed on by the stage before."""
    return plan.account(route.reply_to.partition("/")[0])


class StageRequests:
    def __init__(self, ctx: TrunkContext, assignment: Assignment, results: ResultStreams, *,
                 capture: Callable[[str, Frame], None],
                 expert_calls: Callable[[float, float], tuple[HopCall, ...]] = lambda start, stop: ()) -> None:
        """``capture``: keep a frame sent (--capture); ``expert_calls(start, stop)``: the expert
        calls made in that window of a batch's compute (swarmctl/trunk/experts.py), listed in a
        traced packet's hop record."""
        self.name = ctx.name
        self._expert_calls = expert_calls
        self.creds = ctx.creds
        self.handler = ctx.handler  # for the connection we open to the next stage
        self.connect = ctx.connect  # how we open it (the trunk's dialer)
        self.held = assignment  # the plan, the stage, its engine, runner and budget
        self.prefixes = StagePrefixes(ctx.name, assignment)  # requests' cells kept for their account's next
        self.routes = RouteTable()
        self.results = results
        self.next_conn: SwarmProtocol | None = None
        self.next_member: str | None = None
        self._connecting = asyncio.Lock()  # held while the connection onward is being made
        self.activation_bytes_sent = 0
        self.peak_kv_bytes = 0
        self._capture = capture
        self._spawn = ctx.spawn
        self._refusals = LogLimit(log)
        # Test-only fault injection, like SWARMCTL_TEST_FETCH_CRASH_AFTER: a dishonest trunk that adds
        # Gaussian noise of this size (relative to each output row's RMS) to what it sends on, for the
        # spot-check tests and benchmark (swarmctl/asker/verify.py). Unset or 0 in any real run.
        self._test_corrupt = float(os.environ.get("SWARMCTL_TEST_CORRUPT") or 0)
        self.one_stage = OneStageLedger()  # who re-checked this stage alone, for the host (in ``stats``)

    # --- events from the connections ---

    def packet_frame(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        try:
            packet = decode_packet(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        if packet.kind == PacketKind.ERROR:  # coming back from a next stage (nobody else sends errors here)
            self._do(self.routes.error_from_next_stage(conn, stream_id, packet))
            return
        self.routes.stream_carries_requests(conn, stream_id)
        self._spawn(self._handle_safely(conn, stream_id, packet, time.perf_counter()))

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        actions = self.routes.stream_ended(conn, stream_id)
        if actions:
            self._spawn(self._carry_out(actions))

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self._do(self.routes.connection_lost(conn))
        if conn is self.next_conn:
            self.next_conn = self.next_member = None

    def drop_all(self, reason: str) -> None:
        self._do(self.routes.drop_all(reason))

    async def reap_idle(self, idle_timeout: float) -> None:
        while True:
            await asyncio.sleep(min(10.0, idle_timeout))
            actions = self.routes.reap_idle(idle_timeout, clock.now())
            await self.prefixes.reap()
            for action in actions:
                if isinstance(action, Release):
                    log.info("request %s idle for over %.0fs: freeing its cache", action.request_id.hex()[:8],
                             idle_timeout)
            self._do(actions)

    async def close(self) -> None:
        if self.next_conn is not None:
            await close(self.next_conn, "trunk shutting down")

    # --- one packet ---

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
        async with self.routes.locks.hold(rid):
            if self.routes.has_failed(conn, stream_id, rid):
                return  # the sender is already rerouting: later packets on this stream answer nothing
            if packet.kind == PacketKind.END:
                keep = Keep(packet.prefix, packet.start_pos) if packet.prefix else None
                await self._carry_out(self.routes.end(rid, conn, stream_id, keep))
                return
            if packet.kind not in (PacketKind.PREFILL, PacketKind.DECODE):
                self._refuse(conn, stream_id, rid, f"a trunk does not accept {packet.kind.name} packets")
                return
            problem, retry = self._check_packet(packet)
            if problem:
                self._refuse(conn, stream_id, rid, problem, retry=retry)
                return
            held = self.held
            stage, plan = held.stage, held.plan
            # From the stage before: a hop of a request that entered earlier, whose results address
            # that stage passes on. From anyone else: a request entering here (at the first stage,
            # an ask; at a later one, an asker re-checking the route stage by stage: verify.py), whose
            # results can only go to the sender's own results streams, on the sender's budget.
            entering = stage.start == plan.head_layers or conn.peer_name != self._previous_member()
            if packet.one_stage and not entering:
                self._refuse(conn, stream_id, rid, "a one-stage step comes from whoever asks, not from the stage "
                                                   "before")
                return
            reply_to = results_key(conn.peer_name, packet.reply_to) if entering else packet.reply_to
            route, actions, problem = self.routes.claim(rid, conn, stream_id, packet.start_pos, reply_to, clock.now())
            if problem:
                self._refuse(conn, stream_id, rid, problem, retry=True)
                return
            self._do(actions)
            if packet.prefix and packet.kind == PacketKind.PREFILL and packet.start_pos > 0 \
                    and not held.engine.has_request(rid):
                # A request that starts from its account's kept prefix (swarmctl/trunk/prefixes.py).
                problem = await self.prefixes.resume(rid, account_of(route, plan), packet.prefix, packet.start_pos)
                if problem:
                    self._refuse(conn, stream_id, rid, problem, retry=True)
                    return
            problem = await self._admit(rid, route, packet)
            if problem:  # (not worth a retry: the same request would be over the same budget elsewhere)
                if held.engine.has_request(rid) and rid not in self.routes:
                    await self._carry_out([FreeRequest(rid)])  # (a resumed prefix it would have continued)
                self._refuse(conn, stream_id, rid, problem)
                return
            submitted = time.perf_counter()
            runner, engine, budget = held.runner, held.engine, held.budget
            try:
                out, timing = await runner.run(Step(rid, packet.start_pos,
                                                    hidden=np.asarray(packet.data, dtype=np.float32),
                                                    rewind=packet.rewind, verify=packet.verify),
                                               member=account_of(route, plan))
            except EngineError as e:
                budget.settle(rid, engine.kv_bytes_of(rid), engine.has_request(rid))
                if held.runner is runner and engine.has_request(rid) and rid not in self.routes \
                        and not isinstance(e, EngineClosedError):
                    await self._carry_out([FreeRequest(rid)])  # a first step that failed after its cache was made
                # A request this stage lost (it restarted, or is reloading) can be replayed from the start.
                self._refuse(conn, stream_id, rid, str(e),
                             retry=isinstance(e, (RequestStateError, EngineClosedError, RemoteExpertError)))
                return
            budget.settle(rid, engine.kv_bytes_of(rid), engine.has_request(rid))  # the engine's real figure
            # What the plan says now, read once: the step was awaited, and a plan that arrived
            # meanwhile may have moved or taken away this stage (``Assignment.apply`` sets its stage
            # to None at once when the plan gives this trunk no layers, before any reload).
            plan_now, stage_now = held.plan, held.stage
            if held.runner is not runner or stage_now is None or plan_now is None \
                    or (stage_now.start, stage_now.stop) != (stage.start, stage.stop):
                # The plan changed while this step computed: its layers are gone from here (or going),
                # and so is the request's cache. The sender starts it over on the new route.
                version = f"now v{plan_now.version}" if plan_now is not None else "no plan now"
                self._refuse(conn, stream_id, rid, f"the plan changed ({version})", retry=True)
                return
            route.checks.step(packet.start_pos, int(packet.data.shape[0]), packet.verify)
            self.routes.commit(rid, route)
            if packet.one_stage:  # the host's evidence that this account re-checked this stage (one_stage.py)
                self.one_stage.record(account_of(route, plan_now), plan_now.version)
            self.peak_kv_bytes = max(self.peak_kv_bytes, engine.kv_bytes)
            if self._test_corrupt:  # test-only (SWARMCTL_TEST_CORRUPT, in __init__): lie about the result
                out = _corrupted(out, self._test_corrupt)
            # The batch's compute began about queued_s after this step was submitted (the runner
            # counts from a moment later, by microseconds): on a traced packet, the expert calls
            # made from then until its end are listed, timed from its start.
            computed_from = submitted + timing.queued_s
            calls = self._expert_calls(computed_from, computed_from + timing.compute_s) if packet.trace else ()
            hop = Hop(self.name, int((timing.queued_s + submitted - arrived) * 1e6), int(timing.compute_s * 1e6),
                      timing.batch_requests, calls)
            await self._pass_on(route, packet, out, hop, plan_now, stage_now)

    def _previous_member(self) -> str | None:
        return next((s.member for s in self.held.plan.stages if s.stop == self.held.stage.start), None)

    async def _admit(self, rid: bytes, route: Route, packet: ActivationPacket) -> str:
        """Charge the KV this step leaves the request holding to the account of the member who
        asked (account_of), before it runs; over that budget, why not: a member is bounded at every
        stage, not only the first, and all names of one invite together. The account's own kept
        prefixes make room first, least recently used first."""
        member = account_of(route, self.held.plan)
        needed = self.held.engine.kv_bytes_after(rid, packet.start_pos + int(packet.data.shape[0]))
        problem = await self.prefixes.admit(rid, member, needed)
        return f"over budget at {self.name}: {problem}" if problem else ""

    def _check_packet(self, packet: ActivationPacket) -> tuple[str, bool]:
        """What is wrong with a packet, if anything, and whether a resend under a newer plan may work."""
        held = self.held
        if held.swapping:
            return f"the plan changed (now v{held.plan.version}): this stage is loading other layers", True
        if held.stage is None or held.runner is None or held.plan is None:
            return "this trunk is not serving any layers right now", True
        if packet.plan_version != held.plan.version:
            return f"stale plan: packet has version {packet.plan_version}, the swarm is at {held.plan.version}", True
        if packet.layer_index != held.stage.start:
            return (f"this stage runs layers [{held.stage.start}, {held.stage.stop}), not layer {packet.layer_index}",
                    False)
        if packet.data.ndim != 2 or packet.data.shape[1] != held.engine.spec.n_embd:
            return (f"activations of shape {list(packet.data.shape)} do not fit: expected "
                    f"[n_tokens, {held.engine.spec.n_embd}]"), False
        if len(packet.hops) >= MAX_HOPS:  # this stage's record would not fit on the packet it sends on
            return f"the packet has passed {len(packet.hops)} stages already; at most {MAX_HOPS} fit", False
        return "", False

    async def _pass_on(self, route: Route, packet: ActivationPacket, out: np.ndarray, hop: Hop, plan: Plan,
                       stage: StageAssignment) -> None:
        """Send a step's output on under ``plan``, from ``stage``: what the caller checked after the
        step ran (``self.held`` may change under any await from here on)."""
        rid = packet.request_id
        is_last = stage.stop == plan.trunk_range[1]
        # The plan says how this stage's output travels on (plans/wire.py); a re-check goes back
        # the way it came.
        dtype = packet.dtype if packet.one_stage else stage.send_dtype
        onward = ActivationPacket(PacketKind.RESULT if is_last or packet.one_stage else packet.kind, rid,
                                  plan.version, stage.stop, packet.start_pos, out, dtype, route.reply_to,
                                  hops=(*packet.hops, hop), rewind=packet.rewind, verify=packet.verify,
                                  trace=packet.trace, one_stage=packet.one_stage,
                                  prefix=packet.prefix if not (is_last or packet.one_stage) else b"")
        if packet.one_stage:  # a re-check of this stage alone (swarmctl/asker/verify.py): back to its sender
            await self._send_and_drain(route.in_conn, route.in_stream, onward)
            return
        if is_last:
            results = self.results.stream_for(route.reply_to)
            if results is None:
                self._refuse(route.in_conn, route.in_stream, rid, f"asker {route.reply_to.split('/')[0]!r} has no "
                                                                  "results stream open at the last stage", retry=True)
                return
            await self._send_and_drain(*results, onward)
            return
        try:
            conn = await self._next_stage_conn(plan.next_stage(stage))
        except (ConnectionError, OSError) as e:
            self._refuse(route.in_conn, route.in_stream, rid, f"cannot reach the next stage: {e}", retry=True)
            return
        if not route.leaves_on(conn):
            self._do(self.routes.send_on(rid, route, conn, conn.open_stream()))
        await self._send_and_drain(conn, route.out_stream, onward)

    async def _next_stage_conn(self, nxt: StageAssignment | None) -> SwarmProtocol:
        if nxt is None:
            raise ConnectionError("the plan has no stage after this one")
        # One connection at a time: requests passing on together while it is being made (the
        # first batch after a plan change) must all get the one that is made. Each making its own
        # left the earlier ones' streams on a connection the next request's step then closed,
        # and the next stage freed those requests (seen as "unknown request" refusals).
        async with self._connecting:
            if self.next_conn is not None and self.next_conn.is_open and self.next_member == nxt.member:
                return self.next_conn
            if self.next_conn is not None:
                await close(self.next_conn, "plan changed")
            self.next_conn = await self.connect(nxt.member, nxt.address, self.handler)
            self.next_member = nxt.member
            return self.next_conn

    # --- carrying out what the route table says ---

    def _do(self, actions: list[Action]) -> None:
        """Actions that need no wait happen now; freeing a request needs its lock and the compute
        thread, so those run as tasks."""
        for action in actions:
            if isinstance(action, (Release, FreeRequest)):
                self._spawn(self._carry_out([action]))
            else:
                self._send_now(action)

    async def _carry_out(self, actions: list[Action]) -> None:
        """In order, waiting for each release (the caller may hold the request's lock: a
        ``FreeRequest`` then needs none, a ``Release`` takes it)."""
        for action in actions:
            if isinstance(action, Release):
                async with self.routes.locks.hold(action.request_id):
                    await self._carry_out(self.routes.take(action.request_id, action.route))
            elif isinstance(action, KeepRequest):
                plan = self.held.plan
                account = plan.account(action.reply_to.partition("/")[0]) if plan is not None else ""
                if not (plan is not None and await self.prefixes.keep(action.request_id, account, action.keep.prefix,
                                                                        action.keep.positions)):
                    await self._carry_out([FreeRequest(action.request_id)])
            elif isinstance(action, FreeRequest):
                held = self.held
                if held.runner is not None:
                    await held.runner.call(held.engine.release, action.request_id)
                held.budget.release(action.request_id)
            else:
                self._send_now(action)

    def _send_now(self, action: Action) -> None:
        if isinstance(action, SendError):
            self._send_error(action.conn, action.stream_id, action.request_id, action.message, action.retry)
        elif isinstance(action, PassBack):
            self._send(action.conn, action.stream_id, action.packet)
        elif isinstance(action, EndOnward):
            self._end_onward(action.conn, action.stream_id, action.request_id, action.keep)
        elif isinstance(action, FinishStream):
            action.conn.finish(action.stream_id)

    def _end_onward(self, conn: SwarmProtocol, stream_id: int, rid: bytes, keep: Keep | None = None) -> None:
        if not conn.is_open:
            return
        plan, stage = self.held.plan, self.held.stage
        end = ActivationPacket(PacketKind.END, rid, plan.version if plan else 0, stage.stop if stage else 0,
                               keep.positions if keep else 0, np.empty((0, 0), np.float32),
                               prefix=keep.prefix if keep else b"")
        try:
            conn.send(stream_id, encode_packet(end), end=True)
        except StreamClosedError:
            conn.finish(stream_id)

    # --- sending ---

    def _refuse(self, conn: SwarmProtocol, stream_id: int, rid: bytes, reason: str, retry: bool = False) -> None:
        self._refusals.warning("request %s from %s refused: %s", rid.hex()[:8], conn.peer_name, reason)
        self._send_error(conn, stream_id, rid, reason, retry)
        if retry:
            self.routes.mark_failed(conn, stream_id, rid)

    def _send_error(self, conn: SwarmProtocol, stream_id: int, rid: bytes, message: str, retry: bool = False) -> None:
        """An error leaves the stream open on our side: the sender may already have sent its next
        step on it, and that step must be answered too (a stream we had ended could not carry the
        answer, and the sender would wait until its deadline). The sender ends the stream when it
        gives up on it, and then so do we (``RouteTable.stream_ended``)."""
        plan = self.held.plan
        error = ActivationPacket(PacketKind.ERROR, rid, plan.version if plan else 0, 0, 0,
                                 np.empty((0, 0), np.float32), DType.F32, "", message, retry=retry)
        self._send(conn, stream_id, error)

    def _send(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket) -> None:
        if conn.is_open:
            data = encode_packet(packet)
            self.activation_bytes_sent += len(data)
            self._capture("send", Frame(FrameType.ACTIVATION, data[FRAME_HEADER.size:]))
            try:
                conn.send(stream_id, data)
            except StreamClosedError as e:  # the peer reset it (it gave up on the request): nobody to tell
                log.info("%s", e)

    async def _send_and_drain(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket) -> None:
        self._send(conn, stream_id, packet)
        await conn.drain(stream_id, SEND_BACKLOG)
