"""The asker's reroute-and-replay table, driven directly (no sockets): every failover path the
multi-process fault tests exercise (tests/test_fault_tolerance.py), event by event.

Connections are stand-in objects: the table only stores and compares them."""

import numpy as np

from swarmctl.asker.replay import End, Free, ReplayTable


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def run_step(table: ReplayTable, rid: bytes, conn, stream: int, version: int, start: int, n: int,
             verify: bool = False) -> np.ndarray:
    """One step that the swarm answers: the link's calls in the link's order."""
    hidden = rows(n, start)
    table.begin(rid, start)
    if table.route(rid, version) is None:
        table.opened(rid, conn, stream, version)
    table.sent(rid, start)
    assert table.is_answer(rid, conn, stream, start, error=False)
    table.answered(rid, start, hidden, verify)
    return hidden


def test_the_first_step_opens_a_route_and_replays_nothing():
    table, conn = ReplayTable(), object()
    table.begin(b"r", 0)
    assert table.route(b"r", 1) is None
    assert table.opened(b"r", conn, 4, 1) == []
    route = table.route(b"r", 1)
    assert route is not None and route.conn is conn and route.stream_id == 4


def test_a_killed_stage_replays_every_answered_step_in_order_then_the_failed_one():
    """kill -9 mid-generation: the connection is lost while a decode step waits."""
    table, old, new = ReplayTable(), object(), object()
    prompt = run_step(table, b"r", old, 0, 1, 0, 5)
    decode = run_step(table, b"r", old, 0, 1, 5, 1)
    table.begin(b"r", 6)
    table.sent(b"r", 6)
    assert table.waiting() == [b"r"]
    assert table.failed(b"r") == [Free(old, 0)]
    assert table.waiting() == []
    assert table.route(b"r", 2) is None  # a new route is needed
    replay = table.opened(b"r", new, 8, 2)
    assert [s.start_pos for s in replay] == [0, 5]
    assert np.array_equal(replay[0].hidden, prompt) and np.array_equal(replay[1].hidden, decode)
    # the replayed steps' results come back too: they are not the answer awaited
    table.sent(b"r", 6)
    assert not table.is_answer(b"r", new, 8, 0, error=False)
    assert not table.is_answer(b"r", new, 8, 5, error=False)
    assert table.is_answer(b"r", new, 8, 6, error=False)


def test_a_new_plan_fails_over_only_requests_waiting_on_an_older_plan():
    table, conn = ReplayTable(), object()
    run_step(table, b"a", conn, 0, 1, 0, 3)
    table.begin(b"a", 3)
    table.sent(b"a", 3)  # waiting on v1
    run_step(table, b"b", conn, 4, 1, 0, 3)  # answered, not waiting
    run_step(table, b"c", conn, 8, 2, 0, 3)
    table.begin(b"c", 3)
    table.sent(b"c", 3)  # waiting on v2 already
    assert table.plan_changed(2) == [b"a"]
    # b's next step opens a new route on v2 and replays its prompt
    assert table.route(b"b", 2) is None
    assert [s.start_pos for s in table.opened(b"b", conn, 12, 2)] == [0]


def test_a_silent_stage_fails_every_waiting_request_and_the_same_plan_replays_them():
    """Frozen nodes, a 3 s cut: the plan stays the same; the link retries it on fresh connections."""
    table, old, fresh = ReplayTable(), object(), object()
    for i, rid in enumerate([b"a", b"b", b"c"]):
        run_step(table, rid, old, 4 * i, 1, 0, 2)
        table.begin(rid, 2)
        table.sent(rid, 2)
    assert sorted(table.waiting()) == [b"a", b"b", b"c"]
    for rid in table.waiting():
        assert table.failed(rid) == [Free(old, [b"a", b"b", b"c"].index(rid) * 4)]
    assert table.route(b"a", 1) is None  # the same plan version, but the stream was given up
    assert [s.start_pos for s in table.opened(b"a", fresh, 0, 1)] == [0]


def test_an_error_counts_only_from_the_route_the_request_travels_now():
    table, old, new = ReplayTable(), object(), object()
    run_step(table, b"r", old, 0, 1, 0, 2)
    table.failed(b"r")
    table.opened(b"r", new, 4, 2)
    table.begin(b"r", 2)
    table.sent(b"r", 2)
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
    table.begin(b"r", 0)
    assert table.history(b"r") == []


def test_the_record_holds_copies_not_the_callers_buffer():
    table, conn = ReplayTable(), object()
    hidden = rows(2, 0)
    table.begin(b"r", 0)
    table.opened(b"r", conn, 0, 1)
    table.sent(b"r", 0)
    table.answered(b"r", 0, hidden, False)
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
        table.begin(rid, 3 + i)
        table.sent(rid, 3 + i)
    for rid in table.plan_changed(2):
        table.failed(rid)
    for i in range(8):
        rid = bytes([i])
        replay = table.opened(rid, new, 100 + 4 * i, 2)
        assert [s.start_pos for s in replay] == [0, 2 + i]
        assert all(np.array_equal(s.hidden, h) for s, h in zip(replay, sent[rid]))
