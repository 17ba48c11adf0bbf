"""The asker's link to the host: the host pushes every new plan on one watch stream, and the
asker waits here for a complete one. Reports to the host (a recovery, a wrong result) go out on
the same connection."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from kernels.errors import EngineError
from net import messages as m
from net.dispatch import Dispatcher
from net.endpoint import NoAddressAnswered
from net.identity import Credentials
from net.liveness import IDLE_TIMEOUT, SilenceClock
from net.protocol import ConnectionHandler, SwarmProtocol
from net.wire import WireError, decode_control
from plans.plan import Plan
from swarmctl.node.home import NodeConfig
from swarmctl.reaching.host_addresses import connect_host

log = logging.getLogger("swarmctl.asker")

CHECK_EVERY_S = 0.5  # while waiting for a complete plan, the host is also asked this often (a missed push)


class SwarmError(EngineError):
    """The swarm could not run a request (unreachable, incomplete, or a stage refused)."""


def cannot_serve(plan: Plan | None) -> str:
    """Why a swarm cannot answer: the trunk layers no ready stage holds, and the planner's warnings."""
    gaps = ", ".join(f"[{a}, {b})" for a, b in plan.missing_layers()) if plan else "all"
    notes = f" ({'; '.join(plan.warnings)})" if plan and plan.warnings else ""
    return f"the swarm cannot serve the model: no ready trunk holds layers {gaps}{notes}"


def check_asker_layers(plan: Plan, gguf) -> None:
    """The asker's own copy of the model must match the swarm's in the layers it runs itself."""
    k, n = plan.head_layers, plan.n_layer
    for layer in [*range(k), *range(n - k, n)]:
        if layer >= len(plan.layer_hashes) or gguf.layer_hash(layer) != plan.layer_hashes[layer]:
            raise SwarmError(f"your copy of the model differs from the swarm's ({plan.model_name}) "
                             f"in layer {layer}; use --model with the swarm's GGUF")


class PlanWatch:
    def __init__(self, config: NodeConfig, creds: Credentials, handler: ConnectionHandler,
                 connect_with: Callable[[list[str]], Awaitable[SwarmProtocol]] | None = None) -> None:
        """``connect_with``: how to reach the host (the asker's swarm socket: swarmctl/reaching/reach.py;
        by default a socket of its own)."""
        self.config = config
        self.creds = creds
        self.handler = handler  # receives the host connection's frames (and passes plan pushes to received())
        self.conn: SwarmProtocol | None = None
        self.stream: int | None = None  # the watch stream: every new plan arrives on it
        self.latest: Plan | None = None
        self.connect_with = connect_with or \
            (lambda addresses: connect_host(self.config, self.creds, self.handler, addresses=addresses))
        self._changed = asyncio.Event()
        self._given_up: SwarmProtocol | None = None  # a connection closed here for the host's silence
        # What the host sends on the watch stream (net/dispatch.py): a plan, or an error.
        self.from_host = Dispatcher({m.PlanPush: self._plan, m.Error: lambda error: None})

    @property
    def is_open(self) -> bool:
        return self.conn is not None and self.conn.is_open and self.conn is not self._given_up

    def give_up_if_silent(self, silence: SilenceClock) -> None:
        """The host not heard for IDLE_TIMEOUT: its connection is given up here (and connected
        again), not left to QUIC, whose idle timeout is three probe timeouts of the round trip it
        measured: after 10 s of 2-second datagrams an asker kept the connection of a host that
        had restarted meanwhile for 36 s more, and asked with that process's last plan until then
        (the simulator; a trunk's HostLink does the same for its registration)."""
        if self.is_open and (quiet := silence.silence(self.conn)) > IDLE_TIMEOUT:
            log.warning("the host has been silent for %.0f s: connecting again", quiet)
            self._given_up = self.conn
            self.conn.close_with(f"silent for {quiet:.0f} s")

    async def connect(self) -> Plan | None:
        """Connect (to the first advertised address that answers, even on the host's own machine)
        and start watching; the current plan is the stream's first message, returned."""
        try:
            self.conn = await self.connect_with(self.config.host_addresses)
        except NoAddressAnswered as e:
            raise SwarmError(f"cannot reach the swarm host: {e}") from None
        self.stream = self.conn.open_stream()
        first = await self.conn.request(m.encode(m.WatchPlan()), stream_id=self.stream)
        return self.received(first.body)

    def is_watch_stream(self, conn: SwarmProtocol, stream_id: int) -> bool:
        return conn is self.conn and stream_id == self.stream

    def received(self, body: bytes) -> Plan | None:
        """A message on the watch stream: the new plan, or None if it was something else."""
        try:
            message = self.from_host.parse(decode_control(body))
        except WireError:
            return None
        return self.from_host.dispatch(message)

    def _plan(self, push: m.PlanPush) -> Plan:
        plan = Plan.from_dict(push.plan)
        for setting in ("kernels", "attention") if self.latest is not None else ():
            now, was = getattr(plan, setting), getattr(self.latest, setting)
            if now != was:  # (the head and tail were loaded under the plan this asker started with)
                log.warning("the swarm's %s is now %s (was %s): this asker's head and tail keep theirs until it "
                            "restarts", setting, now, was)
        self.latest = plan
        self._changed.set()
        return self.latest

    async def changed(self, timeout: float = CHECK_EVERY_S) -> bool:
        """Wait up to ``timeout`` for a new plan; True if one came."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def complete(self, timeout: float, alive_check: Callable[[], None] | None = None,
                       min_stages: int = 1) -> Plan:
        """The newest plan, once it is complete (every trunk layer served by a ready stage) and has
        at least ``min_stages`` stages; SwarmError with the reason after ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            plan = self.latest
            if plan is not None and plan.complete and len(plan.stages) >= min_stages:
                return plan
            if alive_check is not None:
                alive_check()
            if asyncio.get_running_loop().time() > deadline:
                raise SwarmError(cannot_serve(plan))
            if not await self.changed() and self.is_open:
                try:
                    self.latest = await self.fetch()  # in case a push was missed
                except (ConnectionError, asyncio.TimeoutError):
                    pass  # the host went away meanwhile (the link reconnects): wait on, to the deadline

    async def fetch(self) -> Plan:
        try:
            return Plan.from_dict(m.decode((await self.conn.request(m.encode(m.GetPlan()))).body, m.PlanPush).plan)
        except (m.Refused, WireError) as e:
            raise SwarmError(f"host: {e}") from None

    async def tell(self, message: m.Message) -> None:
        """A control message to the host whose answer is not needed; a closed or slow host is ignored."""
        if self.is_open:
            try:
                await self.conn.request(m.encode(message), timeout=5)
            except (ConnectionError, asyncio.TimeoutError):
                pass
