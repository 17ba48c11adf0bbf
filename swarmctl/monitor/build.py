"""From raw polls to snapshots: the arithmetic of occupancy, rates and request marks.

Pure: a ``RawPoll`` is the host's answers and each trunk's ``stats`` as they came over the wire,
decoded into their message types (net/messages.py); ``SnapshotBuilder.add`` turns a sequence of
them into ``SwarmSnapshot``s. The only state it keeps between polls is what needs history: the
swarm-wide rate (a counter's growth from one poll to the next) and the letter each request keeps
in the chart while it is visible. Recorded polls replayed through it give the same snapshots,
which is what the view tests use.
"""

from __future__ import annotations

import dataclasses
import string
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from net.messages import MemberStatus, NodeInfo, Stats, Status
from swarmctl.model_files.fetch_progress import fetching
from swarmctl.monitor.snapshot import Batch, Lane, NodeView, PlanView, RequestView, SwarmSnapshot, waiting_snapshot

LETTERS = string.ascii_lowercase + string.ascii_uppercase
OVERFLOW_LETTER = "*"  # more requests visible at once than letters
HISTORY = 240  # polls of swarm-wide tok/s kept for the sparkline (2 minutes at the default interval)
MIN_RATE_SPAN_S = 1.0  # a request seen for less than this is rated over this, not over a few ms


class RawPoll(msgspec.Struct, frozen=True):
    """One round of questions to the swarm, the answers as received (for recording: ``to_dict``
    is plain JSON-shaped data, ``from_dict`` reads it back and checks it)."""

    taken_at: float  # unix time when the poll started
    poll_s: float  # how long the whole poll took
    status: Status | None  # the host's "status" reply; None when the host could not be asked
    nodes: list[NodeInfo] | None = None  # the host's "nodes" reply: device and measured links per trunk
    stats: dict[str, Stats] = {}  # trunk name → its "stats" reply
    pings_ms: dict[str, float] = {}  # trunk name → QUIC ping from here
    stats_errors: dict[str, str] = {}  # trunk name → why no stats
    host_error: str = ""
    retry_in_s: float = 0.0
    paths: dict[str, str] = {}  # trunk name → how this monitor reached it: direct, punched, relayed via X

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RawPoll":
        """Raises msgspec.ValidationError (a ValueError) naming the field that is wrong."""
        return msgspec.convert(d, cls, strict=False)


class _Held(msgspec.Struct, frozen=True):
    """One entry of a trunk's ``requests_detail`` (``Stats`` types it only as a dict)."""

    id: str
    position: int
    idle_s: float
    drafted: int = 0  # drafted tokens its VERIFY steps carried here (trunks before drafts send none)
    accepted: int = 0  # of those, how many the asker kept


@dataclass(frozen=True)
class _StageBatches:
    """A trunk's ``recent_batches`` as typed values: (started unix time, seconds, steps' request ids)."""

    clock: float
    spans: tuple[tuple[float, float, tuple[str, ...]], ...]

    @classmethod
    def from_stats(cls, stats: Stats) -> "_StageBatches":
        # each batch is [started, seconds, tokens, [request ids]] (Stats types it as a list of Any)
        spans = tuple((float(b[0]), float(b[1]), tuple(str(r) for r in b[3])) for b in stats.recent_batches)
        return cls(stats.time, spans)

    def busy_fraction(self, window_s: float) -> float:
        """The share of the last ``window_s`` seconds during which the engine ran a batch."""
        since = self.clock - window_s
        busy = sum(max(0.0, min(start + seconds, self.clock) - max(start, since)) for start, seconds, _ in self.spans)
        return min(1.0, busy / window_s)

    def steps_per_s(self, window_s: float) -> float:
        since = self.clock - window_s
        return sum(len(ids) for start, _, ids in self.spans if start >= since) / window_s

    def request_rate(self, request_id: str, window_s: float) -> float:
        """Steps of one request per second, over the part of the window it has been seen in."""
        since = self.clock - window_s
        starts = [start for start, _, ids in self.spans if start >= since and request_id in ids]
        if not starts:
            return 0.0
        return len(starts) / min(window_s, max(MIN_RATE_SPAN_S, self.clock - starts[0]))


