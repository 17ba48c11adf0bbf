"""Run this node's role until interrupted: the host (membership and plan) or a trunk (a slice
of layers).

examples:
  swarmctl run --role host
  swarmctl run --role host --upload-mbit 40   (slices to members with no model file at 40 Mbit/s at most)
  swarmctl run --role trunk --memory 12G
  swarmctl run --role trunk --device cuda:0 --gpu-memory 20G
  swarmctl run --role trunk --device cuda:0 --memory 96G   (a mixture of experts: the routed experts
                                                          the card cannot hold, in 96 GB of host RAM)
  swarmctl run --role trunk --relay        (a reachable machine that also relays for NATed ones)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
from pathlib import Path

from kernels.errors import EngineError
from swarmctl.commands.options import add_device_option
from swarmctl.errors import UsageError
from swarmctl.node.home import SwarmHome

log = logging.getLogger("swarmctl.trunk")

# Sizes read the way the rest of swarmctl prints them (status, plan, top and the planner all
# count GB as 10^9 bytes): "12G" and "12GB" are 12 GB and 'status' shows 12.0 GB back. The binary
# units say so explicitly: "12GiB" (or "12Gi") is 12 × 2^30 bytes, shown as 12.9 GB.
_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(I?)B?|B)?", re.IGNORECASE)
MIN_BARE_BYTES = 2**20  # "--memory 12" is 12 bytes: far more likely a missing unit than meant


def parse_size(text: str) -> int:
    """Bytes from a size such as 512M, 12G, 12GB, 1.5T or 16GiB (see above); a bare number is bytes."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UsageError(f"invalid size {text!r} (examples: 512M, 12G, 16GiB)")
    number, unit, binary = match.group(1), (match.group(2) or "").upper(), bool(match.group(3))
    value = float(number) * (_BINARY[unit] if binary else _DECIMAL[unit])
    if value <= 0:
        raise UsageError(f"invalid size {text!r}: it must be more than 0")
    if not unit and value < MIN_BARE_BYTES:
        raise UsageError(f"invalid size {text!r}: that is {int(value)} bytes; give a unit (examples: 512M, 12G)")
    return int(value)


def _size_text(text: str) -> str:
    """argparse type for --memory: a bad size is a usage error before anything starts."""
    try:
        parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _upload_rate(text: str) -> float:
    """argparse type for --upload-mbit: a rate of 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: Mbit/s, 0 or more (0 serves no layers)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["host", "trunk"], required=True)
    parser.add_argument("--memory", metavar="SIZE", type=_size_text,
                        help="memory this trunk offers, e.g. 12G: 12 GB of 10^9 bytes, as 'status' shows it (16GiB "
                             "for binary units; default: what is available). On a GPU: host RAM for the routed "
                             "experts of a mixture-of-experts model that the device cannot hold (default: none)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: $SWARMCTL_THREADS, else every core this process may use)")
    add_device_option(parser, "a trunk's slices")
    parser.add_argument("--gpu-memory", metavar="SIZE", type=_size_text,
                        help="trunk on a GPU: device memory its slices may take (default: what the device reports "
                             "free, less max(512 MiB, 5%%) for compute buffers and the driver)")
    parser.add_argument("--advertise", metavar="HOST:PORT",
                        help="trunk: the address others should use to reach it (default: where it listens)")
    parser.add_argument("--relay", action="store_true",
                        help="trunk: also relay links that hole punching cannot open (symmetric NATs); "
                             "for a machine others can reach: it forwards their encrypted datagrams")
    parser.add_argument("--upload-mbit", type=_upload_rate, default=None, metavar="MBIT",
                        help="upload rate in Mbit/s for serving model layers to members fetching them: a trunk's "
                             "the layers it holds (default 10; 0: serve none), the host's every slice it sends "
                             "(default: no cap)")
    parser.add_argument("--capture", metavar="DIR", help=argparse.SUPPRESS)  # tests and audits: keep every frame
    # host: write the address it listens on to FILE once it does (a local swarm waits for it: swarmctl/node/local_swarm.py)
    parser.add_argument("--ready-file", metavar="FILE", help=argparse.SUPPRESS)


async def _serve(args: argparse.Namespace, home: SwarmHome) -> str | None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.role == "host":
        from swarmctl.host import run_host

        if args.upload_mbit == 0:
            raise UsageError("--upload-mbit 0 would leave members with no model file nothing to fetch from; "
                             "the host's cap must be above 0 (leave it out for none)")
        await run_host(home, stop, Path(args.ready_file) if args.ready_file else None, args.upload_mbit)
        return None
    from kernels.devices import choose_device
    from swarmctl.trunk import TrunkService
    from swarmctl.trunk.context import TrunkOptions
    from swarmctl.trunk.layer_share import DEFAULT_UPLOAD_MBIT

    device = choose_device(args.device)
    if args.gpu_memory and device.is_cpu:
        raise UsageError(f"--gpu-memory is for a trunk on a GPU; this one computes on the CPU (--device "
                         f"{args.device}): offer host memory with --memory")
    # What the trunk offers the planner: host memory on the CPU, device memory on a GPU (None: what
    # is there now, less a reserve on a GPU).
    # On a GPU, --memory is host RAM for the routed experts of a mixture-of-experts model that the
    # device cannot hold (kernels/device_split.py), as llama.cpp's --override-tensor exps=CPU does.
    offered = args.memory if device.is_cpu else args.gpu_memory
    memory = parse_size(offered) if offered else None
    ram = parse_size(args.memory) if args.memory and not device.is_cpu else 0
    options = TrunkOptions(memory=memory, n_threads=args.threads, device=device,
                           capture_dir=Path(args.capture) if args.capture else None, advertise=args.advertise,
                           relay=args.relay, ram=ram,
                           upload_mbit=DEFAULT_UPLOAD_MBIT if args.upload_mbit is None else args.upload_mbit)
    service = TrunkService(home, options, stop)
    log.info("trunk computes on %s (%s)%s", device.label, device.description or device.name,
             f", offering {service.memory / 1e9:.1f} GB of its memory" if not device.is_cpu else "")
    await service.run()
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
