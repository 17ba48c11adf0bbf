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
from net.endpoint import close
from net.identity import REVOKED_REASON, Credentials, is_revocation
from net.liveness import PING_INTERVAL, SILENCE_LIMIT, SilenceClock
from net.ping import quiet_ping
from net.protocol import SwarmProtocol
from net import messages as m
from net.wire import FRAME_HEADER, ActivationPacket, DType, Frame, FrameType, PacketKind, WireError, decode_packet, \
    encode_packet
from plans.plan import Plan
from swarmctl.asker.head_tail import TrunkResult
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.reaching.path_memo import FILE_NAME as PATH_MEMO_FILE, PathMemoFile
from swarmctl.asker.replay import Action, Free, OpenRoute, ReplayTable, SentStep, cut_steps
from swarmctl.asker.plan_watch import PlanWatch, SwarmError, cannot_serve
from swarmctl.reaching.reach import Dialer, ask_route

__all__ = ["SwarmError", "SwarmLink"]

log = logging.getLogger("swarmctl.client")

SEND_BACKLOG = 8 * 1024 * 1024
NO_PLAN_GRACE = 20.0  # how long to wait for the swarm to become whole again before giving up
STAGE_RETRY_S = 1.0  # a stage that did not answer as the link opened is tried again after this (or a new plan)
SAME_ROUTE_RETRY_S = 2 * SILENCE_LIMIT  # a route that failed on a plan that stays is tried again after this
# A step whose route answers pings but not the step is resent on a fresh route after the larger of
# STALL_MIN_S and STALL_FACTOR times what the plan expects its rows (and those ahead of it) to take;
# twice that at each further stall of the same step. Nothing should lose a step on a live route;
# this bounds what it costs if something does (before, the step waited for the request's deadline).
STALL_MIN_S = 30.0
STALL_FACTOR = 20.0


@dataclass(frozen=True)
class KeptSteps:
    """What rebuilds a kept prefix's cells on a route: the steps as sent, and the plan they ran under."""

    steps: list[SentStep]
    plan_version: int


class _RouteFailed(Exception):
    """The route broke, not the request: reroute and replay."""


class _PrefixLost(_RouteFailed):
    """A stage of a resumed request's first route does not hold its kept prefix (evicted,
    restarted, replanned): the same route replays the steps from position 0, at once."""


@dataclass
class _Waiting:
    """The I/O side of a step out (the replay table keeps the rest). A route failure fails
    ``result`` and puts a fresh one in its place at once, so an answer that a replay brings back
    before the step's coroutine woke up still finds it."""

    result: asyncio.Future
    route: OpenRoute | None = None  # where it was last sent
    failures: int = 0  # route failures it was told of (one may come while the step is being handed over)
    sent_bytes: int = 0  # the waiting step's frame as sent, and its result's as received (for the trace)
    received_bytes: int = 0
    received_at: float = 0.0  # time.perf_counter() as the result's frame arrived
    sent_at: float = 0.0  # clock.now() as it was last sent on a route
    rows: int = 0  # rows the route runs before this step's answer (its own, and its request's ahead of it)
    patience: float = 1.0  # doubled at each stall (a stage that is only slow is not asked again and again)

    def sent(self, route: OpenRoute, rows: int) -> None:
        self.route, self.sent_at, self.rows = route, clock.now(), rows

    def overdue(self, per_row_s: float, min_s: float) -> float | None:
        """Its stall limit (min_s, or STALL_FACTOR times ``per_row_s`` for its rows, times its
        patience) when it has waited longer than that on its route, else None; the patience
        doubles then."""
        if self.route is None or not self.sent_at or self.result.done():
            return None
        limit = max(min_s, STALL_FACTOR * per_row_s * self.rows) * self.patience
        if clock.now() - self.sent_at <= limit:
            return None
        self.patience *= 2
        return limit


