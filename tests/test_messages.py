"""Control messages are checked once where they arrive (net/messages.py): what a member says about
itself must have the right type and a magnitude a real machine can have before the host plans with
it; replies decode into their types, and an error reply is raised, not returned."""

from __future__ import annotations

import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from net import messages as m
from net.wire import FRAME_HEADER, WireError, decode_control

HOST = m.kinds(m.Register, m.Speed, m.Links, m.BadResult, m.Recovered)


def register(**fields) -> dict:
    return {"type": "register", "listen": "127.0.0.1:7471", "memory": 2**30, **fields}


@pytest.mark.parametrize("value", [10**400, -1, float("nan"), float("inf"), "12", True, None, [1], 2**60, 1.5])
def test_memory_claims_outside_reason_are_refused(value):
    with pytest.raises(m.MalformedMessage, match=r"^malformed register: .*memory"):
        m.parse(register(memory=value), HOST)


def test_sane_claims_pass_through():
    r = m.parse(register(memory=12 * 2**30, ms_per_layer_token=0.27, rtt_ms=3), HOST)
    assert (r.memory, r.ms_per_layer_token, r.rtt_ms, r.device) == (12 * 2**30, 0.27, 3.0, "cpu")
    assert m.parse(register(), HOST).ms_per_layer_token is None  # no model file to measure with yet
    links = m.parse({"type": "links", "links": {"bob": {"rtt_ms": 20, "bandwidth_mb_s": 50}, "eve": {"rtt_ms": 1}}},
                    HOST).links
    assert {p: (c.rtt_ms, c.bandwidth_mb_s) for p, c in links.items()} == {"bob": (20.0, 50.0), "eve": (1.0, None)}


@pytest.mark.parametrize("value", [0, 1e-9, 1e9, float("nan"), "fast", None])
def test_speed_claims_outside_reason_are_refused(value):
    with pytest.raises(m.MalformedMessage, match="ms_per_layer_token"):
        m.parse({"type": "speed", "ms_per_layer_token": value}, HOST)


def test_link_claims_are_bounded_in_size_and_value():
    for links in ({f"p{i}": {"rtt_ms": 1} for i in range(m.MAX_LINKS + 1)}, {"bob": {"rtt_ms": -5}}, ["bob"],
                  {"x" * 65: {"rtt_ms": 1}}):
        with pytest.raises(m.MalformedMessage):
            m.parse({"type": "links", "links": links}, HOST)


def test_an_accusation_names_one_to_sixty_four_members():
    for members in ([], ["a"] * 65, "trunk-a", [1]):
        with pytest.raises(m.MalformedMessage):
            m.parse({"type": "bad_result", "members": members}, HOST)
    assert m.parse({"type": "bad_result", "members": ["a"], "rel_error": 0.5}, HOST).members == ["a"]


def test_unknown_and_unaccepted_types_are_named():
    with pytest.raises(m.UnknownMessage, match="unknown request 'nope'"):
        m.parse({"type": "nope"}, HOST)
    with pytest.raises(m.UnknownMessage):  # a real message, but not one this endpoint answers
        m.parse({"type": "subscribe", "session": "x"}, HOST)


def test_unknown_fields_are_ignored_for_newer_members():
    assert m.parse(register(gpu="rtx 4090"), HOST).memory == 2**30


def test_messages_survive_encode_and_decode():
    sent = m.Ok(closed=2, counted=["a"])
    assert m.decode(m.encode(sent)[FRAME_HEADER.size:], m.Ok) == sent
    assert m.as_dict(sent) == {"type": "ok", "closed": 2, "counted": ["a"]}  # unset fields stay off the wire
    with pytest.raises(m.Refused, match="no such thing") as refused:
        m.decode(m.encode(m.Error(message="no such thing", missing=True))[FRAME_HEADER.size:], m.Ok)
    assert refused.value.error.missing
    with pytest.raises(WireError, match="answered 'ok' instead of 'plan'"):
        m.decode(m.encode(sent)[FRAME_HEADER.size:], m.PlanPush)
    with pytest.raises(m.MalformedMessage):
        m.decode(b'{"type": "plan", "plan": 3}', m.PlanPush)


# --- every message, any valid content: a property test over the types themselves ---

def _strategy(t: mi.Type) -> st.SearchStrategy:
    """Values msgspec's own description of a field type allows (its bounds included)."""
    if isinstance(t, mi.StructType):
        fields = {f.name: _strategy(f.type) for f in t.fields}
        optional = {f.name for f in t.fields if not f.required}
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k not in optional},
                                     optional={k: v for k, v in fields.items() if k in optional}) \
            .map(lambda kwargs: t.cls(**kwargs))
    if isinstance(t, mi.UnionType):
        return st.one_of(*(_strategy(u) for u in t.types))
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -2**63)
        high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**63 - 1)
        return st.integers(low, high)
    if isinstance(t, mi.FloatType):
        low = t.ge if t.ge is not None else t.gt if t.gt is not None else -1e300
        return st.floats(low, t.le if t.le is not None else 1e300, exclude_min=t.gt is not None and t.ge is None,
                         allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            return st.from_regex(t.pattern, fullmatch=True)
        return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or 40, 40))
    if isinstance(t, mi.ListType):
        return st.lists(_strategy(t.item_type), min_size=t.min_length or 0, max_size=min(t.max_length or 4, 4))
    if isinstance(t, mi.TupleType):
        return st.tuples(*(_strategy(u) for u in t.item_types))
    if isinstance(t, mi.DictType):
        return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=4)
    if isinstance(t, mi.AnyType):
        return st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=10),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=8)
    raise AssertionError(f"no strategy for {t!r}")


MESSAGES = sorted((t for t in vars(m).values() if isinstance(t, type) and issubclass(t, m.Message)
                   and t is not m.Message), key=lambda t: t.__name__)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda t: t.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_message_survives_encode_and_decode(cls, data):
    sent = data.draw(_strategy(mi.type_info(cls)))
    body = m.encode(sent)[FRAME_HEADER.size:]
    received = m.decode(body, cls) if cls is not m.Error else m.parse(decode_control(body), m.kinds(m.Error))
    assert received == sent
