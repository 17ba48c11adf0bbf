"""The asker's link to a swarm: the trunk of the U, reached over QUIC.

``SwarmLink`` implements the ``Trunk`` interface on the asker's event loop: hand it the head's
activations, get back the last trunk stage's output and the per-hop timings. Each request gets its
own stream to the first stage; results come back on one results stream this asker opened at the
last stage. Many requests can be in flight at once; the stages batch them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import numpy as np

from kernels.errors import EngineError
from net.endpoint import Address, close, connect_member
from net.identity import Credentials
from net.protocol import SwarmProtocol
from net.wire import (ActivationPacket, DType, Frame, FrameType, PacketKind, WireError, decode_control, decode_packet,
                      encode_control, encode_packet)
from plans.plan import Plan
from swarmctl.asker import TrunkResult
from swarmctl.home import NodeConfig, SwarmHome

log = logging.getLogger("swarmctl.client")

SEND_BACKLOG = 8 * 1024 * 1024


class SwarmError(EngineError):
    """The swarm could not run a request (unreachable, incomplete, or a stage refused)."""


class _Pending:
    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.result: asyncio.Future[ActivationPacket] | None = None


class SwarmLink:
    def __init__(self, config: NodeConfig, creds: Credentials, *, request_timeout: float = 120.0,
                 dtype: DType = DType.F32) -> None:
        self.config = config
        self.creds = creds
        self.request_timeout = request_timeout
        self.dtype = dtype
        self.plan: Plan | None = None
        self.latest_plan: Plan | None = None  # the host pushes every new plan; new requests follow it
        self.watch_stream: int | None = None
        self._plan_changed = asyncio.Event()
        self.host_conn: SwarmProtocol | None = None
        self.first_conn: SwarmProtocol | None = None
        self.last_conn: SwarmProtocol | None = None
        self._pending: dict[bytes, _Pending] = {}

    @classmethod
    async def open(cls, home: SwarmHome, *, ready_timeout: float = 60.0,
                   alive_check: Callable[[], None] | None = None, min_stages: int = 1, **kwargs) -> "SwarmLink":
        """Connect to the swarm's host, wait for a complete plan (of at least ``min_stages`` stages:
        a local swarm knows how many trunks it started), connect to the first and last stage."""
        link = cls(home.load_config(), home.credentials(), **kwargs)
        try:
            await link._connect(ready_timeout, alive_check, min_stages)
        except BaseException:
            await link.close()
            raise
        return link

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

    async def forward(self, rid: bytes, hidden: np.ndarray, start_pos: int) -> TrunkResult:
        if self.plan is None or self.first_conn is None or not self.first_conn.is_open:
            raise SwarmError("not connected to the swarm")
        pending = self._pending.get(rid)
        if pending is None and self.latest_plan is not None and self.latest_plan.version != self.plan.version:
            await self._follow_plan()  # a new request starts on the newest plan
        if pending is None:
            pending = self._pending[rid] = _Pending(self.first_conn.open_stream())
        pending.result = asyncio.get_running_loop().create_future()
        kind = PacketKind.PREFILL if hidden.shape[0] > 1 or start_pos == 0 else PacketKind.DECODE
        packet = ActivationPacket(kind, rid, self.plan.version, self.plan.head_layers, start_pos, hidden,
                                  self.dtype, self.creds.name)
        t0 = time.perf_counter()
        self.first_conn.send(pending.stream_id, encode_packet(packet))
        await self.first_conn.drain(pending.stream_id, SEND_BACKLOG)
        try:
            result = await asyncio.wait_for(pending.result, self.request_timeout)
        except asyncio.TimeoutError:
            raise SwarmError(f"the swarm did not answer within {self.request_timeout:.0f}s") from None
        if result.kind == PacketKind.ERROR:
            raise SwarmError(f"the swarm refused the request: {result.message}")
        return TrunkResult(np.asarray(result.data, dtype=np.float32), result.hops, time.perf_counter() - t0)

    async def release(self, rid: bytes) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None and self.first_conn is not None and self.first_conn.is_open:
            end = ActivationPacket(PacketKind.END, rid, self.plan.version, self.plan.head_layers, 0,
                                   np.empty((0, 0), np.float32))
            self.first_conn.send(pending.stream_id, encode_packet(end), end=True)

    async def close(self) -> None:
        for conn in {self.host_conn, self.first_conn, self.last_conn} - {None}:
            await close(conn)

    # --- setup ---

    async def _connect(self, ready_timeout: float, alive_check: Callable[[], None] | None,
                       min_stages: int) -> None:
        self.host_conn = await self._connect_host()
        self.watch_stream = self.host_conn.open_stream()
        first = await self.host_conn.request(encode_control({"type": "watch_plan"}), stream_id=self.watch_stream)
        self._plan_message(decode_control(first.body))
        self.plan = await self._wait_for_plan(ready_timeout, alive_check, min_stages)
        await self._connect_stages()

    async def _wait_for_plan(self, timeout: float, alive_check: Callable[[], None] | None, min_stages: int = 1) -> Plan:
        """The newest plan, once it is complete (every trunk layer served by a ready stage)."""
        deadline = time.monotonic() + timeout
        while True:
            plan = self.latest_plan
            if plan is not None and plan.complete and len(plan.stages) >= min_stages:
                return plan
            if alive_check is not None:
                alive_check()
            if time.monotonic() > deadline:
                gaps = ", ".join(f"[{a}, {b})" for a, b in plan.missing_layers()) if plan else "all"
                notes = f" ({'; '.join(plan.warnings)})" if plan and plan.warnings else ""
                raise SwarmError(f"the swarm cannot serve the model: no ready trunk holds layers {gaps}{notes}")
            self._plan_changed.clear()
            try:
                await asyncio.wait_for(self._plan_changed.wait(), 0.5)
            except asyncio.TimeoutError:
                self.latest_plan = await self.fetch_plan()  # in case a push was missed

    async def _connect_stages(self) -> None:
        first, last = self.plan.stages[0], self.plan.stages[-1]
        self.first_conn = await connect_member(Address.parse(first.address), self.creds, first.member, self)
        self.last_conn = self.first_conn if last.member == first.member else \
            await connect_member(Address.parse(last.address), self.creds, last.member, self)
        reply = decode_control((await self.last_conn.request(encode_control({"type": "subscribe"}))).body)
        if reply.get("type") != "ok":
            raise SwarmError(f"the last stage refused the results stream: {reply}")
        log.info("swarm plan v%d: %s", self.plan.version,
                 ", ".join(f"{s.member}[{s.start},{s.stop})" for s in self.plan.stages))

    async def _follow_plan(self) -> None:
        """Move to the newest plan: new stage connections once it is complete. Requests already
        running keep their streams (the stages answer them, or tell them the plan changed)."""
        self.plan = await self._wait_for_plan(self.request_timeout, None)
        old = {c for c in (self.first_conn, self.last_conn) if c is not None}
        await self._connect_stages()
        busy = {self.first_conn, self.last_conn}
        for conn in old - busy:
            if not any(p.result is not None and not p.result.done() for p in self._pending.values()):
                await close(conn)

    def _plan_message(self, message: dict) -> None:
        if message.get("type") == "plan":
            self.latest_plan = Plan.from_dict(message["plan"])
            self._plan_changed.set()

    async def fetch_plan(self) -> Plan:
        reply = decode_control((await self.host_conn.request(encode_control({"type": "get_plan"}))).body)
        if reply.get("type") != "plan":
            raise SwarmError(f"host: {reply.get('message', 'unexpected reply')}")
        return Plan.from_dict(reply["plan"])

    async def _connect_host(self) -> SwarmProtocol:
        errors = []
        for text in self.config.host_addresses:
            try:
                return await connect_member(Address.parse(text), self.creds, self.config.host_name, self)
            except (ConnectionError, OSError) as e:
                errors.append(str(e))
        raise SwarmError(f"cannot reach the swarm host: {'; '.join(errors) or 'no address'}")

    # --- ConnectionHandler ---

    def connection_made(self, conn: SwarmProtocol) -> None:
        pass

    def connection_lost(self, conn: SwarmProtocol) -> None:
        if conn in (self.first_conn, self.last_conn):
            for pending in self._pending.values():
                if pending.result is not None and not pending.result.done():
                    pending.result.set_exception(SwarmError(f"lost the connection to {conn.peer_name}"))

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        pass

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if conn is self.host_conn and stream_id == self.watch_stream and frame.type == FrameType.CONTROL:
            self._plan_message(decode_control(frame.body))
            return
        if frame.type != FrameType.ACTIVATION:
            return
        try:
            packet = decode_packet(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        pending = self._pending.get(packet.request_id)
        if pending is not None and pending.result is not None and not pending.result.done():
            pending.result.set_result(packet)
