"""The host's checks' I/O-free core (swarmctl/host/check_core.py), driven with plain times and
outcomes: no sockets, no threads, no trunk."""

from __future__ import annotations

from net.messages import MS_PER_LAYER
from swarmctl.host.check_core import RECHECK_EVERY_S, STRIKES_FORGOTTEN_S, WRONG_RESULT_HOLD_MAX_S, CheckRecord, \
    CheckTimings, claims_faster, ready_verdict, reprobe_delay, trial_failure
from swarmctl.node.layer_proof import Outcome


def test_a_failed_check_holds_a_member_out_and_a_newer_hold_outlasts_the_older_ones_end():
    record = CheckRecord(CheckTimings(failed_hold_s=300.0))
    assert record.fail("bob", 100.0) == 300.0
    assert record.left_out("bob", 150.0) == (250.0, "failed a layer check")
    assert record.left_out("bob", 400.0) is None and record.left_out("carol", 150.0) is None
    record.fail("bob", 350.0, 60.0, "returned wrong results")  # left out again before the first hold ended
    assert not record.readmit("bob", 400.0)  # the first hold's end: the second still runs
    assert record.readmit("bob", 410.0) and record.left_out("bob", 410.0) is None


def test_wrong_results_double_the_hold_up_to_a_cap_and_are_forgotten_after_a_while():
    record = CheckRecord(CheckTimings(wrong_hold_s=300.0))
    assert [record.strike("liar", t) for t in (0.0, 10.0, 20.0)] == [300.0, 600.0, 1200.0]
    assert max(record.strike("liar", 30.0 + t) for t in range(5)) == WRONG_RESULT_HOLD_MAX_S
    assert record.strike("liar", 34.0 + STRIKES_FORGOTTEN_S + 1) == 300.0  # long after the latest: a first strike
    record.cleared("liar")  # a re-check passed
    assert "liar" not in record.strikes and record.strike("liar", 1e6) == 300.0


def test_askers_reports_make_the_host_check_a_member_at_most_once_a_while():
    record = CheckRecord()
    assert record.may_recheck("bob", 0.0)
    assert not record.may_recheck("bob", RECHECK_EVERY_S - 1) and record.may_recheck("carol", 1.0)
    assert record.may_recheck("bob", RECHECK_EVERY_S)


def test_the_fastest_timing_is_kept_never_under_the_floor():
    record = CheckRecord()
    assert record.timed("bob", 2.0, None) == (2.0, 2.0)
    assert record.timed("bob", 3.0, 2.0) == (3.0, 2.0)  # interference only adds time
    assert record.timed("bob", 0.0, 2.0) == (MS_PER_LAYER[0], MS_PER_LAYER[0])
    assert record.measured_speeds == {"bob": MS_PER_LAYER[0]}


def test_retries_and_reprobes_back_off():
    record = CheckRecord(CheckTimings(retry_first_s=5.0, retry_max_s=30.0))
    assert [record.retry_delay(n) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert [reprobe_delay(n) for n in range(4)] == [10.0, 20.0, 40.0, None]
    assert claims_faster(0.5, 1.0) and not claims_faster(0.95, 1.0) and not claims_faster(None, 1.0)


def test_a_ready_check_fails_a_wrong_answer_and_excuses_a_plan_that_moved_once():
    wrong, missing, late, good = Outcome(problem="wrong proof"), Outcome(missing="[4, 9)"), \
        Outcome(problem="no answer in time", timed_out=True), Outcome()
    assert ready_verdict(good, True, False).kind == "ready"
    assert ready_verdict(good, False, False).kind == "moved"
    assert ready_verdict(wrong, False, False) == ("failed", "wrong proof")  # a wrong answer never
    assert ready_verdict(missing, True, False) == ("failed", "said it was ready with layers it does not hold ([4, 9))")
    assert ready_verdict(missing, False, True).kind == "excused"  # it may have loaded other layers since
    assert ready_verdict(late, False, False).kind == "excused"
    assert ready_verdict(late, False, True).kind == "failed"  # once between two passed checks


def test_a_trial_must_hold_its_layers_and_be_timed():
    assert trial_failure(Outcome(ms_per_layer=1.0)) == ""
    assert "not timed" in trial_failure(Outcome())
    assert "[4, 9)" in trial_failure(Outcome(missing="[4, 9)", ms_per_layer=1.0))

