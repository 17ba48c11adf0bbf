"""Layers from everyone who holds them: a trunk serves chunks of the layers it holds (its model
file, or slices it fetched) to members fetching them, within an upload budget it sets; and it
fetches from such members in turn (swarmctl/model_files/distribution.py MemberSource pulls through
``PeerFetches``).

    member → trunk  {"type": "fetch_chunks", "tensors": [names], "want": ["k:index", ...]}
    trunk → member  DATA frames k:u32 offset:u64 bytes, then {"type": "done"}; or one "error" line

Only a member with a valid certificate reaches a trunk at all (the connection's check); only a
trunk certificate may ask (``FetchChunks.senders``). A trunk serves layer tensors only, only from a
file that holds the tensor's layer, never more than ``upload_mbit`` (all streams together, paced
chunk by chunk) and at most MAX_STREAMS requests at once; ``--upload-mbit 0`` serves nothing and
tells the host it holds nothing. The host lists a trunk as a holder from what it says it holds
(``register``/``ready`` ``holds``); a trunk that lies only wastes a fetcher one batch, since every
chunk is checked against the host's hashes and a wrong one is reported (``bad_source``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path
from typing import Callable

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec, layer_of
from net import messages as m
from net.protocol import ConnectionHandler, SwarmProtocol
from net.wire import Frame
from swarmctl.model_files.distribution import CHUNK, MemberSource, SliceManifest, send_chunks
from swarmctl.model_files.upload_budget import UploadBudget

log = logging.getLogger("swarmctl.trunk")

DEFAULT_UPLOAD_MBIT = 10.0  # about half a typical home uplink: activations keep the rest
MAX_STREAMS = 4  # fetch_chunks requests served at once; more wait their turn
SLICE_NAME = re.compile(r"^([0-9a-f]{16})-layers-(\d+)-(\d+)\.gguf$")  # distribution.slice_path's names


class LayerShare:
    """The serving side. ``model_hash``: the plan's (None before one arrived): only slices of that
    model are offered."""

    def __init__(self, name: str, model_path: Path, slices_dir: Path, upload_mbit: float,
                 model_hash: Callable[[], str | None]) -> None:
        self.name = name
        self.model_path = model_path
        self.slices_dir = slices_dir
        self.budget = UploadBudget.from_mbit(upload_mbit) if upload_mbit > 0 else None
        self.model_hash = model_hash
        self.sent_bytes = 0
        self._streams = asyncio.Semaphore(MAX_STREAMS)
        self._files: dict[Path, GGUFFile] = {}
        self._model_layers: int | None = None
        # fault injection for the tests of a member that sends wrong bytes (as a corrupt disk would)
        self._wrong_bytes = bool(os.environ.get("SWARMCTL_TEST_SERVE_WRONG_CHUNKS"))

    def holds(self) -> list[tuple[int, int]]:
        """Layer ranges on disk that this trunk serves ([] with no upload budget)."""
        if self.budget is None:
            return []
        return sorted({(a, b) for a, b, _ in self._files_held()})[:64]

    def _files_held(self) -> list[tuple[int, int, Path]]:
        held = []
        if self.model_path.exists():
            try:
                if self._model_layers is None:
                    self._model_layers = ModelSpec.from_gguf(self._open(self.model_path)).n_layer
                held.append((0, self._model_layers, self.model_path))
            except (EngineError, OSError, ValueError) as e:
                log.debug("not offering layers of %s: %s", self.model_path, e)
        prefix = (self.model_hash() or "")[:16]
        if prefix and self.slices_dir.is_dir():
            for path in self.slices_dir.iterdir():
                found = SLICE_NAME.match(path.name)
                if found and found.group(1) == prefix and int(found.group(2)) < int(found.group(3)):
                    held.append((int(found.group(2)), int(found.group(3)), path))
        return held

    def _open(self, path: Path) -> GGUFFile:
        if path not in self._files:
            self._files[path] = GGUFFile(path)
        return self._files[path]

    def _file_for(self, layer: int, held: list[tuple[int, int, Path]]) -> GGUFFile | None:
        for start, stop, path in held:
            if start <= layer < stop:
                return self._open(path)
        return None

    def _chunks(self, request: m.FetchChunks) -> list[tuple[int, int, memoryview]]:
        """What the request names, from the files that hold it; ValueError (one line) for anything
        this trunk does not hold."""
        tensors = []
        held = self._files_held()
        for name in request.tensors:
            layer = layer_of(name)
            gguf = self._file_for(layer, held) if layer is not None else None
            if gguf is None or name not in gguf.tensors:
                held = ", ".join(f"[{a}, {b})" for a, b in self.holds()) or "none"
                raise ValueError(f"{self.name} does not hold {name[:80]} (layers it holds: {held})")
            data = gguf.tensor_bytes(gguf.tensors[name])
            tensors.append(_WrongBytes(data) if self._wrong_bytes else data)
        chunks = []
        for chunk_id in request.want:
            k, _, j = chunk_id.partition(":")
            if not (k.isdigit() and j.isdigit() and int(k) < len(tensors) and int(j) * CHUNK < len(tensors[int(k)])):
                raise ValueError(f"no chunk {chunk_id[:32]!r} in the tensors asked for")
            chunks.append((int(k), int(j), tensors[int(k)]))
        return chunks

    async def serve(self, conn: SwarmProtocol, stream_id: int, request: m.FetchChunks) -> None:
        if self.budget is None:
            conn.send(stream_id, m.encode(m.Error(message=f"{self.name} serves no layers (--upload-mbit 0)")), end=True)
            return
        try:
            chunks = self._chunks(request)
        except (ValueError, EngineError, OSError) as e:
            conn.send(stream_id, m.encode(m.Error(message=str(e)[:300])), end=True)
            return
        async with self._streams:
            try:
                self.sent_bytes += await send_chunks(conn, stream_id, chunks, self.budget.take)
            except ConnectionError:
                return

    def close(self) -> None:
        for gguf in self._files.values():
            gguf.close()
        self._files.clear()


class _WrongBytes:
    """A tensor's bytes with the first byte of every piece read flipped (fault injection)."""

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, where: slice) -> bytes:
        piece = bytearray(self.data[where])
        piece[0] ^= 0xFF
        return bytes(piece)


