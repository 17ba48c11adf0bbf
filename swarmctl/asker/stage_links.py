"""The asker link's connections to the current plan's first and last stage, and its moves to a
new plan (``swarmctl/asker/link.py`` sends on them; ``swarmctl/asker/link_core.py`` decides when
to move)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from net import clock
from net import messages as m
from net.endpoint import close, close_all
from net.protocol import ConnectionHandler, SwarmProtocol
from net.wire import WireError
from plans.plan import Plan
from swarmctl.asker.link_core import GIVE_UP, ReroutePolicy, RouteFailed, RouteWait, already_moved, needs_move, \
    refusal
from swarmctl.asker.plan_watch import PlanWatch, SwarmError, cannot_serve
from swarmctl.reaching.reach import Dialer

log = logging.getLogger("swarmctl.client")


def each_once(*conns: SwarmProtocol | None) -> list[SwarmProtocol]:
    """The connections given, each once, in the order given (a set's order is their addresses':
    pings and closes would go out in another order in every process)."""
    return list(dict.fromkeys(c for c in conns if c is not None))


class LinkHandler(ConnectionHandler, Protocol):
    def refused_for_good(self, reason: str) -> str:
        """Record a refusal that holds at every node; returns what to tell the requests."""

    def still_served(self) -> None:
        """Raises SwarmError once this member was refused for good."""


class StageLinks:
    def __init__(self, host: PlanWatch, handler: LinkHandler, session: str, policy: ReroutePolicy,
                 request_timeout: float) -> None:
        """``handler``: the link (it receives the stages' frames); ``session``: its results address
        at the last stage."""
        self.host, self.handler, self.session = host, handler, session
        self.policy, self.request_timeout = policy, request_timeout
        self.plan: Plan | None = None  # the plan the stage connections follow
        self.first: SwarmProtocol | None = None
        self.last: SwarmProtocol | None = None
        self.dialer: Dialer | None = None  # our swarm socket, and the path to each stage (swarmctl/reaching/reach.py)
        self.moved_at = 0.0  # when the stage connections last moved (requests failing together move once)
        self._moving: asyncio.Lock | None = None

    async def connect_host(self, addresses: list[str]) -> SwarmProtocol:
        """The host, from our swarm socket (so the host sees where it leads and answers our reach)."""
        if self.dialer is None:
            raise ConnectionError("the link has no socket yet")
        return await self.dialer.connect_host(addresses, self.host.config.host_name, self.handler)

    @property
    def alive(self) -> bool:
        return all(c is not None and c.is_open for c in (self.first, self.last))

    async def reach(self, deadline: float, alive_check: Callable[[], None] | None, min_stages: int) -> None:
        """A complete plan and connections to its first and last stage, by ``deadline``. A stage
        that does not answer (one that just died, before the host noticed; one too busy to finish
        a handshake in time) is tried again, on the next plan if one comes, until the deadline;
        the last failure is raised then."""
        while True:
            self.plan = await self.host.complete(max(1.0, deadline - clock.now()), alive_check, min_stages)
            try:
                await self.connect()
                return
            except (ConnectionError, OSError, asyncio.TimeoutError) as e:
                await close_all(each_once(self.first, self.last))
                self.first = self.last = None
                if not self.policy.retry_reach(clock.now(), deadline):
                    raise
                log.warning("cannot reach plan v%d's stages (%s); trying again", self.plan.version, e)
                await self.host.changed(self.policy.stage_retry_s)  # a new plan, or a pause before the same again

    async def connect(self, fresh: bool = True) -> None:
        """Connections to the plan's first and last stage; live ones to the same members are kept
        unless ``fresh`` (after a failure on the same plan they may be dead without knowing it)."""
        first, last = self.plan.stages[0], self.plan.stages[-1]

        async def conn_to(member: str, address: str, current: SwarmProtocol | None) -> SwarmProtocol:
            if not fresh and current is not None and current.is_open and current.peer_name == member:
                return current
            return await self.dialer.connect(member, address, self.handler)

        self.first = await conn_to(first.member, first.address, self.first)
        self.last = self.first if last.member == first.member else await conn_to(last.member, last.address, self.last)
        try:
            m.decode((await self.last.request(m.encode(m.Subscribe(session=self.session)))).body, m.Ok)
        except (m.Refused, WireError) as e:
            raise SwarmError(f"the last stage refused the results stream: {e}") from None
        log.info("swarm plan v%d: %s", self.plan.version,
                 ", ".join(f"{s.member}[{s.start},{s.stop})" for s in self.plan.stages))

    async def follow(self, force: bool = False, since: float | None = None) -> None:
        """Move to the newest complete plan: new connections to its first and last stage (also on
        the same plan when ``force``: the old connections may be dead without knowing it yet).
        ``since``: when the failure that calls for it happened; a move made after it (by another
        step, while this one waited or before it came to ask) is the one it needed."""
        if self._moving is None:
            self._moving = asyncio.Lock()
        since = self.moved_at if since is None else since
        async with self._moving:
            latest = self.host.latest
            if already_moved(self.moved_at, since) or not needs_move(
                    force=force, latest_version=None if latest is None else latest.version,
                    plan_version=self.plan.version, alive=self.alive):
                return
            self.plan = await self.host.complete(self.request_timeout, self.handler.still_served)
            old = each_once(self.first, self.last)
            for attempt in range(self.policy.connect_attempts):
                try:
                    await self.connect(fresh=force or attempt > 0)
                    break
                except (ConnectionError, OSError, SwarmError, asyncio.TimeoutError) as e:
                    if refusal(str(e)) is not None:
                        raise SwarmError(self.handler.refused_for_good(str(e))) from None
                    if attempt == self.policy.connect_attempts - 1:
                        raise RouteFailed(f"cannot connect to the new route: {e}") from None
                    await asyncio.sleep(self.policy.connect_pause_s)
            for conn in [c for c in old if c is not self.first and c is not self.last]:
                asyncio.ensure_future(close(conn))
            self.moved_at = clock.now()

    async def await_route(self, deadline: float, failed_at: float) -> None:
        """After a route failure at ``failed_at``: the host's next complete plan, or the same route
        again after a pause (link_core.RouteWait). A step whose request's other steps already moved
        the link since it failed goes on the connections they made."""
        if already_moved(self.moved_at, failed_at):
            return
        wait = RouteWait(self.policy, clock.now(), deadline, self.plan.version)
        while True:
            self.handler.still_served()
            decision = wait.decide(clock.now(), self.host.latest)
            if decision == GIVE_UP:
                raise SwarmError(cannot_serve(self.host.latest))
            if decision is not None:
                await self.follow(force=decision.force, since=failed_at)
                return
            await self.host.changed()

    async def close(self) -> None:
        await close_all(each_once(self.host.conn, self.first, self.last))
        if self.dialer is not None:
            self.dialer.close()
