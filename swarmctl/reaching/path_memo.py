"""What the last attempts to reach each trunk found, so that a punch known to fail is not tried
again on every ask's clock.

A punch towards a member behind a symmetric NAT fails after net.punch.PUNCH_TIMEOUT (3 s), and
only then does the member ask for a relay. Every `swarmctl ask` is a new process, so without a
memory each one paid those seconds again. The dialer (swarmctl/reaching/reach.py) records the outcome of
each path attempt here, keyed by the member, the address the host gave for it (a new NAT mapping
is a new key), what the host planned (direct or punch) and our own side (the local address our
datagrams leave from: on another network the answer may differ). Where a punch failed within
MEMO_TTL_S, the dialer asks for the relay at once and punches again in the background; what that
finds is recorded in turn, so a path that starts to work is punched on the next ask.

``PathMemo`` is pure (the clock is passed in); ``PathMemoFile`` keeps one in the node's home as
JSON, written whole and atomically, read again before each write so that concurrent processes
(two asks, serve) lose at most each other's newest entry, never the file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("swarmctl.reaching.reach")

MEMO_TTL_S = 600.0  # how long an outcome is trusted; background attempts refresh it
MAX_ENTRIES = 256  # the oldest go first: a member talks to few trunks at a time
OUTCOMES = ("direct", "punched", "relayed")  # relayed: the punch failed (or was skipped) and a relay was asked for
FILE_NAME = "paths.json"


@dataclass(frozen=True)
class PathKey:
    member: str  # the trunk
    address: str  # where the host said it is (for a punch: its public ip:port as the host sees it)
    plan: str  # what the host planned: "direct" or "punch"
    origin: str = ""  # our local IP towards it ("": unknown)


@dataclass(frozen=True)
class Outcome:
    path: str  # one of OUTCOMES
    at: float  # when (seconds since the epoch: entries outlive the process)


class PathMemo:
    def __init__(self, ttl_s: float = MEMO_TTL_S, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.entries: dict[PathKey, Outcome] = {}  # oldest first

    def get(self, key: PathKey, now: float) -> Outcome | None:
        """The outcome recorded for ``key`` within the last ttl_s seconds, if any."""
        outcome = self.entries.get(key)
        if outcome is None or not (0 <= now - outcome.at < self.ttl_s):
            return None  # (an entry from the future: a clock that jumped back; not trusted)
        return outcome

    def punch_failed(self, key: PathKey, now: float) -> Outcome | None:
        """The recent outcome for ``key`` if it says punching does not get through."""
        outcome = self.get(key, now)
        return outcome if key.plan == "punch" and outcome is not None and outcome.path == "relayed" else None

    def put(self, key: PathKey, path: str, now: float) -> None:
        if path not in OUTCOMES:
            raise ValueError(f"path outcome {path!r}: expected one of {', '.join(OUTCOMES)}")
        self.entries.pop(key, None)
        self.entries[key] = Outcome(path, now)
        self.forget_old(now)

    def forget_old(self, now: float) -> None:
        for key in [k for k, o in self.entries.items() if not (0 <= now - o.at < self.ttl_s)]:
            del self.entries[key]
        while len(self.entries) > self.max_entries:
            del self.entries[next(iter(self.entries))]

    def to_json(self) -> str:
        return json.dumps({"paths": [{**asdict(k), **asdict(o)} for k, o in self.entries.items()]}, indent=1)

    def merge_json(self, text: str, now: float) -> None:
        """Add the recent entries of a saved memo (the newer outcome wins where both have one);
        anything unreadable is skipped: the memo only saves time, it never decides correctness."""
        try:
            rows = json.loads(text).get("paths", [])
        except (ValueError, AttributeError):
            return
        merged: dict[PathKey, Outcome] = {}
        for row in rows if isinstance(rows, list) else []:
            try:
                key = PathKey(str(row["member"]), str(row["address"]), str(row["plan"]), str(row.get("origin", "")))
                outcome = Outcome(str(row["path"]), float(row["at"]))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if outcome.path in OUTCOMES:
                merged[key] = outcome
        for key, outcome in self.entries.items():
            if key not in merged or merged[key].at <= outcome.at:
                merged[key] = outcome
        self.entries = dict(sorted(merged.items(), key=lambda item: item[1].at))
        self.forget_old(now)


class PathMemoFile:
    """A PathMemo kept in a file (``None``: in memory only, as a long-lived trunk needs)."""

    def __init__(self, path: Path | None = None, clock=time.time) -> None:
        self.path = path
        self.clock = clock
        self.memo = PathMemo()
        self._load()

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            self.memo.merge_json(self.path.read_text(), self.clock())
        except OSError:
            pass  # none yet, or unreadable: start empty

    def punch_failed(self, key: PathKey) -> float | None:
        """Seconds since a punch for ``key`` was last found not to get through (None: not recently)."""
        outcome = self.memo.punch_failed(key, self.clock())
        return None if outcome is None else self.clock() - outcome.at

    def record(self, key: PathKey, path: str) -> None:
        now = self.clock()
        self._load()  # what other processes learnt meanwhile
        self.memo.put(key, path, now)
        if self.path is None:
            return
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(self.memo.to_json())
            os.replace(tmp, self.path)
        except OSError as e:
            log.info("cannot keep path outcomes in %s: %s", self.path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
