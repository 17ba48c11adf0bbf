"""Per-member budgets at a stage (swarmctl/trunk/budget.py): the bookkeeping on its own, and the engine's
prediction of what a step will leave a request's KV cache holding, which admission charges."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.slice import SliceEngine
from kernels.spec import KV_CELL_PAD, SliceSpec
from swarmctl.trunk.budget import MIN_REQUESTS, SHORT_REQUESTS, SLACK, Limits, MemberBudget
from tests.conftest import N_THREADS

MB = 1_000_000


def rid(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_requests_per_member_are_bounded_and_members_are_separate():
    budget = MemberBudget(Limits(member_requests=3, member_kv_bytes=100 * MB, total_kv_bytes=1000 * MB))
    for i in range(3):
        assert budget.admit(rid(i), "eve", MB) == ""
    problem = budget.admit(rid(3), "eve", MB)
    assert "'eve' already holds 3 requests" in problem and "limit (3" in problem
    assert budget.usage("eve").requests == 3 and budget.n_requests == 3  # the refused one left nothing
    assert budget.admit(rid(4), "alice", MB) == ""  # another member has its own budget
    assert budget.admit(rid(0), "eve", 2 * MB) == ""  # a held request may still grow
    budget.release(rid(1))
    assert budget.admit(rid(3), "eve", MB) == ""  # released: room again
    assert budget.refusals == 1


def test_kv_bytes_per_member_are_bounded_growth_included():
    budget = MemberBudget(Limits(member_requests=100, member_kv_bytes=10 * MB, total_kv_bytes=1000 * MB))
    assert budget.admit(rid(0), "eve", 6 * MB) == ""
    assert budget.admit(rid(1), "eve", 4 * MB) == ""  # exactly at the limit
    problem = budget.admit(rid(2), "eve", 1)
    assert "'eve' would hold 10.0 MB of KV cache at this stage, over its limit of 10.0 MB" in problem
    problem = budget.admit(rid(1), "eve", 5 * MB)  # an existing request growing past the limit
    assert "would hold 11.0 MB" in problem
    assert budget.usage("eve").kv_bytes == 10 * MB and budget.charged(rid(1)) == 4 * MB  # unchanged
    assert budget.admit(rid(1), "eve", 4 * MB) == ""  # a step that needs no more memory always runs
    assert budget.admit(rid(9), "alice", 10 * MB) == ""


def test_the_stage_total_bounds_all_members_together():
    budget = MemberBudget(Limits(member_requests=100, member_kv_bytes=10 * MB, total_kv_bytes=15 * MB))
    assert budget.admit(rid(0), "eve", 8 * MB) == ""
    assert budget.admit(rid(1), "alice", 7 * MB) == ""
    problem = budget.admit(rid(2), "bob", MB)
    assert "KV cache is full: 15.0 MB held of 15.0 MB for all members" in problem
    budget.release(rid(0))
    assert budget.admit(rid(2), "bob", MB) == "" and budget.total_kv_bytes == 8 * MB


def test_settle_follows_the_engine_and_release_frees_everything():
    budget = MemberBudget(Limits(member_requests=10, member_kv_bytes=10 * MB, total_kv_bytes=10 * MB))
    assert budget.admit(rid(0), "eve", 4 * MB) == ""
    budget.settle(rid(0), 2 * MB, held=True)  # the engine holds less than was predicted
    assert budget.usage("eve").kv_bytes == 2 * MB and budget.total_kv_bytes == 2 * MB
    budget.settle(rid(0), 0, held=False)  # a first step that failed: the engine holds nothing
    assert budget.usage("eve").requests == 0 and budget.total_kv_bytes == 0 and budget.n_requests == 0
    assert budget.stats()["members"] == {}
    budget.release(rid(0))  # twice, and unknown ids: no effect
    budget.release(rid(7))
    budget.settle(rid(7), MB, held=True)  # (settling an id never charged charges nothing)
    assert budget.n_requests == 0 and budget.total_kv_bytes == 0


def test_a_request_id_taken_over_by_another_member_moves_its_charge():
    budget = MemberBudget(Limits(member_requests=10, member_kv_bytes=10 * MB, total_kv_bytes=100 * MB))
    assert budget.admit(rid(0), "eve", 3 * MB) == ""
    assert budget.admit(rid(0), "alice", 3 * MB) == ""
    assert budget.usage("eve").requests == 0 and budget.usage("alice").kv_bytes == 3 * MB
    assert budget.total_kv_bytes == 3 * MB


def test_limits_derive_from_the_plan_and_let_the_planned_load_through():
    per_position = 768 * 11  # SmolLM2: 3 KV heads × 64 × K and V × f16, 11 layers
    smallest = KV_CELL_PAD * per_position
    limits = Limits.derive(kv_bytes_per_position=per_position, smallest_cache_bytes=smallest, context_tokens=4096,
                           concurrent=4, room_bytes=None)
    assert limits.member_kv_bytes == SLACK * 4 * 4096 * per_position
    assert limits.member_requests >= MIN_REQUESTS >= 64
    assert "4 × 4096 tokens" in limits.basis
    # 64 short requests from one asker (tests/test_pipelining.py): a 256-cell cache each
    budget = MemberBudget(limits)
    assert all(budget.admit(rid(i), "asker", smallest) == "" for i in range(64))
    # ... and the planned concurrency at full context, twice over, but no more
    budget = MemberBudget(limits)
    assert all(budget.admit(rid(i), "asker", 4096 * per_position) == "" for i in range(2 * 4))
    assert budget.admit(rid(99), "asker", smallest) != ""
    # A small plan (2 × 512 tokens: tests/test_fault_tolerance.py) still lets an asker's default
    # 16 short requests through.
    small = Limits.derive(kv_bytes_per_position=per_position, smallest_cache_bytes=smallest, context_tokens=512,
                          concurrent=2, room_bytes=-10**6)
    assert small.member_kv_bytes == SHORT_REQUESTS * smallest > SLACK * 2 * 512 * per_position
    budget = MemberBudget(small)
    assert all(budget.admit(rid(i), "asker", smallest) == "" for i in range(SHORT_REQUESTS))
    assert budget.admit(rid(99), "asker", smallest) != ""
    # The node's room bounds all members together, never below one member's budget.
    assert small.total_kv_bytes == small.member_kv_bytes
    assert Limits.derive(kv_bytes_per_position=10, smallest_cache_bytes=1, context_tokens=100, concurrent=2,
                         room_bytes=10**9).total_kv_bytes == 10**9


@pytest.fixture(scope="module")
def engine(bundled_model):
    e = SliceEngine.open(bundled_model, SliceSpec(4, 7), n_threads=N_THREADS, max_context=1024)
    yield e
    e.close()


def test_the_engine_predicts_what_a_step_leaves_a_cache_holding(engine):
    """Admission charges ``kv_bytes_after`` before a step; it must equal what the cache then holds."""
    x = np.random.default_rng(1).standard_normal((700, engine.spec.n_embd)).astype(np.float32)
    key = rid(1)
    steps = [(0, 3), (3, 1), (4, 300), (304, 1), (305, 250), (0, 2), (2, 700), (702, 300)]  # growth, rewind
    try:
        for start, n in steps:
            predicted = engine.kv_bytes_after(key, start + n)
            engine.forward(key, start_pos=start, hidden=x[:n])
            assert engine.kv_bytes_of(key) == predicted, (start, n)
            assert engine.kv_bytes == predicted
        assert engine.kv_bytes_of(key) == 1024 * engine.kv_bytes_per_position  # capped at the context
        assert engine.kv_bytes_after(rid(2), 5000) == 1024 * engine.kv_bytes_per_position
    finally:
        engine.release(key)
    assert engine.kv_bytes_of(key) == 0 and engine.kv_bytes_after(key, 1) == KV_CELL_PAD * engine.kv_bytes_per_position
