"""The data path of a stage: run each request's steps on its layers and pass the result on.

Each request arrives on its own stream from the previous hop (the asker, or the previous stage);
its output goes straight to the next stage, or, from the last stage, to the asker's results
stream. Errors travel back along the request's streams as ERROR packets. KV caches live per
request id until END or an idle timeout. Which streams a request holds, and which end when, is
the route table's business (swarmctl/trunk/routes.py); what a step may do and where its output
goes, ``stage_step``'s (both with no I/O); ``stage_sender`` carries out what they say.
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
from net.protocol import SwarmProtocol
from net.wire import ActivationPacket, Frame, Hop, HopCall, PacketKind, WireError, decode_packet
from swarmctl.batching import EngineClosedError
from swarmctl.trunk.assignment import Assignment
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.experts import RemoteExpertError
from swarmctl.trunk.next_stage import NextStage
from swarmctl.trunk.one_stage import OneStageLedger
from swarmctl.trunk.prefixes import StagePrefixes
from swarmctl.trunk.results import ResultStreams, results_key
from swarmctl.trunk.routes import FreeRequest, Keep, Release, Route, RouteTable
from swarmctl.trunk.stage_sender import StageSender
from swarmctl.trunk.stage_step import (Destination, Serving, account_of, check_packet, enters_here,
                                       moved_during_step, onward)

log = logging.getLogger("swarmctl.trunk")


def _corrupted(out: np.ndarray, scale: float) -> np.ndarray:
    """Test-only (SWARMCTL_TEST_CORRUPT): the rows plus Gaussian noise of ``scale`` times their RMS."""
    rms = np.sqrt(np.mean(np.square(out, dtype=np.float64), axis=1, keepdims=True))
    return (out + np.random.default_rng().standard_normal(out.shape) * scale * rms).astype(np.float32)


class StageRequests:
    def __init__(self, ctx: TrunkContext, assignment: Assignment, results: ResultStreams, *,
                 capture: Callable[[str, Frame], None],
                 expert_calls: Callable[[float, float], tuple[HopCall, ...]] = lambda start, stop: ()) -> None:
        """``capture``: keep a frame sent (--capture); ``expert_calls(start, stop)``: the expert
        calls made in that window of a batch's compute (swarmctl/trunk/experts.py), listed in a
        traced packet's hop record."""
        self.name = ctx.name
        self._expert_calls = expert_calls
        self.held = assignment  # the plan, the stage, its engine, runner and budget
        self.prefixes = StagePrefixes(ctx.name, assignment)  # requests' cells kept for their account's next
        self.routes = RouteTable()
        self.results = results
        self.next = NextStage(ctx)  # the connection onward
        self.sender = StageSender(ctx, assignment, self.routes, self.prefixes, capture)
        self.peak_kv_bytes = 0
        self._spawn = ctx.spawn
        # Test-only fault injection, like SWARMCTL_TEST_FETCH_CRASH_AFTER: a dishonest trunk that adds
        # Gaussian noise of this size (relative to each output row's RMS) to what it sends on, for the
        # spot-check tests and benchmark (swarmctl/asker/verify.py). Unset or 0 in any real run.
        self._test_corrupt = float(os.environ.get("SWARMCTL_TEST_CORRUPT") or 0)
        self.one_stage = OneStageLedger()  # who re-checked this stage alone, for the host (in ``stats``)

    @property
    def next_conn(self) -> SwarmProtocol | None:
        return self.next.conn

    @property
    def activation_bytes_sent(self) -> int:
        return self.sender.activation_bytes_sent

    # --- events from the connections ---

    def packet_frame(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        try:
            packet = decode_packet(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        if packet.kind == PacketKind.ERROR:  # coming back from a next stage (nobody else sends errors here)
            self.sender.do(self.routes.error_from_next_stage(conn, stream_id, packet))
            return
        self.routes.stream_carries_requests(conn, stream_id)
        self._spawn(self._handle_safely(conn, stream_id, packet, time.perf_counter()))

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        actions = self.routes.stream_ended(conn, stream_id)
        if actions:
            self._spawn(self.sender.carry_out(actions))

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self.sender.do(self.routes.connection_lost(conn))
        self.next.lost(conn)

    def drop_all(self, reason: str) -> None:
        self.sender.do(self.routes.drop_all(reason))

    async def reap_idle(self, idle_timeout: float) -> None:
        while True:
            await asyncio.sleep(min(10.0, idle_timeout))
            now = clock.now()
            actions = self.routes.reap_idle(idle_timeout, now)
            await self.prefixes.reap(now)
            for action in actions:
                if isinstance(action, Release):
                    log.info("request %s idle for over %.0fs: freeing its cache", action.request_id.hex()[:8],
                             idle_timeout)
            self.sender.do(actions)

    async def close(self) -> None:
        await self.next.close()

    # --- one packet ---

    async def _handle_safely(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket,
                             arrived: float) -> None:
        """A bug met while handling a packet answers the sender (who replays the request, within its
        deadline) instead of leaving it waiting for a packet that never comes."""
        try:
            await self._handle(conn, stream_id, packet, arrived)
        except Exception as e:  # noqa: BLE001 - logged in full; the node and its other requests carry on
            log.exception("request %s: unexpected error", packet.request_id.hex()[:8])
            self.sender.refuse(conn, stream_id, packet.request_id,
                               f"internal error at {self.name}: {type(e).__name__}", retry=True)

    def _serving(self) -> Serving:
        held = self.held
        return Serving(held.plan, held.stage, running=held.runner is not None, swapping=held.swapping,
                       n_embd=held.engine.spec.n_embd if held.engine is not None else 0)

    async def _handle(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket, arrived: float) -> None:
        rid = packet.request_id
        refuse = self.sender.refuse
        async with self.routes.locks.hold(rid):
            if self.routes.has_failed(conn, stream_id, rid):
                return  # the sender is already rerouting: later packets on this stream answer nothing
            if packet.kind == PacketKind.END:
                keep = Keep(packet.prefix, packet.start_pos) if packet.prefix else None
                await self.sender.carry_out(self.routes.end(rid, conn, stream_id, keep))
                return
            if packet.kind not in (PacketKind.PREFILL, PacketKind.DECODE):
                refuse(conn, stream_id, rid, f"a trunk does not accept {packet.kind.name} packets")
                return
            problem, retry = check_packet(packet, self._serving())
            if problem:
                refuse(conn, stream_id, rid, problem, retry=retry)
                return
            held = self.held
            stage, plan = held.stage, held.plan
            entering = enters_here(plan, stage, conn.peer_name)
            if packet.one_stage and not entering:
                refuse(conn, stream_id, rid, "a one-stage step comes from whoever asks, not from the stage before")
                return
            reply_to = results_key(conn.peer_name, packet.reply_to) if entering else packet.reply_to
            route, actions, problem = self.routes.claim(rid, conn, stream_id, packet.start_pos, reply_to, clock.now())
            if problem:
                refuse(conn, stream_id, rid, problem, retry=True)
                return
            self.sender.do(actions)
            if packet.prefix and packet.kind == PacketKind.PREFILL and packet.start_pos > 0 \
                    and not held.engine.has_request(rid):
                # A request that starts from its account's kept prefix (swarmctl/trunk/prefixes.py).
                problem = await self.prefixes.resume(rid, account_of(route.reply_to, plan), packet.prefix,
                                                     packet.start_pos)
                if problem:
                    refuse(conn, stream_id, rid, problem, retry=True)
                    return
            problem = await self._admit(rid, route, packet)
            if problem:  # (not worth a retry: the same request would be over the same budget elsewhere)
                if held.engine.has_request(rid) and rid not in self.routes:
                    await self.sender.carry_out([FreeRequest(rid)])  # (a resumed prefix it would have continued)
                refuse(conn, stream_id, rid, problem)
                return
            submitted = time.perf_counter()
            runner, engine, budget = held.runner, held.engine, held.budget
            try:
                out, timing = await runner.run(Step(rid, packet.start_pos,
                                                    hidden=np.asarray(packet.data, dtype=np.float32),
                                                    rewind=packet.rewind, verify=packet.verify),
                                               member=account_of(route.reply_to, plan))
            except EngineError as e:
                budget.settle(rid, engine.kv_bytes_of(rid), engine.has_request(rid))
                if held.runner is runner and engine.has_request(rid) and rid not in self.routes \
                        and not isinstance(e, EngineClosedError):
                    await self.sender.carry_out([FreeRequest(rid)])  # a first step that failed after its cache was made
                # A request this stage lost (it restarted, or is reloading) can be replayed from the start.
                refuse(conn, stream_id, rid, str(e),
                       retry=isinstance(e, (RequestStateError, EngineClosedError, RemoteExpertError)))
                return
            budget.settle(rid, engine.kv_bytes_of(rid), engine.has_request(rid))  # the engine's real figure
            # What the plan says now, read once: the step was awaited, and a plan that arrived
            # meanwhile may have moved or taken away this stage (``Assignment.apply`` sets its stage
            # to None at once when the plan gives this trunk no layers, before any reload).
            plan_now, stage_now = held.plan, held.stage
            moved = moved_during_step(held.runner is runner, plan_now, stage_now, stage)
            if moved:
                refuse(conn, stream_id, rid, moved, retry=True)
                return
            route.checks.step(packet.start_pos, int(packet.data.shape[0]), packet.verify)
            self.routes.commit(rid, route)
            if packet.one_stage:  # the host's evidence that this account re-checked this stage (one_stage.py)
                self.one_stage.record(account_of(route.reply_to, plan_now), plan_now.version)
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

    async def _admit(self, rid: bytes, route: Route, packet: ActivationPacket) -> str:
        """Charge the KV this step leaves the request holding to the account of the member who
        asked (account_of), before it runs; over that budget, why not: a member is bounded at every
        stage, not only the first, and all names of one invite together. The account's own kept
        prefixes make room first, least recently used first."""
        member = account_of(route.reply_to, self.held.plan)
        needed = self.held.engine.kv_bytes_after(rid, packet.start_pos + int(packet.data.shape[0]))
        problem = await self.prefixes.admit(rid, member, needed)
        return f"over budget at {self.name}: {problem}" if problem else ""

    async def _pass_on(self, route: Route, packet: ActivationPacket, out: np.ndarray, hop: Hop, plan, stage) -> None:
        """Send a step's output on under ``plan``, from ``stage``: what the caller checked after the
        step ran (``self.held`` may change under any await from here on)."""
        rid = packet.request_id
        sent = onward(packet, out, hop, plan, stage, route.reply_to)
        if sent.to == Destination.SENDER:  # a re-check of this stage alone (swarmctl/asker/verify.py)
            await self.sender.send_and_drain(route.in_conn, route.in_stream, sent.packet)
            return
        if sent.to == Destination.RESULTS:
            results = self.results.stream_for(route.reply_to)
            if results is None:
                self.sender.refuse(route.in_conn, route.in_stream, rid, f"asker {route.reply_to.split('/')[0]!r} has "
                                   "no results stream open at the last stage", retry=True)
                return
            await self.sender.send_and_drain(*results, sent.packet)
            return
        try:
            conn = await self.next.connection(plan.next_stage(stage))
        except (ConnectionError, OSError) as e:
            self.sender.refuse(route.in_conn, route.in_stream, rid, f"cannot reach the next stage: {e}", retry=True)
            return
        if not route.leaves_on(conn):
            self.sender.do(self.routes.send_on(rid, route, conn, conn.open_stream()))
        await self.sender.send_and_drain(conn, route.out_stream, sent.packet)
