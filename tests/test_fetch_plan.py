"""The fetch plan alone (swarmctl/model_files/fetch_plan.py): which source pulls which chunk, driven by hand,
no I/O."""

from __future__ import annotations

from swarmctl.model_files.fetch_plan import MAX_FAILURES, FetchPlan


def plan_of(n: int, *sources: str) -> FetchPlan:
    plan = FetchPlan({f"0:{j}": 10 for j in range(n)})
    for name in sources:
        plan.add_source(name)
    return plan


def test_sources_pull_batches_in_file_order_and_a_busy_source_gets_nothing_more():
    plan = plan_of(10, "mirror", "host")
    assert plan.next_batch("mirror", 4) == ["0:0", "0:1", "0:2", "0:3"]
    assert plan.next_batch("host", 2) == ["0:4", "0:5"]
    assert plan.next_batch("host", 2) == []  # one batch at a time per source
    for c in ["0:4", "0:5"]:
        assert plan.delivered("host", c)
    plan.batch_ended("host")
    assert plan.next_batch("host", 2) == ["0:6", "0:7"]
    assert plan.shares() == {"mirror": 0, "host": 20}


def test_a_failed_batch_goes_back_and_three_in_a_row_drop_the_source():
    plan = plan_of(6, "host", "mirror")
    batch = plan.next_batch("host", 3)
    plan.delivered("host", batch[0])
    assert not plan.failed("host", "timeout")
    assert plan.next_batch("mirror", 10) == ["0:1", "0:2", "0:3", "0:4", "0:5"]  # given back, in order
    for _ in range(MAX_FAILURES - 1):
        plan.failed("mirror", "timeout")
        assert plan.next_batch("mirror", 10)
    assert plan.failed("mirror", "reset")
    assert "3 failed batches in a row, the last: reset" in plan.sources["mirror"].dropped
    assert plan.next_batch("mirror", 10) == [] and plan.live == ["host"]
    assert plan.next_batch("host", 10) == ["0:1", "0:2", "0:3", "0:4", "0:5"]


def test_a_success_resets_the_failure_count():
    plan = plan_of(4, "host")
    for _ in range(MAX_FAILURES - 1):
        plan.next_batch("host", 1)
        plan.failed("host", "timeout")
    plan.delivered("host", plan.next_batch("host", 1)[0])
    plan.batch_ended("host")
    plan.next_batch("host", 1)
    assert not plan.failed("host", "timeout")


def test_a_wrong_chunk_drops_the_source_and_its_chunks_go_to_the_others():
    plan = plan_of(4, "mirror", "host")
    assert plan.next_batch("mirror", 4) == ["0:0", "0:1", "0:2", "0:3"]
    plan.delivered("mirror", "0:0")
    plan.wrong("mirror", "chunk 1 does not match")
    assert plan.sources["mirror"].dropped == "chunk 1 does not match"
    assert plan.next_batch("host", 8) == ["0:1", "0:2", "0:3"]
    for c in ["0:1", "0:2", "0:3"]:
        plan.delivered("host", c)
    assert plan.finished and plan.shares() == {"mirror": 10, "host": 30}


def test_the_end_game_duplicates_one_chunk_of_a_slow_source_and_the_first_copy_wins():
    plan = plan_of(3, "slow", "fast")
    assert plan.next_batch("slow", 2) == ["0:0", "0:1"]
    assert plan.next_batch("fast", 2) == ["0:2"]
    plan.delivered("fast", "0:2")
    plan.batch_ended("fast")
    assert plan.next_batch("fast", 2) == ["0:1"]  # nothing pending: the chunk "slow" reaches last
    assert plan.wanted("fast", "0:1")
    assert plan.delivered("fast", "0:1")
    assert not plan.wanted("slow", "0:1")  # the slow copy, when it comes, is not written
    plan.batch_ended("fast")
    assert plan.next_batch("fast", 2) == ["0:0"]
    assert plan.next_batch("slow", 2) == []  # still busy with its batch
    plan.delivered("slow", "0:0")
    assert not plan.wanted("fast", "0:0")
    assert plan.finished and plan.shares() == {"slow": 10, "fast": 20}


def test_a_chunk_out_with_two_sources_is_not_handed_out_again_nor_given_back_while_one_has_it():
    plan = plan_of(1, "a", "b", "c")
    plan.next_batch("a", 1)
    assert plan.next_batch("b", 1) == ["0:0"]
    assert plan.next_batch("c", 1) == []  # already duplicated once
    plan.failed("a", "timeout")
    assert list(plan.pending) == []  # b still has it
    plan.failed("b", "timeout")
    assert list(plan.pending) == ["0:0"]


def test_a_source_takes_only_what_it_holds():
    plan = FetchPlan({f"{i}:0": 5 for i in range(4)})
    plan.add_source("member", frozenset({"1:0", "3:0"}))
    plan.add_source("host")
    assert plan.next_batch("member", 8) == ["1:0", "3:0"]
    assert plan.next_batch("host", 8) == ["0:0", "2:0"]
