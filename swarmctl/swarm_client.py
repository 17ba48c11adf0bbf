"""The asker's link to a swarm: the trunk of the U, reached over QUIC.

``SwarmTrunk`` implements the same ``Trunk`` interface as the in-process stages: hand it the head's
activations, get back the last trunk stage's output. It runs an asyncio loop in a background
thread; each request gets its own stream to the first stage, and results come back on one
results stream this asker opened at the last stage.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future as ThreadFuture
from typing import Callable

import numpy as np

from kernels.errors import EngineError
from net.endpoint import Address, close, connect_member
from net.protocol import SwarmProtocol
from net.wire import (ActivationPacket, DType, Frame, FrameType, PacketKind, WireError, decode_control, decode_packet,
                      encode_control, encode_packet)
from plans.plan import Plan
from swarmctl.home import SwarmHome

log = logging.getLogger("swarmctl.client")

SEND_BACKLOG = 8 * 1024 * 1024


class SwarmError(EngineError):
    """The swarm could not run a request (unreachable, incomplete, or a stage refused)."""


class _Pending:
    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.result: asyncio.Future[ActivationPacket] | None = None


class SwarmTrunk:
    def __init__(self, home: SwarmHome, *, ready_timeout: float = 60.0, request_timeout: float = 120.0,
                 dtype: DType = DType.F32, alive_check: Callable[[], None] | None = None) -> None:
        self.home = home
        self.config = home.load_config()
        self.creds = home.credentials()
        self.request_timeout = request_timeout
        self.dtype = dtype
        self.alive_check = alive_check  # raises if something we depend on (a local swarm) has died
        self.plan: Plan | None = None
        self.host_conn: SwarmProtocol | None = None
        self.first_conn: SwarmProtocol | None = None
        self.last_conn: SwarmProtocol | None = None
        self._pending: dict[bytes, _Pending] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-client", daemon=True)
        self._thread.start()
        try:
            self._call(self._connect(ready_timeout), ready_timeout + 15)
        except BaseException:
            self.close()
            raise

    # --- the Trunk interface (called from the generation thread) ---

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

    def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int) -> np.ndarray:
        return self._call(self._forward(request_id, hidden, start_pos), self.request_timeout)

    def release(self, request_id: bytes) -> None:
        try:
            self._call(self._release(request_id), 10)
        except (SwarmError, TimeoutError):
            pass

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self._close(), 10)
            except (SwarmError, TimeoutError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def _call(self, coro, timeout: float):
        future: ThreadFuture = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise SwarmError(f"the swarm did not answer within {timeout:.0f}s") from None
        except (ConnectionError, OSError) as e:
            raise SwarmError(str(e)) from None

    # --- async side ---

    async def _connect(self, ready_timeout: float) -> None:
        self.host_conn = await self._connect_host()
        deadline = time.monotonic() + ready_timeout
        while True:
            reply = decode_control((await self.host_conn.request(encode_control({"type": "get_plan"}))).body)
            if reply.get("type") != "plan":
                raise SwarmError(f"host: {reply.get('message', 'unexpected reply')}")
            self.plan = Plan.from_dict(reply["plan"])
            if self.plan.complete:
                break
            if self.alive_check is not None:
                self.alive_check()
            if time.monotonic() > deadline:
                gaps = ", ".join(f"[{a}, {b})" for a, b in self.plan.missing_layers())
                raise SwarmError(f"the swarm cannot serve the model: no ready trunk holds layers {gaps}")
            await asyncio.sleep(0.2)
        first, last = self.plan.stages[0], self.plan.stages[-1]
        self.first_conn = await connect_member(Address.parse(first.address), self.creds, first.member, self)
        self.last_conn = self.first_conn if last.member == first.member else \
            await connect_member(Address.parse(last.address), self.creds, last.member, self)
        reply = decode_control((await self.last_conn.request(encode_control({"type": "subscribe"}))).body)
        if reply.get("type") != "ok":
            raise SwarmError(f"the last stage refused the results stream: {reply}")
        log.info("swarm plan v%d: %s", self.plan.version,
                 ", ".join(f"{s.member}[{s.start},{s.stop})" for s in self.plan.stages))

    async def _connect_host(self) -> SwarmProtocol:
        errors = []
        for text in self.config.host_addresses:
            try:
                return await connect_member(Address.parse(text), self.creds, self.config.host_name, self)
            except (ConnectionError, OSError) as e:
                errors.append(str(e))
        raise SwarmError(f"cannot reach the swarm host: {'; '.join(errors) or 'no address'}")

    async def _forward(self, rid: bytes, hidden: np.ndarray, start_pos: int) -> np.ndarray:
        assert self.plan is not None and self.first_conn is not None
        pending = self._pending.get(rid)
        if pending is None:
            pending = self._pending[rid] = _Pending(self.first_conn.open_stream())
        pending.result = self._loop.create_future()
        kind = PacketKind.PREFILL if hidden.shape[0] > 1 or start_pos == 0 else PacketKind.DECODE
        packet = ActivationPacket(kind, rid, self.plan.version, self.plan.head_layers, start_pos, hidden,
                                  self.dtype, self.creds.name)
        self.first_conn.send(pending.stream_id, encode_packet(packet))
        await self.first_conn.drain(pending.stream_id, SEND_BACKLOG)
        result = await pending.result
        if result.kind == PacketKind.ERROR:
            raise SwarmError(f"the swarm refused the request: {result.message}")
        return np.asarray(result.data, dtype=np.float32)

    async def _release(self, rid: bytes) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None and self.first_conn is not None and self.first_conn.is_open:
            end = ActivationPacket(PacketKind.END, rid, self.plan.version, self.plan.head_layers, 0,
                                   np.empty((0, 0), np.float32))
            self.first_conn.send(pending.stream_id, encode_packet(end), end=True)

    async def _close(self) -> None:
        for conn in {self.host_conn, self.first_conn, self.last_conn} - {None}:
            await close(conn)

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