class SnapshotBuilder:
    def __init__(self, window_s: float = 5.0, history: int = HISTORY) -> None:
        self.window_s = window_s
        self._seq = 0
        self._letters: dict[str, str] = {}  # request id prefix → its mark while it stays visible
        self._history: deque[float] = deque(maxlen=history)
        self._history_times: deque[float] = deque(maxlen=history)
        self._last_count: tuple[str, float, int] | None = None  # (reference stage, its clock, its steps counter)
        self._last_good: SwarmSnapshot | None = None

    def add(self, poll: RawPoll) -> SwarmSnapshot:
        """The next snapshot. A malformed trunk entry raises ValueError, IndexError or TypeError."""
        self._seq += 1
        if poll.status is None:
            return self._unreachable(poll)
        status = poll.status
        members = status.members
        stages = sorted((m for m in members if m.layers), key=lambda m: m.layers[0])
        batches = {name: _StageBatches.from_stats(s) for name, s in poll.stats.items()}
        held = {name: _held(s) for name, s in poll.stats.items()}
        self._assign_letters(stages, batches, held)
        reference = next((m.name for m in stages if m.name in batches), None)
        snapshot = SwarmSnapshot(
            seq=self._seq, taken_at=poll.taken_at, poll_ms=poll.poll_s * 1e3, window_s=self.window_s,
            swarm=status.swarm, model=status.model, plan_version=status.plan_version, complete=status.complete,
            missing_layers=tuple((int(a), int(b)) for a, b in status.missing_layers),
            nodes=self._nodes(members, stages, poll, batches),
            lanes=tuple(self._lane(m, batches.get(m.name)) for m in stages),
            requests=self._requests(stages, held, batches.get(reference) if reference else None),
            tok_s_history=self._rate(reference, poll.stats.get(reference or ""), batches.get(reference or ""),
                                     poll.taken_at),
            history_s=self._history_times[-1] - self._history_times[0], plan=_plan_view(status))
        self._last_good = snapshot
        return snapshot

    # --- parts of a snapshot ---

    def _unreachable(self, poll: RawPoll) -> SwarmSnapshot:
        retry = f"retrying in {poll.retry_in_s:.0f} s" if poll.retry_in_s >= 1 else "retrying"
        banner = f"swarm unreachable: {poll.host_error or 'no answer'}, {retry}"
        if self._last_good is None:
            return dataclasses.replace(waiting_snapshot(banner), seq=self._seq, taken_at=poll.taken_at)
        return dataclasses.replace(self._last_good, seq=self._seq, banner=banner, stale=True)

    def _nodes(self, members: list[MemberStatus], stages: list[MemberStatus], poll: RawPoll,
               batches: dict[str, _StageBatches]) -> tuple[NodeView, ...]:
        described = {n.name: n for n in poll.nodes or ()}
        paths = {(r.source, r.target): r for r in (poll.status.links if poll.status is not None else ())}
        next_hop = {m.name: (stages[i + 1].name if i + 1 < len(stages) else "asker") for i, m in enumerate(stages)}
        by_name: dict[str, MemberStatus] = {}
        for m in members:
            by_name.setdefault(m.name, m)
        staged = [m.name for m in stages]
        order = staged + sorted((m.name for m in members if m.name not in staged),
                                key=lambda n: (0 if by_name[n].role == "host" else 1, n))
        views = []
        for name in order:
            m = by_name[name]
            stats, work, node = poll.stats.get(name), batches.get(name), described.get(name)
            hop = next_hop.get(name, "")
            link = node.links.get(hop) if node is not None and hop else None
            row = paths.get((name, hop))  # the host's status row for this hop (path, and rtt if measured)
            if link is None and row is not None and row.measured:
                link = row
            views.append(NodeView(
                name=name, role=m.role, address=m.address, layers=tuple(m.layers) if m.layers else None,
                device=(node.device if node is not None else "") or ("cpu" if m.role == "trunk" else ""),
                health=m.health,
                memory_used=stats.rss if stats is not None and stats.rss else None,
                memory_budget=m.memory or None,
                queue_depth=stats.queue_depth if stats is not None else None,
                occupancy=work.busy_fraction(self.window_s) if work else None,
                tok_s=work.steps_per_s(self.window_s) if work else None,
                next_hop=hop, next_hop_ms=link.rtt_ms if link is not None else None,
                ping_ms=poll.pings_ms.get(name), stats_error=poll.stats_errors.get(name, ""),
                next_hop_path=row.path if row is not None else "", path=poll.paths.get(name, ""),
                fetch=fetching(m), cached_tokens=getattr(m, "cached_tokens", 0)))
        return tuple(views)

    def _lane(self, member: MemberStatus, work: _StageBatches | None) -> Lane:
        layers = (member.layers[0], member.layers[1])
        if work is None:
            return Lane(member.name, layers, (), reachable=False)
        return Lane(member.name, layers, tuple(
            Batch(work.clock - start, seconds, tuple(self._letters.get(r, OVERFLOW_LETTER) for r in ids))
            for start, seconds, ids in work.spans), reachable=True)

    def _requests(self, stages: list[MemberStatus], held: dict[str, tuple[_Held, ...]],
                  reference: _StageBatches | None) -> tuple[RequestView, ...]:
        places: dict[str, list[tuple[str, _Held]]] = {}  # id → (stage, what it holds of the request)
        for m in stages:
            for r in held.get(m.name, ()):
                places.setdefault(r.id, []).append((m.name, r))
        views = []
        for rid, seen in sorted(places.items()):
            stage, latest = min(seen, key=lambda p: p[1].idle_s)
            # every stage sees the same steps, but a stage counts a VERIFY step only when the next
            # step arrives (later downstream), and one that took the request over in a replan saw
            # fewer: the furthest count, taken from one stage so that accepted ≤ drafted holds
            drafts = max((r for _, r in seen), key=lambda r: (r.drafted, r.accepted))
            views.append(RequestView(rid, self._letters.get(rid, OVERFLOW_LETTER), max(p[1].position for p in seen),
                                     reference.request_rate(rid, self.window_s) if reference else 0.0,
                                     stage, latest.idle_s, drafts.drafted, drafts.accepted))
        return tuple(views)

    def _rate(self, reference: str | None, stats: Stats | None, work: _StageBatches | None,
              taken_at: float) -> tuple[float, ...]:
        """Swarm-wide tok/s: every generated token is one step at every stage, so the first
        stage's step counter grows at the swarm's rate (a prompt counts once, as one step)."""
        self._history_times.append(taken_at)
        if reference is None or stats is None or work is None:
            self._history.append(0.0)
            self._last_count = None
            return tuple(self._history)
        count = (reference, work.clock, stats.steps)
        last = self._last_count
        if last is not None and last[0] == reference and count[1] > last[1] and count[2] >= last[2]:
            rate = (count[2] - last[2]) / (count[1] - last[1])
        else:  # the first poll, another stage, or a restarted one: the recent window's rate
            rate = work.steps_per_s(min(self.window_s, 1.0))
        self._last_count = count
        self._history.append(rate)
        return tuple(self._history)

    def _assign_letters(self, stages: list[MemberStatus], batches: dict[str, _StageBatches],
                        held: dict[str, tuple[_Held, ...]]) -> None:
        """Each visible request keeps one letter; letters of requests gone from view are reused."""
        seen: list[str] = []
        for m in stages:
            work = batches.get(m.name)
            spans = sorted(work.spans) if work else ()
            seen += [r for _, _, ids in spans for r in ids]
            seen += [r.id for r in held.get(m.name, ())]
        visible = dict.fromkeys(seen)
        self._letters = {r: letter for r, letter in self._letters.items() if r in visible}
        free = [letter for letter in LETTERS if letter not in set(self._letters.values())]
        for r in visible:
            if r not in self._letters:
                self._letters[r] = free.pop(0) if free else OVERFLOW_LETTER


def _held(stats: Stats) -> tuple[_Held, ...]:
    return msgspec.convert(stats.requests_detail, tuple[_Held, ...], strict=False)


def _plan_view(status: Status) -> PlanView:
    recovery = status.recovery
    return PlanView(objective=status.objective, expected_ms_per_token=status.expected_ms_per_token,
                    expected_tok_s=status.expected_tokens_per_s, bottleneck=status.bottleneck,
                    warnings=tuple(status.warnings), recoveries=recovery.recoveries,
                    last_recovery_s=recovery.last_recovery_s, last_marked_down=recovery.last_marked_down)
