"""Show the swarm's members, their addresses, layer ranges and health.

examples:
  swarmctl status
  swarmctl status --json
"""

from __future__ import annotations

import argparse
import asyncio
import json

from kernels.errors import EngineError
from net.endpoint import NoAddressAnswered, close
from net.protocol import RequestOnlyHandler
from net.wire import decode_control, encode_control
from swarmctl.home import SwarmHome
from swarmctl.host_addresses import connect_host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


async def fetch_status(home: SwarmHome, request: str = "status") -> dict:
    try:
        conn = await connect_host(home.load_config(), home.credentials(), RequestOnlyHandler())
    except NoAddressAnswered as e:
        raise EngineError(f"cannot reach the swarm host: {e}") from None
    try:
        return decode_control((await conn.request(encode_control({"type": request}), timeout=10)).body)
    finally:
        await close(conn)


def format_table(status: dict) -> str:
    rows = [("NAME", "ROLE", "ADDRESS", "LAYERS", "MEMORY", "HEALTH")]
    for m in status["members"]:
        layers = f"[{m['layers'][0]}, {m['layers'][1]})" if m["layers"] else "-"
        if m.get("experts"):  # expert parallelism: this member holds experts of every trunk layer
            layers = f"experts [{m['experts'][0]}, {m['experts'][1]})"
        memory = f"{m['memory'] / 1e9:.1f} GB" if m.get("memory") else "-"
        rows.append((m["name"], m.get("may", m["role"]), m["address"] or "-", layers, memory, m["health"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"swarm {status['swarm']}: model {status['model']} ({status['n_layer']} layers, asker keeps "
             f"{status['head_layers']} at each end), plan v{status['plan_version']}, "
             + ("complete" if status["complete"] else _incomplete(status))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _incomplete(status: dict) -> str:
    if status["missing_layers"]:
        return "INCOMPLETE: no ready trunk for layers " + ", ".join(f"[{a}, {b})" for a, b in status["missing_layers"])
    return "INCOMPLETE: waiting for expert nodes"


def run(args: argparse.Namespace) -> int:
    status = asyncio.run(fetch_status(SwarmHome()))
    status.pop("type", None)
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 0
