"""What a stage sends: its packets on, errors back, and what the route table says to do.

The route table (swarmctl/trunk/routes.py) returns ``Action`` values and never does I/O; this
module carries them out: ERROR packets to senders, ENDs onward, streams finished, and requests
freed or kept as prefixes on the compute thread (under the request's lock where a ``Release``
asks for it). Every packet a stage sends goes through ``send`` (counted, and kept with --capture).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from net import clock
from net.protocol import StreamClosedError, SwarmProtocol
from net.wire import FRAME_HEADER, ActivationPacket, DType, Frame, FrameType, PacketKind, encode_packet
from swarmctl.node.log_limit import LogLimit
from swarmctl.trunk.assignment import Assignment
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.prefixes import StagePrefixes
from swarmctl.trunk.routes import (Action, EndOnward, FinishStream, FreeRequest, Keep, KeepRequest, PassBack,
                                   Release, RouteTable, SendError)
from swarmctl.trunk.stage_step import account_of

log = logging.getLogger("swarmctl.trunk")

SEND_BACKLOG = 8 * 1024 * 1024  # bytes unacknowledged per stream before a sender waits


class StageSender:
    def __init__(self, ctx: TrunkContext, held: Assignment, routes: RouteTable, prefixes: StagePrefixes,
                 capture: Callable[[str, Frame], None]) -> None:
        """``capture``: keep a frame sent (--capture)."""
        self.held = held  # the plan and the stage (their versions and layers go on what is sent)
        self.routes = routes
        self.prefixes = prefixes
        self.activation_bytes_sent = 0
        self._capture = capture
        self._spawn = ctx.spawn
        self._refusals = LogLimit(log)

    # --- carrying out what the route table says ---

    def do(self, actions: list[Action]) -> None:
        """Actions that need no wait happen now; freeing a request needs its lock and the compute
        thread, so those run as tasks."""
        for action in actions:
            if isinstance(action, (Release, FreeRequest)):
                self._spawn(self.carry_out([action]))
            else:
                self._send_now(action)

    async def carry_out(self, actions: list[Action]) -> None:
        """In order, waiting for each release (the caller may hold the request's lock: a
        ``FreeRequest`` then needs none, a ``Release`` takes it)."""
        for action in actions:
            if isinstance(action, Release):
                async with self.routes.locks.hold(action.request_id):
                    await self.carry_out(self.routes.take(action.request_id, action.route))
            elif isinstance(action, KeepRequest):
                plan = self.held.plan
                account = account_of(action.reply_to, plan) if plan is not None else ""
                if not (plan is not None and await self.prefixes.keep(action.request_id, account, action.keep.prefix,
                                                                        action.keep.positions, clock.now())):
                    await self.carry_out([FreeRequest(action.request_id)])
            elif isinstance(action, FreeRequest):
                held = self.held
                if held.runner is not None:
                    await held.runner.call(held.engine.release, action.request_id)
                held.budget.release(action.request_id)
            else:
                self._send_now(action)

    def _send_now(self, action: Action) -> None:
        if isinstance(action, SendError):
            self.send_error(action.conn, action.stream_id, action.request_id, action.message, action.retry)
        elif isinstance(action, PassBack):
            self.send(action.conn, action.stream_id, action.packet)
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

    def refuse(self, conn: SwarmProtocol, stream_id: int, rid: bytes, reason: str, retry: bool = False) -> None:
        self._refusals.warning("request %s from %s refused: %s", rid.hex()[:8], conn.peer_name, reason)
        self.send_error(conn, stream_id, rid, reason, retry)
        if retry:
            self.routes.mark_failed(conn, stream_id, rid)

    def send_error(self, conn: SwarmProtocol, stream_id: int, rid: bytes, message: str, retry: bool = False) -> None:
        """An error leaves the stream open on our side: the sender may already have sent its next
        step on it, and that step must be answered too (a stream we had ended could not carry the
        answer, and the sender would wait until its deadline). The sender ends the stream when it
        gives up on it, and then so do we (``RouteTable.stream_ended``)."""
        plan = self.held.plan
        error = ActivationPacket(PacketKind.ERROR, rid, plan.version if plan else 0, 0, 0,
                                 np.empty((0, 0), np.float32), DType.F32, "", message, retry=retry)
        self.send(conn, stream_id, error)

    def send(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket) -> None:
        if conn.is_open:
            data = encode_packet(packet)
            self.activation_bytes_sent += len(data)
            self._capture("send", Frame(FrameType.ACTIVATION, data[FRAME_HEADER.size:]))
            try:
                conn.send(stream_id, data)
            except StreamClosedError as e:  # the peer reset it (it gave up on the request): nobody to tell
                log.info("%s", e)

    async def send_and_drain(self, conn: SwarmProtocol, stream_id: int, packet: ActivationPacket) -> None:
        self.send(conn, stream_id, packet)
        await conn.drain(stream_id, SEND_BACKLOG)
