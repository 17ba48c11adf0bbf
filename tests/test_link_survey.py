"""A trunk's link survey (swarmctl/trunk/link_survey.py), driven directly: which links a round
measures and reports, when a background round is due, and who may have a relayed link."""

from __future__ import annotations

from net import messages as m
from plans.nodes import ASKER
from plans.plan import Plan, StageAssignment
from swarmctl.trunk.link_survey import (IDLE_BEFORE_PROBE_S, LINK_REFRESH_S, LinkRound, Peer, over_next_stage,
                                        refresh_delay, refresh_due, relay_refusal, stage_idle)


def plan(*stages: tuple[str, int, int]) -> Plan:
    return Plan(version=3, model_name="m", n_layer=30, head_layers=4,
                stages=[StageAssignment(name, f"10.0.0.{i}:7471", a, b) for i, (name, a, b) in enumerate(stages)])


def claim(rtt: float) -> m.LinkClaim:
    return m.LinkClaim(rtt_ms=rtt, bandwidth_mb_s=50.0)


def run(survey: LinkRound, answers: dict[str, list[m.LinkClaim | None]]) -> list[str]:
    """Drive a round as the trunk does: each peer asked for in turn, measured as ``answers`` say."""
    asked = []
    while (peer := survey.next_peer()) is not None:
        asked.append(peer.member)
        survey.measured(peer, answers[peer.member].pop(0))
    return asked


def test_a_round_measures_every_other_stage_once_in_plan_order_then_the_host_as_the_asker():
    survey = LinkRound(plan(("a", 4, 10), ("me", 10, 16), ("b", 16, 22), ("a", 22, 26)), "me")
    asked = run(survey, {"a": [claim(10.0)], "b": [claim(20.0)]})
    assert asked == ["a", "b"]  # "a" holds two stages: measured once, itself never
    report = survey.report(claim(30.0))
    assert list(report.links) == ["a", "b", ASKER]
    assert report.links["b"].rtt_ms == 20.0 and report.links[ASKER].rtt_ms == 30.0


def test_a_member_that_could_not_be_measured_is_left_out_and_tried_again_at_its_next_stage():
    survey = LinkRound(plan(("a", 4, 10), ("b", 10, 16), ("a", 16, 26)), "me")
    asked = run(survey, {"a": [None, claim(12.0)], "b": [None]})
    assert asked == ["a", "b", "a"]
    assert list(survey.report(None).links) == ["a"]  # b unreachable: not guessed; no host link either


def test_a_round_with_nothing_measured_reports_nothing():
    survey = LinkRound(plan(("me", 4, 26)), "me")
    assert survey.next_peer() is None and survey.report(None) is None
    assert list(survey.report(claim(5.0)).links) == [ASKER]


def test_the_next_stage_connection_is_measured_over_only_when_it_is_open_and_leads_to_that_member():
    assert over_next_stage("b", True, "b")
    assert not over_next_stage("b", False, "b")
    assert not over_next_stage("c", True, "b")
    assert not over_next_stage(None, False, "b")


def test_the_refresh_period_is_jittered_a_quarter_either_way():
    assert refresh_delay(0.0) == 0.75 * LINK_REFRESH_S
    assert refresh_delay(0.5) == LINK_REFRESH_S
    assert abs(refresh_delay(0.999999) - 1.25 * LINK_REFRESH_S) < 1e-3


def test_a_stage_is_idle_once_no_step_arrived_lately_and_nothing_waits_to_compute():
    now = 1000.0
    assert stage_idle(now, 0, [])
    assert stage_idle(now, 0, [now - IDLE_BEFORE_PROBE_S - 0.1, now - 500.0])
    assert not stage_idle(now, 0, [now - 500.0, now - IDLE_BEFORE_PROBE_S])  # one step at the limit
    assert not stage_idle(now, 1, [])  # a batch waiting for the compute thread


def test_a_background_round_is_due_only_for_a_stage_of_the_plan_that_is_idle():
    p = plan(("a", 4, 10), ("me", 10, 26))
    assert refresh_due(p, "me", 100.0, 0, [50.0])
    assert not refresh_due(p, "me", 100.0, 0, [95.0])
    assert not refresh_due(p, "other", 100.0, 0, [])  # no stage here (an expert node, or none)
    assert not refresh_due(None, "me", 100.0, 0, [])


def test_only_the_host_may_have_a_relayed_link_and_only_from_a_trunk_that_relays():
    assert relay_refusal(True, True, "t1") is None
    assert relay_refusal(False, True, "t1") == "only the host allocates relayed links"
    assert relay_refusal(True, False, "t1") == "t1 does not relay (run --relay)"
    assert Peer("a", "x:1") == Peer("a", "x:1")
