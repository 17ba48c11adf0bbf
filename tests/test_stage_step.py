"""What a stage decides about one step (swarmctl/trunk/stage_step.py), driven directly: which
steps it refuses and whether the sender may retry, whose request a step is, when a plan that came
during the step stops its output, and where that output goes, in which form."""

from __future__ import annotations

import numpy as np

from net.wire import MAX_HOPS, ActivationPacket, DType, Hop, PacketKind
from plans.plan import Plan, StageAssignment
from swarmctl.trunk.stage_step import (Destination, Serving, account_of, check_packet, enters_here,
                                       moved_during_step, onward, previous_member)

N_EMBD = 8
A, B, C = (StageAssignment("a", "x:1", 4, 10, send_dtype=DType.F16), StageAssignment("b", "x:2", 10, 20),
           StageAssignment("c", "x:3", 20, 26))


def plan(version: int = 3, stages=(A, B, C), **kw) -> Plan:
    return Plan(version=version, model_name="m", n_layer=30, head_layers=4, stages=list(stages), **kw)


def packet(kind=PacketKind.DECODE, version=3, layer=10, rows=1, width=N_EMBD, **kw) -> ActivationPacket:
    return ActivationPacket(kind, b"r" * 16, version, layer, 40, np.zeros((rows, width), np.float32),
                            reply_to="alice/01", **kw)


def serving(stage=B, swapping=False, running=True, p=None) -> Serving:
    return Serving(p if p is not None else plan(), stage, running=running, swapping=swapping, n_embd=N_EMBD)


def test_a_step_that_fits_the_stage_passes():
    assert check_packet(packet(), serving()) == ("", False)


def test_steps_the_plan_moved_away_from_are_refused_with_a_retry():
    problem, retry = check_packet(packet(), serving(swapping=True))
    assert retry and "loading other layers" in problem and "now v3" in problem
    assert check_packet(packet(), serving(stage=None)) == ("this trunk is not serving any layers right now", True)
    assert check_packet(packet(), serving(running=False))[1]
    problem, retry = check_packet(packet(version=2), serving())
    assert retry and problem == "stale plan: packet has version 2, the swarm is at 3"


def test_steps_that_could_never_run_here_are_refused_for_good():
    problem, retry = check_packet(packet(layer=12), serving())
    assert not retry and problem == "this stage runs layers [10, 20), not layer 12"
    problem, retry = check_packet(packet(width=N_EMBD + 1), serving())
    assert not retry and "do not fit" in problem
    hops = tuple(Hop("s", 0, 0, 1) for _ in range(MAX_HOPS))
    problem, retry = check_packet(packet(hops=hops), serving())
    assert not retry and f"at most {MAX_HOPS} fit" in problem


def test_a_step_enters_here_unless_it_comes_from_the_stage_before():
    p = plan()
    assert previous_member(p, B) == "a" and previous_member(p, A) is None
    assert not enters_here(p, B, "a")  # a hop of a request that entered at a
    assert enters_here(p, B, "asker-1")  # an asker re-checking b alone
    assert enters_here(p, A, "asker-1")  # the first stage: every step enters
    assert enters_here(p, A, "a")  # (even its own member asking)
    odd = plan(stages=(StageAssignment("x", "x:0", 2, 4), A, B))  # a stage ending where the trunk begins
    assert enters_here(odd, A, "x")  # still: nothing comes to the first stage "from the stage before"


def test_a_request_spends_its_members_account():
    p = plan(accounts={"alice-laptop": "alice"})
    assert account_of("alice-laptop/01", p) == "alice"
    assert account_of("bob/07", p) == "bob"


def test_a_plan_that_moved_the_stage_during_the_step_stops_its_output():
    p = plan()
    assert moved_during_step(True, p, B, B) == ""
    assert moved_during_step(True, plan(4), StageAssignment("b", "x:2", 10, 20), B) == ""  # same layers
    assert moved_during_step(True, plan(4), StageAssignment("b", "x:2", 10, 22), B) == "the plan changed (now v4)"
    assert moved_during_step(True, plan(4), None, B) == "the plan changed (now v4)"  # no layers here now
    assert moved_during_step(False, p, B, B) == "the plan changed (now v3)"  # the runner was replaced
    assert moved_during_step(True, None, B, B) == "the plan changed (no plan now)"


def test_output_goes_to_the_next_stage_in_the_plans_dtype_with_the_hop_added():
    p, hop = plan(), Hop("a", 5, 6, 1)
    out = np.ones((2, N_EMBD), np.float32)
    sent = onward(packet(PacketKind.PREFILL, layer=4, rows=2, prefix=b"p" * 16), out, hop, p, A, "alice/01")
    assert sent.to == Destination.NEXT_STAGE
    q = sent.packet
    assert (q.kind, q.layer_index, q.dtype, q.plan_version, q.start_pos) == (PacketKind.PREFILL, 10, DType.F16, 3, 40)
    assert q.hops == (hop,) and q.prefix == b"p" * 16 and q.reply_to == "alice/01" and q.data is out


def test_the_last_stage_sends_a_result_to_the_askers_results_stream():
    sent = onward(packet(layer=20, prefix=b"p" * 16), np.ones((1, N_EMBD), np.float32), Hop("c", 1, 1, 1), plan(), C,
                  "alice/01")
    assert sent.to == Destination.RESULTS
    assert sent.packet.kind == PacketKind.RESULT and sent.packet.layer_index == 26 and sent.packet.prefix == b""


def test_a_one_stage_recheck_goes_back_to_its_sender_as_it_came():
    sent = onward(packet(layer=4, one_stage=True, dtype=DType.F32), np.ones((1, N_EMBD), np.float32),
                  Hop("a", 1, 1, 1), plan(), A, "asker-1/02")
    assert sent.to == Destination.SENDER
    assert sent.packet.kind == PacketKind.RESULT and sent.packet.dtype == DType.F32 and sent.packet.one_stage
