"""Revocations reach the running host two ways: its own CLI tells it (`swarmctl revoke` sends
``Revoked``), and the host reads its member records again whenever they change on disk. The second
way covers a CLI that found no host to tell although one was running (stopped for a while, or too
busy to answer within the CLI's wait): the revoked member then kept its live connections and its
place in the plan until the host restarted."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

from swarmctl.node.home import HomeError, SwarmHome

from .model_hashes import FileIdentity

log = logging.getLogger("swarmctl.host")

RECORDS_POLL_S = 2.0  # how often the host looks whether members.json changed (a stat; read only if it did)


class FileStamp:
    """Whether a file changed since the last look (its ``FileIdentity``: inode, size, modification time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # (not looked at yet: the first look reads the file, so that a change between the host
        # reading its records at start and this watch starting is not missed)
        self.seen: FileIdentity | None = None

    def changed(self) -> bool:
        try:
            now = FileIdentity.of(self.path)
        except OSError:
            now = None
        if now == self.seen:
            return False
        self.seen = now
        return True


async def watch_revocations(home: SwarmHome, known: Callable[[], frozenset[int]],
                            revoke: Callable[[frozenset[int]], int]) -> None:
    """Every RECORDS_POLL_S: if the member records changed and name a revoked certificate the host
    does not know of (``known``), ``revoke`` with every revoked serial."""
    stamp = FileStamp(home.file("members.json"))
    while True:
        await asyncio.sleep(RECORDS_POLL_S)
        if not stamp.changed():
            continue
        try:
            revoked = home.revoked_serials()
        except HomeError as e:  # (written half-way: the next change reads it whole)
            log.warning("the member records could not be read: %s", e)
            continue
        if not revoked - known():
            continue  # (a join, or a revocation the CLI told already)
        try:
            closed = revoke(revoked)
        except Exception:  # noqa: BLE001 - the watch must outlive any one bad re-plan
            log.exception("applying a revocation from the member records failed")
            continue
        log.warning("a revocation found in the member records before the CLI told this host: %d connection%s "
                    "closed", closed, "" if closed == 1 else "s")
