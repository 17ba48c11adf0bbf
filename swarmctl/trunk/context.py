"""What a trunk's parts share, built once by ``TrunkService`` and handed to each part.

``TrunkContext`` holds the trunk's identity, its resources (the compute thread, the event loop,
memory and threads) and its ways out (``connect`` a member, ``connect_host``, ``spawn`` a task);
``TrunkEvents`` is what the parts tell the trunk, which ``TrunkService`` implements. A part takes
the context and the few things that are its own, and keeps no callables it was handed one by one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kernels.devices import Device
from net import messages as m
from net.identity import Credentials
from net.protocol import ConnectionHandler, SwarmProtocol
from plans.plan import Plan
from swarmctl.node.home import NodeConfig


@dataclass(frozen=True)
class TrunkOptions:
    """How the trunk was started (``swarmctl run trunk``'s flags)."""

    memory: int | None = None  # what it offers; None: what is free (on a GPU: the device's, less a reserve)
    n_threads: int | None = None
    idle_timeout: float = 300.0  # a request idle this long is freed
    capture_dir: Path | None = None  # --capture: keep every frame received and sent
    advertise: str | None = None  # the address to register instead of the one it listens on
    device: Device | None = None  # where the slices compute (None: the CPU)
    relay: bool = False  # also relay links for members that cannot punch one (net/turn.py)
    ram: int = 0  # on a GPU: host RAM offered for the routed experts the device cannot hold (--memory there)
    upload_mbit: float = 10.0  # serving held layers to fetching members (swarmctl/trunk/layer_share.py); 0: none


@dataclass(frozen=True)
class TrunkContext:
    name: str
    creds: Credentials
    config: NodeConfig
    model_path: Path
    slices_dir: Path  # layers fetched from the swarm when the model file is missing
    memory: int  # what this trunk offers (bytes)
    n_threads: int | None
    device: Device | None
    executor: Executor  # the compute thread: steps, loading and unloading all run there
    loop: asyncio.AbstractEventLoop  # the trunk's event loop (the compute thread hands work back to it)
    handler: ConnectionHandler  # where frames of every connection go (the trunk)
    spawn: Callable[[Awaitable], None]  # run a coroutine as a task the trunk keeps track of
    connect: Callable[[str, str, ConnectionHandler], Awaitable[SwarmProtocol]]  # (member, address, handler)
    connect_host: Callable[[list[str]], Awaitable[SwarmProtocol]]  # the host, at one of these addresses


class TrunkEvents(Protocol):
    """What the parts tell the trunk."""

    def plan_received(self, plan: Plan) -> None: ...

    def peer_coming(self, message: m.Message) -> None: ...  # punch_with, relay_end

    def fail(self, reason: str) -> None: ...  # this trunk cannot serve: it stops

    def drop_routes(self, reason: str) -> None: ...  # before the layers change: every request retries elsewhere

    async def serving(self, plan: Plan) -> None: ...  # a plan's layers are loaded and confirmed
