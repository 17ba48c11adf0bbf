"""net/wire.py, property by property (hypothesis): every activation packet, frame, expert call and
control message that the encoders accept comes back from the decoders with the same fields, and
bytes from anywhere (random, or a valid encoding cut short, extended or with bytes changed) make
the decoders raise ``WireError`` and nothing else. Pure encode/decode: no sockets, no processes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from net.wire import (FLAG_TRACE, FRAME_HEADER, MAX_HOPS, ActivationPacket, DType, ExpertCall, ExpertCallKind, FrameDecoder,
                      FrameType, Hop, HopCall, PacketKind, WireError, decode_control, decode_expert_call, decode_packet,
                      encode_control, encode_expert_call, encode_frame, encode_packet)

# The machine running the suite may be busy: a slow example is not a failure of the property.
PROPERTY = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])

U16 = st.integers(0, 2**16 - 1)
U32 = st.integers(0, 2**32 - 1)
ERROR_TEXT_CHARS = 500  # decode_packet and decode_expert_call keep this many characters of a message


def short_utf8(max_bytes: int) -> st.SearchStrategy[str]:
    """Text whose UTF-8 encoding fits a one-byte length field (surrogates do not encode)."""
    return st.text(st.characters(exclude_categories=("Cs",))).filter(lambda s: len(s.encode("utf-8")) <= max_bytes)


hops = st.builds(Hop, short_utf8(255), U32, U32, U16)
hop_calls = st.builds(HopCall, short_utf8(255), U32, U32, U32, U32, U32)
# A traced packet's hops may list expert calls (swarmctl ask --trace); an untraced one's never do.
traced_hops = st.builds(Hop, short_utf8(255), U32, U32, U16, st.lists(hop_calls, max_size=4).map(tuple))


@st.composite
def activations(draw, dtype: DType) -> np.ndarray:
    shape = (draw(st.integers(1, 8)), draw(st.integers(0, 16)))
    return draw(hnp.arrays(dtype.numpy, shape))  # NaNs and infinities included: compared bit for bit


@st.composite
def packets(draw) -> ActivationPacket:
    kind = draw(st.sampled_from(PacketKind))
    dtype = draw(st.sampled_from([DType.F32, DType.F16]))  # (bit for bit; q8_0 has its own test below)
    trace = draw(st.booleans())
    common = dict(kind=kind, request_id=draw(st.binary(min_size=16, max_size=16)), plan_version=draw(U32),
                  layer_index=draw(U32), start_pos=draw(U32), dtype=dtype, reply_to=draw(short_utf8(255)),
                  hops=tuple(draw(st.lists(traced_hops if trace else hops, max_size=MAX_HOPS))), trace=trace)
    if kind == PacketKind.ERROR:
        return ActivationPacket(data=np.empty((0, 0), np.float32), message=draw(st.text(max_size=ERROR_TEXT_CHARS)),
                                retry=draw(st.booleans()), **common)
    # a kept prefix's id rides on END (keep) and PREFILL (resume) only
    prefix = draw(st.binary(min_size=16, max_size=16) | st.just(b"")) \
        if kind in (PacketKind.END, PacketKind.PREFILL) else b""
    if kind == PacketKind.END:
        return ActivationPacket(data=np.empty((0, 0), dtype.numpy), prefix=prefix, **common)
    return ActivationPacket(data=draw(activations(dtype)), prefix=prefix, **common)


@st.composite
def expert_calls(draw) -> ExpertCall:
    kind = draw(st.sampled_from(ExpertCallKind))
    layer = draw(U32)
    if kind == ExpertCallKind.ERROR:
        return ExpertCall(kind, layer, np.empty((0, 0), np.float32), message=draw(st.text(max_size=ERROR_TEXT_CHARS)))
    data = draw(activations(DType.F32))
    ids = None
    if kind == ExpertCallKind.REQUEST:
        ids = draw(hnp.arrays(np.dtype("<i4"), data.shape[0]))
    return ExpertCall(kind, layer, data, ids)


def _json_values(children):
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           _json_values, max_leaves=20)
controls = st.builds(lambda kind, rest: {**rest, "type": kind}, st.text(),
                     st.dictionaries(st.text(max_size=12), json_values, max_size=6))


def one_frame_body(encoded: bytes) -> tuple[FrameType, bytes]:
    frames = FrameDecoder().feed(encoded)
    assert len(frames) == 1
    return frames[0].type, frames[0].body


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --- encode → decode gives the same fields ---


@PROPERTY
@given(packets())
def test_every_packet_survives_encode_and_decode(packet):
    frame_type, body = one_frame_body(encode_packet(packet))
    assert frame_type == FrameType.ACTIVATION
    got = decode_packet(body)
    assert (got.kind, got.request_id, got.plan_version, got.layer_index, got.start_pos, got.dtype, got.reply_to,
            got.hops, got.message, got.retry, got.trace) == (packet.kind, packet.request_id, packet.plan_version,
                                                            packet.layer_index, packet.start_pos, packet.dtype,
                                                            packet.reply_to, packet.hops, packet.message,
                                                            packet.retry, packet.trace)
    if packet.kind in (PacketKind.ERROR, PacketKind.END):
        assert got.n_tokens == 0 and got.data.size == 0
    else:
        assert same_array(got.data, packet.data)


@PROPERTY
@given(packets())
def test_an_untraced_packet_is_the_encoding_from_before_the_trace_flag(packet):
    """TRACE adds only its flag bit and, after the hop records, one u16 count of expert calls per
    hop: with the flag off the bytes are exactly the format from before it existed (which stages
    of an older version read), and with it on but no calls listed, only those bits differ."""
    plain = dict(packet.__dict__, trace=False, hops=tuple(replace(h, calls=()) for h in packet.hops), prefix=b"")
    untraced = one_frame_body(encode_packet(ActivationPacket(**plain)))[1]
    traced = one_frame_body(encode_packet(ActivationPacket(**{**plain, "trace": True})))[1]
    hops_end = len(untraced) - len(_payload_of(packet))
    assert traced[3] == untraced[3] | FLAG_TRACE and traced[:3] == untraced[:3]
    assert traced[4:hops_end] == untraced[4:hops_end]
    assert traced[hops_end:hops_end + 2 * len(packet.hops)] == bytes(2 * len(packet.hops))
    assert traced[hops_end + 2 * len(packet.hops):] == untraced[hops_end:]


def _payload_of(packet: ActivationPacket) -> bytes:
    if packet.kind == PacketKind.ERROR:
        return packet.message.encode("utf-8")
    if packet.kind == PacketKind.END:
        return b""
    return np.ascontiguousarray(packet.data, dtype=packet.dtype.numpy).tobytes()


def test_expert_call_records_need_the_trace_flag():
    calls = (HopCall("experts-a", 2, 10, 300, 1, 2048),)
    packet = ActivationPacket(PacketKind.RESULT, b"r" * 16, 1, 3, 0, np.zeros((1, 4), np.float32),
                              hops=(Hop("stage-a", 1, 2, 1, calls),))
    with pytest.raises(WireError, match="traced packets"):
        encode_packet(packet)
    got = decode_packet(one_frame_body(encode_packet(replace(packet, trace=True)))[1])
    assert got.trace and got.hops[0].calls == calls


@PROPERTY
@given(expert_calls())
def test_every_expert_call_survives_encode_and_decode(call):
    frame_type, body = one_frame_body(encode_expert_call(call))
    assert frame_type == FrameType.DATA
    got = decode_expert_call(body)
    assert (got.kind, got.layer, got.message) == (call.kind, call.layer, call.message)
    if call.kind == ExpertCallKind.ERROR:
        assert got.data.size == 0 and got.expert_ids is None
        return
    assert same_array(got.data, call.data)
    if call.kind == ExpertCallKind.REQUEST:
        assert same_array(got.expert_ids, call.expert_ids)
    else:
        assert got.expert_ids is None


@PROPERTY
@given(controls)
def test_every_control_message_survives_encode_and_decode(message):
    frame_type, body = one_frame_body(encode_control(message))
    assert frame_type == FrameType.CONTROL
    assert decode_control(body) == message


@PROPERTY
@given(st.lists(st.tuples(st.sampled_from(FrameType), st.binary(max_size=300)), max_size=8), st.data())
def test_frames_come_out_whole_however_the_stream_splits_them(frames, data):
    stream = b"".join(encode_frame(t, body) for t, body in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    decoder, got = FrameDecoder(), []
    for a, b in zip([0, *cuts], [*cuts, len(stream)]):
        got += decoder.feed(stream[a:b])
    decoder.finish()
    assert [(f.type, f.body) for f in got] == frames
    assert decoder.buffered == 0


# --- any bytes: a WireError or a valid result, never another exception ---


@st.composite
def mangled(draw, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding cut short, extended, or with some bytes changed."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, 4))):
        if data and draw(st.booleans()):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))):]
    return bytes(data) + draw(st.binary(max_size=8))


def bodies(encoded: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return encoded.map(lambda frame: one_frame_body(frame)[1])


packet_bodies = bodies(packets().map(encode_packet))
expert_bodies = bodies(expert_calls().map(encode_expert_call))
control_bodies = bodies(controls.map(encode_control))
any_bytes = st.binary(max_size=600)


def wire_error_or_result(decode, data: bytes) -> None:
    try:
        decode(data)
    except WireError as e:
        assert "\n" not in str(e)  # one line, safe to log


@PROPERTY
@given(any_bytes | mangled(packet_bodies))
def test_no_bytes_crash_the_packet_decoder(data):
    wire_error_or_result(decode_packet, data)


@PROPERTY
@given(any_bytes | mangled(expert_bodies))
def test_no_bytes_crash_the_expert_call_decoder(data):
    wire_error_or_result(decode_expert_call, data)


@PROPERTY
@given(any_bytes | mangled(control_bodies) | st.text().map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_no_bytes_crash_the_control_decoder(data):
    wire_error_or_result(decode_control, data)


@PROPERTY
@given(st.lists(any_bytes | mangled(packets().map(encode_packet)), max_size=4), st.integers(1, 2**20))
def test_no_bytes_crash_the_frame_decoder(chunks, max_frame):
    decoder = FrameDecoder(max_frame=max_frame)

    def feed_all(_: bytes) -> None:
        for chunk in chunks:
            decoder.feed(chunk)
        decoder.finish()

    wire_error_or_result(feed_all, b"")


@pytest.mark.parametrize("body", [
    b'{"type": "stats", "n": ' + b"1" * 5000 + b"}",  # past Python's int digit limit: ValueError, not JSON's
    b'{"type": "stats", "x": 1e999999}',  # an infinity is a valid result, not an error
    b"[" * 100_000 + b"]" * 100_000,  # past the interpreter's recursion limit
    b'{"type": "\xed\xa0\x80"}',  # an encoded surrogate: not UTF-8
])
def test_control_messages_that_once_raised_something_else(body):
    wire_error_or_result(decode_control, body)



@PROPERTY
@given(st.integers(1, 6), st.integers(1, 8), st.floats(1e-3, 1e4), st.data())
def test_q8_0_rows_round_trip_within_half_a_step_and_re_encode_to_the_same_bytes(rows, blocks, scale, data):
    """q8_0 (ggml's block_q8_0: per 32 values an f16 scale and 32 int8): each value comes back within
    half a quantization step of its block (plus the scale's f16 rounding, coarse where the scale is
    an f16 subnormal: blocks whose largest value is below about 0.008), and what a receiver got
    encodes to the very same bytes again (a stage that passes q8_0 on adds no further error)."""
    x = data.draw(hnp.arrays(np.float32, (rows, 32 * blocks), elements=st.floats(-1, 1, width=32))) * np.float32(scale)
    packet = ActivationPacket(PacketKind.PREFILL, b"q" * 16, 1, 4, 0, x, DType.Q8_0)
    frame = encode_packet(packet)
    assert len(frame) - FRAME_HEADER.size - (len(encode_packet(replace(packet, data=x[:, :0], dtype=DType.F32)))
                                              - FRAME_HEADER.size) == rows * blocks * 34
    got = decode_packet(frame[FRAME_HEADER.size:]).data
    step = np.abs(x.reshape(rows, blocks, 32)).max(axis=2, keepdims=True) / 127
    err = np.abs(got.reshape(rows, blocks, 32) - x.reshape(rows, blocks, 32))
    scale_rounding = 127 * np.maximum(step * 2.0**-11, 2.0**-25)  # the scale's f16 rounding (subnormal: absolute)
    assert np.all(err <= step * 0.5 + scale_rounding * 1.01)
    again = encode_packet(replace(packet, data=got))
    assert again == frame


def test_q8_0_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(WireError, match="multiple of 32"):
        encode_packet(ActivationPacket(PacketKind.PREFILL, b"q" * 16, 1, 4, 0, np.zeros((1, 40), np.float32),
                                       DType.Q8_0))
