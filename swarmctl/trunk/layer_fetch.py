"""Where a trunk's layers come from when it has no model file: fetched from the swarm.

A stage's layers come as a slice file, from the host and the members that hold them
(swarmctl/model_files/distribution.py, through ``PeerFetches``); an expert node's experts as a
file with just its experts of the trunk's layers (swarmctl/model_files/expert_slices.py). Each
chunk is checked against the host's hashes; progress is logged and told to the host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from kernels.errors import EngineError
from net import messages as m
from plans.plan import ExpertAssignment, Plan, StageAssignment
from swarmctl.model_files.fetch_progress import FetchProgress
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.host_link import HostLink
from swarmctl.trunk.layer_share import LayerShare, PeerFetches

log = logging.getLogger("swarmctl.trunk")


class LayerFetch:
    def __init__(self, ctx: TrunkContext, host: HostLink | None, share: LayerShare | None = None,
                 peers: PeerFetches | None = None) -> None:
        """``share``: what this trunk holds and serves (told to the host with ``ready``); ``peers``:
        fetching from members that hold our layers too."""
        self.model_path = ctx.model_path
        self.slices_dir = ctx.slices_dir  # layers fetched from the swarm when the model file is missing
        self.fetched_bytes = 0
        self._host = host
        self._share = share
        self._peers = peers
        self._spawn = ctx.spawn

    def holds(self) -> list[tuple[int, int]]:
        return self._share.holds() if self._share is not None else []

    async def stage_file(self, stage: StageAssignment, plan: Plan) -> Path:
        """Our model file, or a slice file with the stage's layers, fetched from the host if need be."""
        if self.model_path.exists():
            return self.model_path
        from swarmctl.model_files.distribution import fetch_slice

        if not self._host.is_open:
            raise EngineError("no model file and no host to fetch layers from")
        crash_after = os.environ.get("SWARMCTL_TEST_FETCH_CRASH_AFTER")  # fault injection for the resume test
        members = self._peers.sources(self._report_source) if self._peers is not None else None
        try:
            path, received = await fetch_slice(
                self._host.conn, self._host.open_fetch, self._host.close_fetch, self.slices_dir,
                model_hash=plan.model_hash, start=stage.start, stop=stage.stop, layer_hashes=plan.layer_hashes,
                on_progress=self._progress(f"layers [{stage.start}, {stage.stop})"),
                stop_after_bytes=int(crash_after) if crash_after else None, members=members)
        finally:
            if self._peers is not None:
                await self._peers.release()
        self.fetched_bytes += received
        log.info("layers [%d, %d) ready in %s (%.1f MB received)", stage.start, stage.stop, path.name, received / 1e6)
        return path

    async def experts_file(self, expert: ExpertAssignment, plan: Plan) -> Path:
        """Our model file, or a file with just our experts of the trunk's layers, fetched if need be."""
        if self.model_path.exists():
            return self.model_path
        from swarmctl.model_files.expert_slices import fetch_experts

        if not self._host.is_open:
            raise EngineError("no model file and no host to fetch experts from")
        start, stop = plan.trunk_range
        what = f"experts [{expert.start}, {expert.stop}) of layers [{start}, {stop})"
        path, received = await fetch_experts(
            self._host.conn, self._host.open_fetch, self._host.close_fetch, self.slices_dir,
            model_hash=plan.model_hash, start=start, stop=stop, first=expert.start, last=expert.stop,
            layer_hashes=plan.layer_hashes,
            on_progress=self._progress(what))
        self.fetched_bytes += received
        log.info("%s ready in %s (%.1f MB received)", what, path.name, received / 1e6)
        return path

    def _report_source(self, member: str, reason: str) -> None:
        """A member sent us a chunk that failed the host's hash: the host hears of it."""
        self._spawn(self._host.tell(m.BadSource(member=member, reason=reason[:300])))

    def _progress(self, what: str) -> Callable[[int, int], None]:
        """A fetch's ``on_progress``: a line in the log every so often with the rate and the time
        left, and the host told (status and top show it; the planner prices moves at the rate)."""
        progress = FetchProgress(what)

        def update(done: int, total: int) -> None:
            progress.update(done, total)
            if progress.log_due():
                log.info("%s", progress.line())
            if progress.report_due():
                self._spawn(self._host.tell(m.Fetching(what=what[:200], done=done, total=total,
                                                       bytes_per_s=progress.bytes_per_s, finished=progress.finished)))
        return update
