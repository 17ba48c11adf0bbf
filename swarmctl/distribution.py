"""Slice distribution: a trunk that lacks the model receives exactly its layers' tensors from a
member that has them, over the swarm's QUIC links, and keeps them on disk as a slice GGUF.

    trunk → host   {"type": "fetch_slice", "start", "stop", "have": ["3:0", ...]}
    host  → trunk  {"type": "manifest", ...}            the slice's metadata and tensor directory
                   DATA frames: tensor:u32 offset:u64 bytes   (1 MiB chunks not in "have")
                   {"type": "done"}                       then the stream ends

The trunk writes the GGUF header once (``*.gguf.part``), places each chunk at its offset, and
appends the chunk's id to ``*.part.progress``: an interrupted fetch resumes by telling the host
what it already has. When every chunk is there, each layer is checked against the plan's hash, and
only then is the file renamed into place. A node that already has the file uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec, layer_of
from net import messages as m
from net.protocol import SwarmProtocol
from net.wire import FrameType, WireError, encode_frame

log = logging.getLogger("swarmctl.distribution")

CHUNK = 1 << 20
CHUNK_HEADER = struct.Struct(">IQ")
SEND_BACKLOG = 4 * CHUNK
_SCALAR_TYPES = {bool: GGUFValueType.BOOL, int: GGUFValueType.INT64, float: GGUFValueType.FLOAT32,
                 str: GGUFValueType.STRING}


@dataclass
class TensorEntry:
    name: str
    shape: list[int]  # ggml order
    ggml_type: int
    n_bytes: int


@dataclass
class SliceManifest:
    model_hash: str
    start: int
    stop: int
    metadata: list[tuple[str, str, object]]  # (key, GGUF value type name, value): scalars only
    tensors: list[TensorEntry]

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def chunk_ids(self) -> list[str]:
        return [f"{i}:{j}" for i, t in enumerate(self.tensors) for j in range(-(-t.n_bytes // CHUNK))]

    def to_dict(self) -> dict:
        return {"model_hash": self.model_hash, "start": self.start, "stop": self.stop,
                "metadata": [list(m) for m in self.metadata], "tensors": [asdict(t) for t in self.tensors]}

    @classmethod
    def from_dict(cls, d: dict) -> "SliceManifest":
        return cls(str(d["model_hash"]), int(d["start"]), int(d["stop"]), [tuple(m) for m in d["metadata"]],
                   [TensorEntry(**t) for t in d["tensors"]])


# --- the side that has the model ---

def build_manifest(gguf: GGUFFile, start: int, stop: int, model_hash: str) -> SliceManifest:
    spec = ModelSpec.from_gguf(gguf)
    if not 0 <= start < stop <= spec.n_layer:
        raise EngineError(f"layer range [{start}, {stop}) is outside the model's {spec.n_layer} layers")
    metadata = []
    for key, value in gguf.metadata.items():
        if key.startswith("tokenizer.") or type(value) not in _SCALAR_TYPES or key == "general.architecture":
            continue  # a trunk needs hyper-parameters, not the vocabulary
        metadata.append((key, _SCALAR_TYPES[type(value)].name, value))
    if f"{spec.architecture}.vocab_size" not in gguf.metadata:  # the vocabulary array is not copied
        metadata.append((f"{spec.architecture}.vocab_size", GGUFValueType.UINT32.name, spec.n_vocab))
    metadata += [("swarmctl.slice.start", GGUFValueType.UINT32.name, start),
                 ("swarmctl.slice.stop", GGUFValueType.UINT32.name, stop),
                 ("general.architecture", GGUFValueType.STRING.name, spec.architecture)]
    names = [n for n in gguf.tensors if (il := layer_of(n)) is not None and start <= il < stop]
    names.sort(key=lambda n: (layer_of(n), n))
    tensors = [TensorEntry(n, list(gguf.tensors[n].shape), gguf.tensors[n].ggml_type, gguf.tensors[n].n_bytes)
               for n in names]
    return SliceManifest(model_hash, start, stop, metadata, tensors)


async def serve_slice(conn: SwarmProtocol, stream_id: int, gguf: GGUFFile, manifest: SliceManifest,
                      have: set[str]) -> int:
    """Send the manifest, then every chunk not in ``have``; returns the bytes sent."""
    conn.send(stream_id, m.encode(m.Manifest(manifest=manifest.to_dict())))
    sent = 0
    for i, entry in enumerate(manifest.tensors):
        data = gguf.tensor_bytes(gguf.tensors[entry.name])
        for j in range(-(-entry.n_bytes // CHUNK)):
            if f"{i}:{j}" in have:
                continue
            piece = bytes(data[j * CHUNK:(j + 1) * CHUNK])
            conn.send(stream_id, encode_frame(FrameType.DATA, CHUNK_HEADER.pack(i, j * CHUNK) + piece))
            sent += len(piece)
            await conn.drain(stream_id, SEND_BACKLOG)
            if not conn.is_open:
                return sent
    conn.send(stream_id, m.encode(m.Done(bytes=sent)), end=True)
    return sent


# --- the side that fetches ---

def slice_path(folder: Path, model_hash: str, start: int, stop: int) -> Path:
    return folder / f"{model_hash[:16]}-layers-{start}-{stop}.gguf"


class SliceFile:
    """A slice GGUF being written: the header at once, the data chunk by chunk, resumable."""

    def __init__(self, final: Path, manifest: SliceManifest) -> None:
        self.final = final
        self.manifest = manifest
        self.part = final.with_suffix(".gguf.part")
        self.progress = final.with_suffix(".part.progress")
        self.offsets: list[int] = []
        self.done: set[str] = set()
        self.received = 0  # bytes written in this session
        if self.part.exists() and self.progress.exists():
            self.done = set(self.progress.read_text().split())
        else:
            self._create()
        with GGUFFile(self.part) as gguf:  # where each tensor's data starts
            self.offsets = [gguf.tensors[t.name].offset for t in manifest.tensors]

    def _create(self) -> None:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        arch = next(str(v) for k, _, v in self.manifest.metadata if k == "general.architecture")
        writer = GGUFWriter(str(self.part), arch)
        for key, vtype, value in self.manifest.metadata:
            if key != "general.architecture":
                writer.add_key_value(key, value, GGUFValueType[vtype])
        for t in self.manifest.tensors:
            writer.add_tensor_info(t.name, list(reversed(t.shape)), np.dtype(np.float32), t.n_bytes,
                                   raw_dtype=GGMLQuantizationType(t.ggml_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        header = self.part.stat().st_size
        align = writer.data_alignment
        total = -(-header // align) * align + sum(-(-t.n_bytes // align) * align for t in self.manifest.tensors)
        os.truncate(self.part, total)
        self.progress.write_text("")

    def write(self, tensor: int, offset: int, data: bytes) -> None:
        entry = self.manifest.tensors[tensor]
        if offset % CHUNK or offset + len(data) > entry.n_bytes:
            raise EngineError(f"chunk at {offset} does not fit tensor {entry.name}")
        with open(self.part, "r+b") as f:
            f.seek(self.offsets[tensor] + offset)
            f.write(data)
        with open(self.progress, "a") as f:
            f.write(f"{tensor}:{offset // CHUNK}\n")
        self.done.add(f"{tensor}:{offset // CHUNK}")
        self.received += len(data)

    @property
    def complete(self) -> bool:
        return self.done >= set(self.manifest.chunk_ids())

    def finish(self, layer_hashes: list[str]) -> Path:
        """Check every layer against the plan's hash; only a verified file takes its final name."""
        with GGUFFile(self.part) as gguf:
            bad = [i for i in range(self.manifest.start, self.manifest.stop) if gguf.layer_hash(i) != layer_hashes[i]]
        if bad:
            self.part.unlink(missing_ok=True)
            self.progress.unlink(missing_ok=True)
            raise EngineError(f"fetched layers {bad[0]}..{bad[-1]} do not match the swarm's hashes; discarded")
        os.replace(self.part, self.final)
        self.progress.unlink(missing_ok=True)
        return self.final


