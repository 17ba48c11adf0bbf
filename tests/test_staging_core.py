"""The host's make-before-break core (swarmctl/host/staging.py), driven with plain times: no
sockets, no threads, no keeper."""

from __future__ import annotations

from plans.plan import Plan, StageAssignment
from swarmctl.host.staging import Staging, StagingSettings, Unready, next_step


def plan(version: int, *stages: tuple[str, int, int, bool]) -> Plan:
    p = Plan(version, "m", 30, 4)
    p.stages = [StageAssignment(name, "127.0.0.1:1", a, b, ready) for name, a, b, ready in stages]
    return p


def test_versions_are_never_issued_twice_also_after_a_restart():
    s = Staging()
    assert s.restarted(0) == 0 and s.issue(0) == 1 and s.issue(0) == 2 and s.issue(5) == 6
    assert Staging().restarted(6) == 7


def test_a_staged_plan_is_given_up_at_its_deadline_and_misses_double():
    s = Staging(StagingSettings(staged_deadline_s=8.0, missed_hold_s=300.0))
    staged = plan(3, ("alice", 4, 15, True), ("mallory", 15, 26, False))
    s.staged(100.0)
    assert s.due() == 108.0 and not s.staged_overdue(107.9) and s.staged_overdue(108.0)
    holds = s.give_up(staged, 3, 108.0)
    assert list(holds) == ["mallory"] and holds["mallory"].until == 408.0 and holds["mallory"].missed
    assert s.staged_by is None and s.ended_holds(407.0) == [] and s.ended_holds(408.0) == ["mallory"]
    s.staged(500.0)
    assert s.give_up(staged, 3, 508.0)["mallory"].until == 508.0 + 600.0  # twice as long
    assert s.give_up(staged, 4, 600.0) == {}  # another plan by now: nobody is blamed


def test_a_ready_deadline_keeps_its_start_through_replans_and_a_check_under_way_gets_grace():
    s = Staging(StagingSettings(ready_deadline_s=10.0, checking_grace_s=5.0))
    s.track({"bob": Unready("layers [4, 15)", 0)}, 0.0)
    s.track({"bob": Unready("layers [4, 15)", 0)}, 6.0)  # a re-plan gives no new deadline
    assert s.ready_by == 10.0 and not s.ready_due(9.0) and s.ready_due(10.0)
    assert s.overdue(2, {"bob": Unready("layers [4, 15)", 0)}, {"bob"}, 10.0) == {}
    assert s.ready_by == 15.0
    late = s.overdue(2, {"bob": Unready("layers [4, 15)", 0)}, set(), 15.0)
    assert late == {"bob": "was given layers [4, 15) of plan v2 and was not ready 15 s later"}


def test_a_member_back_right_after_leaving_is_free_once_then_held():
    s = Staging(StagingSettings(rejoin_hold_s=60.0))
    s.left("carol", 0.0)
    assert s.registered("carol", 2.0, False, True, settle_s=30.0).hold is None  # a restart: free
    s.left("carol", 5.0)
    rejoin = s.registered("carol", 7.0, False, True, settle_s=30.0)
    assert rejoin.hold is not None and not rejoin.waiting and rejoin.hold.until == 67.0
    assert s.held("carol", rejoin.hold.why) and not s.held("carol", "")
    again = s.registered("carol", 10.0, True, True, settle_s=30.0)
    assert again.waiting and again.hold.until == 67.0
    assert s.waiting({"carol": rejoin.hold.why}, missed=False) == ["carol"]


def test_next_step_stages_only_beside_a_whole_serving_plan():
    old = plan(1, ("alice", 4, 26, True))
    new = plan(2, ("alice", 4, 15, False), ("bob", 15, 26, False))
    assert next_step(old, None, new, {"alice", "bob"}) == "stage"
    assert next_step(old, None, new, {"bob"}) == "publish"  # a member of the plan in use is gone
    assert next_step(old, new, plan(3, ("alice", 4, 26, False)), {"alice", "bob"}) == "drop"


def test_a_member_whose_fetch_keeps_advancing_is_not_late_and_one_that_stalls_is():
    # a 1 GB stage priced at a local reload is due at 10 s + 20 s; fetched at 1 MB/s it takes 1,000 s
    settings = StagingSettings(ready_deadline_s=10.0, fetch_stall_s=60.0, fetch_floor_bytes_s=250e3)
    size = 1_000_000_000
    given = {"slow": Unready("layers [4, 15)", size)}
    s = Staging(settings)
    s.track(given, 0.0)
    for t in range(0, 600, 10):  # a report every 10 s, 1 MB/s
        s.fetch_progress("slow", t * 1_000_000, float(t))
        assert s.overdue(2, given, set(), float(t)) == {}
    assert s.ready_by == 590.0 + 60.0  # its latest progress, and the stall allowance
    s.fetch_progress("slow", 590 * 1_000_000, 640.0)  # no advance: it counts for nothing
    assert s.overdue(2, given, set(), 649.0) == {}
    assert "not ready" in s.overdue(2, given, set(), 650.0)["slow"]  # stalled: late 60 s after its last progress


def test_a_fetch_slower_than_the_floor_or_claiming_more_than_it_was_given_moves_no_deadline():
    settings = StagingSettings(ready_deadline_s=10.0, fetch_stall_s=60.0, fetch_floor_bytes_s=250e3)
    given = {"m": Unready("layers [4, 15)", 1_000_000_000)}
    crawl = Staging(settings)
    crawl.track(given, 0.0)
    for t in range(0, 40, 10):
        crawl.fetch_progress("m", t * 1_000, float(t))  # 1 kB/s
    assert "m" in crawl.overdue(2, given, set(), 40.0)
    liar = Staging(settings)
    liar.track(given, 0.0)
    liar.fetch_progress("m", 0, 0.0)
    liar.fetch_progress("m", 3_000_000_000, 30.0)  # more than twice the stage's bytes
    assert "m" in liar.overdue(2, given, set(), 40.0)
    gone = Staging(settings)
    gone.track(given, 0.0)
    gone.fetch_progress("m", 0, 0.0)
    gone.fetch_progress("m", 10_000_000, 10.0)
    gone.left("m", 11.0)  # its fetch is forgotten with its registration
    assert "m" in gone.overdue(2, given, set(), 40.0)