class PeerFetches:
    """The fetching side: connections to members this trunk fetches chunks from, and their
    streams' frames (which the trunk hands here first: ``take_frame``)."""

    def __init__(self, connect: Callable, handler: ConnectionHandler) -> None:
        self._connect = connect  # (member, address, handler) → a connection (TrunkContext.connect)
        self._handler = handler
        self._conns: dict[str, SwarmProtocol] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._streams: dict[tuple[int, int], asyncio.Queue] = {}  # (id(conn), stream) → its frames
        self._fetches = 0  # fetches under way (a staged plan's may run beside the one in use)

    def sources(self, report: Callable[[str, str], None] | None = None):
        """For distribution.fetch_slice's ``members``: a MemberSource per holder the host named.
        Each call is one fetch, ended by ``release``."""
        self._fetches += 1

        def make(manifest: SliceManifest, holders: list[m.Holder]) -> list[MemberSource]:
            made = [MemberSource(holder, manifest, self._link(holder), report) for holder in holders]
            return [source for source in made if source.holds]
        return make

    def _link(self, holder: m.Holder):
        async def link():
            lock = self._connecting.setdefault(holder.name, asyncio.Lock())
            async with lock:
                conn = self._conns.get(holder.name)
                if conn is None or not conn.is_open:
                    conn = self._conns[holder.name] = await self._connect(holder.name, holder.address, self._handler)
            return conn, lambda: self._open(conn), lambda stream_id: self._streams.pop((id(conn), stream_id), None)
        return link

    def _open(self, conn: SwarmProtocol) -> tuple[int, asyncio.Queue]:
        stream_id = conn.open_stream()
        frames: asyncio.Queue = asyncio.Queue()
        self._streams[(id(conn), stream_id)] = frames
        return stream_id, frames

    def take_frame(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> bool:
        frames = self._streams.get((id(conn), stream_id))
        if frames is None or self._conns.get(conn.peer_name) is not conn:
            return False
        frames.put_nowait(frame)
        return True

    async def release(self) -> None:
        """After a fetch: once no other is under way, close the connections they opened."""
        from net.endpoint import close_all

        self._fetches = max(0, self._fetches - 1)
        if self._fetches:
            return
        conns, self._conns = self._conns, {}
        self._streams.clear()
        await close_all([conn for conn in conns.values() if conn.is_open], "fetch done")
