"""Create a swarm on this machine: its CA and the host's identity (this machine becomes the host).

examples:
  swarmctl init --name host --listen 0.0.0.0:7470
  swarmctl init --advertise 192.168.1.20:7470 --model ~/models/llama-3-70b.Q4_K_M.gguf
  swarmctl init --model ~/models/Kimi-K2-UD-IQ2_XXS-00001-of-00006.gguf \
      --model-url https://huggingface.co/unsloth/Kimi-K2-Instruct-GGUF/resolve/main/UD-IQ2_XXS/
"""

from __future__ import annotations

import argparse
import socket

from net.endpoint import Address
from plans import options
from swarmctl.node.home import DEFAULT_PORT, HomeError, SwarmHome
from swarmctl.node.membership import create_swarm
from swarmctl.model_files.models import checked_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="host", help="the host's member name (default: host)")
    parser.add_argument("--swarm", default="swarm", metavar="NAME", help="a name for the swarm")
    parser.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", metavar="HOST:PORT",
                        help=f"UDP address the host listens on (default 0.0.0.0:{DEFAULT_PORT})")
    parser.add_argument("--advertise", action="append", metavar="HOST:PORT",
                        help="address members use to reach the host (repeatable; default: this machine's)")
    parser.add_argument("--model", metavar="PATH", help="the GGUF the swarm runs (default: the bundled SmolLM2)")
    parser.add_argument("--model-url", metavar="URL", default="",
                        help="a folder URL where the model's files (every part, named as here) are served by a "
                             "server that answers Range requests, e.g. a Hugging Face resolve/main/ folder: "
                             "members fetch from it and the host at once")
    options.add_arguments(parser)  # the planner's (plans/options.py)


def _default_advertise(listen: Address) -> list[str]:
    if listen.host not in ("0.0.0.0", "::", ""):
        return [str(listen)]
    addresses = []
    try:  # the address this machine would use to reach the Internet (no packet is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            addresses.append(s.getsockname()[0])
    except OSError:
        pass
    return [str(Address(a, listen.port)) for a in addresses] or [str(Address("127.0.0.1", listen.port))]


def run(args: argparse.Namespace) -> int:
    listen = Address.parse(args.listen, default_port=DEFAULT_PORT)
    advertise = [str(Address.parse(a, default_port=listen.port)) for a in args.advertise] if args.advertise \
        else _default_advertise(listen)
    model = str(checked_model(args.model).resolve()) if args.model else None  # fails now, not at 'run'
    if args.model_url and not args.model_url.startswith(("http://", "https://")):
        raise HomeError(f"--model-url {args.model_url!r} is not an http:// or https:// URL")
    home = SwarmHome()
    config = create_swarm(home, swarm_name=args.swarm, host_name=args.name, listen=str(listen),
                          advertise=advertise, model=model, planner=options.PlannerSettings(**options.given(args)))
    config.model_url = args.model_url
    home.save_config(config)
    print(f"created swarm '{config.swarm_name}' in {home.path}")
    print(f"host: {config.name}, reachable at {', '.join(config.host_addresses)} (UDP)")
    print(f"CA fingerprint: {config.ca_fingerprint}")
    print("next: 'swarmctl run --role host', then 'swarmctl invite' for each friend")
    return 0
