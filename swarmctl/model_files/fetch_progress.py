"""How a member's fetch is going: bytes done of the total, the rate, the time left; when to say
so in `run`'s log (one line every LOG_EVERY_S, not every chunk) and when to tell the host (every
REPORT_EVERY_S; status and top show each member's fetch, the planner prices a layer move at the
member's measured rate). I/O-free: the clock is passed in.

The rate is this session's: bytes received since its first chunk arrived over the time since, so
a fetch resumed with most of its chunks already on disk is not credited with bytes it did not move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

LOG_EVERY_S = 10.0
REPORT_EVERY_S = 5.0
STALE_FETCH_S = 60.0  # a fetch not reported on for this long is not shown as under way
MIN_RATE_S = 1.0  # no rate (nor time left) before this much time: the first chunks say little


@dataclass
class FetchProgress:
    what: str  # "layers [4, 10)", "experts [0, 4) of layers [1, 3)"
    clock: Callable[[], float] = time.monotonic
    total: int = 0
    done: int = 0
    started: float = field(default=0.0)
    start_bytes: int | None = None  # already on disk when this session began (a resumed fetch)
    finished: bool = False
    _logged: float | None = None
    _reported: float | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()

    def update(self, done: int, total: int) -> None:
        if self.start_bytes is None:  # the clock starts at the first chunk: its bytes count as there
            self.start_bytes = done if done < total else 0
            self.started = self.clock()
        self.done, self.total = done, total
        self.finished = total > 0 and done >= total

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started

    @property
    def bytes_per_s(self) -> float | None:
        """This session's rate; None until MIN_RATE_S passed (but a finished fetch's, however short)."""
        elapsed = self.elapsed_s
        if elapsed < MIN_RATE_S and not (self.finished and elapsed > 0):
            return None
        return max(0, self.done - (self.start_bytes or 0)) / elapsed

    @property
    def eta_s(self) -> float | None:
        rate = self.bytes_per_s
        if self.finished:
            return 0.0
        return (self.total - self.done) / rate if rate else None

    def line(self) -> str:
        """One line for the log."""
        pct = 100 * self.done / self.total if self.total else 0.0
        head = f"fetching {self.what}: {self.done / 1e6:.1f} / {self.total / 1e6:.1f} MB ({pct:.0f}%)"
        rate = self.bytes_per_s
        if self.finished:
            # (not "fetched <what>": distribution's line giving each source's share starts so)
            return f"{self.what}: all {self.total / 1e6:.1f} MB fetched in {format_duration(self.elapsed_s)}" + \
                (f" ({rate / 1e6:.2f} MB/s)" if rate is not None else "")
        if rate is None:
            return head
        eta = self.eta_s
        return f"{head}, {rate / 1e6:.2f} MB/s, " + \
            (f"about {format_duration(eta)} left" if eta is not None else "stalled")

    def log_due(self) -> bool:
        """Whether to log a line now (the first after LOG_EVERY_S, then every LOG_EVERY_S; the end)."""
        return self._due("_logged", LOG_EVERY_S)

    def report_due(self) -> bool:
        """Whether to tell the host now (every REPORT_EVERY_S, and the end)."""
        return self._due("_reported", REPORT_EVERY_S)

    def _due(self, attr: str, every: float) -> bool:
        now = self.clock()
        last = getattr(self, attr)
        if self.finished:  # the end, once
            if last == float("inf"):
                return False
            setattr(self, attr, float("inf"))
            return True
        if now - (self.started if last is None else last) >= every:
            setattr(self, attr, now)
            return True
        return False


def fetching(member) -> str:
    """A member's fetch under way (a ``MemberStatus``), as it last reported it: "" for none, a
    finished one, or one not reported on for STALE_FETCH_S."""
    fetch = getattr(member, "fetch", None)  # (a host too old to say sends none)
    if fetch is None or fetch.finished or fetch.age_s > STALE_FETCH_S or member.health in ("down", "revoked"):
        return ""
    return summary(fetch.done, fetch.total, fetch.bytes_per_s, fetch.eta_s, fetch.finished)


def summary(done: int, total: int, bytes_per_s: float | None, eta_s: float | None, finished: bool) -> str:
    """A member's fetch as status and top show it: "fetching 31% of 1.0 GB, 2.40 MB/s, about 5 min left"."""
    if finished:
        return f"fetched {total / 1e9:.2f} GB" + (f" at {bytes_per_s / 1e6:.2f} MB/s" if bytes_per_s else "")
    pct = 100 * done / total if total else 0.0
    text = f"fetching {pct:.0f}% of {total / 1e9:.2f} GB"
    if bytes_per_s is not None:
        text += f", {bytes_per_s / 1e6:.2f} MB/s"
    if eta_s is not None:
        text += f", about {format_duration(eta_s)} left"
    return text


def format_duration(seconds: float) -> str:
    """"45 s", "4 min 57 s", "3 h 12 min"."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
