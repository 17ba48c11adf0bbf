"""Print a one-line invite code for a friend (run on the host).

examples:
  swarmctl invite                  # one use, valid for an hour
  swarmctl invite --ttl 1d --uses 3
"""

from __future__ import annotations

import argparse
import re
import sys

from swarmctl.errors import UsageError
from swarmctl.node.home import SwarmHome
from swarmctl.node.membership import issue_invite

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    match = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if not match or int(match.group(1)) == 0:
        raise UsageError(f"invalid duration {text!r} (examples: 90s, 30m, 1h, 2d)")
    return int(match.group(1)) * _UNITS[match.group(2) or "s"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ttl", default="1h", help="how long the code stays valid (default 1h)")
    parser.add_argument("--uses", type=int, default=1, help="how many members it can admit (default 1)")
    parser.add_argument("--role", choices=("trunk", "asker"), default="trunk",
                        help="what the joiner may be: trunk (serves layers, and may ask) or asker (only asks); "
                             "signed into its certificate (default trunk)")


def run(args: argparse.Namespace) -> int:
    invite = issue_invite(SwarmHome(), ttl_seconds=parse_duration(args.ttl), uses=args.uses, role=args.role)
    print(invite.encode())
    uses = "one use" if args.uses == 1 else f"{args.uses} uses"
    print(f"valid for {args.ttl}, {uses}, joins as {args.role}; the friend runs: swarmctl join CODE", file=sys.stderr)
    return 0
