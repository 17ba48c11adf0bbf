"""Expert parallelism over the swarm: a stage's client for the expert nodes, and an expert
node's server for the stages' calls.

A stage whose plan puts its routed experts elsewhere sends each expert node the rows routed to
its experts, from the compute thread through the event loop, and gathers the outputs; an expert
node answers those calls on the compute thread (kernels/experts.py does the math on both sides).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from kernels.errors import EngineError
from kernels.experts import ExpertEngine, rows_for
from net import clock
from net.liveness import SILENCE_LIMIT
from net.ping import ping_ms
from net.protocol import SwarmProtocol
from net.wire import ExpertCall, ExpertCallKind, Frame, HopCall, WireError, decode_expert_call, encode_expert_call
from swarmctl.trunk.call_deadline import CallDeadlines
from swarmctl.trunk.context import TrunkContext
from plans.plan import ExpertAssignment

log = logging.getLogger("swarmctl.trunk")

CALL_TIMEOUT_S = 30.0  # one expert node's answer, however slow, while it answers pings
ALL_CALLS_TIMEOUT_S = 60.0  # the compute thread's wait for every expert node of one layer
# After a node failed a call (no answer, no ping), calls to it fail at once for this long: the
# request is replayed once the host plans the node out, and the asker retries the same plan after
# 2 × SILENCE_LIMIT (ReroutePolicy.same_route_retry_s, swarmctl/asker/link_core.py) if the host never does.
GIVEN_UP_S = 2 * SILENCE_LIMIT


class RemoteExpertError(EngineError):
    """An expert node failed a call; the request can be replayed once the plan moves on."""


RECENT_CALLS = 8192  # answered calls remembered for traced packets' hop records (a few batches' worth)


@dataclass(frozen=True)
class CallTiming:
    """One answered expert call, on this process's clock."""

    node: str
    layer: int
    started: float  # time.perf_counter()
    seconds: float
    rows: int
    bytes: int


