"""Slice distribution: a member that lacks the model receives exactly the tensors it runs from the
host and, at the same time, from a web mirror of the model's files if the host names one
(``swarmctl init --model-url``), and keeps them on disk as a GGUF of its own: a trunk its layers,
an asker with no model file its part (the embedding, its head and tail layers, the output norm and
LM head, the whole metadata with the tokenizer).

    trunk → host   {"type": "fetch_slice", "start", "stop", "have": [...], "want": []}
    asker → host   {"type": "fetch_asker_part", "head_layers", "have": [...], "want": []}
    host  → member {"type": "manifest", ...}   the file's metadata section, tensor directory, the
                                               SHA-256 of every 1 MiB chunk of every tensor, and
                                               for a mirror its URL and each tensor's file and offset
                   {"type": "done"}            then the stream ends
    member → host  the same with "want": ["3:0", "3:1", ...]   (a batch of chunk ids, one stream each)
    host  → member DATA frames: tensor:u32 offset:u64 bytes, then {"type": "done"}
    member → mirror  GET FILE with Range: bytes=a-b for each run of adjacent chunks → 206

(Without "want", as members before batches asked, the host sends the manifest and every chunk not
in "have" on one stream.) Which source fetches which chunk is swarmctl/model_files/fetch_plan.py's: each pulls
the next batch when it is free, a source that sends a wrong chunk or fails three batches in a row
is dropped for the fetch, and at the end an idle source may duplicate a chunk a slow one still has.

The member writes the GGUF header once (``*.gguf.part``), checks each chunk against its hash
before it places it at its offset (a wrong chunk drops its sender: ``WrongChunk``), and appends the
chunk's id to ``*.part.progress``: an interrupted fetch resumes by asking only for what it lacks.
When every chunk is there, each tensor (and each of a slice's layers, against the plan's hash) is
checked again, and only then is the file renamed into place. A node that already has the file
uses it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Mapping

from gguf import GGUFValueType

from kernels.errors import EngineError
from kernels.gguf_file import (DEFAULT_ALIGNMENT, HASH_CHUNK, GGUFFile, encode_kv, layer_hash_of, tensor_hash_of,
                               write_header)
from kernels.spec import ModelSpec, layer_of
from net import messages as m
from net.protocol import SwarmProtocol
from swarmctl.model_files.fetch_plan import FetchPlan
from net.wire import MAX_MANIFEST_BYTES, FrameType, WireError, encode_frame

log = logging.getLogger("swarmctl.model_files.distribution")

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
    file: str = ""  # the name of the model's file (part) that holds it, for a mirror ("": unknown)
    offset: int = -1  # where its bytes start in that file

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
    mirror: str = ""  # a folder URL serving the model's files with Range requests ("": none)
    # kind "experts" (an expert node's, swarmctl/model_files/expert_slices.py): experts [first_expert,
    # last_expert) of the model's n_expert, of each expert tensor of layers [start, stop); only the
    # chunks holding them are fetched and only their bytes kept. other_tensors: the hashes of the
    # layers' other tensors, so that the member can check the manifest against the plan's layer hashes.
    first_expert: int = 0
    last_expert: int = 0
    n_expert: int = 0
    other_tensors: dict[str, str] = field(default_factory=dict)

    @property
    def n_bytes(self) -> int:
        """The bytes a fetch moves."""
        return sum(self.chunk_sizes().values())

    def describe(self) -> str:
        if self.kind == "experts":
            return f"experts [{self.first_expert}, {self.last_expert}) of layers [{self.start}, {self.stop})"
        return f"layers [{self.start}, {self.stop})" if self.kind == "layers" else \
            f"the asker's part ({self.start} layers at each end)"

    def window(self, tensor: int) -> tuple[int, int]:
        """The bytes of tensor #``tensor`` the member keeps: all of them, or (an expert node) the
        slabs of its experts, one after another in an expert tensor."""
        n_bytes = self.tensors[tensor].n_bytes
        if self.kind != "experts":
            return 0, n_bytes
        slab = n_bytes // self.n_expert
        return self.first_expert * slab, self.last_expert * slab

    def stored(self, tensor: int) -> tuple[tuple[int, ...], int]:
        """Shape (ggml order) and bytes of the tensor as the member's file holds it."""
        t = self.tensors[tensor]
        lo, hi = self.window(tensor)
        if (lo, hi) == (0, t.n_bytes):
            return tuple(t.shape), t.n_bytes
        return (*t.shape[:-1], self.last_expert - self.first_expert), hi - lo

    def chunk_range(self, tensor: int) -> range:
        """The chunks of tensor #``tensor`` that hold bytes the member keeps."""
        lo, hi = self.window(tensor)
        return range(lo // CHUNK, -(-hi // CHUNK))

    def chunk_ids(self) -> list[str]:
        return [f"{i}:{j}" for i in range(len(self.tensors)) for j in self.chunk_range(i)]

    def to_dict(self) -> dict:
        return {"model_hash": self.model_hash, "kind": self.kind, "start": self.start, "stop": self.stop,
                "n_kv": self.n_kv, "kv": base64.b64encode(self.kv).decode(), "alignment": self.alignment,
                "tensors": [asdict(t) for t in self.tensors], "mirror": self.mirror,
                **({"experts": [self.first_expert, self.last_expert, self.n_expert],
                    "other_tensors": self.other_tensors} if self.kind == "experts" else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "SliceManifest":
        tensors = [TensorEntry(str(t["name"]), [int(x) for x in t["shape"]], int(t["ggml_type"]), int(t["n_bytes"]),
                               [str(h) for h in t["chunks"]], str(t.get("file", "")), int(t.get("offset", -1)))
                   for t in d["tensors"]]
        for t in tensors:
            if t.n_bytes < 0 or len(t.chunks) != -(-t.n_bytes // CHUNK):
                raise ValueError(f"tensor {t.name}: {len(t.chunks)} chunk hashes for {t.n_bytes} bytes")
        kind = str(d["kind"])
        if kind not in ("layers", "asker", "experts"):
            raise ValueError(f"unknown kind {kind!r}")
        first, last, n_expert = (int(x) for x in d.get("experts", [0, 0, 0])) if kind == "experts" else (0, 0, 0)
        if kind == "experts" and not 0 <= first < last <= n_expert:
            raise ValueError(f"experts [{first}, {last}) of {n_expert}")
        if kind == "experts" and any(len(t.shape) != 3 or t.n_bytes % n_expert for t in tensors):
            raise ValueError("an expert tensor that does not hold one slab per expert")
        other = {str(k): str(v) for k, v in d.get("other_tensors", {}).items()} if kind == "experts" else {}
        alignment = int(d["alignment"])
        if not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment}")
        mirror = str(d.get("mirror", ""))
        if mirror and not mirror.startswith(("http://", "https://")):
            raise ValueError(f"mirror {mirror!r} is not an HTTP(S) URL")
        return cls(str(d["model_hash"]), kind, int(d["start"]), int(d["stop"]), int(d["n_kv"]),
                   base64.b64decode(d["kv"], validate=True), alignment, tensors, mirror, first, last, n_expert, other)

    def chunk_sizes(self) -> dict[str, int]:
        """Every chunk's id ("tensor:index") and size, in the order the slice's file holds them."""
        return {f"{i}:{j}": min(CHUNK, t.n_bytes - j * CHUNK)
                for i, t in enumerate(self.tensors) for j in self.chunk_range(i)}


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
                     [(t.name, shape, t.ggml_type, n_bytes) for t, (shape, n_bytes) in
                      zip(self.manifest.tensors, map(self.manifest.stored, range(len(self.manifest.tensors))))],
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
        lo, hi = self.manifest.window(tensor)  # an expert node keeps only its experts' bytes of a chunk
        a, b = max(offset, lo), min(offset + len(data), hi)
        with open(self.part, "r+b") as f:
            f.seek(self.offsets[tensor] + a - lo)
            f.write(data[a - offset:b - offset])
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
            bad = [t.name for i, t in enumerate(self.manifest.tensors) if not self._intact(gguf, i)]
            layers = range(self.manifest.start, self.manifest.stop) if self.manifest.kind != "asker" else ()
            bad_layers = [i for i in layers if self._layer_hash(gguf, i) != layer_hashes[i]]
        if bad or bad_layers:
            self.part.unlink(missing_ok=True)
            self.progress.unlink(missing_ok=True)
            what = f"tensor {bad[0]} does" if bad else f"layers {bad_layers[0]}..{bad_layers[-1]} do"
            raise EngineError(f"fetched {what} not match the swarm's hashes; discarded")
        os.replace(self.part, self.final)
        self.progress.unlink(missing_ok=True)
        return self.final

    def _intact(self, gguf: GGUFFile, tensor: int) -> bool:
        """The tensor's bytes on disk still hash as they should: the whole tensor, or (an expert
        node's) each chunk wholly inside what it keeps (the chunks at its edges were checked whole
        when they arrived; only their kept part is on disk)."""
        entry = self.manifest.tensors[tensor]
        lo, hi = self.manifest.window(tensor)
        if (lo, hi) == (0, entry.n_bytes):
            return gguf.tensor_hash(entry.name) == entry.hash
        data = gguf.tensor_bytes(gguf.tensors[entry.name])
        inner = range(-(-lo // CHUNK), hi // CHUNK if hi < entry.n_bytes else -(-hi // CHUNK))
        return all(hashlib.sha256(data[j * CHUNK - lo:min((j + 1) * CHUNK, entry.n_bytes) - lo]).hexdigest()
                   == entry.chunks[j] for j in inner)

    def _layer_hash(self, gguf: GGUFFile, layer: int) -> str:
        """A layer's hash as the file's tensors give it or, for an expert node holding only its
        experts' slabs, as the manifest's tensor hashes give it: the host's chunk hashes check out
        against the plan's layer hashes only if they are the model's."""
        if self.manifest.kind != "experts":
            return gguf.layer_hash(layer)
        prefix = f"blk.{layer}."
        hashes = {t.name: t.hash for t in self.manifest.tensors if t.name.startswith(prefix)}
        return layer_hash_of({**{k: v for k, v in self.manifest.other_tensors.items() if k.startswith(prefix)},
                              **hashes})


# --- the side that has the model ---

def _trunk_keeps(key: str) -> bool:
    """Metadata a trunk's slice carries: not the vocabulary or chat template (the asker's)."""
    return not key.startswith("tokenizer.") and key != "general.architecture"


def build_manifest(gguf: GGUFFile, start: int, stop: int, model_hash: str,
                   chunk_hashes: Mapping[str, list[str]] | None = None, mirror: str = "") -> SliceManifest:
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
                         _entries(gguf, names, chunk_hashes), mirror)


def asker_tensor_names(gguf: GGUFFile, head_layers: int) -> list[str]:
    """What an asker keeping ``head_layers`` at each end runs: every tensor outside the trunk's
    layers (the embedding, output norm and LM head, any multi-token-prediction layer after the
    last) and its head and tail layers."""
    spec = ModelSpec.from_gguf(gguf)
    trunk = range(head_layers, spec.n_layer - head_layers)
    names = [n for n in gguf.tensors if (il := layer_of(n)) is None or il not in trunk]
    return sorted(names, key=lambda n: (-1 if layer_of(n) is None else layer_of(n), n))


def build_asker_manifest(gguf: GGUFFile, head_layers: int, model_hash: str,
                         chunk_hashes: Mapping[str, list[str]] | None = None, mirror: str = "") -> SliceManifest:
    spec = ModelSpec.from_gguf(gguf)
    if not 0 <= head_layers <= spec.n_layer // 2:
        raise EngineError(f"{head_layers} head layers do not fit the model's {spec.n_layer}")
    n_kv, kv = gguf.raw_metadata()
    return SliceManifest(model_hash, "asker", head_layers, head_layers, n_kv, kv, _alignment(gguf),
                         _entries(gguf, asker_tensor_names(gguf, head_layers), chunk_hashes), mirror)


def _alignment(gguf: GGUFFile) -> int:
    return int(gguf.metadata.get("general.alignment", DEFAULT_ALIGNMENT))


def _entries(gguf: GGUFFile, names: list[str], chunk_hashes: Mapping[str, list[str]] | None) -> list[TensorEntry]:
    known = chunk_hashes or {}
    return [TensorEntry(n, list(gguf.tensors[n].shape), gguf.tensors[n].ggml_type, gguf.tensors[n].n_bytes,
                        list(known[n]) if n in known else gguf.chunk_hashes(n),
                        gguf.parts[gguf.tensors[n].part].name, gguf.tensors[n].offset) for n in names]


def parse_chunk_ids(manifest: SliceManifest, ids: list[str]) -> list[tuple[int, int]]:
    """(tensor, chunk index) of each id ("tensor:index"); ValueError for one the slice does not have."""
    out = []
    for chunk_id in ids:
        i, _, j = chunk_id.partition(":")
        tensor, index = int(i), int(j)
        if not 0 <= tensor < len(manifest.tensors) or not 0 <= index * CHUNK < manifest.tensors[tensor].n_bytes:
            raise ValueError(f"no chunk {chunk_id!r} in {manifest.describe()}")
        out.append((tensor, index))
    return out


async def serve_slice(conn: SwarmProtocol, stream_id: int, gguf: GGUFFile, manifest: SliceManifest,
                      have: set[str], want: list[tuple[int, int]] | None = None,
                      holders: list[m.Holder] | None = None,
                      pace: Callable[[int], Awaitable[None]] | None = None) -> int:
    """What a fetch asked for: ``want`` None, the manifest and every chunk not in ``have`` (members
    before batched fetching); ``want`` [], the manifest alone (with ``holders``: members to fetch
    from too); else just those chunks, each after ``pace`` lets its bytes go (the host's upload
    budget). Then ``done``. Returns the bytes sent."""
    if not want:
        conn.send(stream_id, m.encode(m.Manifest(manifest=manifest.to_dict(), holders=holders or [])))
    if want is None:
        want = [(i, j) for i, entry in enumerate(manifest.tensors) for j in range(-(-entry.n_bytes // CHUNK))
                if f"{i}:{j}" not in have]
    chunks = [(i, j, gguf.tensor_bytes(gguf.tensors[manifest.tensors[i].name])) for i, j in want]
    return await send_chunks(conn, stream_id, chunks, pace)


# --- fetching from several sources at once (which chunk from whom: swarmctl/model_files/fetch_plan.py) ---

HOST_BATCH = 16  # chunks per request to the host: 16 MiB, then the next batch is asked for
MIRROR_BATCH = 64  # chunks per batch from a mirror, one Range request per run of adjacent chunks
MIRROR_TIMEOUT = 30.0  # seconds a mirror may take to connect or between bytes
MIRROR_GAP = 64 * 1024  # bytes between two tensors in a file that one Range request reads over


class SourceGone(Exception):
    """A source that cannot serve this fetch (a mirror that answers anything but the range asked
    for): dropped at once, the fetch goes on from the others."""


OpenStream = Callable[[], "tuple[int, asyncio.Queue]"]


class HostSource:
    """The host, over the member's connection: one stream per request, which the host ends."""

    name = "host"
    batch = HOST_BATCH

    def __init__(self, conn: SwarmProtocol, open_stream: OpenStream, close_stream: Callable[[int], None],
                 request: Callable[[list[str], list[str] | None], m.Message], timeout: float = 60.0) -> None:
        self.conn = conn
        self.open_stream = open_stream
        self.close_stream = close_stream
        self.request = request  # (have, want) → the message
        self.timeout = timeout
        self.holders: list[m.Holder] = []  # as the manifest's answer names them

    async def manifest(self, have: list[str]) -> SliceManifest:
        stream_id, frames = self.open_stream()
        try:
            self.conn.send(stream_id, m.encode(self.request(have, [])), end=True)
            first = await asyncio.wait_for(frames.get(), self.timeout)
            if first.type != FrameType.CONTROL:
                raise WireError("no manifest")
            reply = m.decode(first.body, m.Manifest, MAX_MANIFEST_BYTES)
            manifest = SliceManifest.from_dict(reply.manifest)
            self.holders = list(reply.holders)  # members holding these layers (MemberSource)
            await asyncio.wait_for(frames.get(), self.timeout)  # its "done": the stream ends on both sides
            return manifest
        finally:
            self.close_stream(stream_id)

    async def fetch(self, ids: list[str], wanted: Callable[[str], bool] = lambda chunk: True):
        """Yields (chunk id, bytes) for what the host sends of ``ids`` (all of them: a batch is
        small)."""
        stream_id, frames = self.open_stream()
        ended = False
        try:
            self.conn.send(stream_id, m.encode(self.request([], ids)), end=True)
            while True:
                frame = await asyncio.wait_for(frames.get(), self.timeout)
                if frame.type == FrameType.CONTROL:
                    ended = True
                    try:
                        m.decode(frame.body, m.Done)
                    except (m.Refused, WireError) as e:
                        raise ConnectionError(str(e)) from None
                    return
                if frame.type != FrameType.DATA or len(frame.body) < CHUNK_HEADER.size:
                    raise WrongChunk("the host sent something that is not a data chunk")
                tensor, offset = CHUNK_HEADER.unpack_from(frame.body)
                if offset % CHUNK:
                    raise WrongChunk(f"the host sent a chunk at offset {offset}, not a chunk boundary")
                yield f"{tensor}:{offset // CHUNK}", frame.body[CHUNK_HEADER.size:]
        finally:
            self.close_stream(stream_id)
            if not ended and self.conn.is_open:  # left mid-batch (the fetch ended, a wrong chunk): stop it
                self.conn.abandon(stream_id)


class MirrorSource:
    """A web server holding the model's files (``manifest.mirror``): one GET with ``Range`` per run
    of adjacent chunks of a tensor. Anything but a 206 with the Content-Range asked for ends it
    (SourceGone)."""

    name = "mirror"
    batch = MIRROR_BATCH

    def __init__(self, manifest: SliceManifest, session, timeout: float = MIRROR_TIMEOUT) -> None:
        self.manifest = manifest
        self.session = session  # aiohttp.ClientSession
        self.timeout = timeout

    def _runs(self, ids: list[str]) -> list[tuple[str, int, int, list[tuple[str, int, int]]]]:
        """One Range request per run of chunks adjacent in a file (tensors are, but for alignment
        padding of at most MIRROR_GAP bytes, read and skipped): (file, first byte, last byte,
        [(chunk id, its offset in the file, its size)])."""
        runs: list[tuple[str, int, int, list[tuple[str, int, int]]]] = []
        for tensor, index in parse_chunk_ids(self.manifest, ids):
            entry = self.manifest.tensors[tensor]
            if not entry.file or entry.offset < 0:
                raise SourceGone(f"the host did not say which file holds {entry.name}")
            at, size = entry.offset + index * CHUNK, min(CHUNK, entry.n_bytes - index * CHUNK)
            if runs and runs[-1][0] == entry.file and 0 <= at - runs[-1][2] - 1 <= MIRROR_GAP:
                file, first, _, chunks = runs[-1]
                runs[-1] = (file, first, at + size - 1, chunks + [(f"{tensor}:{index}", at, size)])
            else:
                runs.append((entry.file, at, at + size - 1, [(f"{tensor}:{index}", at, size)]))
        return runs

    async def fetch(self, ids: list[str], wanted: Callable[[str], bool] = lambda chunk: True):
        """Yields (chunk id, bytes) for ``ids``; stops a range early once ``wanted`` is false for
        the rest of it."""
        import aiohttp
        from urllib.parse import quote

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
        for file, a, b, chunks in self._runs(ids):
            url = f"{self.manifest.mirror.rstrip('/')}/{quote(file)}"
            try:
                async with self.session.get(url, headers={"Range": f"bytes={a}-{b}"}, timeout=timeout) as resp:
                    if resp.status != 206:
                        why = " (it ignores Range and would send the whole file)" if resp.status == 200 else ""
                        raise SourceGone(f"{url} answered {resp.status} {resp.reason or ''}".rstrip() + why)
                    got = resp.headers.get("Content-Range", "")
                    if not _content_range_matches(got, a, b):
                        raise SourceGone(f"{url} answered Content-Range {got!r} to bytes={a}-{b}")
                    position = a
                    for n, (chunk_id, at, size) in enumerate(chunks):
                        if not any(wanted(c) for c, _, _ in chunks[n:]):
                            break  # the rest came from elsewhere (the end game): stop downloading it
                        if at > position:
                            await resp.content.readexactly(at - position)  # alignment padding
                        yield chunk_id, await resp.content.readexactly(size)
                        position = at + size
            except (aiohttp.ClientError, asyncio.TimeoutError, asyncio.IncompleteReadError, OSError) as e:
                what = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
                raise SourceGone(f"{url}: {what}") from None


def _content_range_matches(header: str, a: int, b: int) -> bool:
    unit, _, rest = header.strip().partition(" ")
    span, _, size = rest.partition("/")
    return unit == "bytes" and span == f"{a}-{b}" and (size == "*" or size.isdigit())


# --- members that hold the layers (the serving side: swarmctl/trunk/layer_share.py) ---

MEMBER_BATCH = 16  # chunks per fetch_chunks request: 16 MiB, as the host's
PeerLink = Callable[[], "Awaitable[tuple[SwarmProtocol, OpenStream, Callable[[int], None]]]"]
MemberSources = Callable[[SliceManifest, "list[m.Holder]"], list]  # the manifest and its holders → sources


class MemberSource:
    """A member the host named as holding layers [start, stop) of the slice: one ``fetch_chunks``
    per batch over a connection ``link`` opens on first use. It is asked only for chunks of
    tensors in those layers; whatever it sends is checked against the host's hashes like any
    source's, and a wrong chunk is ``report``ed (to the host) as well as dropping it."""

    batch = MEMBER_BATCH

    def __init__(self, holder: m.Holder, manifest: SliceManifest, link: PeerLink,
                 report: Callable[[str, str], None] | None = None, timeout: float = 60.0) -> None:
        self.member = holder.name
        self.name = f"member {holder.name}"
        self.manifest = manifest
        self.holds = frozenset(c for c in manifest.chunk_ids()
                               if holder.start <= _layer_or(manifest.tensors[int(c.split(":")[0])].name) < holder.stop)
        self.link = link
        self.reporter = report
        self.timeout = timeout

    def report(self, reason: str) -> None:
        if self.reporter is not None:
            self.reporter(self.member, reason)

    async def fetch(self, ids: list[str], wanted: Callable[[str], bool] = lambda chunk: True):
        """Yields (chunk id, bytes) for what the member sends of ``ids``."""
        pairs = parse_chunk_ids(self.manifest, ids)
        local: dict[int, int] = {}  # the manifest's tensor index → its index in this request
        for tensor, _ in pairs:
            local.setdefault(tensor, len(local))
        back = {k: tensor for tensor, k in local.items()}
        request = m.FetchChunks(tensors=[self.manifest.tensors[t].name for t in local],
                                want=[f"{local[t]}:{j}" for t, j in pairs])
        try:
            conn, open_stream, close_stream = await self.link()
        except Exception as e:  # noqa: BLE001 - any way of not reaching it (a refused route, a punch that
            # failed, a timeout) is a failed batch of this source, never the end of the fetch
            raise ConnectionError(f"cannot reach {self.member}: {e or type(e).__name__}") from None
        stream_id, frames = open_stream()
        ended = False
        try:
            conn.send(stream_id, m.encode(request), end=True)
            async for k, offset, data in _chunk_frames(frames, self.timeout, self.name):
                if k not in back:
                    raise WrongChunk(f"the {self.name} sent a chunk of a tensor it was not asked for")
                yield f"{back[k]}:{offset // CHUNK}", data
            ended = True
        finally:
            close_stream(stream_id)
            if not ended and conn.is_open:  # left mid-batch: the member stops sending it
                conn.abandon(stream_id)


def _layer_or(name: str, default: int = -1) -> int:
    layer = layer_of(name)
    return default if layer is None else layer


async def _chunk_frames(frames: asyncio.Queue, timeout: float, who: str):
    """(tensor, offset, bytes) of each DATA frame on a fetch's stream until its ``done``;
    ConnectionError for an ``error`` (a refusal), WrongChunk for a frame that is no chunk."""
    while True:
        frame = await asyncio.wait_for(frames.get(), timeout)
        if frame.type == FrameType.CONTROL:
            try:
                m.decode(frame.body, m.Done)
            except (m.Refused, WireError) as e:
                raise ConnectionError(str(e)) from None
            return
        if frame.type != FrameType.DATA or len(frame.body) < CHUNK_HEADER.size:
            raise WrongChunk(f"the {who} sent something that is not a data chunk")
        tensor, offset = CHUNK_HEADER.unpack_from(frame.body)
        if offset % CHUNK:
            raise WrongChunk(f"the {who} sent a chunk at offset {offset}, not a chunk boundary")
        yield tensor, offset, frame.body[CHUNK_HEADER.size:]


async def send_chunks(conn: SwarmProtocol, stream_id: int, chunks: list[tuple[int, int, memoryview]],
                      pace: Callable[[int], Awaitable[None]] | None = None) -> int:
    """DATA frames (tensor:u32 offset:u64 bytes) for each (tensor, chunk index, the tensor's bytes),
    each after ``pace`` lets its bytes go (an upload budget), then ``done``. Returns the bytes sent."""
    sent = 0
    for tensor, index, data in chunks:
        piece = bytes(data[index * CHUNK:(index + 1) * CHUNK])
        if pace is not None:
            await pace(len(piece))
        if not conn.is_open:
            return sent
        conn.send(stream_id, encode_frame(FrameType.DATA, CHUNK_HEADER.pack(tensor, index * CHUNK) + piece))
        sent += len(piece)
        await conn.drain(stream_id, SEND_BACKLOG)
    if conn.is_open:
        conn.send(stream_id, m.encode(m.Done(bytes=sent)), end=True)
    return sent


async def fetch_slice(conn: SwarmProtocol, open_stream: OpenStream, close_stream: Callable[[int], None],
                      folder: Path, *, model_hash: str, start: int, stop: int, layer_hashes: list[str],
                      on_progress: Callable[[int, int], None] | None = None,
                      stop_after_bytes: int | None = None, members: MemberSources | None = None) -> tuple[Path, int]:
    """Fetch layers [start, stop) from the host over ``conn`` (each request on a stream from
    ``open_stream``, whose frames arrive on its queue), from the manifest's mirror, if any, and
    from the members the host names as holding them (``members`` makes their sources).
    Returns the slice file and the bytes received. ``stop_after_bytes`` simulates a crash (for
    the resume test): the process exits abruptly once that many bytes are in."""
    final = slice_path(folder, model_hash, start, stop)
    host = HostSource(conn, open_stream, close_stream,
                      lambda have, want: m.FetchSlice(start=start, stop=stop, have=have, want=want))
    return await fetch_file(host, final, f"layers [{start}, {stop})", model_hash, layer_hashes, on_progress,
                            stop_after_bytes, members=members)


async def fetch_asker_part(conn: SwarmProtocol, open_stream: OpenStream, close_stream: Callable[[int], None],
                           folder: Path, *, model_hash: str, head_layers: int,
                           on_progress: Callable[[int, int], None] | None = None) -> tuple[Path, int]:
    """Fetch what an asker keeping ``head_layers`` at each end runs (``build_asker_manifest``)."""
    final = asker_part_path(folder, model_hash, head_layers)
    host = HostSource(conn, open_stream, close_stream,
                      lambda have, want: m.FetchAskerPart(head_layers=head_layers, have=have, want=want))
    return await fetch_file(host, final, "the asker's part of the model", model_hash, [], on_progress, None)


async def fetch_file(host, final: Path, what: str, model_hash: str, layer_hashes: list[str],
                     on_progress: Callable[[int, int], None] | None = None,
                     stop_after_bytes: int | None = None, mirror_timeout: float = MIRROR_TIMEOUT,
                     members: MemberSources | None = None) -> tuple[Path, int]:
    """The manifest from ``host``, then the chunks not yet on disk from the host, the manifest's
    mirror and the members holding them (``members``, from the host's list) at once; the file
    once all are there and checked."""
    if final.exists():
        return final, 0
    part, progress = final.with_suffix(".gguf.part"), final.with_suffix(".part.progress")
    have = sorted(set(progress.read_text().split())) if part.exists() and progress.exists() else []
    try:
        manifest = await host.manifest(have)
    except (m.Refused, WireError, KeyError, TypeError, ValueError, ConnectionError, asyncio.TimeoutError) as e:
        raise EngineError(f"cannot fetch {what}: {e or type(e).__name__}") from None
    if manifest.model_hash != model_hash:
        raise EngineError(f"the host offered {what} of a different model")
    out = SliceFile(final, manifest)
    # members before the host: the host's uplink is everyone's
    swarm = [*(members(manifest, getattr(host, "holders", [])) if members is not None else []), host]
    log.info("fetching %s (%.1f MB not on disk yet) from %s", what, sum(
        n for c, n in manifest.chunk_sizes().items() if c not in out.done) / 1e6, ", ".join(
        ["the mirror"] * bool(manifest.mirror) + [f"the {s.name}" for s in swarm]))
    if not manifest.mirror:
        plan = await _pull(out, swarm, what, on_progress, stop_after_bytes)
    else:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            plan = await _pull(out, [MirrorSource(manifest, session, mirror_timeout), *swarm], what, on_progress,
                               stop_after_bytes)
    if not out.complete:
        reasons = "; ".join(f"{s.name}: {s.dropped}" for s in plan.sources.values() if s.dropped)
        raise EngineError(f"fetching {what} ended with chunks missing ({reasons or 'no source had them'})")
    _log_shares(plan, what)
    return out.finish(layer_hashes), out.received


async def _pull(out: SliceFile, sources: list, what: str, on_progress: Callable[[int, int], None] | None,
                stop_after_bytes: int | None) -> FetchPlan:
    """Every source pulls batches from one FetchPlan until no chunk is left (or no source can give
    what is). The first source listed asks first: a mirror, whose uplink is not the swarm's."""
    sizes = {c: n for c, n in out.manifest.chunk_sizes().items() if c not in out.done}
    plan = FetchPlan(sizes)
    for source in sources:
        plan.add_source(source.name, getattr(source, "holds", None))
    total = out.manifest.n_bytes
    already = total - sum(sizes.values())
    changed = asyncio.Event()
    finished = asyncio.Event()  # every chunk is in: sources still in a batch are stopped
    last_report = [0.0]

    def arrived(source, chunk: str, data: bytes) -> None:
        tensor, index = (int(x) for x in chunk.split(":"))
        _write(out, tensor, index * CHUNK, data, what)
        plan.delivered(source.name, chunk)
        if plan.finished:
            finished.set()
        have_bytes = already + sum(plan.shares().values())
        if on_progress is not None and (time.monotonic() - last_report[0] > 0.5 or have_bytes == total):
            on_progress(have_bytes, total)
            last_report[0] = time.monotonic()
        if stop_after_bytes is not None and out.received >= stop_after_bytes:
            os._exit(3)  # a crash mid-transfer, for the resume test: no cleanup, no goodbye

    async def pull(source) -> None:
        state = plan.sources[source.name]
        while not plan.finished and not state.dropped:
            batch = plan.next_batch(source.name, source.batch)
            if not batch:
                if not any(s.out for s in plan.sources.values()):
                    return  # nothing out anywhere: nothing will come back to take
                changed.clear()
                await changed.wait()
                continue
            try:
                wanted = functools.partial(plan.wanted, source.name)
                async with contextlib.aclosing(source.fetch(batch, wanted)) as chunks:
                    async for chunk, data in chunks:
                        if plan.wanted(source.name, chunk):
                            arrived(source, chunk, data)
                plan.batch_ended(source.name)
            except WrongChunk as e:
                plan.wrong(source.name, str(e))
                log.warning("fetching %s: the %s sent a wrong chunk (%s); not used again for this fetch",
                            what, source.name, e)
                if hasattr(source, "report"):  # a member: the host hears of it too
                    source.report(str(e))
            except SourceGone as e:
                plan.drop(source.name, str(e))
                log.warning("fetching %s: not using the %s for this fetch: %s", what, source.name, e)
            except (ConnectionError, asyncio.TimeoutError, WireError, ValueError) as e:
                if plan.failed(source.name, f"{e or type(e).__name__}"):
                    log.warning("fetching %s: not using the %s for this fetch: %s", what, source.name,
                                state.dropped)
            finally:
                changed.set()

    tasks = [asyncio.ensure_future(pull(source)) for source in sources]
    everything, all_in = asyncio.gather(*tasks), asyncio.ensure_future(finished.wait())
    try:
        await asyncio.wait([everything, all_in], return_when=asyncio.FIRST_COMPLETED)
        if everything.done():
            everything.result()  # (what a pull raised: a full disk)
    finally:
        all_in.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if everything.done() and not everything.cancelled():
            everything.exception()  # (retrieved: a cancelled pull's, or one already raised above)
    return plan


def _write(out: SliceFile, tensor: int, offset: int, data: bytes, what: str) -> None:
    """A checked chunk onto disk; a full disk (any write error) ends the fetch in one line,
    keeping what was written for the next try."""
    try:
        out.write(tensor, offset, data)
    except WrongChunk:
        raise
    except OSError as e:
        kept = sum(_chunk_len(out.manifest, c) for c in out.done)
        raise EngineError(f"cannot write {what} to {out.part.parent}: {e.strerror or e}; the {kept / 1e6:.1f} MB "
                          f"already written are kept and the next fetch resumes from there") from None


def _log_shares(plan: FetchPlan, what: str) -> None:
    """One line: which share of the bytes came from which source."""
    shares = plan.shares()
    total = sum(shares.values())
    if total:
        log.info("fetched %s (%.1f MB): %s", what, total / 1e6, "; ".join(
            f"{100 * n / total:.0f}% from the {name}" for name, n in sorted(shares.items(), key=lambda kv: -kv[1])))


def _chunk_len(manifest: SliceManifest, chunk_id: str) -> int:
    i, j = (int(x) for x in chunk_id.split(":"))
    return min(CHUNK, manifest.tensors[i].n_bytes - j * CHUNK)
