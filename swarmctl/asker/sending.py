"""A request's stream on the asker link's current route: opened (replaying what the new stages
must hold), each step sent on it in order, ended or freed at the end. The replay table
(``swarmctl/asker/replay.py``) decides what goes; this sends it."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import numpy as np

from net import clock
from net.endpoint import close
from net.protocol import ConnectionHandler
from net.wire import ActivationPacket, DType, PacketKind, encode_packet
from plans.plan import Plan
from swarmctl.asker.link_core import RouteFailed
from swarmctl.asker.plan_watch import SwarmError
from swarmctl.asker.replay import Action, Free, OpenRoute, ReplayTable, SentStep, cut_steps, rebuilds
from swarmctl.asker.stage_links import StageLinks
from swarmctl.asker.steps_out import StepOut, StepsOut

SEND_BACKLOG = 8 * 1024 * 1024


@dataclass(frozen=True)
class KeptSteps:
    """What rebuilds a kept prefix's cells on a route: the steps as sent, and the plan they ran under."""

    steps: list[SentStep]
    plan_version: int


class RouteSender:
    def __init__(self, stages: StageLinks, steps: StepsOut, *, dtype: DType | None = None,
                 trace: bool = False) -> None:
        """``dtype``: how the head's activations travel to the first stage (None: as the plan says,
        plans/wire.py); ``trace``: ask every stage to list its expert calls in its hop record (for
        ``--trace``; it costs bytes on every hop, so it is off otherwise)."""
        self.stages, self.steps = stages, steps
        self.dtype_override, self.trace = dtype, trace
        self.table = ReplayTable()  # what each request's stages hold, and its stream
        self._sending: dict[bytes, asyncio.Lock] = {}  # a request's sends and replays, one at a time, in order
        self.recomputed: set[bytes] = set()  # resumed requests whose kept prefix a stage lacked (replayed)
        self.resumed_under: dict[bytes, int] = {}  # resumed request → the plan its prefix was kept under

    @property
    def plan(self) -> Plan | None:
        return self.stages.plan

    @property
    def dtype(self) -> DType:
        if self.dtype_override is not None:
            return self.dtype_override
        return self.plan.entry_dtype if self.plan is not None else DType.F32

    async def hand_over(self, rid: bytes, start_pos: int, hidden: np.ndarray, rewind: bool, verify: bool,
                        step: StepOut) -> int:
        """Send the step on the request's route, opening one (and replaying) where it has none;
        a request's sends one at a time, so its steps travel in order. Returns the bytes replayed."""
        async with self._sending.setdefault(rid, asyncio.Lock()):
            replayed = 0
            route = self.table.route(rid, self.plan.version)
            if route is None:
                route, replayed = await self._open_route(rid)  # (sends this step too)
            elif self.table.to_send(rid, start_pos):
                step.route = route
                step.sent_bytes = self.send(rid, route, hidden, start_pos, rewind, verify)
                step.sent(route, clock.now(),
                          sum(s.hidden.shape[0] for s in self.table.out(rid) if s.start_pos <= start_pos))
            await route.conn.drain(route.stream_id, SEND_BACKLOG)
            return replayed

    async def _open_route(self, rid: bytes) -> tuple[OpenRoute, int]:
        """A new stream on the current route, and every step the swarm held for the request
        replayed on it back to back (the stages run them in order; their results are not waited
        for), then the request's steps out. Returns the route and the bytes replayed."""
        latest = self.stages.host.latest
        if latest is not None and latest.version != self.plan.version:
            await self.stages.follow()
        if not self.stages.alive:  # (a move to this plan that could not reach its stages)
            raise RouteFailed("no open connection to the route's first and last stage")
        conn = self.stages.first
        stream_id = conn.open_stream()
        route = OpenRoute(conn, stream_id, self.plan.version)
        replayed = 0
        if self.table.resuming(rid) and self.resumed_under.get(rid) != self.plan.version:
            self.table.give_up_resume(rid)  # (a plan moved on since the prefix was kept: replay it)
            self.recomputed.add(rid)
        prefix = self.table.resuming(rid)  # the stages may hold the history: its first step out names it
        answered = 0 if prefix else len(self.table.history(rid))
        steps = self.table.opened(rid, conn, stream_id, self.plan.version)
        for step in self.steps.of(rid).values():
            step.route = route  # (every step out goes on it now)
        rows = 0
        for i, sent in enumerate(steps):
            size = self.send(rid, route, sent.hidden, sent.start_pos, verify=sent.verify,
                             prefix=prefix if i == 0 else b"")
            rows += sent.hidden.shape[0]
            if i < answered:
                replayed += sent.hidden.nbytes
            elif (step := self.steps.get(rid, sent.start_pos)) is not None:
                step.sent_bytes = size
                step.sent(route, clock.now(), rows)
            await conn.drain(stream_id, SEND_BACKLOG)
        return route, replayed

    def send(self, rid: bytes, route: OpenRoute, hidden: np.ndarray, start_pos: int, rewind: bool = False,
             verify: bool = False, layer: int | None = None, prefix: bytes = b"") -> int:
        """Send one step (activations at ``layer``: the head's output unless said, and then the
        step comes back from that stage alone; ``prefix``: the stages start from that kept
        prefix); returns the frame's size in bytes."""
        kind = PacketKind.PREFILL if hidden.shape[0] > 1 or start_pos == 0 or prefix else PacketKind.DECODE
        packet = ActivationPacket(kind, rid, route.version, self.plan.head_layers if layer is None else layer,
                                  start_pos, hidden, self.dtype, self.stages.session, rewind=rewind, verify=verify,
                                  trace=self.trace, one_stage=layer is not None, prefix=prefix)
        if not route.conn.is_open:
            raise RouteFailed("the connection to the first stage is closed")
        frame = encode_packet(packet)
        try:
            route.conn.send(route.stream_id, frame)
        except ConnectionError as e:  # the stage reset the stream, or the connection just closed
            raise RouteFailed(str(e)) from None
        return len(frame)

    def release(self, rid: bytes, keep: tuple[bytes, int] | None = None) -> None:
        """The request is over: end its stream (``keep``: as a kept prefix, prefix id and positions)."""
        self._sending.pop(rid, None)
        self.recomputed.discard(rid)
        self.resumed_under.pop(rid, None)
        self.carry_out(self.table.release(rid, self.plan.version, keep), rid)

    def resume(self, rid: bytes, prefix: bytes, positions: int, record: KeptSteps | None) -> bool:
        """Before request ``rid``'s first step: its route's stages may hold ``record``'s cells cut to
        ``positions`` as ``prefix``; if any does not, the link replays them from position 0. Under
        another plan than the one they ran under it replays them at once (its stages, or how
        activations travel between them, may differ: the cells a plain run makes there may too).
        False (nothing changed) without a record to replay."""
        if record is None:
            return False
        same_plan = record.plan_version == self.plan.version
        if same_plan:
            self.resumed_under[rid] = record.plan_version
        else:
            self.recomputed.add(rid)
        self.table.resume(rid, prefix if same_plan else b"", cut_steps(record.steps, positions))
        return True

    def keep(self, rid: bytes, prefix: bytes, positions: int) -> KeptSteps | None:
        """End the request, asking the route's stages to keep its cells [0, positions) as
        ``prefix``; returns the steps that rebuild them on another route (None: this link did
        not send them all, and the prefix cannot be resumed here)."""
        history = cut_steps(self.table.history(rid), positions)
        whole = rebuilds(history, positions)
        version = self.plan.version
        self.release(rid, keep=(prefix, positions) if whole else None)
        return KeptSteps(history, version) if whole else None

    async def run_stage(self, stage: int, steps: list[tuple[int, np.ndarray]], timeout_s: float,
                        handler: ConnectionHandler) -> np.ndarray:
        """Run ``steps`` (start position, activations at the stage's first layer) as a new request
        through the current plan's stage ``stage`` alone, which sends each result back (ONE_STAGE);
        returns the last step's. For ``--verify``'s re-check stage by stage: one attempt, no
        failover (a failure raises SwarmError). ``handler``: a middle stage's connection's."""
        target = self.plan.stages[stage]
        rid = secrets.token_bytes(16)
        conn = self.stages.first if stage == 0 else self.stages.last if stage == len(self.plan.stages) - 1 else \
            await self.stages.dialer.connect(target.member, target.address, handler)
        deadline = clock.now() + timeout_s
        try:
            stream_id = conn.open_stream()
            self.table.opened(rid, conn, stream_id, self.plan.version)
            route = OpenRoute(conn, stream_id, self.plan.version)
            result = None
            for start_pos, hidden in steps:
                self.table.begin(rid, SentStep(start_pos, hidden[:0], False))  # (nothing to replay: one attempt)
                step = self.steps.add(rid, start_pos)
                self.table.to_send(rid, start_pos)
                self.send(rid, route, hidden, start_pos, layer=target.start)
                step.sent(route, clock.now(), hidden.shape[0])
                try:
                    result = await step.answer(deadline, timeout_s)
                except RouteFailed as e:
                    raise SwarmError(f"stage {target.member} did not answer the check: {e}") from None
                self.table.answered(rid, start_pos)
            return np.asarray(result.data, dtype=np.float32)
        finally:
            self.steps.drop(rid)
            self.release(rid)
            if conn not in (self.stages.first, self.stages.last):
                await close(conn)

    def carry_out(self, actions: list[Action], rid: bytes = b"") -> None:
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
