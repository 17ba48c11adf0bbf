"""The asker's reroute-and-replay table, driven directly (no sockets): every failover path the
multi-process fault tests exercise (tests/test_fault_tolerance.py), event by event.

Connections are stand-in objects: the table only stores and compares them."""

import numpy as np

from swarmctl.asker.replay import End, Free, ReplayTable, SentStep


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def run_step(table: ReplayTable, rid: bytes, conn, stream: int, version: int, start: int, n: int,
             verify: bool = False) -> np.ndarray:
    """One step that the swarm answers: the link's calls in the link's order."""
    hidden = rows(n, start)
    table.begin(rid, SentStep(start, hidden, verify))
    if table.route(rid, version) is None:
        table.opened(rid, conn, stream, version)
    else:
        assert table.to_send(rid, start)
    assert table.is_answer(rid, conn, stream, start, error=False)
    table.answered(rid, start)
    return hidden


def step_out(table: ReplayTable, rid: bytes, start: int, n: int = 1) -> None:
    """A step handed over and sent on the route the request has."""
    table.begin(rid, SentStep(start, rows(n, start), False))
    assert table.to_send(rid, start)


def test_the_first_step_opens_a_route_and_replays_nothing():
    table, conn = ReplayTable(), object()
    table.begin(b"r", SentStep(0, rows(3, 0), False))
    assert table.route(b"r", 1) is None
    assert [s.start_pos for s in table.opened(b"r", conn, 4, 1)] == [0]  # the step itself, nothing before it
    assert not table.to_send(b"r", 0)  # it went with the opening
    route = table.route(b"r", 1)
    assert route is not None and route.conn is conn and route.stream_id == 4


def test_a_killed_stage_replays_every_answered_step_in_order_then_the_failed_one():
    """kill -9 mid-generation: the connection is lost while a decode step waits."""
    table, old, new = ReplayTable(), object(), object()
    prompt = run_step(table, b"r", old, 0, 1, 0, 5)
    decode = run_step(table, b"r", old, 0, 1, 5, 1)
    step_out(table, b"r", 6)
    assert table.waiting() == [b"r"]
    assert table.failed(b"r") == [Free(old, 0)]
    assert table.waiting() == []
    assert table.route(b"r", 2) is None  # a new route is needed
    replay = table.opened(b"r", new, 8, 2)
    assert [s.start_pos for s in replay] == [0, 5, 6]  # the history, then the step that failed
    assert np.array_equal(replay[0].hidden, prompt) and np.array_equal(replay[1].hidden, decode)
    assert not table.to_send(b"r", 6)
    # the replayed steps' results come back too: they are not the answer awaited
    assert not table.is_answer(b"r", new, 8, 0, error=False)
    assert not table.is_answer(b"r", new, 8, 5, error=False)
    assert table.is_answer(b"r", new, 8, 6, error=False)


def test_a_new_plan_fails_over_only_requests_waiting_on_an_older_plan():
    table, conn = ReplayTable(), object()
    run_step(table, b"a", conn, 0, 1, 0, 3)
    step_out(table, b"a", 3)  # waiting on v1
    run_step(table, b"b", conn, 4, 1, 0, 3)  # answered, not waiting
    run_step(table, b"c", conn, 8, 2, 0, 3)
    step_out(table, b"c", 3)  # waiting on v2 already
    assert table.plan_changed(2) == [b"a"]
    # b's next step opens a new route on v2 and replays its prompt
    assert table.route(b"b", 2) is None
    assert [s.start_pos for s in table.opened(b"b", conn, 12, 2)] == [0]


def test_a_silent_stage_fails_every_waiting_request_and_the_same_plan_replays_them():
    """Frozen nodes, a 3 s cut: the plan stays the same; the link retries it on fresh connections."""
    table, old, fresh = ReplayTable(), object(), object()
    for i, rid in enumerate([b"a", b"b", b"c"]):
        run_step(table, rid, old, 4 * i, 1, 0, 2)
        step_out(table, rid, 2)
    assert sorted(table.waiting()) == [b"a", b"b", b"c"]
    for rid in table.waiting():
        assert table.failed(rid) == [Free(old, [b"a", b"b", b"c"].index(rid) * 4)]
    assert table.route(b"a", 1) is None  # the same plan version, but the stream was given up
    assert [s.start_pos for s in table.opened(b"a", fresh, 0, 1)] == [0, 2]


