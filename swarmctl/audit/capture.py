"""A trunk stage's capture files, read back as the attacker reads them.

``swarmctl run --role trunk --capture DIR`` keeps every frame the stage receives and sends as
``NNNNNN-{recv|send}-{activation|control}.bin``: exactly what a curious member running that stage
has in hand. This module turns those bytes into per-request streams of activations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from net.wire import ActivationPacket, PacketKind, WireError, decode_packet

_NAME = re.compile(r"^(\d+)-(recv|send)-activation\.bin$")


@dataclass(frozen=True)
class CapturedPacket:
    seq: int  # order in which the stage saw it
    direction: str  # "recv" or "send"
    packet: ActivationPacket


@dataclass
class Chunk:
    start_pos: int
    data: np.ndarray  # [n_tokens, n_embd] float32
    kind: PacketKind


@dataclass
class ObservedStream:
    """One request's activations at one layer boundary, in the order the stage saw them."""

    request_id: bytes
    layer_index: int  # the first layer run on these activations
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def n_positions(self) -> int:
        return max((c.start_pos + len(c.data) for c in self.chunks), default=0)

    @property
    def n_prefill(self) -> int:
        """Positions that arrived in prefill packets: the prompt, as the stage can tell."""
        return max((c.start_pos + len(c.data) for c in self.chunks if c.kind == PacketKind.PREFILL), default=0)

    def states(self) -> np.ndarray:
        """[n_positions, n_embd]: one row per position (a later chunk overwrites, as a rewind would)."""
        if not self.chunks:
            return np.empty((0, 0), np.float32)
        out = np.full((self.n_positions, self.chunks[0].data.shape[1]), np.nan, np.float32)
        for c in self.chunks:
            out[c.start_pos:c.start_pos + len(c.data)] = c.data
        return out

    @property
    def complete(self) -> bool:
        """Every position from 0 on was seen (inversion needs the whole prefix)."""
        return bool(self.chunks) and not np.isnan(self.states()).any()


def read_capture(files: Iterable[Path]) -> list[CapturedPacket]:
    """Activation packets from capture files, in capture order; control frames and undecodable
    bytes are skipped (a stage keeps what it was sent, valid or not)."""
    packets = []
    for path in files:
        m = _NAME.match(Path(path).name)
        if not m:
            continue
        try:
            packet = decode_packet(Path(path).read_bytes())
        except WireError:
            continue
        packets.append(CapturedPacket(int(m.group(1)), m.group(2), packet))
    return sorted(packets, key=lambda p: p.seq)


def capture_files(folder: Path) -> set[Path]:
    return set(Path(folder).iterdir())


def _streams(packets: Iterable[CapturedPacket], direction: str, kinds: set[PacketKind]) -> list[ObservedStream]:
    streams: dict[tuple[bytes, int], ObservedStream] = {}
    for cp in packets:
        p = cp.packet
        if cp.direction != direction or p.kind not in kinds or p.n_tokens == 0:
            continue
        key = (p.request_id, p.layer_index)
        stream = streams.setdefault(key, ObservedStream(p.request_id, p.layer_index))
        stream.chunks.append(Chunk(p.start_pos, np.asarray(p.data, dtype=np.float32), p.kind))
    return list(streams.values())


def received_streams(packets: Iterable[CapturedPacket]) -> list[ObservedStream]:
    """What the stage was handed to compute on (for the first stage: the asker's head output)."""
    return _streams(packets, "recv", {PacketKind.PREFILL, PacketKind.DECODE})


def result_streams(packets: Iterable[CapturedPacket]) -> list[ObservedStream]:
    """What the stage sent back to the asker as results (only the last stage does)."""
    return _streams(packets, "send", {PacketKind.RESULT})
