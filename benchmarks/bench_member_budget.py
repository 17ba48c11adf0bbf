"""Issue 14, finding 5, measured: one member sends prefills with fresh request ids to a trunk that
serves every trunk layer under the default plan (4 requests × 4096 tokens of KV reserved), as
fast as the trunk takes them; what the trunk holds afterwards (KV bytes, RSS) and what it refused.

    python -m benchmarks.bench_member_budget [--prefills 200] [--tokens 2] [--out FILE]

Prints JSON. A real swarm on loopback (host + 1 trunk + the member), set up through the CLI.

Measured (2 shared cores, 200 prefills of 2 tokens, the trunk holding layers [4, 26) of SmolLM2):
without the budget all 200 ran, KV 865 MB, RSS 131 -> 1013 MB; with it 128 ran and 72 were
refused ("over budget ..."), KV 554 MB (the member's limit: 2 x 4 x 4096 tokens of KV), RSS
132 -> 693 MB (results/bench_member_budget.json).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import emit_json
from net.endpoint import Address, ask_member, close, connect_member
from net.protocol import RequestOnlyHandler
from net.wire import ActivationPacket, PacketKind, decode_control, decode_packet, encode_control, encode_packet
from swarmctl.node.home import SwarmHome
from harness.swarm import Swarm

CONNECTIONS = 4  # (QUIC grants 128 streams per connection at a time)


class _Count(RequestOnlyHandler):
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.results = 0

    def frame_received(self, conn, stream_id, frame) -> None:
        packet = decode_packet(frame.body)
        if packet.kind == PacketKind.ERROR:
            self.errors.append(packet.message)
        else:
            self.results += 1


async def _keep_alive(conn) -> None:
    while conn.is_open:
        try:
            await asyncio.wait_for(conn.ping(), 2)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(1.0)


async def attack(swarm: Swarm, n: int, n_tokens: int) -> dict:
    creds = SwarmHome(swarm.homes["eve"]).credentials()
    conn = await connect_member(Address("127.0.0.1", swarm.host_port), creds, "host", RequestOnlyHandler())
    plan = decode_control((await conn.request(encode_control({"type": "get_plan"}))).body)["plan"]
    await close(conn)
    stage = plan["stages"][0]
    address = Address.parse(stage["address"])
    before = await ask_member(address, creds, stage["member"], {"type": "stats"})
    handler = _Count()
    conns = [await connect_member(address, creds, stage["member"], handler) for _ in range(CONNECTIONS)]
    await conns[0].request(encode_control({"type": "subscribe", "session": "e0e0"}), timeout=10)
    keep_alive = [asyncio.ensure_future(_keep_alive(c)) for c in conns]  # a long batch must not idle them out
    x = np.random.default_rng(0).standard_normal((n_tokens, 576)).astype(np.float32)
    t0 = time.perf_counter()
    for i in range(n):
        c = conns[i % CONNECTIONS]
        c.send(c.open_stream(), encode_packet(ActivationPacket(PacketKind.PREFILL, secrets.token_bytes(16),
                                                               plan["version"], stage["start"], 0, x,
                                                               reply_to="e0e0")))
    deadline = time.monotonic() + 300
    while len(handler.errors) + handler.results < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    seconds = time.perf_counter() - t0
    after = await ask_member(address, creds, stage["member"], {"type": "stats"})
    for task in keep_alive:
        task.cancel()
    for c in conns:
        await close(c)
    over = [m for m in handler.errors if "over budget" in m]
    return {
        "prefills": n, "tokens_each": n_tokens, "stage_layers": [stage["start"], stage["stop"]],
        "answered_s": round(seconds, 2), "ran": handler.results, "refused_over_budget": len(over),
        "other_errors": len(handler.errors) - len(over), "first_refusal": over[0] if over else None,
        "kv_bytes_before": before["kv_bytes"], "kv_bytes_after": after["kv_bytes"],
        "rss_before": before["rss"], "rss_after": after["rss"],
        "budget": after.get("budget"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefills", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        swarm = Swarm(Path(root))
        try:
            swarm.init()
            swarm.start_host()
            swarm.wait_host()
            swarm.join("trunk-a")
            swarm.join("eve", role="asker")
            swarm.start_trunk("trunk-a", capture=False)
            swarm.wait_complete(1)
            emit_json(asyncio.run(attack(swarm, args.prefills, args.tokens)), args.out)
        finally:
            swarm.close()


if __name__ == "__main__":
    main()
