"""The host's checks of a trunk's layers (``prove``, ``probe_run``, ``probe_reveal``), answered.

Only the trunk's host may ask (anyone else could use the trunk to time or read the model); the
answer is computed on the compute thread, between batches (swarmctl/node/layer_proof.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from net import messages as m
from net.protocol import StreamClosedError, SwarmProtocol
from swarmctl.node.layer_proof import ProofError, Prover
from swarmctl.trunk.context import TrunkContext
from swarmctl.trunk.host_link import HostLink

log = logging.getLogger("swarmctl.trunk")


class LayerChecks:
    def __init__(self, ctx: TrunkContext, host: HostLink, sources: Callable[[], list[Path]]) -> None:
        """``sources``: the files that may hold the layers asked about, best first."""
        self._executor = ctx.executor
        self._host = host
        self._prover = Prover(sources, ctx.n_threads)

    async def answer(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        kind = type(message).__struct_config__.tag
        reply: m.Message
        if not self._host.is_host(conn):
            reply = m.Error(message=f"only the host sends {kind!r}")
        else:
            try:
                reply = await asyncio.get_running_loop().run_in_executor(self._executor, self._prover.answer, message)
            except ProofError as e:
                reply = m.Error(message=str(e), missing=e.missing)
            except Exception as e:  # noqa: BLE001 - the edge: answer the host, carry on serving
                log.exception("answering the host's %s failed", kind)
                reply = m.Error(message=f"{type(e).__name__}: {e}"[:300])
        if conn.is_open:
            try:
                conn.send(stream_id, m.encode(reply), end=True)
            except StreamClosedError:
                pass