def test_an_error_counts_only_from_the_route_the_request_travels_now():
    table, old, new = ReplayTable(), object(), object()
    run_step(table, b"r", old, 0, 1, 0, 2)
    table.failed(b"r")
    table.opened(b"r", new, 4, 2)
    step_out(table, b"r", 2)
    assert not table.is_answer(b"r", old, 0, 0, error=True)  # the abandoned route's late error
    assert not table.is_answer(b"r", new, 8, 0, error=True)  # another stream
    assert table.is_answer(b"r", new, 4, 0, error=True)


def test_a_rewind_cuts_the_record_so_a_replay_does_not_resurrect_rejected_drafts():
    """Speculation: a check step of 4 positions keeps 2; the next step starts at 2 + 1 with rewind."""
    table, conn, new = ReplayTable(), object(), object()
    run_step(table, b"r", conn, 0, 1, 0, 3)
    check = run_step(table, b"r", conn, 0, 1, 3, 4, verify=True)
    run_step(table, b"r", conn, 0, 1, 5, 1)  # positions 5.. replace the rejected drafts at 5, 6
    table.failed(b"r")
    replay = table.opened(b"r", new, 4, 2)
    assert [(s.start_pos, len(s.hidden), s.verify) for s in replay] == [(0, 3, False), (3, 2, True), (5, 1, False)]
    assert np.array_equal(replay[1].hidden, check[:2])


def test_a_restart_from_zero_forgets_everything():
    table, conn = ReplayTable(), object()
    run_step(table, b"r", conn, 0, 1, 0, 3)
    table.begin(b"r", SentStep(0, rows(2, 9), False))
    assert table.history(b"r") == [] and [s.start_pos for s in table.out(b"r")] == [0]


def test_the_record_holds_copies_not_the_callers_buffer():
    table, conn = ReplayTable(), object()
    hidden = rows(2, 0)
    table.begin(b"r", SentStep(0, hidden, False))
    table.opened(b"r", conn, 0, 1)
    table.answered(b"r", 0)
    hidden[:] = 0
    assert np.abs(table.history(b"r")[0].hidden).sum() > 0


def test_release_ends_a_live_stream_and_only_finishes_an_old_plans():
    table, conn = ReplayTable(), object()
    run_step(table, b"a", conn, 0, 1, 0, 2)
    run_step(table, b"b", conn, 4, 1, 0, 2)
    assert table.release(b"a", 1) == [End(conn, 0)]
    assert table.release(b"b", 2) == [Free(conn, 4)]  # the plan moved on: its stages dropped it
    assert len(table) == 0
    assert table.release(b"a", 1) == []  # twice: nothing


def test_release_after_a_failure_frees_nothing_twice():
    """A request that gives up (no spare capacity, its deadline passed) after its stream was freed."""
    table, conn = ReplayTable(), object()
    run_step(table, b"r", conn, 0, 1, 0, 2)
    assert table.failed(b"r") == [Free(conn, 0)]
    assert table.failed(b"r") == []
    assert table.release(b"r", 1) == []
    assert b"r" not in table


def test_eight_requests_fail_over_independently():
    """Eight concurrent requests survive a kill: each replays its own steps, nothing crosses."""
    table, old, new = ReplayTable(), object(), object()
    sent = {}
    for i in range(8):
        rid = bytes([i])
        sent[rid] = [run_step(table, rid, old, 4 * i, 1, 0, 2 + i), run_step(table, rid, old, 4 * i, 1, 2 + i, 1)]
        step_out(table, rid, 3 + i)
    for rid in table.plan_changed(2):
        table.failed(rid)
    for i in range(8):
        rid = bytes([i])
        replay = table.opened(rid, new, 100 + 4 * i, 2)
        assert [s.start_pos for s in replay] == [0, 2 + i, 3 + i]
        assert all(np.array_equal(s.hidden, h) for s, h in zip(replay, sent[rid]))


