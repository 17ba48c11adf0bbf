"""Recording raw polls to a file and replaying them: a deterministic feed for views and tests.

A recording is JSON lines: a header, then one ``RawPoll`` per line. Each trunk reports its last
10 s of batches every poll, so consecutive polls repeat most of them; a recording keeps only the
batches a trunk had not reported before, and reading rebuilds each poll's full window.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path
from typing import IO, Any

import msgspec

from kernels.errors import EngineError
from swarmctl.monitor.build import RawPoll, SnapshotBuilder
from swarmctl.monitor.snapshot import SwarmSnapshot, waiting_snapshot

FORMAT = "swarmctl-top-recording"
VERSION = 1
TRUNK_WINDOW_S = 10.0  # how far back a trunk's stats reach (trunk.stats' window)
_OLDER_MEMBER = {"may": ""}  # what _from_older_versions fills in where a recording lacks it
_OLDER_STATS = {"budget": {}, "open_streams": 0, "request_locks": 0}


class RecordingError(EngineError):
    """A file that is not a recording this version can read."""


class Recorder:
    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "w")
        self._file.write(json.dumps({"format": FORMAT, "version": VERSION}) + "\n")
        self._reported: dict[str, float] = {}  # trunk → start of the newest batch already written

    def write(self, poll: RawPoll) -> None:
        d = poll.to_dict()
        if not d.get("paths"):  # (no member behind a NAT: leave the line as it was before paths)
            d.pop("paths", None)
        if isinstance(d.get("status"), dict) and not d["status"].get("staged"):
            d["status"].pop("staged", None)  # (no plan staged, as in most polls: the line as before)
        members = d["status"].get("members", []) if isinstance(d.get("status"), dict) else []
        for row in [*members, *(d.get("nodes") or [])]:
            if isinstance(row, dict) and not row.get("ram_bytes"):  # (no RAM beside a GPU, as most: as before)
                row.pop("ram_bytes", None)
                row.pop("ram_gb_s", None)
            if isinstance(row, dict) and row.get("prompt_ms_per_layer_row", 0) is None:  # (unmeasured: as before)
                row.pop("prompt_ms_per_layer_row")
        for name, stats in poll.stats.items():
            newest = self._reported.get(name, float("-inf"))
            # 0.1 ms and 10 µs: finer than any chart cell, and a third of the bytes
            rounded = [[round(b[0], 4), round(b[1], 5), *b[2:]] for b in stats.recent_batches]
            fresh = [b for b in rounded if b[0] > newest]
            if fresh:
                self._reported[name] = fresh[-1][0]
            d["stats"][name]["recent_batches"] = fresh
        self._file.write(json.dumps(d, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_recording(path: Path) -> list[RawPoll]:
    try:
        lines = Path(path).read_text().splitlines()
        header = json.loads(lines[0]) if lines else {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RecordingError(f"cannot read recording {path}: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise RecordingError(f"{path} is not a swarmctl top recording (version {VERSION})")
    windows: dict[str, deque] = {}
    polls = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            poll = RawPoll.from_dict(_from_older_versions(json.loads(line)))
            stats = {}
            for name, recorded in poll.stats.items():
                window = windows.setdefault(name, deque())
                window.extend(b for b in recorded.recent_batches if not window or b[0] > window[-1][0])
                while window and window[0][0] < recorded.time - TRUNK_WINDOW_S:
                    window.popleft()
                stats[name] = msgspec.structs.replace(recorded, recent_batches=list(window))
        except (ValueError, TypeError, IndexError) as e:  # msgspec.ValidationError is a ValueError
            raise RecordingError(f"{path}, line {number}: not a recorded poll ({e})") from None
        polls.append(msgspec.structs.replace(poll, stats=stats))
    return polls


def _from_older_versions(d: Any) -> Any:
    """A recorded poll with what older hosts and trunks did not report yet filled in: a member's
    ``may`` (its certificate's role), a trunk's ``budget``, ``open_streams`` and ``request_locks``.
    Snapshots read none of them, so a recording from before them replays as it did."""
    if not isinstance(d, dict):
        return d  # RawPoll.from_dict says what it is instead
    status = d.get("status")
    if isinstance(status, dict) and isinstance(status.get("members"), list):
        members = [{**_OLDER_MEMBER, **m} if isinstance(m, dict) else m for m in status["members"]]
        d = {**d, "status": {**status, "members": members}}
    if isinstance(d.get("stats"), dict):
        d = {**d, "stats": {name: {**_OLDER_STATS, **s} if isinstance(s, dict) else s
                            for name, s in d["stats"].items()}}
    return d


class ReplayFeed:
    """Recorded polls as a feed: at their recorded pace (``realtime``), or all at once, for a
    view that should show exactly the last one."""

    def __init__(self, polls: list[RawPoll], *, window_s: float = 5.0, realtime: bool = True) -> None:
        self.polls = polls
        self.realtime = realtime
        self.builder = SnapshotBuilder(window_s)
        self._latest = waiting_snapshot("replaying a recording")
        if not realtime:
            for poll in polls:
                self._latest = self.builder.add(poll)

    def latest(self) -> SwarmSnapshot:
        return self._latest

    async def run(self) -> None:
        if not self.realtime or not self.polls:
            return
        loop = asyncio.get_running_loop()
        start, first = loop.time(), self.polls[0].taken_at
        for poll in self.polls:
            await asyncio.sleep(max(0.0, start + (poll.taken_at - first) - loop.time()))
            self._latest = self.builder.add(poll)
