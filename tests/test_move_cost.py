"""A layer move priced at the rate the member actually gets layers (plans/hysteresis.py
move_cost_s): a reload from its own model file, or, where it has none, a fetch at the rate it last
fetched at (a conservative default until it fetched anything). I/O-free, then the host's path from
a ``fetching`` report to the planner's descriptors."""

from __future__ import annotations

import pytest

from net.messages import Fetching
from plans.hysteresis import (DEFAULT_FETCH_MB_S, RELOAD_MB_S, REPLAY_S, load_mb_s, move_cost_s, replan_gain)
from plans.layout import ModelLayout
from plans.nodes import ASKER, Link, NodeDescriptor
from tests.test_replan_under_load import SMOL, FakeHost, constraints

MB = 1e6
LAYER = 100_000_000  # bytes
WIDE = ModelLayout("wide", 30, 2048, (LAYER,) * 30, (1,) * 30, 1024, 0, 0)  # 22 trunk layers of 100 MB


def node(name: str, ms: float, *, fetches: bool = False, fetch_mb_s: float | None = None) -> NodeDescriptor:
    return NodeDescriptor(name, int(1e12), ms, links={ASKER: Link(1.0, 100.0)}, fetches=fetches, fetch_mb_s=fetch_mb_s)


def test_a_member_with_the_model_reloads_one_without_fetches_at_its_rate():
    current, proposed = [("a", 4, 26)], [("a", 4, 15), ("b", 15, 26)]  # 11 layers move to b
    moved = 11 * LAYER
    assert move_cost_s(WIDE, current, proposed) == pytest.approx(moved / (RELOAD_MB_S * MB) + REPLAY_S)
    assert move_cost_s(WIDE, current, proposed, [node("a", 1), node("b", 1)]) == \
        pytest.approx(moved / (RELOAD_MB_S * MB) + REPLAY_S)
    # no model file, nothing fetched yet: the default, a home uplink's 20 Mbit/s
    assert move_cost_s(WIDE, current, proposed, [node("a", 1), node("b", 1, fetches=True)]) == \
        pytest.approx(moved / (DEFAULT_FETCH_MB_S * MB) + REPLAY_S)
    # measured: its own rate, slower or faster than the default, never faster than a reload
    assert move_cost_s(WIDE, current, proposed, [node("a", 1), node("b", 1, fetches=True, fetch_mb_s=0.5)]) == \
        pytest.approx(moved / (0.5 * MB) + REPLAY_S)
    assert load_mb_s(node("b", 1, fetches=True, fetch_mb_s=12.0)) == 12.0
    assert load_mb_s(node("b", 1, fetches=True, fetch_mb_s=5000.0)) == RELOAD_MB_S
    # only what moves to the member that fetches is priced as a fetch: a has the file
    swap = [("b", 4, 15), ("a", 15, 26)]
    assert move_cost_s(WIDE, proposed, swap, [node("a", 1), node("b", 1, fetches=True, fetch_mb_s=1.0)]) == \
        pytest.approx(11 * LAYER / (1.0 * MB) + 11 * LAYER / (RELOAD_MB_S * MB) + REPLAY_S)


def test_a_gain_worth_a_reload_is_not_worth_a_slow_fetch():
    """The same 17% faster member: moving 2.2 GB to it repays a 16 s reload within the payback
    time, not a 15-minute fetch at 2.5 MB/s; fetched as fast as a reload (a LAN) it is worth it again."""
    current = [("stage", 4, 26)]
    with_file = [node("stage", 44.6), node("other", 37.2)]
    assert replan_gain(WIDE, with_file, constraints(), current).worth
    fetching = [node("stage", 44.6), node("other", 37.2, fetches=True)]
    gain = replan_gain(WIDE, fetching, constraints(), current)
    assert not gain.worth and gain.cost_s == pytest.approx(22 * LAYER / (DEFAULT_FETCH_MB_S * MB) + REPLAY_S)
    fast = [node("stage", 44.6), node("other", 37.2, fetches=True, fetch_mb_s=250.0)]
    assert replan_gain(WIDE, fast, constraints(), current).worth


def test_the_host_plans_with_the_rate_a_member_reported(tmp_path):
    host = FakeHost(tmp_path, {"alice": 0.41, "bob": 0.45})
    host.trunks["bob"].fetches = True  # its register said it has no model file
    by_name = {n.name: n for n in host.planning.descriptors()}
    assert (by_name["alice"].fetches, by_name["bob"].fetches, by_name["bob"].fetch_mb_s) == (False, True, None)
    assert load_mb_s(by_name["bob"]) == DEFAULT_FETCH_MB_S
    host.host.fetching(host.conns["bob"], 0, Fetching(what="layers [4, 15)", done=30_000_000, total=44_000_000,
                                                      bytes_per_s=1_500_000.0))
    bob = {n.name: n for n in host.planning.descriptors()}["bob"]
    assert bob.fetch_mb_s == 1.5 and load_mb_s(bob) == 1.5
    assert move_cost_s(SMOL, [("alice", 4, 26)], [("bob", 4, 26)], [bob]) == \
        pytest.approx(22 * 4_000_000 / 1.5e6 + REPLAY_S)
