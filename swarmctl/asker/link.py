"""The asker's link to a swarm: the trunk of the U, reached over QUIC.

``SwarmLink`` implements the ``Trunk`` interface on the asker's event loop: hand it the head's
activations, get back the last trunk stage's output and the per-hop timings. Each request gets its
own stream to the first stage; results come back on one results stream this asker opened at the
last stage. Many requests can be in flight at once; the stages batch them. The plan comes from
the host through ``PlanWatch`` (swarmctl/asker/plan_watch.py).

Failures: the link keeps every step it sent for each request (its start position and the head's
activations). When a route fails (a stage dies, the plan changes, a link drops), it waits for the
host's next complete plan and replays those same steps, back to back, through the new route, so
the new stages rebuild the request's KV cache bit for bit (same steps, same kernels), then
resends the step that failed. A request that cannot be rerouted before its deadline fails with the
reason (for a swarm too small to hold the model: the missing layers). A refusal that no route can
get past (this member was revoked: every stage and the host refuse it) ends every request at once.

The parts: what to resend (swarmctl/asker/replay.py) and when to reroute, resend or give up
(swarmctl/asker/link_core.py) are decided without I/O; the stage connections
(swarmctl/asker/stage_links.py), the sends on a request's stream (swarmctl/asker/sending.py) and
the futures its steps wait on (swarmctl/asker/steps_out.py) do the I/O; this class ties them to
the Trunk interface and the connections' events.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from net import clock
from net.identity import Credentials
from net.liveness import PING_INTERVAL, SilenceClock
from net.ping import quiet_ping
from net.protocol import SwarmProtocol
from net import messages as m
from net.wire import FRAME_HEADER, DType, Frame, FrameType, PacketKind, WireError, decode_packet
from plans.plan import Plan
from swarmctl.asker.head_tail import TrunkResult
from swarmctl.asker.link_core import CHECK_STALLS, Answer, PrefixLost, ReroutePolicy, RouteFailed, Silent, \
    StepFailures, answer_verdict, on_tick, refusal
from swarmctl.asker.plan_watch import PlanWatch, SwarmError, check_asker_layers
from swarmctl.asker.replay import SentStep
from swarmctl.asker.sending import KeptSteps, RouteSender
from swarmctl.asker.stage_links import StageLinks, each_once
from swarmctl.asker.steps_out import StepOut, StepsOut
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.reaching.path_memo import FILE_NAME as PATH_MEMO_FILE, PathMemoFile
from swarmctl.reaching.reach import Dialer, ask_route

__all__ = ["KeptSteps", "ReroutePolicy", "SwarmError", "SwarmLink"]

log = logging.getLogger("swarmctl.client")


@dataclass
class LinkStats:
    """Failovers the link carried out, and how far requests streamed."""

    recoveries: int = 0
    replayed_bytes: int = 0
    last_recovery_s: float | None = None
    most_steps_out: int = 0  # the most steps of one request out at once (a long prompt's chunks stream)
    stalls: int = 0  # steps resent because a live route did not answer them in time (ReroutePolicy.stall_min_s)


class SwarmLink:
    def __init__(self, config: NodeConfig, creds: Credentials, *, request_timeout: float = 300.0,
                 dtype: DType | None = None, trace: bool = False, policy: ReroutePolicy = ReroutePolicy()) -> None:
        """``dtype``: how the head's activations travel to the first stage (None: as the plan says);
        ``trace``: ask every stage to list its expert calls in its hop record (``--trace``);
        ``policy``: the timings of rerouting and stall detection (swarmctl/asker/link_core.py)."""
        self.config, self.creds = config, creds
        self.request_timeout, self.policy = request_timeout, policy
        self.host = PlanWatch(config, creds, self, lambda addresses: self.stages.connect_host(addresses))
        self.stats = LinkStats()
        # This process's results address at the last stage: other processes of the same member
        # (another terminal, serve, top) subscribe with their own, so results never cross.
        self.session = secrets.token_hex(16)
        self.stages = StageLinks(self.host, self, self.session, policy, request_timeout)
        self.steps = StepsOut()
        self.sender = RouteSender(self.stages, self.steps, dtype=dtype, trace=trace)
        self.table = self.sender.table  # what each request's stages hold, and its stream (swarmctl/asker/replay.py)
        self.recomputed = self.sender.recomputed  # resumed requests whose kept prefix a stage lacked (replayed)
        self._tasks: list[asyncio.Task] = []
        self.refused = ""  # why no route can serve this member any more (its revocation), once a node said so
        self._refusal = asyncio.Event()  # set with it

    @classmethod
    async def open(cls, home: SwarmHome, *, ready_timeout: float = 60.0,
                   alive_check: Callable[[], None] | None = None, min_stages: int = 1, **kwargs) -> "SwarmLink":
        """Connect to the swarm's host, wait for a complete plan (of at least ``min_stages`` stages:
        a local swarm knows how many trunks it started), connect to the first and last stage."""
        link = cls(home.load_config(), home.credentials(), **kwargs)
        try:
            link.stages.dialer = await Dialer.open(
                link.creds, memo=PathMemoFile(home.file(PATH_MEMO_FILE)), asking=True,
                ask_host=lambda message: ask_route(link.host.conn, message))
            await link.host.connect()
            await link.stages.reach(clock.now() + ready_timeout, alive_check, min_stages)
            link._tasks = [asyncio.ensure_future(link._keep_alive())]
        except BaseException:
            await link.close()
            raise
        return link

    plan = property(lambda self: self.stages.plan, doc="the plan the stage connections follow")
    first_conn = property(lambda self: self.stages.first)
    last_conn = property(lambda self: self.stages.last)
    dialer = property(lambda self: self.stages.dialer)
    dtype = property(lambda self: self.sender.dtype, doc="how the head's activations travel")

    @property
    def head_layers(self) -> int:
        assert self.plan is not None
        return self.plan.head_layers

    def check_model(self, gguf) -> None:
        """The asker's own copy must match the swarm's in the layers it runs itself."""
        assert self.plan is not None
        check_asker_layers(self.plan, gguf)

    # --- the Trunk interface ---

    steps_in_flight = 8  # steps of one request out at once (a long prompt's chunks; they travel in order)

    async def forward(self, rid: bytes, hidden: np.ndarray, start_pos: int, *, rewind: bool = False,
                      verify: bool = False) -> TrunkResult:
        """One step through the trunk. Several steps of one request may be out at once, handed
        over in position order (a long prompt's chunks): they travel the route in that order, and
        a failover replays the history and then every step out, in order."""
        if self.refused:
            raise SwarmError(self.refused)
        self.table.begin(rid, SentStep(start_pos, hidden, verify))
        step = self.steps.add(rid, start_pos)
        self.stats.most_steps_out = max(self.stats.most_steps_out, len(self.steps.of(rid)))
        failures = StepFailures(clock.now() + self.request_timeout)
        replayed, first_sent, attempts = 0, 0.0, 0
        try:
            while True:
                try:
                    t0 = time.perf_counter()
                    first_sent, attempts, attempt = first_sent or t0, attempts + 1, step.failures
                    # Handed over whole even if the asker gives the step up meanwhile (a window in
                    # flight that fell): a replay cut short would leave the stages a gap.
                    hand_over = asyncio.ensure_future(self.sender.hand_over(rid, start_pos, hidden, rewind, verify,
                                                                            step))
                    hand_over.add_done_callback(lambda task: task.cancelled() or task.exception())
                    replayed += await self._unless_refused(hand_over)
                    if step.failures != attempt:  # its route failed while it was being handed over
                        raise RouteFailed("the route failed as the step went out")
                    result = await step.answer(failures.deadline, self.request_timeout)
                    self.table.answered(rid, start_pos)
                    if (recovery_s := failures.recovery_s(clock.now())) is not None:
                        self._recovered(recovery_s, replayed)
                    # The round trip ends as the result's frame arrived, before this coroutine woke up.
                    received_at = step.received_at or time.perf_counter()
                    return TrunkResult(np.asarray(result.data, dtype=np.float32), result.hops, received_at - t0,
                                       sent_at=t0, received_at=received_at, sent_bytes=step.sent_bytes,
                                       received_bytes=step.received_bytes,
                                       activation_bytes=self.dtype.nbytes(*hidden.shape),
                                       first_sent_at=first_sent, attempts=attempts)
                except RouteFailed as e:
                    await self._reroute(rid, step, e, failures)
        finally:  # answered, failed, or given up by the asker (a window in flight that fell)
            self.steps.done(rid, start_pos, step)

    async def _reroute(self, rid: bytes, step: StepOut, e: RouteFailed, failures: StepFailures) -> None:
        """After the step's route failed with ``e``: its other steps on that route go again with it,
        on a new route (or, for a missing kept prefix, from position 0 on the same one); SwarmError
        when nothing can serve it (a refusal for good, its deadline)."""
        if self.refused:  # (a reroute would meet the same refusal at every stage, until the deadline)
            raise SwarmError(self.refused) from None
        if not failures.failed(clock.now()):
            raise SwarmError(f"the swarm did not answer within {self.request_timeout:.0f}s (the route "
                             f"kept failing, last: {failures.move_error or e})") from None
        if self.table.resuming(rid):  # (the replay from 0 computes the kept prefix again)
            self.recomputed.add(rid)
        if isinstance(e, PrefixLost):
            log.info("request %s: %s; replaying it from position 0", rid.hex()[:8], e)
        else:
            log.warning("request %s: route failed (%s); rerouting", rid.hex()[:8], e)
        if step.route is not None:
            self.steps.fail(str(e), [rid], on=step.route, failure=type(e))
            self.sender.carry_out(self.table.failed(rid, on=step.route))
        if isinstance(e, PrefixLost):
            return  # (the route is fine: the replay from position 0 goes on it now)
        # With a refusal for good: a new route's stages may take minutes of connects, a revocation none.
        moving = asyncio.ensure_future(self.stages.await_route(failures.deadline, failed_at=clock.now()))
        try:
            await self._unless_refused(moving)
        except RouteFailed as again:  # the new route's stages did not answer: go round again
            failures.move_error = str(again)
            log.warning("request %s: %s", rid.hex()[:8], again)
        finally:
            moving.cancel()  # (refused: no route will serve it)

    async def release(self, rid: bytes, keep: tuple[bytes, int] | None = None) -> None:
        """The request is over; ``keep`` (prefix id, positions): every stage keeps its cells
        [0, positions) as that prefix of this member's account (swarmctl/trunk/prefixes.py)."""
        self.steps.drop(rid)
        self.sender.release(rid, keep)

    # --- kept prefixes (swarmctl/asker/prefixes.py) ---

    async def keep(self, rid: bytes, prefix: bytes, positions: int) -> KeptSteps | None:
        """End the request, its route's stages keeping its cells [0, positions) as ``prefix``;
        the steps that rebuild them on another route (sending.RouteSender.keep), or None."""
        self.steps.drop(rid)
        return self.sender.keep(rid, prefix, positions)

    async def resume(self, rid: bytes, prefix: bytes, positions: int, record: KeptSteps | None) -> bool:
        """Before request ``rid``'s first step: its stages may hold ``record``'s cells as ``prefix``
        (sending.RouteSender.resume); False (nothing changed) without a record to replay."""
        return self.sender.resume(rid, prefix, positions, record)

    async def forget(self, prefix: bytes) -> None:
        """(The stages drop a prefix nobody resumes on their own: their budget and idle limits.)"""

    # --- for spot checks (swarmctl/asker/verify.py) ---

    def sent_steps(self, rid: bytes) -> list[tuple[int, np.ndarray]]:
        """The request's steps the swarm answered, oldest first: (start position, the activations
        as the head computed them). The same record a failover replays."""
        return [(s.start_pos, s.hidden) for s in self.table.history(rid)]

    async def run_stage(self, stage: int, steps: list[tuple[int, np.ndarray]]) -> np.ndarray:
        """``steps`` through the current plan's stage ``stage`` alone (sending.RouteSender.run_stage):
        the last step's result; one attempt, no failover (a failure raises SwarmError)."""
        return await self.sender.run_stage(stage, steps, self.request_timeout, self)

    def route_members(self, rid: bytes) -> list[str]:
        """The members whose stages run the request's steps now: the current plan's route."""
        return [s.member for s in self.plan.stages] if self.plan is not None else []

    def describe_nodes(self) -> dict[str, str]:
        """What each member on the current plan's route holds, for the trace."""
        if self.plan is None:
            return {}
        return {**{s.member: f"layers [{s.start}, {s.stop})" for s in self.plan.stages},
                **{e.member: f"experts [{e.start}, {e.stop}) of every MoE layer" for e in self.plan.experts}}

    async def report(self, message: m.Message) -> None:
        """Tell the host something (a control message); its answer is not needed."""
        await self.host.tell(message)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.stages.close()

    # --- failures ---

    def _plan_arrived(self, plan: Plan | None) -> None:
        if plan is not None and self.plan is not None and plan.version != self.plan.version:
            # the route the waiting steps travel is gone: reroute them now, not at a timeout
            self.steps.fail(f"the plan changed to v{plan.version}", self.table.plan_changed(plan.version))

    async def _unless_refused(self, work: asyncio.Future):
        """``work``'s result, or SwarmError once a refusal for good arrives (``work`` goes on)."""
        refused = asyncio.ensure_future(self._refusal.wait())
        try:
            done, _ = await asyncio.wait({work, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()
        if work in done:
            return work.result()
        raise SwarmError(self.refused)

    def still_served(self) -> None:
        """While waiting for a complete plan: a refusal for good ends the wait (it said why)."""
        if self.refused:
            raise SwarmError(self.refused)

    def refused_for_good(self, reason: str) -> str:
        """Every step out ends with ``reason`` now, and every step after it too: a refusal that
        holds at every node (a revocation) is the request's answer, not a route to replace."""
        # (said from the refusal on, and the first one: "cannot connect to ADDRESS: " is no news)
        self.refused = self.refused or refusal(reason) or reason
        self._refusal.set()
        self.steps.end_all(SwarmError(self.refused))
        return self.refused

    async def _keep_alive(self) -> None:
        """Ping the stages and the host every second; a stage gone silent while steps wait on it
        fails them over at once (the host marks it down on its own within seconds too); steps a
        live route left unanswered too long are resent; a lost host connection is re-established."""
        silences = SilenceClock(PING_INTERVAL)
        while True:
            await asyncio.sleep(PING_INTERVAL)
            silences.tick()
            for conn in (c for c in each_once(self.host.conn, self.first_conn, self.last_conn) if c.is_open):
                asyncio.ensure_future(quiet_ping(conn))
            heard = [(c.peer_name, silences.silence(c)) for c in (self.first_conn, self.last_conn) if c is not None]
            tick = on_tick(bool(self.table.waiting()), heard, self.policy)
            if isinstance(tick, Silent):
                self.steps.fail(f"stage {tick.member} went silent", self.table.waiting())
            elif tick == CHECK_STALLS:
                self._fail_stalled()
            self.host.give_up_if_silent(silences)  # (before QUIC's idle timeout, which a slow link stretches)
            if not self.host.is_open and not self.refused:  # (a revoked member knocks no more)
                try:
                    self._plan_arrived(await self.host.connect())
                    log.info("reconnected to the host")
                except (SwarmError, ConnectionError, OSError, asyncio.TimeoutError) as e:
                    if refusal(str(e)) is not None:
                        self.refused_for_good(str(e))

    def _fail_stalled(self) -> None:
        """Fail over each request with a step out longer than its stall limit on a route whose
        stages answer pings (a silent one is failed over by ``_keep_alive`` sooner)."""
        per_row_s = self.plan.expected_ms_per_token / 1000 if self.plan is not None else 0.0
        for rid, step, limit in self.steps.stalled(self.table.waiting(), clock.now(), per_row_s, self.policy):
            self.stats.stalls += 1
            log.warning("request %s: no answer in %.0fs from a route that answers pings; resending it on a "
                        "fresh route", rid.hex()[:8], limit)
            self.steps.fail(f"no answer in {limit:.0f}s", [rid], on=step.route)

    def _recovered(self, seconds: float, replayed: int) -> None:
        self.stats.recoveries += 1
        self.stats.replayed_bytes += replayed
        self.stats.last_recovery_s = seconds
        log.info("rerouted a request in %.2fs, replaying %.1f KB", seconds, replayed / 1e3)
        asyncio.ensure_future(self.host.tell(m.Recovered(recovery_s=seconds, replayed_bytes=replayed)))

    # --- ConnectionHandler ---

    def connection_made(self, conn: SwarmProtocol) -> None:
        pass

    def connection_lost(self, conn: SwarmProtocol) -> None:
        if refusal(conn.close_reason) is not None:  # closed by a node that will refuse us from now on: no reroute
            self.refused_for_good(conn.close_reason)
            return
        if conn in (self.first_conn, self.last_conn):
            self.steps.fail(f"lost the connection to {conn.peer_name}", self.table.waiting())
            return
        # A connection the link already replaced: steps still out on a route over it (sent just
        # before the move) fail over too, or they would wait for answers that cannot come.
        for rid, route in self.steps.routes_over(conn):
            self.steps.fail(f"lost the connection to {conn.peer_name}", [rid], on=route)

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        pass

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if self.host.is_watch_stream(conn, stream_id) and frame.type == FrameType.CONTROL:
            self._plan_arrived(self.host.received(frame.body))
            return
        if frame.type != FrameType.ACTIVATION:
            return
        try:
            packet = decode_packet(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        rid = packet.request_id
        error = packet.kind == PacketKind.ERROR
        if not self.table.is_answer(rid, conn, stream_id, packet.start_pos, error):
            return  # results of replayed steps, and errors of an abandoned route, are not what it waits for
        verdict = answer_verdict(packet.retry, bool(self.table.resuming(rid))) if error else None
        if verdict in (Answer.REROUTE, Answer.REPLAY):
            # (on a resumed request's first route, a retry is its kept prefix missing somewhere)
            self.steps.fail(packet.message, [rid], failure=PrefixLost if verdict == Answer.REPLAY else RouteFailed)
            return
        self.steps.answer(rid, packet, error, time.perf_counter(), FRAME_HEADER.size + len(frame.body))
