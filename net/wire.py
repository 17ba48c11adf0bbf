"""Bytes on the wire: frames on QUIC streams, activation packets, control messages.

Pure encode/decode, no I/O (like aioquic's QuicConnection): the protocol layer feeds received
bytes into a ``FrameDecoder`` and writes what ``encode_*`` returns.

    frame      := length:u32be  type:u8  body[length - 1]
    type 1     := control message, a UTF-8 JSON object with a "type" field
    type 3     := raw data (a chunk of a file being transferred; its meaning comes from the stream)
    type 2     := activation packet:

      version:u8  kind:u8  dtype:u8  flags:u8  request_id:16s     (flags: bit 0 on ERROR: RETRY;
                                                                 bit 1 REWIND, bit 2 VERIFY, bit 4
                                                                 ONE_STAGE on steps and results;
                                                                 bit 3 TRACE on any kind; bit 5
                                                                 PREFIX on END and PREFILL)
      plan_version:u32  layer_index:u32  start_pos:u32  n_tokens:u32  n_embd:u32
      reply_to_len:u8  reply_to:utf-8[reply_to_len]
      n_hops:u8  n_hops × (name_len:u8 name:utf-8 queued_us:u32 compute_us:u32 batch:u16)
      with TRACE only, for each hop in order:
        n_calls:u16  n_calls × (node_len:u8 node:utf-8 layer:u32 offset_us:u32 duration_us:u32
                                rows:u32 bytes:u32)
      with PREFIX only: prefix:16s
      data: n_tokens * n_embd little-endian IEEE 754 values (f32 or f16); for ERROR, UTF-8 text

Each stage a packet passes appends one hop record (how long the packet queued there, the compute
of the batch it ran in, and that batch's size), so the asker can split a token's latency into
compute per stage, queueing, and transfer (what is left of the round trip).

TRACE (``swarmctl ask --trace``) asks the stages for more: each hop also lists the expert calls
(expert parallelism) its stage made while computing that batch, each timed from the start of the
batch's compute on the stage's own clock, so no clocks need to agree. A packet without TRACE is
byte for byte what it was before the flag existed; the extra section costs bytes on every hop,
which is why only a traced request carries it.

PREFIX names a kept prefix, an id the asker chose (it says nothing of the tokens): on END, each
stage keeps the request's cells [0, start_pos) under that id, on its account, instead of freeing
them; on a request's first PREFILL at start_pos > 0, each stage takes up those cells, cut to
start_pos, as the request's cache, or refuses with RETRY when it holds none (the asker then
replays from position 0).

All integers in packets are little-endian; the frame length is big-endian (network order).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

DEFAULT_MAX_FRAME = 64 * 1024 * 1024  # bytes; a prefill chunk of 512 tokens × 8192 wide in f32 is 16 MiB
FRAME_HEADER = struct.Struct(">IB")  # length, type; the length counts the type byte and the body
PACKET_VERSION = 1
_PACKET_FIXED = struct.Struct("<BBBB16sIIIIIB")
_HOP = struct.Struct("<IIH")
FLAG_RETRY = 1
FLAG_REWIND = 2  # the step starts before the request's filled length: drop the cells from start_pos on
FLAG_VERIFY = 4  # a speculative check: every row attends on its own, as a one-token step (kernels/slice.Step)
FLAG_TRACE = 8  # the hop records carry their expert calls (see the module docstring)
FLAG_ONE_STAGE = 16  # a step that enters a stage and comes back from it on the same stream (a re-check)
FLAG_PREFIX = 32  # END: keep the cells as this prefix; PREFILL: start from it (see the module docstring)
PREFIX_ID_BYTES = 16
MAX_HOPS = 64
MAX_HOP_CALLS = 4096  # expert calls one hop may list (a 64-layer MoE step over 64 expert nodes)
_HOP_CALL = struct.Struct("<IIIII")


class WireError(Exception):
    """Bytes that are not a valid frame or packet. The message is one line, safe to log."""


class FrameType(enum.IntEnum):
    CONTROL = 1
    ACTIVATION = 2
    DATA = 3


class PacketKind(enum.IntEnum):
    PREFILL = 1  # activations of several prompt tokens
    DECODE = 2  # activations of one generated token
    RESULT = 3  # the last trunk stage's output, on its way back to the asker
    END = 4  # the request is over: free its state
    ERROR = 5  # data is a UTF-8 message


Q8_0_BLOCK = 32
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", Q8_0_BLOCK)])  # ggml's block_q8_0: 34 bytes per 32 values


class DType(enum.IntEnum):
    """How activations travel: f32 as computed, f16, or q8_0 (ggml's block_q8_0 layout: per 32
    values of a row an f16 scale and 32 signed bytes, x ~ q * d with d = max|x| / 127)."""

    F32 = 0
    F16 = 1
    Q8_0 = 2

    @classmethod
    def named(cls, name: str) -> "DType":
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown wire dtype {name!r}: choose f32, f16 or q8_0") from None

    @classmethod
    def in_plan(cls, name: str) -> "DType":
        """A hop's dtype as a plan names it; a name this version does not know (a newer host's) is
        taken as f32, as computed."""
        try:
            return cls.named(name)
        except ValueError:
            return cls.F32

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def bytes_per_value(self) -> float:
        """What one activation costs on the wire (q8_0: an f16 scale per block of 32 int8)."""
        return {DType.F32: 4.0, DType.F16: 2.0, DType.Q8_0: (2 + Q8_0_BLOCK) / Q8_0_BLOCK}[self]

    @property
    def numpy(self) -> np.dtype:
        """The element type of an f32 or f16 payload (q8_0 travels in blocks, not elements)."""
        if self is DType.Q8_0:
            raise ValueError("q8_0 activations travel in blocks, not as one numpy element type")
        return np.dtype("<f4") if self is DType.F32 else np.dtype("<f2")

    def nbytes(self, n_tokens: int, n_embd: int) -> int:
        if self is DType.Q8_0:
            return n_tokens * (n_embd // Q8_0_BLOCK) * _Q8_0.itemsize
        return n_tokens * n_embd * (4 if self is DType.F32 else 2)

    def encode(self, data: np.ndarray) -> bytes:
        """A [n_tokens, n_embd] array as this type's bytes."""
        if self is not DType.Q8_0:
            return np.ascontiguousarray(data, dtype="<f4" if self is DType.F32 else "<f2").tobytes()
        n_tokens, n_embd = data.shape
        if n_embd % Q8_0_BLOCK:
            raise WireError(f"q8_0 carries rows whose width is a multiple of {Q8_0_BLOCK}, not {n_embd}")
        x = np.asarray(data, dtype=np.float32).reshape(n_tokens, n_embd // Q8_0_BLOCK, Q8_0_BLOCK)
        d = (np.abs(x).max(axis=2) / 127.0).astype(np.float16)
        # Quantized against the scale as stored (not ggml's f32 one): a receiver's rows encode to
        # the same bytes again, and a scale that underflows f16 gives a block of zeros.
        stored = d.astype(np.float32)
        inverse = np.divide(1.0, stored, out=np.zeros_like(stored), where=stored > 0)
        q = np.clip(np.rint(x * inverse[..., None]), -127, 127)
        # Each block's largest value is ±127 steps exactly (the f16 scale's rounding could make it
        # 126 or 128): then what a receiver decodes has the very same scale, and re-encodes alike.
        top = np.abs(x).argmax(axis=2)[..., None]
        top_sign = np.sign(np.take_along_axis(x, top, axis=2))
        np.put_along_axis(q, top, np.where(stored[..., None] > 0, top_sign * 127, 0), axis=2)
        blocks = np.empty(d.shape, dtype=_Q8_0)
        blocks["d"] = d
        blocks["qs"] = q.astype(np.int8)
        return blocks.tobytes()

    def decode(self, payload: bytes, n_tokens: int, n_embd: int) -> np.ndarray:
        """The array the bytes carry: a view for f32 and f16, dequantized f32 for q8_0."""
        if self is not DType.Q8_0:
            return np.frombuffer(payload, dtype="<f4" if self is DType.F32 else "<f2").reshape(n_tokens, n_embd)
        blocks = np.frombuffer(payload, dtype=_Q8_0).reshape(n_tokens, n_embd // Q8_0_BLOCK)
        x = blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[..., None]
        return x.reshape(n_tokens, n_embd)

    def as_received(self, data: np.ndarray) -> np.ndarray:
        """What the receiver of ``data`` sent in this type gets, as f32."""
        if self is DType.F32:
            return np.asarray(data, dtype=np.float32)
        return np.asarray(self.decode(self.encode(data), *data.shape), dtype=np.float32)


@dataclass(frozen=True)
class HopCall:
    """An expert call a stage made while computing a batch: to which node, for which layer, when
    (from the start of the batch's compute, on the stage's clock) and for how long (the stage's
    wait: both crossings and the expert node's compute), with the rows and bytes it carried."""

    node: str  # the expert node's member name
    layer: int
    offset_us: int
    duration_us: int
    rows: int
    bytes: int  # request and reply frames together


@dataclass(frozen=True)
class Hop:
    """What one stage did with a packet."""

    stage: str  # member name
    queued_us: int
    compute_us: int
    batch: int  # requests in the batch it ran in
    calls: tuple[HopCall, ...] = ()  # only on traced packets (FLAG_TRACE)


@dataclass
class ActivationPacket:
    kind: PacketKind
    request_id: bytes  # 16 random bytes
    plan_version: int
    layer_index: int  # first layer the receiver runs
    start_pos: int  # position of the first token
    data: np.ndarray  # [n_tokens, n_embd] float32 or float16; empty for END / ERROR
    dtype: DType = DType.F32
    reply_to: str = ""  # where the RESULT goes: the asker's session from the asker, "member/session" between stages
    message: str = ""  # ERROR only
    hops: tuple[Hop, ...] = ()
    retry: bool = False  # ERROR only: the route failed, not the request; resend it under a new plan
    rewind: bool = False  # steps: FLAG_REWIND
    verify: bool = False  # steps: FLAG_VERIFY
    trace: bool = False  # FLAG_TRACE: stages list their expert calls in their hop records
    one_stage: bool = False  # steps: FLAG_ONE_STAGE, the RESULT comes back from the stage it entered
    prefix: bytes = b""  # FLAG_PREFIX on END and PREFILL: a kept prefix's id (16 bytes), or none

    @property
    def n_tokens(self) -> int:
        return int(self.data.shape[0]) if self.data.ndim == 2 else 0


@dataclass
class Frame:
    type: FrameType
    body: bytes


# --- frames ---

def encode_frame(frame_type: FrameType, body: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if len(body) + 1 > max_frame:
        raise WireError(f"frame of {len(body) + 1} bytes exceeds the maximum of {max_frame}")
    return FRAME_HEADER.pack(len(body) + 1, frame_type) + body


@dataclass
class FrameDecoder:
    """Buffers a stream's bytes until its framing says a frame is complete."""

    max_frame: int = DEFAULT_MAX_FRAME
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= FRAME_HEADER.size:
            length, ftype = FRAME_HEADER.unpack_from(self._buffer)
            if length == 0 or length > self.max_frame:
                raise WireError(f"frame length {length} is outside (0, {self.max_frame}]")
            if ftype not in FrameType._value2member_map_:
                raise WireError(f"unknown frame type {ftype}")
            end = FRAME_HEADER.size - 1 + length  # the length counts the type byte, which the header holds
            if len(self._buffer) < end:
                break
            frames.append(Frame(FrameType(ftype), bytes(self._buffer[FRAME_HEADER.size:end])))
            del self._buffer[:end]
        return frames

    def finish(self) -> None:
        """The stream ended: anything still buffered is a truncated frame."""
        if self._buffer:
            raise WireError(f"stream ended inside a frame ({len(self._buffer)} bytes left over)")

    @property
    def buffered(self) -> int:
        return len(self._buffer)


# --- activation packets ---

def encode_packet(p: ActivationPacket, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if p.kind == PacketKind.ERROR:
        payload = p.message.encode("utf-8")
        n_tokens = n_embd = 0
    elif p.kind == PacketKind.END:
        payload, n_tokens, n_embd = b"", 0, 0
    else:
        if p.data.ndim != 2:
            raise WireError("activations must be a 2-D array [n_tokens, n_embd]")
        n_tokens, n_embd = p.data.shape
        payload = p.dtype.encode(p.data)
    reply = p.reply_to.encode("utf-8")
    if len(reply) > 255 or len(p.request_id) != 16 or len(p.hops) > MAX_HOPS:
        raise WireError("reply_to longer than 255 bytes, request_id not 16 bytes, or too many hops")
    if p.kind == PacketKind.ERROR:
        flags = FLAG_RETRY if p.retry else 0
    else:
        flags = (FLAG_REWIND if p.rewind else 0) | (FLAG_VERIFY if p.verify else 0) | \
            (FLAG_ONE_STAGE if p.one_stage else 0)
    if p.trace:
        flags |= FLAG_TRACE
    elif any(hop.calls for hop in p.hops):
        raise WireError("expert-call records ride only on traced packets")
    if p.prefix:
        if p.kind not in (PacketKind.END, PacketKind.PREFILL) or len(p.prefix) != PREFIX_ID_BYTES:
            raise WireError(f"a prefix id is {PREFIX_ID_BYTES} bytes, on END and PREFILL packets only")
        flags |= FLAG_PREFIX
    header = _PACKET_FIXED.pack(PACKET_VERSION, p.kind, p.dtype, flags, p.request_id, p.plan_version, p.layer_index,
                                p.start_pos, n_tokens, n_embd, len(reply))
    hops = [bytes([len(p.hops)])]
    for hop in p.hops:
        name = hop.stage.encode("utf-8")[:255]
        hops += [bytes([len(name)]), name, _HOP.pack(min(hop.queued_us, 2**32 - 1), min(hop.compute_us, 2**32 - 1),
                                                      min(hop.batch, 2**16 - 1))]
    if p.trace:
        hops += [_encode_calls(hop.calls) for hop in p.hops]
    if p.prefix:
        hops.append(p.prefix)
    return encode_frame(FrameType.ACTIVATION, header + reply + b"".join(hops) + payload, max_frame)


def _encode_calls(calls: tuple[HopCall, ...]) -> bytes:
    if len(calls) > MAX_HOP_CALLS:
        raise WireError(f"a hop lists {len(calls)} expert calls; at most {MAX_HOP_CALLS} fit")
    parts = [struct.pack("<H", len(calls))]
    for call in calls:
        node = call.node.encode("utf-8")[:255]
        parts += [bytes([len(node)]), node, _HOP_CALL.pack(*(min(max(v, 0), 2**32 - 1) for v in (
            call.layer, call.offset_us, call.duration_us, call.rows, call.bytes)))]
    return b"".join(parts)


def decode_packet(body: bytes) -> ActivationPacket:
    if len(body) < _PACKET_FIXED.size:
        raise WireError(f"activation packet of {len(body)} bytes is shorter than its header")
    (version, kind, dtype, flags, request_id, plan_version, layer_index, start_pos, n_tokens, n_embd,
     reply_len) = _PACKET_FIXED.unpack_from(body)
    if version != PACKET_VERSION:
        raise WireError(f"unsupported packet version {version}")
    if kind not in PacketKind._value2member_map_ or dtype not in DType._value2member_map_:
        raise WireError(f"unknown packet kind {kind} or dtype {dtype}")
    kind, dtype = PacketKind(kind), DType(dtype)
    offset = _PACKET_FIXED.size + reply_len
    if len(body) < offset:
        raise WireError("activation packet ends inside its reply_to field")
    reply_to = body[_PACKET_FIXED.size:offset].decode("utf-8", errors="replace")
    hops, offset = _decode_hops(body, offset)
    trace = bool(flags & FLAG_TRACE)
    if trace:
        hops, offset = _decode_calls(body, offset, hops)
    prefix = b""
    if flags & FLAG_PREFIX:
        if kind not in (PacketKind.END, PacketKind.PREFILL) or len(body) < offset + PREFIX_ID_BYTES:
            raise WireError("a prefix id rides only on END and PREFILL packets, whole")
        prefix, offset = body[offset:offset + PREFIX_ID_BYTES], offset + PREFIX_ID_BYTES
    payload = body[offset:]
    if kind == PacketKind.ERROR:
        return ActivationPacket(kind, request_id, plan_version, layer_index, start_pos, np.empty((0, 0), np.float32),
                                dtype, reply_to, payload.decode("utf-8", errors="replace")[:500], hops,
                                bool(flags & FLAG_RETRY), trace=trace)
    if dtype is DType.Q8_0 and n_embd % Q8_0_BLOCK:
        raise WireError(f"q8_0 activations of width {n_embd}: not a multiple of {Q8_0_BLOCK}")
    expected = dtype.nbytes(n_tokens, n_embd)
    if len(payload) != expected:
        raise WireError(f"activation data has {len(payload)} bytes; shape [{n_tokens}, {n_embd}] "
                        f"in {dtype.name.lower()} needs {expected}")
    if kind in (PacketKind.PREFILL, PacketKind.DECODE, PacketKind.RESULT) and n_tokens == 0:
        raise WireError("activation packet carries no tokens")
    data = dtype.decode(payload, n_tokens, n_embd)
    return ActivationPacket(kind, request_id, plan_version, layer_index, start_pos, data, dtype, reply_to, "", hops,
                            rewind=bool(flags & FLAG_REWIND), verify=bool(flags & FLAG_VERIFY), trace=trace,
                            one_stage=bool(flags & FLAG_ONE_STAGE), prefix=prefix)


def _decode_hops(body: bytes, offset: int) -> tuple[tuple[Hop, ...], int]:
    if offset >= len(body):
        raise WireError("activation packet ends before its hop records")
    count, offset = body[offset], offset + 1
    if count > MAX_HOPS:  # (a stage could not append its own record and send the packet on)
        raise WireError(f"a packet lists {count} hops; at most {MAX_HOPS} fit")
    hops = []
    for _ in range(count):
        name, values, offset = _named_record(body, offset, _HOP, "hop records")
        hops.append(Hop(name, *values))
    return tuple(hops), offset


def _named_record(body: bytes, offset: int, layout: struct.Struct, what: str) -> tuple[str, tuple, int]:
    """One record of a name (u8 length, UTF-8) and fixed fields: (name, fields, offset after it)."""
    if offset >= len(body):
        raise WireError(f"activation packet ends inside its {what}")
    name_len = body[offset]
    end = offset + 1 + name_len + layout.size
    if end > len(body):
        raise WireError(f"activation packet ends inside its {what}")
    name = body[offset + 1:offset + 1 + name_len].decode("utf-8", errors="replace")
    return name, layout.unpack_from(body, offset + 1 + name_len), end


def _decode_calls(body: bytes, offset: int, hops: tuple[Hop, ...]) -> tuple[tuple[Hop, ...], int]:
    """A traced packet's expert-call lists, one per hop, in the hops' order."""
    with_calls = []
    for hop in hops:
        if offset + 2 > len(body):
            raise WireError("activation packet ends inside its expert-call records")
        (count,), offset = struct.unpack_from("<H", body, offset), offset + 2
        if count > MAX_HOP_CALLS:
            raise WireError(f"a hop lists {count} expert calls; at most {MAX_HOP_CALLS} fit")
        calls = []
        for _ in range(count):
            node, values, offset = _named_record(body, offset, _HOP_CALL, "expert-call records")
            calls.append(HopCall(node, *values))
        with_calls.append(replace(hop, calls=tuple(calls)))
    return tuple(with_calls), offset


# --- control messages ---

def encode_control(message: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if "type" not in message:
        raise WireError("control message without a type")
    return encode_frame(FrameType.CONTROL, json.dumps(message, separators=(",", ":")).encode("utf-8"), max_frame)


MAX_CONTROL_BYTES = 4 * 1024 * 1024  # what any member may send us in one control message
# A fetch's manifest (swarmctl/model_files/distribution.py), read only from the host: a model's metadata with its
# tokenizer (Kimi K2's: several MB) and a hash per MiB of the tensors fetched.
MAX_MANIFEST_BYTES = 48 * 1024 * 1024


def decode_control(body: bytes, max_bytes: int = MAX_CONTROL_BYTES) -> dict[str, Any]:
    if len(body) > max_bytes:
        raise WireError(f"control message of {len(body)} bytes is over the {max_bytes} limit")
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"control message is not UTF-8 JSON ({type(e).__name__})") from None
    except ValueError:  # an integer past Python's digit limit (sys.get_int_max_str_digits): hostile, never ours
        raise WireError("control message holds a number too long to read") from None
    except RecursionError:  # nesting deeper than the interpreter's stack: hostile, never ours
        raise WireError("control message is nested too deeply") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise WireError("control message is not a JSON object with a string 'type'")
    return message


# --- expert calls (expert parallelism): a stage sends rows to the node holding their experts ---

_EXPERT_HEADER = struct.Struct(">BIII")  # kind, layer, rows, width


class ExpertCallKind(enum.IntEnum):
    REQUEST = 1  # ids int32[rows], then data f32[rows, width]
    REPLY = 2  # data f32[rows, width]
    ERROR = 3  # a UTF-8 message


@dataclass
class ExpertCall:
    kind: ExpertCallKind
    layer: int
    data: np.ndarray  # [rows, width] float32 (empty for ERROR)
    expert_ids: np.ndarray | None = None  # int32 [rows], REQUEST only
    message: str = ""


def encode_expert_call(call: ExpertCall, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if call.kind == ExpertCallKind.ERROR:
        body = _EXPERT_HEADER.pack(call.kind, call.layer, 0, 0) + call.message.encode("utf-8")
        return encode_frame(FrameType.DATA, body, max_frame)
    data = np.ascontiguousarray(call.data, dtype="<f4")
    rows, width = data.shape
    parts = [_EXPERT_HEADER.pack(call.kind, call.layer, rows, width)]
    if call.kind == ExpertCallKind.REQUEST:
        ids = np.ascontiguousarray(call.expert_ids, dtype="<i4").reshape(-1)
        if ids.size != rows:
            raise WireError("an expert call needs one expert id per row")
        parts.append(ids.tobytes())
    parts.append(data.tobytes())
    return encode_frame(FrameType.DATA, b"".join(parts), max_frame)


def decode_expert_call(body: bytes) -> ExpertCall:
    if len(body) < _EXPERT_HEADER.size:
        raise WireError("expert call shorter than its header")
    kind, layer, rows, width = _EXPERT_HEADER.unpack_from(body)
    if kind not in ExpertCallKind._value2member_map_:
        raise WireError(f"unknown expert call kind {kind}")
    kind = ExpertCallKind(kind)
    rest = body[_EXPERT_HEADER.size:]
    if kind == ExpertCallKind.ERROR:
        return ExpertCall(kind, layer, np.empty((0, 0), np.float32), None, rest.decode("utf-8", errors="replace")[:500])
    ids = None
    if kind == ExpertCallKind.REQUEST:
        if len(rest) < 4 * rows:
            raise WireError("expert call ends inside its expert ids")
        ids, rest = np.frombuffer(rest[:4 * rows], dtype="<i4"), rest[4 * rows:]
    if len(rest) != 4 * rows * width or rows == 0:
        raise WireError(f"expert call data has {len(rest)} bytes; [{rows}, {width}] f32 needs {4 * rows * width}")
    return ExpertCall(kind, layer, np.frombuffer(rest, dtype="<f4").reshape(rows, width), ids)