async def fetch_slice(conn: SwarmProtocol, frames: asyncio.Queue, stream_id: int, folder: Path, *, model_hash: str,
                      start: int, stop: int, layer_hashes: list[str],
                      on_progress: Callable[[int, int], None] | None = None,
                      stop_after_bytes: int | None = None) -> tuple[Path, int]:
    """Fetch layers [start, stop) over ``conn``; frames for ``stream_id`` arrive on ``frames``.
    Returns the slice file and the bytes received. ``stop_after_bytes`` simulates a crash
    (for the resume test): the process exits abruptly once that many bytes are in."""
    final = slice_path(folder, model_hash, start, stop)
    if final.exists():
        return final, 0
    part = final.with_suffix(".gguf.part")
    progress = final.with_suffix(".part.progress")
    have = sorted(set(progress.read_text().split())) if part.exists() and progress.exists() else []
    conn.send(stream_id, m.encode(m.FetchSlice(start=start, stop=stop, have=have)))
    first = await asyncio.wait_for(frames.get(), 60)
    try:
        if first.type != FrameType.CONTROL:
            raise WireError("no manifest")
        manifest = SliceManifest.from_dict(m.decode(first.body, m.Manifest).manifest)
    except (m.Refused, WireError, KeyError, TypeError, ValueError) as e:
        raise EngineError(f"cannot fetch layers [{start}, {stop}): {e}") from None
    if manifest.model_hash != model_hash:
        raise EngineError("the host offered a slice of a different model")
    out = SliceFile(final, manifest)
    total, last_report = manifest.n_bytes, 0.0
    while True:
        frame = await asyncio.wait_for(frames.get(), 60)
        if frame.type == FrameType.CONTROL:
            try:
                m.decode(frame.body, m.Done)
                break
            except (m.Refused, WireError) as e:
                raise EngineError(f"slice transfer failed: {e}") from None
        if frame.type != FrameType.DATA or len(frame.body) < CHUNK_HEADER.size:
            raise EngineError("slice transfer sent something that is not a data chunk")
        tensor, offset = CHUNK_HEADER.unpack_from(frame.body)
        out.write(tensor, offset, frame.body[CHUNK_HEADER.size:])
        have_bytes = sum(_chunk_len(manifest, c) for c in out.done)
        if on_progress is not None and (time.monotonic() - last_report > 0.5 or have_bytes == total):
            on_progress(have_bytes, total)
            last_report = time.monotonic()
        if stop_after_bytes is not None and out.received >= stop_after_bytes:
            os._exit(3)  # a crash mid-transfer, for the resume test: no cleanup, no goodbye
    if not out.complete:
        raise EngineError("slice transfer ended with chunks missing")
    return out.finish(layer_hashes), out.received


def _chunk_len(manifest: SliceManifest, chunk_id: str) -> int:
    i, j = (int(x) for x in chunk_id.split(":"))
    return min(CHUNK, manifest.tensors[i].n_bytes - j * CHUNK)
