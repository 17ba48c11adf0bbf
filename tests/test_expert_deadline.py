"""An expert call's deadline (swarmctl/trunk/call_deadline.py) and what the stage's expert client
does when it passes (swarmctl/trunk/experts.py): a slow node that answers pings is waited for, a
dead one is given up at once instead of at QUIC's idle timeout. No sockets: the client talks to
stand-in connections; the real kill -9 is tests/test_moe.py's."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from net.liveness import IDLE_TIMEOUT, SILENCE_LIMIT
from net.wire import FRAME_HEADER, ExpertCall, ExpertCallKind, Frame, FrameType, decode_expert_call, \
    encode_expert_call
from plans.plan import ExpertAssignment
from swarmctl.trunk.call_deadline import CallDeadlines, DeadlinePolicy
from swarmctl.trunk.experts import RemoteExpertError, ExpertClient


def test_the_deadline_is_a_few_times_the_median_call_kept_between_floor_and_ceiling():
    d = CallDeadlines(DeadlinePolicy(multiple=8, floor_s=1.0, ceiling_s=4.0, default_s=2.0, ping_floor_s=1.5,
                                     window=5, min_calls=3))
    assert d.deadline("e") == 2.0  # nothing measured: the default
    d.record("e", 0.2)
    d.record("e", 0.3)
    assert d.deadline("e") == 2.0  # two calls are not a median yet
    d.record("e", 0.25)
    assert d.deadline("e") == pytest.approx(8 * 0.25)
    d.record("e", 30.0)  # one outlier does not move the median much
    assert d.deadline("e") == pytest.approx(8 * 0.275)
    for _ in range(5):  # fast calls: the floor (and the ping's wait its own floor)
        d.record("e", 0.001)
    assert d.deadline("e") == 1.0 and d.ping_wait("e") == 1.5
    for _ in range(5):  # slow ones: never past the ceiling
        d.record("e", 2.0)
    assert d.deadline("e") == 4.0 and d.ping_wait("e") == 4.0
    assert d.deadline("other") == 2.0  # each node by its own calls
    d.forget("e")
    assert d.deadline("e") == 2.0


def test_a_dead_node_is_found_before_the_host_and_quic_give_up_on_it():
    """Measured calls: a deadline and a ping's wait within the host's verdict on a silent member,
    so the stage is free when the new plan comes; even unmeasured, within QUIC's idle timeout,
    which is what the stage waited for before."""
    p = DeadlinePolicy()
    d = CallDeadlines(p)
    assert d.deadline("e") + d.ping_wait("e") < IDLE_TIMEOUT
    for _ in range(p.min_calls):
        d.record("e", 0.01)
    assert d.deadline("e") + d.ping_wait("e") < SILENCE_LIMIT
    assert p.floor_s >= 0.5 and p.ping_floor_s >= 1.0  # not a loaded machine's hiccup
    with pytest.raises(ValueError):
        DeadlinePolicy(floor_s=5.0, ceiling_s=4.0)



def test_a_node_given_up_fails_its_calls_until_the_time_it_is_given_and_starts_afresh():
    d = CallDeadlines(DeadlinePolicy(floor_s=1.0, default_s=2.0, min_calls=1))
    d.record("e", 0.5)
    assert not d.given_up("e", now=100.0)
    d.give_up("e", now=100.0, for_s=8.0)
    assert d.given_up("e", now=100.0) and d.given_up("e", now=107.9)
    assert not d.given_up("e", now=108.0)  # the plan had time to move on: its calls are tried again
    assert d.deadline("e") == 2.0  # with its old figures forgotten
    assert not d.given_up("other", now=100.0)

class _Node:
    """A stand-in connection to an expert node: answers each call after ``delay`` (never if
    None), and pings while ``alive``."""

    def __init__(self, delay: float | None, alive: bool) -> None:
        self.delay, self.alive = delay, alive
        self.is_open = True
        self.calls = 0
        self.closed = ""

    async def request(self, data: bytes, timeout: float) -> Frame:
        self.calls += 1
        call = decode_expert_call(data[FRAME_HEADER.size:])
        if self.delay is None:
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError
        await asyncio.sleep(self.delay)
        reply = ExpertCall(ExpertCallKind.REPLY, call.layer, call.data * 2)
        return Frame(FrameType.DATA, encode_expert_call(reply)[FRAME_HEADER.size:])

    async def ping(self) -> None:
        if not self.alive:
            await asyncio.sleep(3600)

    def close_with(self, reason: str) -> None:
        self.closed, self.is_open = reason, False


def _client(node: _Node, policy: DeadlinePolicy) -> ExpertClient:
    async def connect(member, address, handler):
        return node

    ctx = SimpleNamespace(creds=None, handler=None, connect=connect, loop=None)  # what ExpertClient reads of a TrunkContext
    client = ExpertClient(ctx, lambda: [ExpertAssignment("experts-a", "10.0.0.2:7471", 0, 8)],
                          on_unanswered=lambda member: None)
    client.deadlines = CallDeadlines(policy)
    return client


X = np.arange(12, dtype=np.float32).reshape(2, 6)
SELECTED = np.array([[1, 3], [2, 7]])
FAST = DeadlinePolicy(floor_s=0.05, ceiling_s=0.1, default_s=0.1, ping_floor_s=0.1)


def test_a_dead_expert_node_fails_the_call_at_its_deadline_and_later_calls_at_once():
    node = _Node(delay=None, alive=False)
    client = _client(node, FAST)
    told: list[str] = []
    client.on_unanswered = told.append  # (the trunk tells the host)

    async def run():
        t0 = time.monotonic()
        with pytest.raises(RemoteExpertError, match="nor a ping"):
            await client.call(1, X, SELECTED)
        first = time.monotonic() - t0
        with pytest.raises(RemoteExpertError, match="stopped answering"):
            await client.call(1, X, SELECTED)
        return first

    first = asyncio.run(run())
    # the deadline, then a ping's as long: not CALL_TIMEOUT_S (30 s), not QUIC's idle timeout (8 s)
    assert first < 2.0
    assert node.calls == 1 and node.closed and "experts-a" not in client.conns
    assert told == ["experts-a"]  # once, at the verdict


def test_a_slow_expert_node_that_answers_pings_is_waited_for():
    node = _Node(delay=0.4, alive=True)  # four deadlines late
    client = _client(node, FAST)
    out = asyncio.run(client.call(1, X, SELECTED))
    np.testing.assert_array_equal(out, np.stack([X * 2, X * 2], axis=1))
    assert node.calls == 1 and not node.closed
    assert client.deadlines.deadline("experts-a") == FAST.default_s  # one measured call: no median yet


class _Planning:
    def __init__(self) -> None:
        self.replans = 0

    def replan(self) -> None:
        self.replans += 1

    def lost(self, name: str) -> None:  # (the host's PlanKeeper: a plan made again without it)
        self.replan()


def test_the_host_marks_an_unanswered_member_down_only_if_it_has_not_heard_it_either():
    """A stage's report speeds the verdict up; it does not replace it: a member the host heard
    from within two ping intervals stays (the stage's trouble was its own link)."""

    from swarmctl.host.liveness import SUSPECT_SILENCE, unanswered
    from swarmctl.host.reports import Recovery

    async def run():
        now = asyncio.get_running_loop().time()
        closed: list[str] = []
        conn = lambda heard: SimpleNamespace(last_heard=heard, close_with=closed.append)  # noqa: E731
        trunks = {"alive": SimpleNamespace(conn=conn(now - 0.5)),
                  "dead": SimpleNamespace(conn=conn(now - SUSPECT_SILENCE - 0.5))}
        planning, recovery = _Planning(), Recovery()
        verdicts = [unanswered(name, "stage-a", trunks, planning, recovery) for name in ("alive", "dead", "nobody")]
        return verdicts, sorted(trunks), planning.replans, recovery.last_marked_down, closed

    verdicts, left, replans, marked, closed = asyncio.run(run())
    assert verdicts == [False, True, False]
    assert left == ["alive"] and replans == 1 and marked == "dead" and len(closed) == 1
