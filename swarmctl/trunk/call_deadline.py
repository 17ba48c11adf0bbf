"""How long a stage waits for an expert node's answer before it asks whether the node is alive.

A stage's compute thread waits for every expert call of a MoE layer, so an expert node killed
mid-call would hold the stage (and every request in its batch) until QUIC's idle timeout gave
the connection up (net/liveness.py, 8 s), long after the host had planned the node out. Instead,
each call gets a deadline of a few times the median of that node's recent calls (their round
trip and compute, as this stage measured them), kept between a floor (a slow moment of a busy
machine is not death) and a ceiling (no longer than the host takes to call a silent member
gone, so the stage is free again by the time the new plan comes). Before a few calls are
measured a default applies. Past the deadline the caller pings the node (swarmctl/trunk/experts.py):
an answer means slow, not dead, and the call waits another deadline; no answer within the ping's
own wait fails the call and the request is replayed as for a dead stage. Since a slow node only
costs a ping, the deadline can be short; the ping's wait is what must not mistake a busy node for
a dead one (a false verdict costs the request a replay), so it has a floor of its own.

No I/O here: ``record`` what each answered call took, ask ``deadline`` before the next one;
a node found dead is ``give_up``-ed, and its calls fail at once (``given_up``) for a while after
``now``, the clock the caller passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from net.liveness import SILENCE_LIMIT


@dataclass(frozen=True)
class DeadlinePolicy:
    multiple: float = 8.0  # times the median call: a call this much slower than usual is suspect
    floor_s: float = 1.0  # a deadline never shorter: scheduling hiccups and GC pauses on a loaded box
    ceiling_s: float = SILENCE_LIMIT  # never longer than the host's own verdict on a silent member
    default_s: float = 2.0  # before min_calls calls to the node were measured
    ping_floor_s: float = 2.0  # the shortest wait for the ping that tells slow from dead
    window: int = 32  # recent calls per node the median is taken over
    min_calls: int = 3  # fewer measured calls than this: the default (one call is not a median)

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.default_s <= self.ceiling_s or not 0 < self.ping_floor_s <= self.ceiling_s \
                or self.multiple <= 0 or self.window < self.min_calls:
            raise ValueError(f"an inconsistent expert call deadline policy: {self}")


@dataclass
class CallDeadlines:
    """Each expert node's recent call times, and the deadline they give its next call."""

    policy: DeadlinePolicy = DeadlinePolicy()
    _recent: dict[str, deque[float]] = field(default_factory=dict)  # node → seconds of its answered calls
    _given_up: dict[str, float] = field(default_factory=dict)  # node → until when its calls fail at once

    def record(self, node: str, seconds: float) -> None:
        """An answered call to ``node`` took ``seconds`` (sent to answer decoded)."""
        calls = self._recent.setdefault(node, deque(maxlen=self.policy.window))
        calls.append(max(0.0, seconds))

    def deadline(self, node: str) -> float:
        """Seconds the next call to ``node`` may take before the node is checked for life."""
        p = self.policy
        calls = self._recent.get(node, ())
        if len(calls) < p.min_calls:
            return p.default_s
        return min(p.ceiling_s, max(p.floor_s, p.multiple * median(calls)))

    def ping_wait(self, node: str) -> float:
        """Seconds to wait for the node's answer to a ping once a call passed its deadline."""
        return max(self.policy.ping_floor_s, self.deadline(node))

    def forget(self, node: str) -> None:
        """The node's figures no longer apply (it was found dead; a member of that name that comes
        back may be another machine)."""
        self._recent.pop(node, None)

    def give_up(self, node: str, now: float, for_s: float) -> None:
        """The node answered neither a call nor a ping: its calls fail at once until ``for_s``
        after ``now``, and its figures are forgotten."""
        self._given_up[node] = now + for_s
        self.forget(node)

    def given_up(self, node: str, now: float) -> bool:
        return now < self._given_up.get(node, 0.0)
