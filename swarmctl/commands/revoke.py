"""End a member's access (run on the host). Its live connections close; it cannot reconnect.

example:
  swarmctl revoke alice
"""

from __future__ import annotations

import argparse
import asyncio

from net.endpoint import Address, close, connect_member
from net.protocol import RequestOnlyHandler
from net.wire import encode_control
from swarmctl.home import SwarmHome
from swarmctl.membership import revoke


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the member to revoke")


async def _tell_running_host(home: SwarmHome) -> bool:
    config = home.load_config()
    creds = home.credentials()
    for text in [config.listen.replace("0.0.0.0", "127.0.0.1"), *config.host_addresses]:
        try:
            conn = await connect_member(Address.parse(text), creds, config.name, RequestOnlyHandler())
        except (ConnectionError, OSError):
            continue
        try:
            await conn.request(encode_control({"type": "revoked"}), timeout=5)
            return True
        except (ConnectionError, asyncio.TimeoutError):
            return False
        finally:
            await close(conn)
    return False


def run(args: argparse.Namespace) -> int:
    home = SwarmHome()
    record = revoke(home, args.name)
    live = asyncio.run(_tell_running_host(home))
    print(f"revoked {record.name} (certificate serial {record.serial:x})"
          + ("; the running host closed its connections" if live else "; the host is not running"))
    return 0
