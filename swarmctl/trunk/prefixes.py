"""Kept prefixes at a stage: a request's cells kept past its end for its account's next request.

A conversation sends its whole history again every turn. When a request ends with an END that
names a prefix (net/wire.py: FLAG_PREFIX), the stage keeps the request's cells [0, positions) under
that id instead of freeing them, charged to the request's account (swarmctl/trunk/budget.py); a later
request of the same account whose first PREFILL names the id starts from those cells, cut to its
start position. The id is the asker's choice and says nothing of the tokens (a stage never sees
them); it is looked up only among the asking account's own prefixes, so no account can reach
another's, nor learn through timing what another asked.

A stage that no longer holds the prefix (evicted, restarted, reloaded for another plan) refuses
the step with a retry, and the asker replays the request from position 0: a recompute, never a
wrong answer. The cells live in the engine, so they go with it when the plan moves this stage.

Each account's prefixes go first, least recently used first, whenever that account needs room
for a request or another prefix; never another account's. Prefixes unused for ``KEPT_IDLE_S`` go
too (the reaper's rounds).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from swarmctl.trunk.budget import MAX_KEPT_PER_MEMBER
from swarmctl.trunk.assignment import Assignment

log = logging.getLogger("swarmctl.trunk")

KEPT_IDLE_S = 600.0  # a conversation idle this long starts over (as a llama.cpp server's slot may be reused)


def prefix_key(account: str, prefix: bytes) -> bytes:
    """The engine's key for an account's prefix: longer than any request id (16 bytes), so the
    two never meet, and the account in it, so one account's id never names another's cells."""
    return b"prefix/" + hashlib.sha256(account.encode()).digest()[:16] + bytes(prefix)


class StagePrefixes:
    """Keeps, finds and evicts the prefixes of the stage ``held`` serves (the caller holds the
    request's lock; engine calls go through its runner, on the compute thread)."""

    def __init__(self, name: str, held: Assignment) -> None:
        self.name = name
        self.held = held
        self._used: dict[bytes, float] = {}  # key → when it was kept (the clock callers pass as ``now``)
        # Keeps under way per account: the END of one turn and the first step of the next come on
        # different streams, and the step may overtake the keep; it waits for it to finish.
        self._keeping: dict[str, list[asyncio.Future]] = {}
        self._told = (0, 0)  # the totals the host last heard (``news``)

    async def keep(self, rid: bytes, account: str, prefix: bytes, positions: int, now: float) -> bool:
        """Keep request ``rid``'s cells [0, positions) as ``prefix`` of ``account``, from ``now`` on
        (``reap`` counts its idle time from then); False when it cannot (the stage does not hold
        them all, or the account has no room): the caller frees it."""
        done = asyncio.get_running_loop().create_future()
        self._keeping.setdefault(account, []).append(done)
        try:
            return await self._keep(rid, account, prefix, positions, now)
        finally:
            done.set_result(None)
            self._keeping[account].remove(done)
            if not self._keeping[account]:
                del self._keeping[account]

    async def _keep(self, rid: bytes, account: str, prefix: bytes, positions: int, now: float) -> bool:
        held = self.held
        runner, engine, budget = held.runner, held.engine, held.budget
        if runner is None or engine is None or positions <= 0 or engine.position_of(rid) < positions:
            return False
        key = prefix_key(account, prefix)
        kv_bytes = engine.kv_bytes_of(rid)
        budget.release(rid)  # (the request's charge goes; the prefix's comes)
        await self.evict(key)
        while budget.kept_count(account) >= MAX_KEPT_PER_MEMBER or budget.member_over(account, kv_bytes):
            oldest = budget.oldest_kept(account)
            if oldest is None:
                return False
            await self.evict(oldest)
        if held.runner is not runner or not await runner.call(engine.move, rid, key, positions):
            return False
        budget.keep(key, account, kv_bytes, positions)
        self._used[key] = now
        return True

    async def resume(self, rid: bytes, account: str, prefix: bytes, positions: int) -> str:
        """Make ``account``'s prefix the cache of request ``rid``, cut to ``positions``; "" when
        done, else why not (the sender replays from position 0)."""
        if self._keeping.get(account):
            await asyncio.gather(*self._keeping[account])
        held = self.held
        runner, engine, budget = held.runner, held.engine, held.budget
        key = prefix_key(account, prefix)
        kept = budget.kept(key, account)
        if runner is None or engine is None or kept is None or kept.positions < positions:
            return f"no kept prefix of {positions} positions at {self.name}: start from position 0"
        moved = await runner.call(engine.move, key, rid, positions)
        budget.drop_kept(key)
        self._used.pop(key, None)
        return "" if moved else f"the kept prefix at {self.name} cannot be resumed: start from position 0"

    async def admit(self, rid: bytes, account: str, kv_bytes: int) -> str:
        """``MemberBudget.admit``, the account's own prefixes making room first, least recently
        used first (never another account's)."""
        budget = self.held.budget
        while (problem := budget.admit(rid, account, kv_bytes)) and (oldest := budget.oldest_kept(account)):
            budget.refusals -= 1  # (room is made: not a refusal)
            await self.evict(oldest)
        return problem

    async def evict(self, key: bytes) -> None:
        held = self.held
        self._used.pop(key, None)
        if held.runner is not None and held.engine is not None and held.engine.has_request(key):
            await held.runner.call(held.engine.release, key)
        held.budget.drop_kept(key)

    def news(self) -> tuple[int, int] | None:
        """The positions and KV bytes kept now, all accounts together, if not what was last
        returned (the host is told: status and top show them)."""
        totals = self.held.budget.kept_totals() if self.held.engine is not None else (0, 0)
        if totals == self._told:
            return None
        self._told = totals
        return totals

    async def reap(self, now: float, idle_s: float = KEPT_IDLE_S) -> None:
        """Prefixes nobody used for ``idle_s`` before ``now`` go (and bookkeeping of ones an engine
        swap took)."""
        engine = self.held.engine
        for key, used in list(self._used.items()):
            if engine is None or not engine.has_request(key):
                self._used.pop(key, None)
            elif now - used > idle_s:
                log.info("a kept prefix idle for over %.0fs: freeing it", idle_s)
                await self.evict(key)
