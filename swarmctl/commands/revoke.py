"""End a member's access (run on the host). Its live connections close; it cannot reconnect.

example:
  swarmctl revoke alice
"""

from __future__ import annotations

import argparse
import asyncio

from net import messages as m
from net.endpoint import NoAddressAnswered, close
from net.protocol import RequestOnlyHandler
from net.wire import WireError
from swarmctl.node.home import SwarmHome
from swarmctl.reaching.host_addresses import connect_host
from swarmctl.node.membership import revoke


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the member to revoke")


async def _tell_running_host(home: SwarmHome) -> int | None:
    """How many of the member's connections the running host closed (None: no host answered)."""
    try:  # revoke runs on the host: host_addresses puts its own listen address first
        conn = await connect_host(home.load_config(), home.credentials(), RequestOnlyHandler())
    except NoAddressAnswered:
        return None
    try:
        reply = m.decode((await conn.request(m.encode(m.Revoked()), timeout=5)).body, m.Ok)
        return reply.closed or 0
    except (ConnectionError, asyncio.TimeoutError, m.Refused, WireError):
        return None
    finally:
        await close(conn)


def run(args: argparse.Namespace) -> int:
    home = SwarmHome()
    record = revoke(home, args.name)
    closed = asyncio.run(_tell_running_host(home))
    if closed is None:
        done = ("; no host answered: a running one finds it in its member records within seconds and closes "
                "the member's connections, one that starts refuses the certificate")
    else:
        done = f"; the running host closed its {closed} connection{'' if closed == 1 else 's'} and tells the trunks"
    print(f"revoked {record.name} (certificate serial {record.serial:x}){done}")
    return 0
