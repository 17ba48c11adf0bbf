"""Run this node's role until interrupted: the host (membership and plan) or a trunk (a slice
of layers).

examples:
  swarmctl run --role host
  swarmctl run --role trunk --memory 12G
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from kernels.errors import EngineError
from swarmctl.errors import UsageError
from swarmctl.home import SwarmHome

_SIZES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _SIZES else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise UsageError(f"invalid size {text!r} (examples: 512M, 12G)") from None
    if value <= 0:
        raise UsageError(f"invalid size {text!r}")
    return int(value * _SIZES[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["host", "trunk"], required=True)
    parser.add_argument("--memory", metavar="SIZE", help="memory this trunk offers (default: what is available)")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    parser.add_argument("--advertise", metavar="HOST:PORT",
                        help="trunk: the address others should use to reach it (default: where it listens)")
    parser.add_argument("--capture", metavar="DIR", help=argparse.SUPPRESS)  # tests and audits: keep every frame


async def _serve(args: argparse.Namespace, home: SwarmHome) -> str | None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.role == "host":
        from swarmctl.host import run_host

        await run_host(home, stop)
        return None
    from swarmctl.trunk import TrunkService

    service = TrunkService(home, memory=parse_size(args.memory) if args.memory else None, n_threads=args.threads,
                           capture_dir=Path(args.capture) if args.capture else None, advertise=args.advertise)
    service.on_fatal = stop.set
    await service.run(stop)
    return service.fatal


def run(args: argparse.Namespace) -> int:
    logging.getLogger("swarmctl").setLevel(logging.INFO)
    home = SwarmHome()
    config = home.load_config()
    if args.role == "host" and config.role != "host":
        raise EngineError(f"{home.path} belongs to member {config.name}, not to the host")
    fatal = asyncio.run(_serve(args, home))
    if fatal:
        raise EngineError(fatal)
    return 0
