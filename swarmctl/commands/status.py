"""Show the swarm's members, their addresses, layer ranges and health, and the plan's links.

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
from net import messages as m
from net.wire import WireError
from plans import units
from swarmctl.model_files.fetch_progress import fetching
from swarmctl.node.home import SwarmHome
from swarmctl.reaching.host_addresses import connect_host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


async def ask_host(home: SwarmHome, request: m.Message, expect: type[m.M]) -> m.M:
    """One request to the swarm's host, and its answer of type ``expect`` (EngineError otherwise)."""
    try:
        conn = await connect_host(home.load_config(), home.credentials(), RequestOnlyHandler())
    except NoAddressAnswered as e:
        raise EngineError(f"cannot reach the swarm host: {e}") from None
    try:
        return m.decode((await conn.request(m.encode(request), timeout=10)).body, expect)
    except (m.Refused, WireError) as e:
        raise EngineError(f"the host: {e}") from None
    finally:
        await close(conn)


async def fetch_status(home: SwarmHome) -> m.Status:
    return await ask_host(home, m.GetStatus(), m.Status)


def format_table(status: m.Status) -> str:
    rows = [("NAME", "ROLE", "ADDRESS", "LAYERS", "DEVICE", "MEMORY", "HEALTH")]
    for member in status.members:
        layers = f"[{member.layers[0]}, {member.layers[1]})" if member.layers else "-"
        if member.experts:  # expert parallelism: this member holds experts of every trunk layer
            layers = f"experts [{member.experts[0]}, {member.experts[1]})"
        memory = units.size(member.memory) if member.memory else "-"
        if member.ram_bytes:  # a GPU trunk's host RAM for the routed experts its device cannot hold
            memory += f" + {units.size(member.ram_bytes)} RAM"
        rows.append((member.name, member.may, member.address or "-", layers, member.device or "-", memory,
                     member_health(member)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"swarm {status.swarm}: model {status.model} ({status.n_layer} layers, asker keeps "
             f"{status.head_layers} at each end), plan v{status.plan_version}, "
             + ("complete" if status.complete else _incomplete(status))
             + (f"; plan {status.staged.replace(':', ' staged, loading beside it:', 1)}" if status.staged else "")]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    # Under the table, after a blank line: stages split between a GPU and the CPU (partial offload)
    # say which layers are where, then the plan's links.
    extras = [f"{member.name}: {member.placement}" for member in status.members if member.placement]
    extras += [f"{member.name}: keeps {member.cached_tokens} prompt tokens for askers' next requests "
               f"({units.size(member.cached_kv_bytes)} of KV cache)"
               for member in status.members if getattr(member, "cached_tokens", 0)]
    extras += format_links(status.links)
    return "\n".join(lines + ([""] + extras if extras else []))


def member_health(member: m.MemberStatus) -> str:
    """The HEALTH cell. An asker serves nothing, so it is never "down": it is an asker, connected
    or last seen so long ago; a member that could serve but is away says when it was last seen."""
    seen = getattr(member, "last_seen_s", None)  # (a host too old to say sends none)
    if member.may == "asker" and member.health in ("up", "down"):
        if member.health == "up":
            return "asker, connected"
        return f"asker, seen {ago(seen)}" if seen is not None else "asker, not seen since the host started"
    if member.health == "down" and seen is not None:
        return f"down, seen {ago(seen)}"
    fetch = fetching(member)
    return f"{member.health}: {fetch}" if fetch else member.health


def ago(seconds: float) -> str:
    """'just now', '40s ago', '2m ago', '3h ago', '2d ago': the largest whole unit."""
    if seconds < 1:
        return "just now"
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{int(seconds // length)}{unit} ago"
    return f"{int(seconds)}s ago"


def with_article(word: str) -> str:
    """'an asker', 'a trunk', 'a host'."""
    return f"{'an' if word[:1].lower() in 'aeiou' and word else 'a'} {word}"


def format_links(links: list[m.LinkStatus]) -> list[str]:
    """The plan's links under the members table: path, round trip, throughput, and whether each
    figure was measured or is the planner's estimate (plans/links.py says how it estimates)."""
    if not links:
        return []
    rows = [("HOP", "LINK", "PATH", "RTT", "THROUGHPUT", "BASIS")]
    for i, link in enumerate(links, 1):
        rtt = f"{link.rtt_ms:.1f} ms" if link.rtt_ms is not None else "-"
        rate = units.rate(link.bandwidth_mb_s) if link.bandwidth_mb_s is not None else "-"
        if link.measured and not link.bandwidth_measured and link.bandwidth_mb_s is not None:
            rate += " (default)"
        basis = "measured" if link.measured else f"estimated ({link.basis})"
        rows.append((str(i), f"{link.source} → {link.target}", link.path, rtt, rate, basis))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _incomplete(status: m.Status) -> str:
    if status.missing_layers:
        return "INCOMPLETE: no ready trunk for layers " + ", ".join(f"[{a}, {b})" for a, b in status.missing_layers)
    return "INCOMPLETE: waiting for expert nodes"


def as_json(status: m.Status) -> dict:
    """What ``--json`` prints: the host's status reply without its message type."""
    shown = m.as_dict(status)
    shown.pop("type")
    return shown


def run(args: argparse.Namespace) -> int:
    status = asyncio.run(fetch_status(SwarmHome()))
    if args.json:
        print(json.dumps(as_json(status), indent=2))
    else:
        print(format_table(status))
    return 0
