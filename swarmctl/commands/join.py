"""Join a swarm with an invite code. Makes this machine's key here; only a signed certificate
comes back from the host.

examples:
  swarmctl join swarm1.eyJ2Ijo... --name alice
  swarmctl join CODE --name bob --listen 0.0.0.0:7471 --model ~/models/the-same-model.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import socket

from net.endpoint import Address
from net.invite import Invite
from swarmctl.node.home import DEFAULT_PORT, SwarmHome
from swarmctl.node.joiner import join_swarm
from swarmctl.model_files.models import resolve_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("code", help="the invite code from 'swarmctl invite'")
    parser.add_argument("--name", default=None, help="your member name (default: this machine's hostname)")
    parser.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT + 1}", metavar="HOST:PORT",
                        help=f"UDP address to serve layers on (default 0.0.0.0:{DEFAULT_PORT + 1})")
    parser.add_argument("--model", metavar="PATH", help="your copy of the swarm's GGUF (default: the bundled one)")


def _default_name() -> str:
    name = "".join(c if c.isalnum() else "-" for c in socket.gethostname().lower()).strip("-")
    return (name or "member")[:32]


def run(args: argparse.Namespace) -> int:
    invite = Invite.decode(args.code)
    listen = Address.parse(args.listen, default_port=DEFAULT_PORT + 1)
    model = str(resolve_model(args.model).resolve()) if args.model else None
    home = SwarmHome()
    config = asyncio.run(join_swarm(home, invite, name=args.name or _default_name(), listen=str(listen), model=model))
    from net.identity import member_role

    role = member_role(home.credentials().cert)
    from swarmctl.commands.status import with_article

    print(f"joined swarm '{config.swarm_name}' as {config.name}, {with_article(role)} (state in {home.path})")
    print("next: 'swarmctl run --role trunk' to serve layers, or 'swarmctl ask \"...\"'" if role == "trunk" else
          "next: 'swarmctl ask \"...\"' (this member may ask, not serve)")
    return 0
