"""The host's slice server (swarmctl/host/slices.py) and the speed figure a trunk is judged by
(swarmctl/host/trunk_reports.py): what a fetch may ask for, and the answers given before any
chunk is read. I/O-free (fake connections; no model file is opened)."""

from __future__ import annotations

from types import SimpleNamespace

from net import messages as m
from net.wire import FrameDecoder, decode_control
from plans.hysteresis import CONVERGE_FACTOR, SERVED_REPORTS, SPEED_FACTOR
from plans.plan import Plan
from swarmctl.host.slices import SliceServer, slice_refusal
from swarmctl.host.trunk_reports import judged_figure

PLAN = Plan(3, "m", 30, 4, n_expert=8)  # trunk layers [4, 26)


def sender(name: str, replies: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(peer_name=name, is_open=True, send=lambda sid, data, end=False: replies.extend(
        decode_control(frame.body) for frame in FrameDecoder().feed(data)))


def test_a_slice_is_trunk_layers_and_the_plans_experts():
    assert slice_refusal(PLAN, 4, 26, []) is None and slice_refusal(PLAN, 10, 11, [0, 8]) is None
    assert slice_refusal(PLAN, 2, 10, []) == "layers [2, 10) are not trunk layers [4, 26)"
    assert slice_refusal(PLAN, 20, 27, []) == "layers [20, 27) are not trunk layers [4, 26)"
    assert slice_refusal(PLAN, 10, 10, []) is not None
    assert slice_refusal(PLAN, 10, 12, [4, 9]) == "experts [4, 9) are not among the plan's 8"
    assert slice_refusal(PLAN, 10, 12, [5]) == "experts [5, 0) are not among the plan's 8"


def test_refused_fetches_are_answered_and_nothing_is_built():
    replies: list[dict] = []
    server = SliceServer(gguf=None, hashes=None, mirror="", plan=lambda: PLAN, trunks={})  # (no file to build from)
    server.fetch_slice(sender("bob", replies), 0, m.FetchSlice(start=0, stop=30))
    server.fetch_asker_part(sender("bob", replies), 0, m.FetchAskerPart(head_layers=2))
    assert replies == [{"type": "error", "message": "layers [0, 30) are not trunk layers [4, 26)"},
                       {"type": "error", "message": "this swarm's askers keep 4 layers at each end, not 2"}]


def test_a_wrong_chunk_report_counts_only_against_a_member_listed_to_the_reporter():
    replies: list[dict] = []
    server = SliceServer(gguf=None, hashes=None, mirror="", plan=lambda: PLAN, trunks={})
    server.bad_source(sender("bob", replies), 0, m.BadSource(member="carol", reason="chunk 3"))
    server.sources.listed["bob"] = {"carol"}
    server.bad_source(sender("bob", replies), 0, m.BadSource(member="carol", reason="chunk 3"))
    server.bad_source(sender("bob", replies), 0, m.BadSource(member="carol", reason="chunk 3"))  # (once each)
    assert [r.get("counted") for r in replies] == [[], ["carol"], []]


def test_a_served_figure_is_the_best_of_the_last_reports_and_a_fresh_one_stands_alone():
    served: list[float] = []
    claims = []
    for figure in [4.5, 0.4, 4.5, 4.6, 4.4]:  # a loaded stage's served reports, one fast batch among them
        served, claim, factor = judged_figure(served, m.Speed(ms_per_layer_token=figure, serving=True))
        assert factor == CONVERGE_FACTOR and len(served) <= SERVED_REPORTS
        claims.append(claim)
    assert SERVED_REPORTS == 3 and claims == [4.5, 0.4, 0.4, 0.4, 4.4]  # the fast one counts for 3 reports
    served, claim, factor = judged_figure(served, m.Speed(ms_per_layer_token=3.0))  # measured afresh
    assert (served, claim, factor) == ([], 3.0, SPEED_FACTOR)
