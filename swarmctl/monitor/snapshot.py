"""What a view of the swarm shows, as immutable values: one ``SwarmSnapshot`` per poll.

Snapshots compare by identity (``eq=False``): a view asks "is this a new one?", never "is it
equal?", which would walk every batch of every lane four times a second.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch a stage ran: when (seconds before the stage's clock at the poll), how long, and
    which requests (their letters) were in it."""

    ago_s: float  # start of the batch, seconds before ``Lane.clock``
    seconds: float
    letters: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Lane:
    """One pipeline stage's recent work, for the occupancy chart."""

    name: str
    layers: tuple[int, int]
    batches: tuple[Batch, ...]  # oldest first
    reachable: bool  # False: no stats this poll (the lane is blank, not idle)


@dataclass(frozen=True, eq=False)
class NodeView:
    """One member of the swarm: what the host says about it, and (for trunks) its own stats."""

    name: str
    role: str  # "host", "trunk" or "member"
    address: str
    layers: tuple[int, int] | None
    device: str
    health: str  # the host's word: ready, loading, up, down, revoked, refused: ...
    memory_used: int | None  # bytes: the process's resident set
    memory_budget: int | None  # bytes the member offered
    queue_depth: int | None  # steps waiting for the stage's engine
    occupancy: float | None  # fraction of the window the engine was busy
    tok_s: float | None  # steps per second over the window: one generated token per request step
    next_hop: str  # the member (or "asker") this stage sends its output to
    next_hop_ms: float | None  # that link's round trip, as the node measured it for the planner
    ping_ms: float | None  # round trip from this monitor to the node, measured now (QUIC PING)
    stats_error: str  # why this poll has no stats from it ("" when it has)
    next_hop_path: str = ""  # how that link goes: "direct", "relayed via X" ("": the host did not say)
    path: str = ""  # how this monitor reaches the node: "direct", "punched", "relayed via X" ("": not connected)
    fetch: str = ""  # a fetch of layers or experts under way, as the host last heard of it ("": none)
    cached_tokens: int = 0  # prompt positions its stage keeps as prefixes for askers' next requests


@dataclass(frozen=True, eq=False)
class RequestView:
    """A request some trunk stage holds (the asker's own steps are not visible from here)."""

    request_id: str  # the first 8 hex digits
    letter: str  # its mark in the occupancy chart
    tokens: int  # tokens in its cache at the stage furthest along (prompt included)
    tok_s: float  # steps per second at the first stage over the window
    stage: str  # the stage that last worked on it
    idle_s: float  # since any stage last worked on it
    drafted: int = 0  # speculative tokens its steps carried through the trunks (0: none, or an older trunk)
    accepted: int = 0  # of those, how many the asker kept


@dataclass(frozen=True, eq=False)
class PlanView:
    """What the host's planner expects of the current plan, and what recovery it has seen."""

    objective: str = ""
    expected_ms_per_token: float = 0.0  # one request alone: trunk compute and links
    expected_tok_s: float = 0.0  # pipelined bound
    bottleneck: str = ""
    warnings: tuple[str, ...] = ()
    recoveries: int = 0  # requests rerouted after a failure
    last_recovery_s: float | None = None
    last_marked_down: str | None = None


@dataclass(frozen=True, eq=False)
class SwarmSnapshot:
    seq: int  # increases with every poll
    taken_at: float  # unix time of the poll
    poll_ms: float  # how long the poll took
    window_s: float  # occupancy and rates are over this many seconds
    swarm: str
    model: str
    plan_version: int
    complete: bool
    missing_layers: tuple[tuple[int, int], ...]
    nodes: tuple[NodeView, ...]  # in pipeline order: stages by layer, then the others by name
    lanes: tuple[Lane, ...]  # one per stage, by layer
    requests: tuple[RequestView, ...]  # by request id
    tok_s_history: tuple[float, ...]  # swarm-wide steps per second at the first stage, one per poll
    history_s: float = 0.0  # the time the history covers
    plan: PlanView = PlanView()
    banner: str = ""  # a line above everything: "swarm unreachable: ..., retrying", "connecting to ..."
    stale: bool = False  # the host did not answer this poll: the figures are the last good poll's

    @property
    def tok_s(self) -> float:
        return self.tok_s_history[-1] if self.tok_s_history else 0.0


def waiting_snapshot(message: str) -> SwarmSnapshot:
    """Before the first answer: nothing known yet but what the monitor is doing."""
    return SwarmSnapshot(seq=0, taken_at=0.0, poll_ms=0.0, window_s=0.0, swarm="", model="", plan_version=0,
                         complete=False, missing_layers=(), nodes=(), lanes=(), requests=(), tok_s_history=(),
                         banner=message, stale=True)
