"""What the soak records while it runs: its clock, the requests, the faults and the samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Clock:
    """Seconds since the load began (every time in the report is on this clock)."""

    t0: float = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


@dataclass
class Request:
    id: int
    channel: str  # "ask:<member>", "api:chat" or "api:completions"
    prompt: int
    started_s: float
    ended_s: float | None = None
    outcome: str | None = None  # ok, wrong, failed, lost
    cause: str | None = None
    clear_error: bool | None = None  # for failures: the client was told why in words
    ttft_s: float | None = None  # API: first token's arrival
    got: str | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self.ended_s is None else self.ended_s - self.started_s

    def end_or(self, now: float) -> float:
        """When it ended, or ``now`` for a request still under way."""
        return self.ended_s if self.ended_s is not None else now


@dataclass
class Event:
    kind: str  # kill, freeze, join
    node: str
    at_s: float
    action_done_s: float | None = None  # restarted / resumed / started
    recovered_s: float | None = None  # the host reports the swarm complete with every running trunk serving
    window: list[float] | None = None
    note: str = ""


@dataclass
class NodeSample:
    """One process at one sample: a trunk as the host lists it and its own `stats`, or the host or
    `serve` with their RSS read from /proc. None where unknown (a trunk that did not answer)."""

    pid: int | None = None
    health: str | None = None  # trunks only
    error: str | None = None  # trunks: why their stats are missing
    rss_mb: float | None = None
    open_streams: int | None = None
    requests: int | None = None
    routes: int | None = None
    kv_mb: float | None = None
    tensor_mb: float | None = None


@dataclass
class Sample:
    """The swarm at one moment: the host's view and each process's figures."""

    t: float
    plan_version: int | None
    complete: bool | None
    stages: list[str]  # the serving members, first stage first
    in_flight: int  # requests under way at the soak
    nodes: dict[str, NodeSample] = field(default_factory=dict)  # trunks by name, "host", "serve"
    host_error: str | None = None  # the host's status could not be read
    idle_check: bool = False  # taken after the load, while waiting for the streams to close


def round_or_none(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)
