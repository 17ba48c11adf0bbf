"""A stage's one connection to the next stage, shared by every request passing on."""

from __future__ import annotations

import asyncio

from net.endpoint import close
from net.protocol import SwarmProtocol
from plans.plan import StageAssignment
from swarmctl.trunk.context import TrunkContext


class NextStage:
    def __init__(self, ctx: TrunkContext) -> None:
        self.conn: SwarmProtocol | None = None
        self.member: str | None = None
        self._connect = ctx.connect  # the trunk's dialer
        self._handler = ctx.handler  # where the connection's frames go (the trunk)
        self._connecting = asyncio.Lock()  # held while the connection onward is being made

    async def connection(self, nxt: StageAssignment | None) -> SwarmProtocol:
        if nxt is None:
            raise ConnectionError("the plan has no stage after this one")
        # One connection at a time: requests passing on together while it is being made (the
        # first batch after a plan change) must all get the one that is made. Each making its own
        # left the earlier ones' streams on a connection the next request's step then closed,
        # and the next stage freed those requests (seen as "unknown request" refusals).
        async with self._connecting:
            if self.conn is not None and self.conn.is_open and self.member == nxt.member:
                return self.conn
            if self.conn is not None:
                await close(self.conn, "plan changed")
            self.conn = await self._connect(nxt.member, nxt.address, self._handler)
            self.member = nxt.member
            return self.conn

    def lost(self, conn: SwarmProtocol) -> None:
        if conn is self.conn:
            self.conn = self.member = None

    async def close(self) -> None:
        if self.conn is not None:
            await close(self.conn, "trunk shutting down")
