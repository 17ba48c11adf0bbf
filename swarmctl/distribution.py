"""Slice distribution: a member that lacks the model receives exactly the tensors it runs from a
member that has them, over the swarm's QUIC links, and keeps them on disk as a GGUF of its own:
a trunk its layers, an asker with no model file its part (the embedding, its head and tail layers,
the output norm and LM head, the whole metadata with the tokenizer).

    trunk → host   {"type": "fetch_slice", "start", "stop", "have": ["3:0", ...]}
    asker → host   {"type": "fetch_asker_part", "head_layers", "have": [...]}
    host  → member {"type": "manifest", ...}   the file's metadata section, tensor directory and
                                               the SHA-256 of every 1 MiB chunk of every tensor
                   DATA frames: tensor:u32 offset:u64 bytes   (1 MiB chunks not in "have")
                   {"type": "done"}                       then the stream ends

The member writes the GGUF header once (``*.gguf.part``), checks each chunk against its hash
before it places it at its offset (a wrong chunk ends the fetch: ``WrongChunk``), and appends the
chunk's id to ``*.part.progress``: an interrupted fetch resumes by telling the host what it already
has. When every chunk is there, each tensor (and each of a slice's layers, against the plan's
hash) is checked again, and only then is the file renamed into place. A node that already has the
file uses it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from gguf import GGUFValueType

from kernels.errors import EngineError
from kernels.gguf_file import DEFAULT_ALIGNMENT, HASH_CHUNK, GGUFFile, encode_kv, tensor_hash_of, write_header
from kernels.spec import ModelSpec, layer_of
from net import messages as m
from net.protocol import SwarmProtocol
from net.wire import MAX_MANIFEST_BYTES, FrameType, WireError, encode_frame

log = logging.getLogger("swarmctl.distribution")

CHUNK = HASH_CHUNK  # a chunk on the wire is a hashed chunk: each is checked on its own
CHUNK_HEADER = struct.Struct(">IQ")
SEND_BACKLOG = 4 * CHUNK


@dataclass
class TensorEntry:
    name: str
    shape: list[int]  # ggml order
    ggml_type: int
    n_bytes: int
    chunks: list[str]  # SHA-256 of each CHUNK of its bytes, from the host's hashes

    @property
    def hash(self) -> str:
        return tensor_hash_of(self.name, self.ggml_type, self.shape, self.chunks)


@dataclass
class SliceManifest:
    """What a member fetches: layers [start, stop) of the trunk (kind "layers"), or an asker's part
    (kind "asker", start = stop = its head layers K: the embedding, layers [0, K) and [L-K, L), the
    output norm and LM head, and the whole metadata with the tokenizer and chat template). The
    metadata section comes as the host's file holds it; each tensor with its chunks' hashes."""

    model_hash: str
    kind: str
    start: int
    stop: int
    n_kv: int
    kv: bytes  # the GGUF metadata section of the file to write
    alignment: int
    tensors: list[TensorEntry]

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def describe(self) -> str:
        return f"layers [{self.start}, {self.stop})" if self.kind == "layers" else \
            f"the asker's part ({self.start} layers at each end)"

    def chunk_ids(self) -> list[str]:
        return [f"{i}:{j}" for i, t in enumerate(self.tensors) for j in range(-(-t.n_bytes // CHUNK))]

    def to_dict(self) -> dict:
        return {"model_hash": self.model_hash, "kind": self.kind, "start": self.start, "stop": self.stop,
                "n_kv": self.n_kv, "kv": base64.b64encode(self.kv).decode(), "alignment": self.alignment,
                "tensors": [asdict(t) for t in self.tensors]}

    @classmethod
    def from_dict(cls, d: dict) -> "SliceManifest":
        tensors = [TensorEntry(str(t["name"]), [int(x) for x in t["shape"]], int(t["ggml_type"]), int(t["n_bytes"]),
                               [str(h) for h in t["chunks"]]) for t in d["tensors"]]
        for t in tensors:
            if t.n_bytes < 0 or len(t.chunks) != -(-t.n_bytes // CHUNK):
                raise ValueError(f"tensor {t.name}: {len(t.chunks)} chunk hashes for {t.n_bytes} bytes")
        kind = str(d["kind"])
        if kind not in ("layers", "asker"):
            raise ValueError(f"unknown kind {kind!r}")
        alignment = int(d["alignment"])
        if not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment}")
        return cls(str(d["model_hash"]), kind, int(d["start"]), int(d["stop"]), int(d["n_kv"]),
                   base64.b64decode(d["kv"], validate=True), alignment, tensors)


# --- the side that fetches ---

def slice_path(folder: Path, model_hash: str, start: int, stop: int) -> Path:
    return folder / f"{model_hash[:16]}-layers-{start}-{stop}.gguf"


def asker_part_path(folder: Path, model_hash: str, head_layers: int) -> Path:
    return folder / f"{model_hash[:16]}-asker-{head_layers}.gguf"


class WrongChunk(EngineError):
    """A chunk whose bytes do not hash to the host's hash for it: whoever sent it is not trusted
    again for this fetch. Nothing of it is written."""


class SliceFile:
    """A slice GGUF being written: the header at once, the data chunk by chunk, each chunk checked
    against its hash before it is written, resumable."""

    def __init__(self, final: Path, manifest: SliceManifest) -> None:
        self.final = final
        self.manifest = manifest
        self.part = final.with_suffix(".gguf.part")
        self.progress = final.with_suffix(".part.progress")
        self.offsets: list[int] = []
        self.done: set[str] = set()
        self.received = 0  # bytes written in this session
        if self.part.exists() and self.progress.exists():
            self.done = set(self.progress.read_text().split()) & set(manifest.chunk_ids())
        else:
            self._create()
        with GGUFFile(self.part) as gguf:  # where each tensor's data starts
            self.offsets = [gguf.tensors[t.name].offset for t in manifest.tensors]

    def _create(self) -> None:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        write_header(self.part, self.manifest.n_kv, self.manifest.kv,
                     [(t.name, tuple(t.shape), t.ggml_type, t.n_bytes) for t in self.manifest.tensors],
                     self.manifest.alignment)
        self.progress.write_text("")

    def check(self, tensor: int, offset: int, data: bytes) -> None:
        """Raises WrongChunk unless ``data`` is the chunk at ``offset`` of tensor #``tensor``."""
        if not 0 <= tensor < len(self.manifest.tensors):
            raise WrongChunk(f"a chunk of tensor #{tensor}, which the slice does not have")
        entry = self.manifest.tensors[tensor]
        if offset % CHUNK or offset >= entry.n_bytes or len(data) != min(CHUNK, entry.n_bytes - offset):
            raise WrongChunk(f"a chunk at {offset} of {len(data)} bytes does not fit tensor {entry.name}")
        if hashlib.sha256(data).hexdigest() != entry.chunks[offset // CHUNK]:
            raise WrongChunk(f"chunk {offset // CHUNK} of tensor {entry.name} does not match the host's hash")

    def write(self, tensor: int, offset: int, data: bytes) -> None:
        self.check(tensor, offset, data)
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
        """Check every tensor against its hash (and, for layers, each layer against the plan's);
        only a verified file takes its final name."""
        with GGUFFile(self.part) as gguf:
            bad = [t.name for t in self.manifest.tensors if gguf.tensor_hash(t.name) != t.hash]
            layers = range(self.manifest.start, self.manifest.stop) if self.manifest.kind == "layers" else ()
            bad_layers = [i for i in layers if gguf.layer_hash(i) != layer_hashes[i]]
        if bad or bad_layers:
            self.part.unlink(missing_ok=True)
            self.progress.unlink(missing_ok=True)
            what = f"tensor {bad[0]} does" if bad else f"layers {bad_layers[0]}..{bad_layers[-1]} do"
            raise EngineError(f"fetched {what} not match the swarm's hashes; discarded")
        os.replace(self.part, self.final)
        self.progress.unlink(missing_ok=True)
        return self.final


# --- the side that has the model ---

def _trunk_keeps(key: str) -> bool:
    """Metadata a trunk's slice carries: not the vocabulary or chat template (the asker's)."""
    return not key.startswith("tokenizer.") and key != "general.architecture"


def build_manifest(gguf: GGUFFile, start: int, stop: int, model_hash: str,
                   chunk_hashes: Mapping[str, list[str]] | None = None) -> SliceManifest:
    """Layers [start, stop) for a trunk. ``chunk_hashes``: the host's (read now where not given)."""
    spec = ModelSpec.from_gguf(gguf)
    if not 0 <= start < stop <= spec.n_layer:
        raise EngineError(f"layer range [{start}, {stop}) is outside the model's {spec.n_layer} layers")
    n_kv, kv = gguf.raw_metadata(_trunk_keeps)
    extra = [("swarmctl.slice.start", start, GGUFValueType.UINT32),
             ("swarmctl.slice.stop", stop, GGUFValueType.UINT32)]
    if f"{spec.architecture}.vocab_size" not in gguf.metadata:  # the vocabulary array is not copied
        extra.append((f"{spec.architecture}.vocab_size", spec.n_vocab, GGUFValueType.UINT32))
    kv = encode_kv("general.architecture", spec.architecture, GGUFValueType.STRING) + kv + \
        b"".join(encode_kv(*e) for e in extra)
    names = [n for n in gguf.tensors if (il := layer_of(n)) is not None and start <= il < stop]
    names.sort(key=lambda n: (layer_of(n), n))
    return SliceManifest(model_hash, "layers", start, stop, n_kv + len(extra) + 1, kv, _alignment(gguf),
                         _entries(gguf, names, chunk_hashes))


def asker_tensor_names(gguf: GGUFFile, head_layers: int) -> list[str]:
    """What an asker keeping ``head_layers`` at each end runs: every tensor outside the trunk's
    layers (the embedding, output norm and LM head, any multi-token-prediction layer after the
    last) and its head and tail layers."""
    spec = ModelSpec.from_gguf(gguf)
    trunk = range(head_layers, spec.n_layer - head_layers)
    names = [n for n in gguf.tensors if (il := layer_of(n)) is None or il not in trunk]
    return sorted(names, key=lambda n: (-1 if layer_of(n) is None else layer_of(n), n))


def build_asker_manifest(gguf: GGUFFile, head_layers: int, model_hash: str,
                         chunk_hashes: Mapping[str, list[str]] | None = None) -> SliceManifest:
    spec = ModelSpec.from_gguf(gguf)
    if not 0 <= head_layers <= spec.n_layer // 2:
        raise EngineError(f"{head_layers} head layers do not fit the model's {spec.n_layer}")
    n_kv, kv = gguf.raw_metadata()
    return SliceManifest(model_hash, "asker", head_layers, head_layers, n_kv, kv, _alignment(gguf),
                         _entries(gguf, asker_tensor_names(gguf, head_layers), chunk_hashes))


def _alignment(gguf: GGUFFile) -> int:
    return int(gguf.metadata.get("general.alignment", DEFAULT_ALIGNMENT))


def _entries(gguf: GGUFFile, names: list[str], chunk_hashes: Mapping[str, list[str]] | None) -> list[TensorEntry]:
    known = chunk_hashes or {}
    return [TensorEntry(n, list(gguf.tensors[n].shape), gguf.tensors[n].ggml_type, gguf.tensors[n].n_bytes,
                        list(known[n]) if n in known else gguf.chunk_hashes(n)) for n in names]


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


async def fetch_slice(conn: SwarmProtocol, frames: asyncio.Queue, stream_id: int, folder: Path, *, model_hash: str,
                      start: int, stop: int, layer_hashes: list[str],
                      on_progress: Callable[[int, int], None] | None = None,
                      stop_after_bytes: int | None = None) -> tuple[Path, int]:
    """Fetch layers [start, stop) over ``conn``; frames for ``stream_id`` arrive on ``frames``.
    Returns the slice file and the bytes received. ``stop_after_bytes`` simulates a crash
    (for the resume test): the process exits abruptly once that many bytes are in."""
    final = slice_path(folder, model_hash, start, stop)
    return await _fetch(conn, frames, stream_id, final, lambda have: m.FetchSlice(start=start, stop=stop, have=have),
                        f"layers [{start}, {stop})", model_hash, layer_hashes, on_progress, stop_after_bytes)


async def fetch_asker_part(conn: SwarmProtocol, frames: asyncio.Queue, stream_id: int, folder: Path, *,
                           model_hash: str, head_layers: int,
                           on_progress: Callable[[int, int], None] | None = None) -> tuple[Path, int]:
    """Fetch what an asker keeping ``head_layers`` at each end runs (``build_asker_manifest``)."""
    final = asker_part_path(folder, model_hash, head_layers)
    return await _fetch(conn, frames, stream_id, final,
                        lambda have: m.FetchAskerPart(head_layers=head_layers, have=have),
                        "the asker's part of the model", model_hash, [], on_progress, None)


async def _fetch(conn: SwarmProtocol, frames: asyncio.Queue, stream_id: int, final: Path,
                 request: Callable[[list[str]], m.Message], what: str, model_hash: str, layer_hashes: list[str],
                 on_progress: Callable[[int, int], None] | None, stop_after_bytes: int | None) -> tuple[Path, int]:
    if final.exists():
        return final, 0
    part = final.with_suffix(".gguf.part")
    progress = final.with_suffix(".part.progress")
    have = sorted(set(progress.read_text().split())) if part.exists() and progress.exists() else []
    conn.send(stream_id, m.encode(request(have)))
    first = await asyncio.wait_for(frames.get(), 60)
    try:
        if first.type != FrameType.CONTROL:
            raise WireError("no manifest")
        manifest = SliceManifest.from_dict(m.decode(first.body, m.Manifest, MAX_MANIFEST_BYTES).manifest)
    except (m.Refused, WireError, KeyError, TypeError, ValueError) as e:
        raise EngineError(f"cannot fetch {what}: {e}") from None
    if manifest.model_hash != model_hash:
        raise EngineError(f"the host offered {what} of a different model")
    out = SliceFile(final, manifest)
    total, last_report = manifest.n_bytes, 0.0
    while True:
        frame = await asyncio.wait_for(frames.get(), 60)
        if frame.type == FrameType.CONTROL:
            try:
                m.decode(frame.body, m.Done)
                break
            except (m.Refused, WireError) as e:
                raise EngineError(f"fetching {what} failed: {e}") from None
        if frame.type != FrameType.DATA or len(frame.body) < CHUNK_HEADER.size:
            raise EngineError(f"fetching {what}: the host sent something that is not a data chunk")
        tensor, offset = CHUNK_HEADER.unpack_from(frame.body)
        out.write(tensor, offset, frame.body[CHUNK_HEADER.size:])
        have_bytes = sum(_chunk_len(manifest, c) for c in out.done)
        if on_progress is not None and (time.monotonic() - last_report > 0.5 or have_bytes == total):
            on_progress(have_bytes, total)
            last_report = time.monotonic()
        if stop_after_bytes is not None and out.received >= stop_after_bytes:
            os._exit(3)  # a crash mid-transfer, for the resume test: no cleanup, no goodbye
    if not out.complete:
        raise EngineError(f"fetching {what} ended with chunks missing")
    return out.finish(layer_hashes), out.received


def _chunk_len(manifest: SliceManifest, chunk_id: str) -> int:
    i, j = (int(x) for x in chunk_id.split(":"))
    return min(CHUNK, manifest.tensors[i].n_bytes - j * CHUNK)