class ExpertClient:
    def __init__(self, ctx: TrunkContext, assignments: Callable[[], list[ExpertAssignment]],
                 on_unanswered: Callable[[str], None]) -> None:
        """``on_unanswered``: told the member a call gave up on (the trunk tells the host, which
        then judges the member by its own link at once instead of at its next silence verdict)."""
        self.creds = ctx.creds
        self.handler = ctx.handler
        self.connect = ctx.connect  # the trunk's dialer
        self.conns: dict[str, SwarmProtocol] = {}  # expert node → our link to it
        self._assignments = assignments  # the current plan's expert nodes
        self.call_bytes = 0  # sent and answered
        self.loop = ctx.loop
        self.recent: deque[CallTiming] = deque(maxlen=RECENT_CALLS)  # newest last
        self.deadlines = CallDeadlines()  # how long each node's next answer may take (call_deadline.py)
        self.on_unanswered = on_unanswered

    def forward(self, layer: int, x: np.ndarray, selected: np.ndarray) -> np.ndarray:
        """On the compute thread (the slice engine's ``remote_experts``): the outputs of each row's
        selected experts, [rows, n_selected, n_embd], computed by the nodes that hold them."""
        future = asyncio.run_coroutine_threadsafe(self.call(layer, x, selected), self.loop)
        try:
            return future.result(timeout=ALL_CALLS_TIMEOUT_S)
        except (ConnectionError, OSError, asyncio.TimeoutError, TimeoutError) as e:
            raise RemoteExpertError(f"an expert node did not answer: {e}") from None

    async def call(self, layer: int, x: np.ndarray, selected: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], selected.shape[1], x.shape[1]), dtype=np.float32)
        await asyncio.gather(*(self._ask(a, layer, x, selected, out) for a in self._assignments()))
        return out

    async def _ask(self, assignment: ExpertAssignment, layer: int, x: np.ndarray, selected: np.ndarray,
                   out: np.ndarray) -> None:
        rows, slots = rows_for(selected, assignment.start, assignment.stop)
        if rows.size == 0:
            return
        member = assignment.member
        if self.deadlines.given_up(member, clock.now()):
            raise RemoteExpertError(f"expert node {member} stopped answering; waiting for the plan to move on")
        started = time.perf_counter()
        conn = self.conns.get(member)
        if conn is None or not conn.is_open:
            conn = await self.connect(member, assignment.address, self.handler)
            self.conns[member] = conn
        request = encode_expert_call(ExpertCall(ExpertCallKind.REQUEST, layer, x[rows], selected[rows, slots]))
        sent = time.perf_counter()
        reply_frame = await self._answer(member, conn, request)
        answered = time.perf_counter()
        reply = decode_expert_call(reply_frame.body)
        if reply.kind != ExpertCallKind.REPLY or reply.data.shape != (rows.size, x.shape[1]):
            raise RemoteExpertError(f"expert node {member}: {reply.message or 'a malformed reply'}")
        out[rows, slots] = reply.data
        self.call_bytes += len(request) + len(reply_frame.body)
        self.deadlines.record(member, answered - sent)  # the round trip and compute, not the connect
        self.recent.append(CallTiming(member, layer, started, answered - started, int(rows.size),
                                      len(request) + len(reply_frame.body)))

    async def _answer(self, member: str, conn: SwarmProtocol, request: bytes) -> Frame:
        """The node's answer to one call. Each time the call outlives its deadline, a ping asks
        whether the node is alive: if it answers, the node is only slow and the call waits on (up
        to CALL_TIMEOUT_S); if not, the node is given up (RemoteExpertError: the stage refuses the
        request with a retry, and the asker replays it on the plan without the node)."""
        call = asyncio.ensure_future(conn.request(request, timeout=CALL_TIMEOUT_S))
        try:
            while True:
                wait = self.deadlines.deadline(member)
                done, _ = await asyncio.wait({call}, timeout=wait)
                if done:
                    return call.result()
                ping_wait = self.deadlines.ping_wait(member)
                try:
                    await ping_ms(conn, ping_wait)
                except (ConnectionError, asyncio.TimeoutError):
                    self._give_up(member, conn, wait + ping_wait)
                    raise RemoteExpertError(f"expert node {member} did not answer a call within {wait:.1f}s, "
                                            f"nor a ping within {ping_wait:.1f}s after it") from None
                log.info("expert node %s is slow (no answer within %.1fs) but answers pings: waiting on", member, wait)
        finally:
            if not call.done():
                call.cancel()

    def _give_up(self, member: str, conn: SwarmProtocol, waited: float) -> None:
        log.warning("expert node %s answered neither a call nor a ping for %.1fs: failing its calls for %.0fs "
                    "(requests are replayed once the plan moves on)", member, waited, GIVEN_UP_S)
        self.deadlines.give_up(member, clock.now(), GIVEN_UP_S)
        if self.conns.get(member) is conn:
            del self.conns[member]
        conn.close_with("no answer to an expert call or a ping")
        self.on_unanswered(member)

    def calls_between(self, start: float, stop: float) -> tuple[HopCall, ...]:
        """The calls that began in [start, stop] (a batch's compute, on this process's clock), each
        timed from ``start``: what a traced packet's hop record lists. A stage computes one batch
        at a time, so the calls in that window are the batch's own."""
        return tuple(HopCall(c.node, c.layer, int((c.started - start) * 1e6), int(c.seconds * 1e6), c.rows, c.bytes)
                     for c in self.recent if start <= c.started <= stop)


class ExpertServer:
    def __init__(self, executor: Executor, engine: Callable[[], ExpertEngine | None]) -> None:
        self._executor = executor
        self._engine = engine  # the experts this node holds now, if any
        self.rows_served = 0
        self.call_bytes = 0  # served

    async def serve(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        """Answer one call; a refused call gets an ERROR reply, never silence."""
        try:
            call = decode_expert_call(frame.body)
            if conn.peer_role != "trunk":
                raise EngineError(f"expert calls come from stages; {conn.peer_name} joined as {conn.peer_role}")
            engine = self._engine()
            if call.kind != ExpertCallKind.REQUEST or engine is None:
                raise EngineError("this trunk is not serving experts" if engine is None else "not a request")
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, engine.forward, call.layer, call.data, call.expert_ids)
            reply = encode_expert_call(ExpertCall(ExpertCallKind.REPLY, call.layer, result))
            self.rows_served += result.shape[0]
            self.call_bytes += len(frame.body) + len(reply)
        except (EngineError, WireError) as e:
            log.warning("expert call from %s refused: %s", conn.peer_name, e)
            reply = encode_expert_call(ExpertCall(ExpertCallKind.ERROR, 0, np.empty((0, 0), np.float32), None, str(e)))
        if conn.is_open:
            conn.send(stream_id, reply, end=True)
