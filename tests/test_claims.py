"""What a member says about itself is checked before the host plans with it."""

from __future__ import annotations

import pytest

from swarmctl import claims


@pytest.mark.parametrize("value", [10**400, -1, float("nan"), float("inf"), "12", True, None, [1], 2**60])
def test_memory_claims_outside_reason_are_refused(value):
    with pytest.raises(claims.ClaimError):
        claims.memory(value)


def test_sane_claims_pass_through():
    assert claims.memory(12 * 2**30) == 12 * 2**30
    assert claims.ms_per_layer(0.27) == 0.27 and claims.ms_per_layer(None) is None
    assert claims.rtt_ms(3) == 3.0
    assert claims.links({"bob": {"rtt_ms": 20, "bandwidth_mb_s": 50}, "eve": {"rtt_ms": 1}}) == \
        {"bob": (20.0, 50.0), "eve": (1.0, None)}


@pytest.mark.parametrize("value", [0, 1e-9, 1e9, float("nan"), "fast"])
def test_speed_claims_outside_reason_are_refused(value):
    with pytest.raises(claims.ClaimError):
        claims.ms_per_layer(value)


def test_link_claims_are_bounded_in_size_and_value():
    with pytest.raises(claims.ClaimError):
        claims.links({f"p{i}": {"rtt_ms": 1} for i in range(claims.MAX_LINKS + 1)})
    with pytest.raises(claims.ClaimError):
        claims.links({"bob": {"rtt_ms": -5}})
    with pytest.raises(claims.ClaimError):
        claims.links(["bob"])