def test_prompt_chunks_out_together_are_answered_each_and_replayed_in_order():
    """A long prompt streams: three chunks out at once, answered in order; a failure with two
    still out replays the answered one, then both out, in position order, each sent once."""
    table, old, new = ReplayTable(), object(), object()
    first = rows(4, 0)
    table.begin(b"r", SentStep(0, first, False))
    table.opened(b"r", old, 0, 1)
    step_out(table, b"r", 4, 4)
    step_out(table, b"r", 8, 2)
    assert [s.start_pos for s in table.out(b"r")] == [0, 4, 8]
    for pos in (0, 4, 8):  # each chunk's result answers its own step
        assert table.is_answer(b"r", old, 0, pos, error=False)
    assert not table.is_answer(b"r", old, 0, 5, error=False)
    table.answered(b"r", 0)
    assert table.failed(b"r") == [Free(old, 0)]
    assert table.waiting() == [] and [s.start_pos for s in table.out(b"r")] == [4, 8]
    replay = table.opened(b"r", new, 4, 2)
    assert [(s.start_pos, len(s.hidden)) for s in replay] == [(0, 4), (4, 4), (8, 2)]
    assert np.array_equal(replay[0].hidden, first)
    assert not table.to_send(b"r", 4) and not table.to_send(b"r", 8)  # the replay carried them
    assert table.waiting() == [b"r"]
    table.answered(b"r", 4)
    table.answered(b"r", 8)
    assert [s.start_pos for s in table.history(b"r")] == [0, 4, 8] and table.waiting() == []


def test_a_rewind_cuts_steps_out_too():
    """A step handed over from an earlier position drops the steps out beyond it: their answers
    are no longer awaited and a replay does not send them."""
    table, conn = ReplayTable(), object()
    run_step(table, b"r", conn, 0, 1, 0, 3)
    step_out(table, b"r", 3, 4)
    step_out(table, b"r", 7, 4)
    table.begin(b"r", SentStep(5, rows(1, 5), False))  # window at 3 kept 2: a step from 5
    assert [(s.start_pos, len(s.hidden)) for s in table.out(b"r")] == [(3, 2), (5, 1)]
    assert not table.is_answer(b"r", conn, 0, 7, error=False)
    assert table.to_send(b"r", 5)


def test_the_result_of_a_fallen_window_is_not_taken_for_the_step_that_replaced_it():
    """Windows in flight: the first window keeps its drafts but the guess that began the second
    window is wrong, so the next step starts where the second window did. The second window's
    result still comes (first: stages keep a request's order) and is not the new step's answer."""
    table, conn = ReplayTable(), object()
    run_step(table, b"r", conn, 0, 1, 0, 3)
    step_out(table, b"r", 3, 3)  # window 1: [x, d1, d2]
    step_out(table, b"r", 6, 2)  # window 2, sent before window 1's verdict: [guess, e1]
    assert table.is_answer(b"r", conn, 0, 3, error=False)
    table.answered(b"r", 3)
    table.begin(b"r", SentStep(6, rows(1, 66), False))  # the guess was wrong: a step from 6 again
    assert table.to_send(b"r", 6)
    assert not table.is_answer(b"r", conn, 0, 6, error=False)  # window 2's result, computed on the wrong guess
    assert table.is_answer(b"r", conn, 0, 6, error=False)  # then the new step's


def test_a_window_whose_result_arrived_before_it_fell_dooms_nothing():
    """The second window's result came while the asker still checked the first; then the first
    window's verdict drops it. No further result of it is coming, so the step that replaces it at
    the same position takes the next result there as its answer."""
    table, conn = ReplayTable(), object()
    run_step(table, b"r", conn, 0, 1, 0, 3)
    step_out(table, b"r", 3, 3)
    step_out(table, b"r", 6, 2)
    assert table.is_answer(b"r", conn, 0, 3, error=False)
    assert table.is_answer(b"r", conn, 0, 6, error=False)  # arrived (its coroutine was then given up)
    table.answered(b"r", 3)
    table.begin(b"r", SentStep(6, rows(1, 66), False))
    assert table.to_send(b"r", 6)
    assert table.is_answer(b"r", conn, 0, 6, error=False)


def test_a_step_that_learns_late_of_a_broken_route_leaves_the_new_one_alone():
    """Two steps out when the route breaks; the first fails over and opens a new route (replaying
    both); the second only then handles its failure, of the old route: nothing is freed."""
    table, old, new = ReplayTable(), object(), object()
    run_step(table, b"r", old, 0, 1, 0, 3)
    step_out(table, b"r", 3, 2)
    step_out(table, b"r", 5, 2)
    broken = table.route(b"r", 1)
    assert table.failed(b"r", on=broken) == [Free(old, 0)]
    assert [s.start_pos for s in table.opened(b"r", new, 4, 1)] == [0, 3, 5]
    assert table.failed(b"r", on=broken) == []  # late news of the old route
    assert table.route(b"r", 1).conn is new and not table.to_send(b"r", 5)
