"""The dialer's memory of path attempts (swarmctl/reaching/path_memo.py, issue 29 item 3): a punch that
failed is not tried again on an ask's clock until MEMO_TTL_S has passed, per member, address,
plan and origin; the file in the home survives the process and its damage."""

from __future__ import annotations

import json

import pytest

from swarmctl.reaching.path_memo import MEMO_TTL_S, PathKey, PathMemo, PathMemoFile

CAROL = PathKey("carol", "198.51.100.12:40123", "punch", "192.168.1.2")


def test_a_failed_punch_is_remembered_for_a_while_then_forgotten():
    memo = PathMemo()
    assert memo.punch_failed(CAROL, now=1000.0) is None
    memo.put(CAROL, "relayed", now=1000.0)
    assert memo.punch_failed(CAROL, now=1000.0 + MEMO_TTL_S - 1).path == "relayed"
    assert memo.punch_failed(CAROL, now=1000.0 + MEMO_TTL_S) is None  # expired
    assert memo.punch_failed(CAROL, now=999.0) is None  # a clock that went back: not trusted
    memo.put(CAROL, "relayed", now=1000.0 + MEMO_TTL_S - 1)  # a background attempt refreshes it
    assert memo.punch_failed(CAROL, now=1000.0 + MEMO_TTL_S + 10) is not None
    memo.put(CAROL, "punched", now=1000.0 + MEMO_TTL_S + 20)  # a later attempt got through
    assert memo.punch_failed(CAROL, now=1000.0 + MEMO_TTL_S + 21) is None


def test_the_memo_is_kept_per_member_address_plan_and_origin():
    memo = PathMemo()
    memo.put(CAROL, "relayed", now=0.0)
    others = [PathKey("bob", CAROL.address, "punch", CAROL.origin),  # another member
              PathKey("carol", "198.51.100.12:40999", "punch", CAROL.origin),  # her router gave a new mapping
              PathKey("carol", CAROL.address, "direct", CAROL.origin),  # the host planned otherwise
              PathKey("carol", CAROL.address, "punch", "10.0.0.7")]  # we moved to another network
    for key in others:
        assert memo.punch_failed(key, now=1.0) is None, key
    assert memo.punch_failed(CAROL, now=1.0) is not None
    memo.put(others[2], "relayed", now=1.0)  # (only a planned punch can be skipped)
    assert memo.punch_failed(others[2], now=2.0) is None
    with pytest.raises(ValueError, match="path outcome 'lost'"):
        memo.put(CAROL, "lost", now=2.0)


def test_the_memo_stays_bounded():
    memo = PathMemo(max_entries=3)
    for i in range(5):
        memo.put(PathKey(f"m{i}", "a:1", "punch"), "relayed", now=float(i))
    assert [k.member for k in memo.entries] == ["m2", "m3", "m4"]


def test_the_file_carries_outcomes_to_the_next_process_and_shrugs_off_damage(tmp_path):
    now = [5000.0]
    path = tmp_path / "paths.json"
    first = PathMemoFile(path, clock=lambda: now[0])
    first.record(CAROL, "relayed")
    now[0] += 30
    second = PathMemoFile(path, clock=lambda: now[0])  # a new `swarmctl ask`
    assert second.punch_failed(CAROL) == pytest.approx(30.0)
    # Two processes writing: each keeps what the other recorded, the newer outcome wins.
    bob = PathKey("bob", "198.51.100.11:7471", "punch", "192.168.1.2")
    first.record(bob, "punched")
    now[0] += 1
    second.record(CAROL, "punched")
    rows = {(r["member"], r["path"]) for r in json.loads(path.read_text())["paths"]}
    assert rows == {("carol", "punched"), ("bob", "punched")}
    for damage in ("{not json", '{"paths": [{"member": 1}]}', '["x"]', ""):
        path.write_text(damage)
        assert PathMemoFile(path, clock=lambda: now[0]).punch_failed(CAROL) is None
    memo = PathMemoFile(tmp_path / "missing" / "paths.json")  # no folder: kept in memory, no error
    memo.record(CAROL, "relayed")
    assert memo.punch_failed(CAROL) is not None
