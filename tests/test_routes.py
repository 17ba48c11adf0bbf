"""The route table (swarmctl/trunk/routes.py), driven directly: no processes, no sockets.

Every path that once leaked a stream at a trunk is here: each test says which streams end (ours
towards the next stage, or the incoming one), which requests are freed, and what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmctl.trunk.routes import (DraftChecks, EndOnward, FinishStream, FreeRequest, PassBack, Release,
                                   RouteTable, SendError)


@dataclass(eq=False)
class Peer:
    """Stands for a connection: the table only compares them and reads the name."""

    peer_name: str


A, B = b"a" * 16, b"b" * 16  # request ids
T0 = 100.0  # the clock the tests give the table


def started(table: RouteTable, rid: bytes, asker: Peer, in_stream: int, nxt: Peer | None = None,
            out_stream: int | None = None):
    """A request whose first step ran here (and went on to ``nxt`` on ``out_stream``)."""
    table.stream_carries_requests(asker, in_stream)
    route, actions, problem = table.claim(rid, asker, in_stream, 0, "alice/01", now=T0)
    assert (actions, problem) == ([], "")
    table.commit(rid, route)
    if nxt is not None:
        assert table.send_on(rid, route, nxt, out_stream) == []
    return route


def ends(actions, kind):
    return [(a.conn.peer_name, a.stream_id) for a in actions if isinstance(a, kind)]


def freed(actions):
    return [a.request_id for a in actions if isinstance(a, (FreeRequest, Release))]


def test_end_frees_the_request_and_ends_both_streams():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    started(table, A, asker, 4, nxt, 8)
    actions = table.end(A, asker, 4)
    assert freed(actions) == [A]
    assert ends(actions, EndOnward) == [("next", 8)]  # the next stage hears the request is over
    assert ends(actions, FinishStream) == [("asker", 4)]  # and the sender's stream ends on our side
    assert A not in table


def test_end_on_an_abandoned_stream_ends_only_that_stream():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    started(table, A, asker, 4, nxt, 8)
    actions = table.end(A, asker, 12)  # the request moved on; an END on an old stream
    assert freed(actions) == [] and ends(actions, EndOnward) == []
    assert ends(actions, FinishStream) == [("asker", 12)]
    assert A in table


def test_a_request_that_starts_over_gives_up_its_old_stream_onward():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    old = started(table, A, asker, 4, nxt, 8)
    route, actions, problem = table.claim(A, asker, 12, 0, "alice/01", now=T0)  # replayed from position 0
    assert problem == "" and route is not old
    assert ends(actions, FinishStream) == [("next", 8)] and old.out_stream is None


def test_a_later_step_on_a_second_stream_is_refused_and_changes_nothing():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    old = started(table, A, asker, 4, nxt, 8)
    route, actions, problem = table.claim(A, asker, 12, 5, "alice/01", now=T0)
    assert route is None and actions == [] and "in use on another stream" in problem
    assert table.get(A) is old and old.out_stream == 8


def test_a_refused_stream_is_remembered_and_bounded():
    table, asker = RouteTable(), Peer("asker")
    table.mark_failed(asker, 4, A)
    assert table.has_failed(asker, 4, A) and not table.has_failed(asker, 8, A)
    for i in range(10_001):
        table.mark_failed(asker, i, B)
    assert not table.has_failed(asker, 4, A)  # cleared past the bound: no growth without limit


def test_a_new_stream_onward_ends_the_previous_one():
    table, asker, nxt, other = RouteTable(), Peer("asker"), Peer("next"), Peer("other")
    route = started(table, A, asker, 4, nxt, 8)
    assert route.leaves_on(nxt) and not route.leaves_on(other)
    actions = table.send_on(A, route, other, 2)  # the next stage changed (a new plan)
    assert ends(actions, FinishStream) == [("next", 8)] and route.leaves_on(other)


def test_an_error_from_the_next_stage_goes_back_and_its_stream_ends():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    route = started(table, A, asker, 4, nxt, 8)
    error = type("Packet", (), {"request_id": A})()
    actions = table.error_from_next_stage(nxt, 8, error)
    assert [(a.conn.peer_name, a.stream_id, a.packet) for a in actions if isinstance(a, PassBack)] == \
        [("asker", 4, error)]
    assert ends(actions, FinishStream) == [("next", 8)] and route.out_stream is None
    stale = table.error_from_next_stage(nxt, 16, error)  # about a stream the request abandoned
    assert ends(stale, PassBack) == [] and ends(stale, FinishStream) == [("next", 16)]


def test_a_reset_request_stream_frees_its_request_and_ends_our_side():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    route = started(table, A, asker, 4, nxt, 8)
    started(table, B, asker, 12)
    actions = table.stream_ended(asker, 4)
    assert [(a.request_id, a.route) for a in actions if isinstance(a, Release)] == [(A, route)]
    assert ends(actions, FinishStream) == [("asker", 4)]
    assert table.stream_ended(asker, 4) == []  # once
    assert table.stream_ended(asker, 99) == []  # not a request stream (a subscription, a control call)
    release = table.take(A, route)  # what Release does, under the request's lock
    assert freed(release) == [A] and ends(release, FinishStream) == [("next", 8)]
    assert B in table and A not in table


def test_release_of_a_route_the_request_left_frees_nothing():
    table, asker = RouteTable(), Peer("asker")
    old = started(table, A, asker, 4)
    route, _, _ = table.claim(A, asker, 12, 0, "alice/01", now=T0)
    table.commit(A, route)  # it started over on stream 12
    assert table.take(A, old) == []
    assert table.get(A) is route


def test_a_lost_sender_frees_its_requests_and_a_lost_next_stage_makes_them_retry():
    table, asker, other, nxt = RouteTable(), Peer("asker"), Peer("other"), Peer("next")
    a = started(table, A, asker, 4, nxt, 8)
    b = started(table, B, other, 4, nxt, 12)
    actions = table.connection_lost(asker)
    assert [(x.request_id, x.route) for x in actions if isinstance(x, Release)] == [(A, a)]
    assert table.open_request_streams(asker) == 0
    assert ends(table.take(A, a), FinishStream) == [("next", 8)]  # the release: its stream onward ends
    actions = table.connection_lost(nxt)
    errors = [a for a in actions if isinstance(a, SendError)]
    assert [(e.conn.peer_name, e.stream_id, e.request_id, e.retry) for e in errors] == [("other", 4, B, True)]
    assert "next went away" in errors[0].message
    assert [x.request_id for x in actions if isinstance(x, Release)] == [B]
    assert b.out_stream is None  # nothing to end on a connection that is gone


def test_a_plan_change_tells_every_sender_and_ends_every_stream_onward():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    started(table, A, asker, 4, nxt, 8)
    started(table, B, asker, 12)
    actions = table.drop_all("the plan changed")
    assert [(e.request_id, e.retry) for e in actions if isinstance(e, SendError)] == [(A, True), (B, True)]
    assert ends(actions, FinishStream) == [("next", 8)]
    assert len(table) == 0


def test_the_idle_reap_frees_only_idle_requests_and_tells_their_senders():
    table, asker, nxt = RouteTable(), Peer("asker"), Peer("next")
    a = started(table, A, asker, 4, nxt, 8)
    b = started(table, B, asker, 12)
    a.last_active, b.last_active = 100.0, 390.0
    actions = table.reap_idle(300.0, now=401.0)
    assert [(e.request_id, e.stream_id) for e in actions if isinstance(e, SendError)] == [(A, 4)]
    assert [(r.request_id, r.route) for r in actions if isinstance(r, Release)] == [(A, a)]
    assert ends(table.take(A, a), FinishStream) == [("next", 8)]  # its stream onward ends with it
    assert B in table


def test_draft_checks_count_drafts_and_kept_drafts_from_where_the_next_step_starts():
    checks = DraftChecks()
    checks.step(40, 5, verify=True)  # the last token and 4 drafts at positions 40-44
    assert (checks.drafted, checks.accepted) == (0, 0)  # counted once the next step says what was kept
    checks.step(43, 1, verify=False)  # 41 and 42 kept, 43 is the asker's correction
    assert (checks.drafted, checks.accepted) == (4, 2)
    checks.step(44, 1, verify=False)  # a plain step after a plain step: nothing drafted
    assert (checks.drafted, checks.accepted) == (4, 2)


def test_draft_checks_count_every_draft_kept_when_the_next_step_starts_past_them():
    checks = DraftChecks()
    checks.step(10, 4, verify=True)  # 3 drafts at 11-13
    checks.step(14, 4, verify=True)  # all kept (the bonus token is 14), and 3 drafts more
    assert (checks.drafted, checks.accepted) == (3, 3)
    checks.step(18, 1, verify=False)
    assert (checks.drafted, checks.accepted) == (6, 6)


def test_a_step_stamps_its_route_with_the_now_it_is_given_and_the_reap_reads_that():
    table, asker = RouteTable(), Peer("asker")
    route = started(table, A, asker, 4)
    assert route.last_active == T0
    again, _, problem = table.claim(A, asker, 4, 5, "alice/01", now=T0 + 250.0)  # its next step, later
    assert again is route and problem == "" and route.last_active == T0 + 250.0
    assert table.reap_idle(300.0, now=T0 + 301.0) == []  # idle since the second step only
    actions = table.reap_idle(300.0, now=T0 + 551.0)
    assert [r.request_id for r in actions if isinstance(r, Release)] == [A]
