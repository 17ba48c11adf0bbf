"""The asker link's rerouting and stall detection, driven directly with a made-up clock (no
sockets, no threads, no event loop): swarmctl/asker/link_core.py. The multi-process tests
(tests/test_fault_tolerance.py, tests/test_pipelining.py) run the same decisions through the link."""

from dataclasses import dataclass

from swarmctl.asker.link_core import CHECK_STALLS, GIVE_UP, Answer, Follow, ReroutePolicy, RouteWait, Silent, \
    StallClock, StepFailures, already_moved, answer_verdict, needs_move, on_tick, refusal
from swarmctl.asker.replay import SentStep, rebuilds

import numpy as np
import pytest

POLICY = ReroutePolicy()


@dataclass
class PlanStub:  # (only a plan's version and completeness are read)
    version: int
    complete: bool = True


def test_a_step_is_overdue_after_the_minimum_or_its_rows_worth_and_its_limit_doubles_each_stall():
    step = StallClock()
    assert step.overdue(1000.0, 0.01, POLICY) is None  # not sent yet
    step.sent(100.0, rows=4)
    assert step.overdue(100.0 + 30.0, 0.01, POLICY) is None  # 30 s is the floor: not past it
    assert step.overdue(100.0 + 30.5, 0.01, POLICY) == 30.0
    assert step.overdue(100.0 + 30.5, 0.01, POLICY) is None  # patience doubled: 60 s now
    assert step.overdue(100.0 + 60.5, 0.01, POLICY) == 60.0
    assert step.overdue(100.0 + 120.5, 0.01, POLICY) == 120.0
    slow = StallClock()
    slow.sent(1.0, rows=100)  # 20 x 0.05 s x 100 rows = 100 s, over the floor
    assert slow.overdue(100.0, 0.05, POLICY) is None and slow.overdue(101.5, 0.05, POLICY) == pytest.approx(100.0)
    short = StallClock()
    short.sent(5.0, rows=1)
    assert short.overdue(6.5, 0.0, ReroutePolicy(stall_min_s=1.0)) == 1.0  # (what the stall test lowers)


def test_a_failing_step_gives_up_only_past_its_deadline_and_times_its_recovery_from_the_first_failure():
    failures = StepFailures(deadline=50.0)
    assert failures.recovery_s(10.0) is None  # never failed: no recovery to report
    assert failures.failed(10.0) and failures.failed(30.0) and failures.failed(50.0)
    assert failures.recovery_s(42.0) == 32.0  # from the first failure, not the last
    assert not failures.failed(50.1)


def test_after_a_failure_a_new_complete_plan_is_followed_at_once_the_same_one_only_after_a_pause():
    wait = RouteWait(POLICY, now=100.0, deadline=1000.0, failed_version=3)
    assert wait.decide(100.0, None) is None
    assert wait.decide(101.0, PlanStub(4, complete=False)) is None  # incomplete: wait on
    assert wait.decide(101.0, PlanStub(3)) is None  # the same plan: not before the pause
    assert wait.decide(101.0, PlanStub(4)) == Follow(4, force=False)
    assert wait.decide(100.0 + 2 * 4.0 + 0.1, PlanStub(3)) == Follow(3, force=True)  # new connections, same plan


def test_waiting_for_a_plan_gives_up_at_the_grace_or_the_deadline_whichever_comes_first():
    wait = RouteWait(POLICY, now=100.0, deadline=1000.0, failed_version=3)
    assert wait.decide(120.0, PlanStub(4, complete=False)) is None
    assert wait.decide(120.1, PlanStub(4, complete=False)) == GIVE_UP  # 20 s of grace
    early = RouteWait(POLICY, now=100.0, deadline=105.0, failed_version=3)
    assert early.decide(105.1, None) == GIVE_UP
    assert early.decide(105.1, PlanStub(4)) == Follow(4, force=False)  # a plan that came is still taken


def test_a_move_happens_once_for_requests_failing_together():
    assert already_moved(moved_at=12.0, since=10.0) and not already_moved(moved_at=10.0, since=10.0)
    assert not needs_move(force=False, latest_version=5, plan_version=5, alive=True)
    assert needs_move(force=True, latest_version=5, plan_version=5, alive=True)
    assert needs_move(force=False, latest_version=6, plan_version=5, alive=True)
    assert needs_move(force=False, latest_version=None, plan_version=5, alive=True)
    assert needs_move(force=False, latest_version=5, plan_version=5, alive=False)


def test_a_revocation_is_for_good_anything_else_is_rerouted():
    said = refusal("cannot connect to 10.0.0.2:7000: membership revoked by the host")
    assert said == "the swarm refused the request: membership revoked by the host"
    assert refusal("connection lost") is None and refusal("") is None
    assert answer_verdict(retry=False, resuming=False) == Answer.REFUSED
    assert answer_verdict(retry=True, resuming=False) == Answer.REROUTE
    assert answer_verdict(retry=True, resuming=True) == Answer.REPLAY


def test_a_keep_alive_tick_fails_over_a_silent_stage_else_checks_for_stalls():
    assert on_tick(False, [("alice", 9.0)], POLICY) is None  # nothing waits: nothing to fail over
    assert on_tick(True, [("alice", 1.0), ("bob", 4.5)], POLICY) == Silent("bob")
    assert on_tick(True, [("alice", 4.0), ("bob", 0.0)], POLICY) == CHECK_STALLS  # 4 s is the limit, not past it


def test_a_reach_is_retried_only_while_a_retry_fits_before_the_deadline():
    assert POLICY.retry_reach(now=10.0, deadline=11.0) and not POLICY.retry_reach(now=10.5, deadline=11.0)


def test_kept_steps_rebuild_a_prefix_only_back_to_back_from_zero():
    def step(start: int, n: int) -> SentStep:
        return SentStep(start, np.zeros((n, 2), np.float32), False)

    assert rebuilds([step(0, 512), step(512, 38)], 550)
    assert not rebuilds([step(0, 512), step(512, 38)], 551)  # short of the positions
    assert not rebuilds([step(0, 500), step(512, 38)], 538)  # a gap
    assert not rebuilds([step(5, 10)], 10) and rebuilds([], 0)
