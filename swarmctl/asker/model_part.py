"""An asker needs only its part of the model: the embedding, its head and tail layers, the output
norm and LM head, and the metadata (tokenizer, chat template). A member whose home names no model
file gets exactly that from the swarm's host the first time it asks, each 1 MiB chunk checked
against the host's hash as it arrives, and keeps it in its home (``parts/``) for next time; an
interrupted fetch resumes where it stopped (swarmctl/model_files/distribution.py).

Which file an asker runs, in order: ``--model``, else the model its home names, else the bundled
default where the swarm runs it, else its part of the swarm's model, fetched if not yet here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from kernels.errors import EngineError
from net import messages as m
from net.endpoint import NoAddressAnswered, close
from net.protocol import SwarmProtocol
from net.wire import Frame, FrameType
from plans.plan import Plan
from swarmctl.model_files.distribution import fetch_asker_part
from swarmctl.node.home import SwarmHome
from swarmctl.reaching.host_addresses import connect_host
from swarmctl.model_files.models import DEFAULT_MODEL_FILE, default_model_path

log = logging.getLogger("swarmctl.asker")

PARTS_FOLDER = "parts"


class _FetchStreams:
    """A connection that only fetches: each stream's frames go to its queue; a lost connection
    ends every fetch with a line saying so (not a minute's wait)."""

    def __init__(self) -> None:
        self.queues: dict[int, asyncio.Queue] = {}

    def open(self, conn: SwarmProtocol) -> tuple[int, asyncio.Queue]:
        stream_id = conn.open_stream()
        self.queues[stream_id] = asyncio.Queue()
        return stream_id, self.queues[stream_id]

    def close(self, stream_id: int) -> None:
        self.queues.pop(stream_id, None)

    def connection_made(self, conn: SwarmProtocol) -> None:
        pass

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if stream_id in self.queues:
            self.queues[stream_id].put_nowait(frame)

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        pass

    def connection_lost(self, conn: SwarmProtocol) -> None:
        lost = json.dumps({"type": "error", "message": "the connection to the host was lost"}).encode()
        for queue in self.queues.values():
            queue.put_nowait(Frame(FrameType.CONTROL, lost))


def runs_bundled_default(plan: Plan) -> Path | None:
    """The bundled model, where the swarm runs it (by name; its layers are checked against the plan's
    hashes before use, as any copy's are)."""
    if plan.model_name != DEFAULT_MODEL_FILE:
        return None
    try:
        return default_model_path()
    except EngineError:
        return None


async def asker_part(home: SwarmHome, plan: Plan) -> Path:
    """This member's part of the swarm's model for ``plan``'s head layers: from its home, or fetched
    from the host."""
    folder = home.path / PARTS_FOLDER
    config, creds = home.load_config(), home.credentials()
    handler = _FetchStreams()
    try:
        conn = await connect_host(config, creds, handler)
    except NoAddressAnswered as e:
        raise EngineError(f"no model file here, and the host cannot be reached to fetch this asker's part: {e}") \
            from None

    def progress(have: int, total: int) -> None:
        log.info("fetching the asker's part of %s: %.1f / %.1f MB (%.0f%%)", plan.model_name, have / 1e6,
                 total / 1e6, 100 * have / max(total, 1))

    try:
        path, received = await fetch_asker_part(conn, lambda: handler.open(conn), handler.close, folder,
                                                 model_hash=plan.model_hash, head_layers=plan.head_layers,
                                                 on_progress=progress)
    finally:
        await close(conn)
    if received:
        log.info("the asker's part of %s is in %s (%.1f MB received)", plan.model_name, path, received / 1e6)
    return path
