"""The host times a serving member again only when its stage is idle (swarmctl/host/checks.py):
a timing run takes the member's compute thread for a few 32-step runs, which a member serving
requests would pay in its answers. The checks' parts only: no sockets, no kernels (the stage's
answer is a fake, the challenge a recorder)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from swarmctl.host.checks import CheckTimings, ClaimChecks, stage_serving
from swarmctl.node.layer_proof import Outcome


def stats(now: float, batches_ago: list[float], queue_depth: int = 0) -> SimpleNamespace:
    """The fields of a stage's ``m.Stats`` the decision reads (the message has many more)."""
    return SimpleNamespace(time=now, queue_depth=queue_depth,
                           recent_batches=[[now - ago, 0.004, 1, ["ab"]] for ago in batches_ago])


def test_a_stage_serves_while_batches_ran_lately_or_steps_wait():
    now = time.time()
    assert stage_serving(stats(now, [0.3]))
    assert stage_serving(stats(now, [30.0], queue_depth=2))
    assert not stage_serving(stats(now, [30.0, 12.0]))
    assert not stage_serving(stats(now, []))


def checks_with(serving_answers: list[bool], wait_max_s: float = 1.0) -> tuple[ClaimChecks, list, object]:
    trunk = SimpleNamespace(refused="", ms_per_layer_token=1.0, reprobes=0)
    planning = SimpleNamespace(trunks={"trunk-1": trunk},
                               plan=SimpleNamespace(stage_for=lambda name: None, trunk_range=(4, 26)))
    answers = iter(serving_answers)

    async def serving(_trunk) -> bool:
        return next(answers, False)

    checks = ClaimChecks(None, planning, serving=serving,
                         timings=CheckTimings(probe_wait_s=0.25, probe_wait_max_s=wait_max_s))
    timed: list[int] = []

    async def challenge(_trunk, layers, probe_layer, experts=None) -> Outcome:
        timed.append(probe_layer)
        return Outcome()

    checks._challenge = challenge
    return checks, timed, trunk


def test_a_serving_member_is_timed_only_once_its_stage_is_idle():
    checks, timed, trunk = checks_with([True, True, False])

    async def run() -> None:
        task = asyncio.ensure_future(checks._probe_again("trunk-1", trunk, 0.0))
        await asyncio.sleep(0.3)
        assert timed == []  # still serving after the first look: no timing run beside its work
        await task

    asyncio.run(run())
    assert len(timed) == 1 and 4 <= timed[0] < 26


def test_a_member_that_serves_throughout_is_not_timed_again():
    checks, timed, trunk = checks_with([True] * 100, wait_max_s=0.5)
    asyncio.run(checks._probe_again("trunk-1", trunk, 0.0))
    assert timed == []


def test_an_idle_member_is_timed_at_once():
    checks, timed, trunk = checks_with([False])
    asyncio.run(checks._probe_again("trunk-1", trunk, 0.0))
    assert len(timed) == 1