@dataclass
class LinkStats:
    """Failovers the link carried out, and how far requests streamed."""

    recoveries: int = 0
    replayed_bytes: int = 0
    last_recovery_s: float | None = None
    most_steps_out: int = 0  # the most steps of one request out at once (a long prompt's chunks stream)
    stalls: int = 0  # steps resent because a live route did not answer them in time (STALL_MIN_S)


class SwarmLink:
    def __init__(self, config: NodeConfig, creds: Credentials, *, request_timeout: float = 300.0,
                 dtype: DType | None = None, trace: bool = False) -> None:
        """``dtype``: how the head's activations travel to the first stage (None: as the plan says,
        plans/wire.py); ``trace``: ask every stage to list its expert calls in its hop record (for
        ``--trace``; it costs bytes on every hop, so it is off otherwise)."""
        self.config = config
        self.creds = creds
        self.request_timeout = request_timeout
        self.stall_min_s = STALL_MIN_S
        self._dtype = dtype
        self.trace = trace
        self.plan: Plan | None = None  # the plan the stage connections follow
        self.host = PlanWatch(config, creds, self, self._connect_host)  # the newest plan, as the host pushes it
        self.first_conn: SwarmProtocol | None = None
        self.last_conn: SwarmProtocol | None = None
        self.stats = LinkStats()
        # This process's results address at the last stage: other processes of the same member
        # (another terminal, serve, top) subscribe with their own, so results never cross.
        self.session = secrets.token_hex(16)
        self.table = ReplayTable()  # what each request's stages hold, and its stream (swarmctl/asker/replay.py)
        self._waiting: dict[bytes, dict[int, _Waiting]] = {}  # request → start position → its step out
        self._sending: dict[bytes, asyncio.Lock] = {}  # a request's sends and replays, one at a time, in order
        self._reconnecting: asyncio.Lock | None = None
        self._moved_at = 0.0  # when the stage connections last moved (requests failing together move once)
        self._tasks: list[asyncio.Task] = []
        self.dialer: Dialer | None = None  # our swarm socket, and the path to each stage (swarmctl/reaching/reach.py)
        self.recomputed: set[bytes] = set()  # resumed requests whose kept prefix a stage lacked (replayed)
        self._resumed_under: dict[bytes, int] = {}  # resumed request → the plan its prefix was kept under
        self.refused = ""  # why no route can serve this member any more (its revocation), once a node said so
        self._refusal = asyncio.Event()  # set with it

    @classmethod
    async def open(cls, home: SwarmHome, *, ready_timeout: float = 60.0,
                   alive_check: Callable[[], None] | None = None, min_stages: int = 1, **kwargs) -> "SwarmLink":
        """Connect to the swarm's host, wait for a complete plan (of at least ``min_stages`` stages:
        a local swarm knows how many trunks it started), connect to the first and last stage."""
        link = cls(home.load_config(), home.credentials(), **kwargs)
        try:
            link.dialer = await Dialer.open(link.creds, memo=PathMemoFile(home.file(PATH_MEMO_FILE)), asking=True,
                                            ask_host=lambda message: ask_route(link.host.conn, message))
            await link.host.connect()
            await link._reach_stages(clock.now() + ready_timeout, alive_check, min_stages)
            link._tasks = [asyncio.ensure_future(link._keep_alive())]
        except BaseException:
            await link.close()
            raise
        return link

    async def _reach_stages(self, deadline: float, alive_check: Callable[[], None] | None, min_stages: int) -> None:
        """A complete plan and connections to its first and last stage, by ``deadline``. A stage
        that does not answer (one that just died, before the host noticed; one too busy to finish
        a handshake in time) is tried again, on the next plan if one comes, until the deadline;
        the last failure is raised then."""
        while True:
            self.plan = await self.host.complete(max(1.0, deadline - clock.now()), alive_check, min_stages)
            try:
                await self._connect_stages()
                return
            except (ConnectionError, OSError, asyncio.TimeoutError) as e:
                for conn in {self.first_conn, self.last_conn} - {None}:
                    await close(conn)
                self.first_conn = self.last_conn = None
                if clock.now() + STAGE_RETRY_S > deadline:
                    raise
                log.warning("cannot reach plan v%d's stages (%s); trying again", self.plan.version, e)
                await self.host.changed(STAGE_RETRY_S)  # a new plan, or a pause before the same again

    async def _connect_host(self, addresses: list[str]) -> SwarmProtocol:
        """The host, from our swarm socket (so the host sees where it leads and answers our reach)."""
        if self.dialer is None:
            raise ConnectionError("the link has no socket yet")
        return await self.dialer.connect_host(addresses, self.config.host_name, self)

    @property
    def dtype(self) -> DType:
        if self._dtype is not None:
            return self._dtype
        return self.plan.entry_dtype if self.plan is not None else DType.F32

    @property
    def head_layers(self) -> int:
        assert self.plan is not None
        return self.plan.head_layers

    def check_model(self, gguf) -> None:
        """The asker's own copy must match the swarm's in the layers it runs itself."""
        assert self.plan is not None
        k, n = self.plan.head_layers, self.plan.n_layer
        for layer in [*range(k), *range(n - k, n)]:
            if layer >= len(self.plan.layer_hashes) or gguf.layer_hash(layer) != self.plan.layer_hashes[layer]:
                raise SwarmError(f"your copy of the model differs from the swarm's ({self.plan.model_name}) "
                                 f"in layer {layer}; use --model with the swarm's GGUF")

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
        out = self._waiting.setdefault(rid, {})
        waiting = out[start_pos] = _Waiting(asyncio.get_running_loop().create_future())
        self.stats.most_steps_out = max(self.stats.most_steps_out, len(out))
        deadline = clock.now() + self.request_timeout
        failed_at: float | None = None
        replayed = 0
        unreachable = ""  # why the last move to a new route failed, if one did
        try:
            while True:
                try:
                    t0 = time.perf_counter()
                    attempt = waiting.failures
                    # Handed over whole even if the asker gives the step up meanwhile (a window in
                    # flight that fell): a replay cut short would leave the stages a gap.
                    hand_over = asyncio.ensure_future(self._hand_over(rid, start_pos, hidden, rewind, verify, waiting))
                    hand_over.add_done_callback(lambda task: task.cancelled() or task.exception())
                    replayed += await self._unless_refused(hand_over)
                    if waiting.failures != attempt:  # its route failed while it was being handed over
                        raise _RouteFailed("the route failed as the step went out")
                    result = await self._answer(waiting, deadline)
                    self.table.answered(rid, start_pos)
                    if failed_at is not None:
                        self._recovered(clock.now() - failed_at, replayed)
                    # The round trip ends as the result's frame arrived, before this coroutine woke up.
                    received_at = waiting.received_at or time.perf_counter()
                    return TrunkResult(np.asarray(result.data, dtype=np.float32), result.hops, received_at - t0,
                                       sent_at=t0, received_at=received_at, sent_bytes=waiting.sent_bytes,
                                       received_bytes=waiting.received_bytes,
                                       activation_bytes=self.dtype.nbytes(*hidden.shape))
                except _RouteFailed as e:
                    if self.refused:  # (a reroute would meet the same refusal at every stage, until the deadline)
                        raise SwarmError(self.refused) from None
                    failed_at = failed_at or clock.now()
                    if clock.now() > deadline:
                        raise SwarmError(f"the swarm did not answer within {self.request_timeout:.0f}s (the route "
                                         f"kept failing, last: {unreachable or e})") from None
                    if self.table.resuming(rid):  # (the replay from 0 computes the kept prefix again)
                        self.recomputed.add(rid)
                    if isinstance(e, _PrefixLost):
                        log.info("request %s: %s; replaying it from position 0", rid.hex()[:8], e)
                    else:
                        log.warning("request %s: route failed (%s); rerouting", rid.hex()[:8], e)
                    if waiting.route is not None:  # (its other steps on that route go again with it)
                        self._fail_waiting(str(e), [rid], on=waiting.route, failure=type(e))
                        self._carry_out(self.table.failed(rid, on=waiting.route))
                    if isinstance(e, _PrefixLost):
                        continue  # (the route is fine: the replay from position 0 goes on it now)
                    try:
                        await self._await_reroute(deadline, failed_at=clock.now())
                    except _RouteFailed as again:  # the new route's stages did not answer: go round again
                        unreachable = str(again)
                        log.warning("request %s: %s", rid.hex()[:8], again)
        finally:  # answered, failed, or given up by the asker (a window in flight that fell)
            if self._waiting.get(rid, {}).get(start_pos) is waiting:
                del self._waiting[rid][start_pos]

    async def release(self, rid: bytes, keep: tuple[bytes, int] | None = None) -> None:
        """The request is over; ``keep`` (prefix id, positions): every stage keeps its cells
        [0, positions) as that prefix of this member's account (swarmctl/trunk/prefixes.py)."""
        self._waiting.pop(rid, None)
        self._sending.pop(rid, None)
        self.recomputed.discard(rid)
        self._resumed_under.pop(rid, None)
        self._carry_out(self.table.release(rid, self.plan.version, keep), rid)

    # --- kept prefixes (swarmctl/asker/prefixes.py) ---

    async def keep(self, rid: bytes, prefix: bytes, positions: int) -> KeptSteps | None:
        """End the request, asking the route's stages to keep its cells [0, positions) as
        ``prefix``; returns the steps that rebuild them on another route (None: this link did
        not send them all, and the prefix cannot be resumed here)."""
        history = cut_steps(self.table.history(rid), positions)
        covered = sum(s.hidden.shape[0] for s in history)
        whole = covered == positions and all(s.start_pos == sum(h.hidden.shape[0] for h in history[:i])
                                             for i, s in enumerate(history))
        version = self.plan.version
        await self.release(rid, keep=(prefix, positions) if whole else None)
        return KeptSteps(history, version) if whole else None

    async def resume(self, rid: bytes, prefix: bytes, positions: int, record: KeptSteps | None) -> bool:
        """Before request ``rid``'s first step: its route's stages may hold ``record``'s cells cut to
        ``positions`` as ``prefix``; if any does not, the link replays them from position 0. Under
        another plan than the one they ran under it replays them at once (its stages, or how
        activations travel between them, may differ: the cells a plain run makes there may too).
        False (nothing changed) without a record to replay."""
        if record is None:
            return False
        same_plan = record.plan_version == self.plan.version
        if same_plan:
            self._resumed_under[rid] = record.plan_version
        else:
            self.recomputed.add(rid)
        self.table.resume(rid, prefix if same_plan else b"", cut_steps(record.steps, positions))
        return True

    async def forget(self, prefix: bytes) -> None:
        """(The stages drop a prefix nobody resumes on their own: their budget and idle limits.)"""

    def _carry_out(self, actions: list[Action], rid: bytes = b"") -> None:
        for action in actions:
            if not action.conn.is_open:
                continue
            if isinstance(action, Free):
                action.conn.finish(action.stream_id)  # abandoned: let QUIC forget it
                continue
            keep = getattr(action, "keep", None)
            end = ActivationPacket(PacketKind.END, rid, self.plan.version, self.plan.head_layers,
                                   keep[1] if keep else 0, np.empty((0, 0), np.float32),
                                   prefix=keep[0] if keep else b"")
            try:
                action.conn.send(action.stream_id, encode_packet(end), end=True)
            except ConnectionError:
                pass  # the stage already reset the stream: it holds nothing for this request

    # --- for spot checks (swarmctl/asker/verify.py) ---

    def sent_steps(self, rid: bytes) -> list[tuple[int, np.ndarray]]:
        """The request's steps the swarm answered, oldest first: (start position, the activations
        as the head computed them). The same record a failover replays."""
        return [(s.start_pos, s.hidden) for s in self.table.history(rid)]

    async def run_stage(self, stage: int, steps: list[tuple[int, np.ndarray]]) -> np.ndarray:
        """Run ``steps`` (start position, activations at the stage's first layer) as a new request
        through the current plan's stage ``stage`` alone, which sends each result back (ONE_STAGE);
        returns the last step's. For ``--verify``'s re-check stage by stage: one attempt, no
        failover (a failure raises SwarmError)."""
        target = self.plan.stages[stage]
        rid = secrets.token_bytes(16)
        conn = self.first_conn if stage == 0 else self.last_conn if stage == len(self.plan.stages) - 1 else \
            await self.dialer.connect(target.member, target.address, self)
        deadline = clock.now() + self.request_timeout
        try:
            stream_id = conn.open_stream()
            self.table.opened(rid, conn, stream_id, self.plan.version)
            route = OpenRoute(conn, stream_id, self.plan.version)
            result = None
            for start_pos, hidden in steps:
                self.table.begin(rid, SentStep(start_pos, hidden[:0], False))  # (nothing to replay: one attempt)
                waiting = self._waiting.setdefault(rid, {})[start_pos] = _Waiting(
                    asyncio.get_running_loop().create_future())
                self.table.to_send(rid, start_pos)
                self._send(rid, route, hidden, start_pos, layer=target.start)
                waiting.sent(route, hidden.shape[0])
                try:
                    result = await self._answer(waiting, deadline)
                except _RouteFailed as e:
                    raise SwarmError(f"stage {target.member} did not answer the check: {e}") from None
                self.table.answered(rid, start_pos)
            return np.asarray(result.data, dtype=np.float32)
        finally:
            await self.release(rid)
            if conn not in (self.first_conn, self.last_conn):
                await close(conn)

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
        for conn in {self.host.conn, self.first_conn, self.last_conn} - {None}:
            await close(conn)
        if self.dialer is not None:
            self.dialer.close()

    # --- one step, and the route it travels ---

    async def _hand_over(self, rid: bytes, start_pos: int, hidden: np.ndarray, rewind: bool, verify: bool,
                         waiting: _Waiting) -> int:
        """Send the step on the request's route, opening one (and replaying) where it has none;
        a request's sends one at a time, so its steps travel in order. Returns the bytes replayed."""
        async with self._sending.setdefault(rid, asyncio.Lock()):
            replayed = 0
            route = self.table.route(rid, self.plan.version)
            if route is None:
                route, replayed = await self._open_route(rid)  # (sends this step too)
            elif self.table.to_send(rid, start_pos):
                waiting.route = route
                waiting.sent_bytes = self._send(rid, route, hidden, start_pos, rewind, verify)
                waiting.sent(route, sum(s.hidden.shape[0] for s in self.table.out(rid) if s.start_pos <= start_pos))
            await route.conn.drain(route.stream_id, SEND_BACKLOG)
            return replayed

    async def _answer(self, waiting: _Waiting, deadline: float) -> ActivationPacket:
        """The step's result, as it arrives (a route failure raises _RouteFailed)."""
        try:
            result = await asyncio.wait_for(asyncio.shield(waiting.result), max(0.1, deadline - clock.now()))
        except asyncio.TimeoutError:
            raise SwarmError(f"the swarm did not answer within {self.request_timeout:.0f}s") from None
        if result.kind == PacketKind.ERROR:
            raise SwarmError(f"the swarm refused the request: {result.message}")
        return result

    def _send(self, rid: bytes, route: OpenRoute, hidden: np.ndarray, start_pos: int, rewind: bool = False,
              verify: bool = False, layer: int | None = None, prefix: bytes = b"") -> int:
        """Send one step (activations at ``layer``: the head's output unless said, and then the
        step comes back from that stage alone; ``prefix``: the stages start from that kept
        prefix); returns the frame's size in bytes."""
        kind = PacketKind.PREFILL if hidden.shape[0] > 1 or start_pos == 0 or prefix else PacketKind.DECODE
        packet = ActivationPacket(kind, rid, route.version, self.plan.head_layers if layer is None else layer,
                                  start_pos, hidden, self.dtype, self.session, rewind=rewind, verify=verify,
                                  trace=self.trace, one_stage=layer is not None, prefix=prefix)
        if not route.conn.is_open:
            raise _RouteFailed("the connection to the first stage is closed")
        frame = encode_packet(packet)
        try:
            route.conn.send(route.stream_id, frame)
        except ConnectionError as e:  # the stage reset the stream, or the connection just closed
            raise _RouteFailed(str(e)) from None
        return len(frame)

    def _fail_stalled(self) -> None:
        """Fail over each request with a step out longer than its stall limit on a route whose
        stages answer pings (a silent one is failed over by ``_keep_alive`` sooner)."""
        per_row_s = self.plan.expected_ms_per_token / 1000 if self.plan is not None else 0.0
        for rid in self.table.waiting():
            for waiting in self._waiting.get(rid, {}).values():
                limit = waiting.overdue(per_row_s, self.stall_min_s)
                if limit is not None:
                    self.stats.stalls += 1
                    log.warning("request %s: no answer in %.0fs from a route that answers pings; resending it on a "
                                "fresh route", rid.hex()[:8], limit)
                    self._fail_waiting(f"no answer in {limit:.0f}s", [rid], on=waiting.route)
                    break

    async def _open_route(self, rid: bytes) -> tuple[OpenRoute, int]:
        """A new stream on the current route, and every step the swarm held for the request
        replayed on it back to back (the stages run them in order; their results are not waited
        for), then the request's steps out. Returns the route and the bytes replayed."""
        if self.host.latest is not None and self.host.latest.version != self.plan.version:
            await self._follow_plan()
        if not self._stages_alive():  # (a move to this plan that could not reach its stages)
            raise _RouteFailed("no open connection to the route's first and last stage")
        conn = self.first_conn
        stream_id = conn.open_stream()
        route = OpenRoute(conn, stream_id, self.plan.version)
        replayed = 0
        if self.table.resuming(rid) and self._resumed_under.get(rid) != self.plan.version:
            self.table.give_up_resume(rid)  # (a plan moved on since the prefix was kept: replay it)
            self.recomputed.add(rid)
        prefix = self.table.resuming(rid)  # the stages may hold the history: its first step out names it
        answered = 0 if prefix else len(self.table.history(rid))
        steps = self.table.opened(rid, conn, stream_id, self.plan.version)
        for waiting in self._waiting.get(rid, {}).values():
            waiting.route = route  # (every step out goes on it now)
        rows = 0
        for i, sent in enumerate(steps):
            size = self._send(rid, route, sent.hidden, sent.start_pos, verify=sent.verify,
                              prefix=prefix if i == 0 else b"")
            rows += sent.hidden.shape[0]
            if i < answered:
                replayed += sent.hidden.nbytes
            elif (waiting := self._waiting.get(rid, {}).get(sent.start_pos)) is not None:
                waiting.sent_bytes = size
                waiting.sent(route, rows)
            await conn.drain(stream_id, SEND_BACKLOG)
        return route, replayed

    async def _await_reroute(self, deadline: float, failed_at: float) -> None:
        """After a route failure at ``failed_at``: the host's next complete plan, or, if the plan
        stays the same (a link that dropped and came back), the same route again after a pause.
        Within the deadline and a grace for a swarm that has lost capacity. A step whose request's
        other steps already moved the link since it failed goes on the connections they made."""
        if self._moved_at > failed_at:
            return
        failed_version = self.plan.version
        retry_same_at = clock.now() + SAME_ROUTE_RETRY_S
        give_up = min(deadline, clock.now() + NO_PLAN_GRACE)
        while True:
            if self.refused:
                raise SwarmError(self.refused)
            plan = self.host.latest
            now = clock.now()
            if plan is not None and plan.complete and (plan.version != failed_version or now > retry_same_at):
                await self._follow_plan(force=plan.version == failed_version, since=failed_at)
                return
            if now > give_up:
                raise SwarmError(cannot_serve(plan))
            await self.host.changed()

    def _stages_alive(self) -> bool:
        return all(c is not None and c.is_open for c in (self.first_conn, self.last_conn))

    # --- plans and connections ---

    async def _connect_stages(self, fresh: bool = True) -> None:
        """Connections to the plan's first and last stage; live ones to the same members are kept
        unless ``fresh`` (after a failure on the same plan they may be dead without knowing it)."""
        first, last = self.plan.stages[0], self.plan.stages[-1]

        async def conn_to(member: str, address: str, current: SwarmProtocol | None) -> SwarmProtocol:
            if not fresh and current is not None and current.is_open and current.peer_name == member:
                return current
            return await self.dialer.connect(member, address, self)

        self.first_conn = await conn_to(first.member, first.address, self.first_conn)
        self.last_conn = self.first_conn if last.member == first.member else \
            await conn_to(last.member, last.address, self.last_conn)
        try:
            m.decode((await self.last_conn.request(m.encode(m.Subscribe(session=self.session)))).body, m.Ok)
        except (m.Refused, WireError) as e:
            raise SwarmError(f"the last stage refused the results stream: {e}") from None
        log.info("swarm plan v%d: %s", self.plan.version,
                 ", ".join(f"{s.member}[{s.start},{s.stop})" for s in self.plan.stages))

    async def _follow_plan(self, force: bool = False, since: float | None = None) -> None:
        """Move to the newest complete plan: new connections to its first and last stage (also on
        the same plan when ``force``: the old connections may be dead without knowing it yet).
        ``since``: when the failure that calls for it happened; a move made after it (by another
        step, while this one waited or before it came to ask) is the one it needed. Moving again
        would close the connections that step's replay went out on."""
        if self._reconnecting is None:
            self._reconnecting = asyncio.Lock()
        moved_at = self._moved_at if since is None else since
        async with self._reconnecting:
            if self._moved_at > moved_at:
                return  # another request moved while this one waited for the lock
            if not force and self.host.latest is not None and self.host.latest.version == self.plan.version \
                    and self._stages_alive():
                return
            self.plan = await self.host.complete(self.request_timeout, self._still_served)
            old = {c for c in (self.first_conn, self.last_conn) if c is not None}
            for attempt in range(3):
                try:
                    await self._connect_stages(fresh=force or attempt > 0)
                    break
                except (ConnectionError, OSError, SwarmError, asyncio.TimeoutError) as e:
                    if is_revocation(str(e)):
                        self._refused_for_good(str(e))
                        raise SwarmError(self.refused) from None
                    if attempt == 2:
                        raise _RouteFailed(f"cannot connect to the new route: {e}") from None
                    await asyncio.sleep(0.5)
            for conn in old - {self.first_conn, self.last_conn}:
                asyncio.ensure_future(close(conn))
            self._moved_at = clock.now()

    def _plan_arrived(self, plan: Plan | None) -> None:
        if plan is not None and self.plan is not None and plan.version != self.plan.version:
            # the route the waiting steps travel is gone: reroute them now, not at a timeout
            self._fail_waiting(f"the plan changed to v{plan.version}", self.table.plan_changed(plan.version))

    def _fail_waiting(self, reason: str, rids: list[bytes] | None = None, on: OpenRoute | None = None,
                      failure: type[_RouteFailed] = _RouteFailed) -> None:
        """Fail over the steps out of ``rids`` (default: every request waiting on a route); ``on``:
        only those sent on that route (another of the request's steps may be on a new one already)."""
        loop = asyncio.get_running_loop()
        for rid in self.table.waiting() if rids is None else rids:
            for waiting in self._waiting.get(rid, {}).values():
                if on is not None and waiting.route != on:
                    continue
                if not waiting.result.done():
                    waiting.failures += 1
                    waiting.result.set_exception(failure(reason))
                    waiting.result.exception()  # (seen: its coroutine may be rerouting already, not awaiting it)
                    waiting.result = loop.create_future()

    async def _unless_refused(self, work: asyncio.Future):
        """``work``'s result, or SwarmError as soon as a refusal for good arrives (a step being
        handed over may be waiting minutes to reach a route's stages; ``work`` goes on)."""
        refused = asyncio.ensure_future(self._refusal.wait())
        try:
            done, _ = await asyncio.wait({work, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()
        if work in done:
            return work.result()
        raise SwarmError(self.refused)

    def _still_served(self) -> None:
        """While waiting for a complete plan: a refusal for good ends the wait (it said why)."""
        if self.refused:
            raise SwarmError(self.refused)

    def _refused_for_good(self, reason: str) -> None:
        """Every step out ends with ``reason`` now, and every step after it too: a refusal that
        holds at every node (a revocation) is the request's answer, not a route to replace."""
        if not self.refused:  # (said from the refusal on: "cannot connect to ADDRESS: " is no news)
            self.refused = f"the swarm refused the request: {reason[reason.index(REVOKED_REASON):]}"
        self._refusal.set()
        for steps in self._waiting.values():
            for waiting in steps.values():
                if not waiting.result.done():
                    waiting.result.set_exception(SwarmError(self.refused))
                    waiting.result.exception()  # (its coroutine may be between awaits, not awaiting it)

    async def _keep_alive(self) -> None:
        """Ping the stages and the host every second; a stage gone silent while steps wait on it
        fails them over at once (the host marks it down on its own within seconds too); a lost
        host connection is re-established (a restarted host)."""
        clock = SilenceClock(PING_INTERVAL)
        while True:
            await asyncio.sleep(PING_INTERVAL)
            clock.tick()
            for conn in {self.host.conn, self.first_conn, self.last_conn} - {None}:
                if conn.is_open:
                    asyncio.ensure_future(quiet_ping(conn))
            waiting = bool(self.table.waiting())
            silent = [c for c in (self.first_conn, self.last_conn) if c is not None and
                      clock.silence(c) > SILENCE_LIMIT]
            if waiting and silent:
                self._fail_waiting(f"stage {silent[0].peer_name} went silent")
            elif waiting:
                self._fail_stalled()
            if not self.host.is_open and not self.refused:  # (a revoked member knocks no more)
                try:
                    self._plan_arrived(await self.host.connect())
                    log.info("reconnected to the host")
                except (SwarmError, ConnectionError, OSError, asyncio.TimeoutError) as e:
                    if is_revocation(str(e)):
                        self._refused_for_good(str(e))

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
        if is_revocation(conn.close_reason):  # closed by a node that will refuse us from now on: no reroute
            self._refused_for_good(conn.close_reason)
            return
        if conn in (self.first_conn, self.last_conn):
            self._fail_waiting(f"lost the connection to {conn.peer_name}")
            return
        # A connection the link already replaced: steps still out on a route over it (sent just
        # before the move) fail over too, or they would wait for answers that cannot come.
        for rid, steps in self._waiting.items():
            routes = {w.route for w in steps.values() if w.route is not None and w.route.conn is conn}
            for route in routes:
                self._fail_waiting(f"lost the connection to {conn.peer_name}", [rid], on=route)

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
        if error and packet.retry:
            # (on a resumed request's first route, a retry is its kept prefix missing somewhere)
            self._fail_waiting(packet.message, [rid], failure=_PrefixLost if self.table.resuming(rid) else _RouteFailed)
            return
        for pos, waiting in self._waiting.get(rid, {}).items():
            if (error or pos == packet.start_pos) and not waiting.result.done():
                if not error:
                    waiting.received_at = time.perf_counter()
                    waiting.received_bytes = FRAME_HEADER.size + len(frame.body)
                waiting.result.set_result(packet)
