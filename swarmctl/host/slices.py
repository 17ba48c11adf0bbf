"""The host's model file, served in slices to members that have none (``fetch_slice``,
``fetch_asker_part``; the fetch itself is swarmctl/model_files/distribution.py).

A slice's manifest is built once and kept: each batch of a fetch names its chunks by it. Chunks
go out one stream per member at a time (the host's uplink is everyone's): a member's next batch
waits for its last, and every chunk to anyone waits its turn within the host's upload budget
(``swarmctl run --role host --upload-mbit``; none by default). A fetch's first request (``want`` []) asks for the manifest alone, and is
told which members hold some of its layers too, so the fetcher pulls from them as well; what
fetchers report of a member that sent wrong chunks (``bad_source``) is counted in
source_reports.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from net import messages as m
from net.protocol import SwarmProtocol
from plans.plan import Plan
from swarmctl.model_files.distribution import SliceManifest, build_asker_manifest, build_manifest, parse_chunk_ids, serve_slice
from swarmctl.model_files.expert_slices import build_expert_manifest
from swarmctl.model_files.upload_budget import UploadBudget

from .model_hashes import ModelHashes
from .replies import error, ok
from .source_reports import SourceReports
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")


def slice_refusal(plan: Plan, start: int, stop: int, experts: list[int]) -> str | None:
    """Why layers [start, stop) (of experts [first, last) when ``experts`` names them) are not a
    slice of ``plan``'s trunk a member may fetch; None when they are."""
    lo, hi = plan.trunk_range
    if not lo <= start < stop <= hi:
        return f"layers [{start}, {stop}) are not trunk layers [{lo}, {hi})"
    if experts:
        first, last = (experts + [0])[:2]
        if not 0 <= first < last <= plan.n_expert:
            return f"experts [{first}, {last}) are not among the plan's {plan.n_expert}"
    return None


class SliceServer:
    def __init__(self, gguf: GGUFFile, hashes: ModelHashes, mirror: str, plan: Callable[[], Plan],
                 trunks: Trunks, upload_mbit: float | None = None) -> None:
        self.gguf, self.hashes, self.mirror = gguf, hashes, mirror  # mirror: the model's URL, named in manifests
        # every chunk to every member waits its turn in one budget: the host's uplink is one (None: no cap)
        self.budget = UploadBudget.from_mbit(upload_mbit)
        self._plan = plan  # the plan now (it changes)
        self.trunks = trunks
        self.sources = SourceReports()  # who holds which layers for fetches, and reports of wrong chunks
        self._sending_to: dict[str, asyncio.Lock] = {}  # one stream of chunks per member at a time
        self._manifests: dict[tuple, SliceManifest] = {}  # (kind, start, stop[, first, last]) → built once

    def fetch_slice(self, conn: SwarmProtocol, stream_id: int, message: m.FetchSlice) -> None:
        """A trunk's layers, or an expert node's experts of them."""
        plan, start, stop = self._plan(), message.start, message.stop
        refusal = slice_refusal(plan, start, stop, message.experts)
        if refusal is not None:
            error(conn, stream_id, refusal)
            return
        if message.experts:
            first, last = (message.experts + [0])[:2]
            try:
                manifest = self._manifest(("experts", start, stop, first, last), lambda: build_expert_manifest(
                    self.gguf, start, stop, first, last, plan.model_hash, self.hashes.chunks, self.mirror))
            except EngineError as e:  # layers with no experts
                error(conn, stream_id, str(e))
                return
        else:
            manifest = self._manifest(("layers", start, stop), lambda: build_manifest(
                self.gguf, start, stop, plan.model_hash, self.hashes.chunks, self.mirror))
        if message.want is None or message.want == []:
            log.info("sending %s to %s (%d chunks already there)", manifest.describe(), conn.peer_name,
                     len(message.have))
        self._start_sending(conn, stream_id, manifest, message.have, message.want)

    def fetch_asker_part(self, conn: SwarmProtocol, stream_id: int, message: m.FetchAskerPart) -> None:
        """An asker with no model file: what it runs, with the plan's head layers (no others)."""
        plan = self._plan()
        if message.head_layers != plan.head_layers:
            error(conn, stream_id, f"this swarm's askers keep {plan.head_layers} layers at each end, "
                                   f"not {message.head_layers}")
            return
        manifest = self._manifest(("asker", message.head_layers, message.head_layers), lambda: build_asker_manifest(
            self.gguf, message.head_layers, plan.model_hash, self.hashes.chunks, self.mirror))
        if message.want is None or message.want == []:
            log.info("sending the asker's part (%.1f MB) to %s (%d chunks already there)", manifest.n_bytes / 1e6,
                     conn.peer_name, len(message.have))
        self._start_sending(conn, stream_id, manifest, message.have, message.want)

    def bad_source(self, conn: SwarmProtocol, stream_id: int, message: m.BadSource) -> None:
        """A fetching member got a wrong chunk from another: counted against it, bounded
        (source_reports.py); the host evicts nobody on it."""
        ok(conn, stream_id, counted=[message.member] if self.sources.report(
            conn.peer_name, message.member, message.reason) else [])

    def _manifest(self, key: tuple, build: Callable[[], SliceManifest]) -> SliceManifest:
        if key not in self._manifests:
            self._manifests[key] = build()
        return self._manifests[key]

    def _start_sending(self, conn: SwarmProtocol, stream_id: int, manifest: SliceManifest, have: list[str],
                       want: list[str] | None) -> None:
        try:
            chunks = None if want is None else parse_chunk_ids(manifest, want)
        except ValueError as e:
            error(conn, stream_id, str(e))
            return
        holders = self._holders(conn.peer_name, manifest) if want == [] and manifest.kind != "asker" else []
        asyncio.ensure_future(self._send(conn, stream_id, manifest, set(have), chunks, holders))

    def _holders(self, asker: str, manifest: SliceManifest) -> list[m.Holder]:
        """The members (trunks online, not refused, not distrusted) that say they hold some of the
        manifest's layers: the fetcher pulls from them too (source_reports.py)."""
        holders = self.sources.holders(asker, manifest.start, manifest.stop, {
            name: (t.listen, t.holds) for name, t in self.trunks.items() if t.holds and t.conn.is_open and not t.refused})
        if holders:
            log.info("members holding %s for %s: %s", manifest.describe(), asker, ", ".join(
                f"{h.name} [{h.start}, {h.stop})" for h in holders))
        return holders

    async def _send(self, conn: SwarmProtocol, stream_id: int, manifest: SliceManifest, have: set[str],
                    want: list[tuple[int, int]] | None, holders: list[m.Holder]) -> None:
        lock = self._sending_to.setdefault(conn.peer_name, asyncio.Lock())
        try:
            if want == []:  # the manifest alone (and who else holds it): no need to wait
                sent = await serve_slice(conn, stream_id, self.gguf, manifest, have, want, holders)
            else:
                async with lock:
                    sent = await serve_slice(conn, stream_id, self.gguf, manifest, have, want,
                                             pace=self.budget.take if self.budget is not None else None)
        except ConnectionError:
            return
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.served_bytes += sent
        if want is None:
            log.info("sent %.1f MB of %s to %s", sent / 1e6, manifest.describe(), conn.peer_name)
