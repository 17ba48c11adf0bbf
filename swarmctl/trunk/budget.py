"""What each member may hold at one stage: requests and KV-cache bytes.

A stage keeps a KV cache per request until the request ends or idles out. Without a bound, one
member sending prefills with fresh request ids grows the stage's memory until the machine gives
out (200 prefills in 2.6 s: 865 MB of KV on a trunk planned for 4 concurrent requests). So every
request is charged to the member that asked for it, *before* its step runs, with the KV its cache
will hold after the step; a step that would take the member over its limits (or the stage over
what it can hold at all) is refused with a reason, and nothing changes. Charges follow the
engine's real figures after each step and go when the request is released.

Kept prefixes (a request's cells kept past its end for the same account's next request) are
charged to that account too, in its KV bytes but not its requests, and go first, least recently
used first, whenever the account needs room: one account's prefixes never push out another's.

Pure bookkeeping, no I/O, one thread (the event loop's): the trunk decides what to charge and
when to release; this class only keeps the sums and answers admit or refuse.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from net.tls import MAX_STREAMS

# A member may hold this many times what the plan reserves at a stage for the whole swarm
# (plan_concurrent requests × plan_context tokens of KV): one member alone may use all of the
# planned concurrency, with room for bursts and for the cache's 256-cell granularity.
SLACK = 2
# ... and never less than this many short requests (one smallest cache each), whatever the plan:
# an asker keeps 16 in flight by default (`ask`, `serve --max-in-flight`), and a small plan
# (tests/test_fault_tolerance.py: 2 × 512 tokens) must not refuse that.
SHORT_REQUESTS = 16
# Requests per member, whatever their size: a request costs a route, a stream per hop and graph
# cache entries even when its KV is small. 64 at once from one asker is tested
# (tests/test_pipelining.py).
REQUESTS_PER_PLANNED = 32  # × plan_concurrent
MIN_REQUESTS = 64
# ... and never more than this share of the streams one connection carries: between two stages
# every member's requests ride one connection, a stream each, so one member's held requests must
# leave the path to the others (128 held requests filled aioquic's 128 streams).
MEMBER_SHARE_OF_STREAMS = 8  # a member may hold at most MAX_STREAMS / 8 requests at a stage


@dataclass(frozen=True)
class Limits:
    member_requests: int  # requests one member may hold at this stage
    member_kv_bytes: int  # KV-cache bytes one member may hold at this stage
    total_kv_bytes: int  # KV-cache bytes all members together may hold at this stage
    basis: str = ""  # where the figures come from, for messages and stats

    @classmethod
    def derive(cls, *, kv_bytes_per_position: int, smallest_cache_bytes: int, context_tokens: int,
               concurrent: int, room_bytes: int | None = None) -> "Limits":
        """Limits for a stage whose KV costs ``kv_bytes_per_position`` per token (a request's cache
        at least ``smallest_cache_bytes``), under a plan that reserves ``concurrent`` requests ×
        ``context_tokens`` tokens there. ``room_bytes``: the memory the node offered less its
        weights and the planner's reserve (None: unknown); all members together hold no more KV
        than that, unless one member's own budget is larger."""
        context_tokens, concurrent = max(1, int(context_tokens)), max(1, int(concurrent))
        planned = kv_bytes_per_position * context_tokens * concurrent
        member_kv = max(SLACK * planned, SHORT_REQUESTS * smallest_cache_bytes)
        total = member_kv if room_bytes is None else max(room_bytes, member_kv)
        requests = min(max(MIN_REQUESTS, REQUESTS_PER_PLANNED * concurrent), MAX_STREAMS // MEMBER_SHARE_OF_STREAMS)
        return cls(requests, member_kv, total,
                   f"the plan reserves KV for {concurrent} × {context_tokens} tokens here")


# Kept prefixes per account at a stage, whatever their size (each costs a cache's bookkeeping).
MAX_KEPT_PER_MEMBER = 32


@dataclass
class Usage:
    requests: int = 0
    kv_bytes: int = 0  # requests' and kept prefixes' together
    kept: int = 0  # kept prefixes, their bytes and positions
    kept_bytes: int = 0
    kept_positions: int = 0


@dataclass(frozen=True)
class Kept:
    member: str
    kv_bytes: int
    positions: int


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class MemberBudget:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._charges: dict[bytes, tuple[str, int]] = {}  # request id → (member, KV bytes charged)
        self._members: dict[str, Usage] = {}
        # prefix key → what it holds, per member, least recently used first
        self._kept: dict[str, OrderedDict[bytes, Kept]] = {}
        self.total_kv_bytes = 0
        self.refusals = 0

    @property
    def n_requests(self) -> int:
        return len(self._charges)

    def charged(self, rid: bytes) -> int:
        return self._charges.get(rid, ("", 0))[1]

    def usage(self, member: str) -> Usage:
        usage = self._members.get(member)
        return Usage(usage.requests, usage.kv_bytes, usage.kept, usage.kept_bytes, usage.kept_positions) \
            if usage else Usage()

    def member_over(self, member: str, kv_bytes: int, rid: bytes = b"") -> bool:
        """Whether ``member`` holding ``kv_bytes`` more (for ``rid``, less what it is charged now)
        passes its own or the stage's KV limit."""
        extra = kv_bytes - (self.charged(rid) if rid else 0)
        return (self.usage(member).kv_bytes + extra > self.limits.member_kv_bytes
                or self.total_kv_bytes + extra > self.limits.total_kv_bytes)

    # --- kept prefixes ---

    def keep(self, key: bytes, member: str, kv_bytes: int, positions: int) -> None:
        """Charge a kept prefix to ``member`` (the trunk made room first: ``oldest_kept``)."""
        self.drop_kept(key)
        self._kept.setdefault(member, OrderedDict())[key] = Kept(member, kv_bytes, positions)
        usage = self._members.setdefault(member, Usage())
        usage.kept += 1
        usage.kept_bytes += kv_bytes
        usage.kept_positions += positions
        usage.kv_bytes += kv_bytes
        self.total_kv_bytes += kv_bytes

    def kept(self, key: bytes, member: str) -> Kept | None:
        """The member's kept prefix ``key``, marked as just used; None if it has none by that key."""
        entries = self._kept.get(member)
        if entries is None or key not in entries:
            return None
        entries.move_to_end(key)
        return entries[key]

    def oldest_kept(self, member: str) -> bytes | None:
        """The member's least recently used kept prefix: the first to go when it needs room."""
        entries = self._kept.get(member)
        return next(iter(entries)) if entries else None

    def kept_totals(self) -> tuple[int, int]:
        """Positions and KV bytes of every member's kept prefixes together."""
        return (sum(u.kept_positions for u in self._members.values()),
                sum(u.kept_bytes for u in self._members.values()))

    def kept_count(self, member: str) -> int:
        return len(self._kept.get(member, ()))

    def drop_kept(self, key: bytes) -> None:
        for member, entries in self._kept.items():
            entry = entries.pop(key, None)
            if entry is None:
                continue
            if not entries:
                del self._kept[member]
            usage = self._members[member]
            usage.kept -= 1
            usage.kept_bytes -= entry.kv_bytes
            usage.kept_positions -= entry.positions
            usage.kv_bytes -= entry.kv_bytes
            self.total_kv_bytes -= entry.kv_bytes
            self._forget_if_idle(member)
            return

    def admit(self, rid: bytes, member: str, kv_bytes: int) -> str:
        """Charge request ``rid`` of ``member`` with ``kv_bytes`` (what its cache will hold after
        the step about to run). Returns "" when admitted, else why not (and nothing changed)."""
        old_member, old_bytes = self._charges.get(rid, (member, 0))
        if old_member != member:  # (a request id that starts over for another member is its charge now)
            old_bytes = 0
        usage = self._members.get(member, Usage())
        is_new = rid not in self._charges or old_member != member
        requests = usage.requests + (1 if is_new else 0)
        member_kv = usage.kv_bytes - old_bytes + kv_bytes
        total = self.total_kv_bytes - self.charged(rid) + kv_bytes
        limits = self.limits
        problem = ""
        if is_new and requests > limits.member_requests:
            problem = (f"member {member!r} already holds {usage.requests} requests at this stage, its limit "
                       f"({limits.member_requests}; {limits.basis})")
        elif member_kv > limits.member_kv_bytes and kv_bytes > old_bytes:
            problem = (f"member {member!r} would hold {_mb(member_kv)} of KV cache at this stage, over its limit of "
                       f"{_mb(limits.member_kv_bytes)} ({limits.basis}; {usage.requests} requests held now)")
        elif total > limits.total_kv_bytes and kv_bytes > self.charged(rid):
            problem = (f"this stage's KV cache is full: {_mb(self.total_kv_bytes)} held of "
                       f"{_mb(limits.total_kv_bytes)} for all members")
        if problem:
            self.refusals += 1
            return problem
        self._set(rid, member, kv_bytes)
        return ""

    def settle(self, rid: bytes, kv_bytes: int, held: bool) -> None:
        """After a step: the engine's real figure for the request, or its release if the engine
        does not hold it (a first step that failed)."""
        if not held:
            self.release(rid)
        elif rid in self._charges:
            self._set(rid, self._charges[rid][0], kv_bytes)

    def release(self, rid: bytes) -> None:
        charge = self._charges.pop(rid, None)
        if charge is None:
            return
        member, kv_bytes = charge
        usage = self._members[member]
        usage.requests -= 1
        usage.kv_bytes -= kv_bytes
        self.total_kv_bytes -= kv_bytes
        self._forget_if_idle(member)

    def _forget_if_idle(self, member: str) -> None:
        usage = self._members[member]
        if usage.requests == 0 and usage.kept == 0:
            del self._members[member]

    def _set(self, rid: bytes, member: str, kv_bytes: int) -> None:
        self.release(rid)
        self._charges[rid] = (member, kv_bytes)
        usage = self._members.setdefault(member, Usage())
        usage.requests += 1
        usage.kv_bytes += kv_bytes
        self.total_kv_bytes += kv_bytes

    def stats(self) -> dict:
        limits = self.limits
        return {
            "members": {m: {"requests": u.requests, "kv_bytes": u.kv_bytes, "kept_prefixes": u.kept,
                            "cached_tokens": u.kept_positions, "cached_kv_bytes": u.kept_bytes}
                        for m, u in sorted(self._members.items())},
            "cached_tokens": sum(u.kept_positions for u in self._members.values()),
            "limits": {"member_requests": limits.member_requests, "member_kv_bytes": limits.member_kv_bytes,
                       "total_kv_bytes": limits.total_kv_bytes, "basis": limits.basis},
            "charged_kv_bytes": self.total_kv_bytes, "refusals": self.refusals,
        }
