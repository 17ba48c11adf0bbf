"""One lock per request id, so that one request's packets run in order at a stage, kept only
while some packet of that request holds it or waits for it: a lock per id ever seen would let a
peer grow the map without bound by sending END or refused packets with fresh ids."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator


class RequestLocks:
    def __init__(self) -> None:
        self._locks: dict[bytes, tuple[asyncio.Lock, int]] = {}  # request id → (lock, holders and waiters)

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, rid: bytes) -> AsyncIterator[None]:
        lock, users = self._locks.get(rid, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[rid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[rid]
            if users == 1:
                del self._locks[rid]
            else:
                self._locks[rid] = (lock, users - 1)
