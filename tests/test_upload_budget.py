"""An upload budget for the model bytes a node serves (swarmctl/model_files/upload_budget.py UploadBudget),
driven by the clock it is given: each chunk waits until what went before has gone out at the rate."""

from __future__ import annotations

import pytest

from swarmctl.model_files.upload_budget import UploadBudget


def test_chunks_queue_behind_each_other_at_the_budgets_rate():
    budget = UploadBudget(bytes_per_s=1000.0)
    assert budget.wait_s(500, now=10.0) == 0.0  # nothing before it: at once
    assert budget.wait_s(500, now=10.0) == pytest.approx(0.5)  # behind the first half second
    assert budget.wait_s(1000, now=10.2) == pytest.approx(0.8)  # behind both (free at 11.0)
    assert budget.wait_s(100, now=12.5) == 0.0  # the budget went idle: no credit saved up, no wait
    assert budget.wait_s(100, now=12.5) == pytest.approx(0.1)
