"""Transport alone: time to move one activation frame between two processes on loopback.

    python benchmarks/bench_transport.py [--repeats 7]

Our QUIC link (aioquic, mutual TLS, the swarm's framing) at several maximum datagram sizes, next
to plain TCP + TLS 1.3 on loopback. Each trial sends one frame of the given size and waits for a
one-frame acknowledgement from the receiving process; medians over repeats. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from net.endpoint import Address, close, connect_member, serve_member  # noqa: E402
from net.identity import (Credentials, load_cert, load_private_key, make_ca, new_private_key, save_cert,  # noqa: E402
                          save_private_key, sign_member)
from net.protocol import RequestOnlyHandler, SwarmProtocol  # noqa: E402
from net.wire import FRAME_HEADER, Frame, FrameType, encode_control, encode_frame  # noqa: E402

SIZES = {"16KB": 16 * 1024, "28KB": 28 * 1024, "1MB": 1024 * 1024, "16MB": 16 * 1024 * 1024}  # 28 KB: a Kimi row in f32
DATAGRAMS = [1200, 1350, 1452, 4096, 16000, 16384, 32768]


def make_credentials(folder: Path) -> None:
    ca_key, ca = make_ca("bench")
    save_cert(folder / "ca.pem", ca)
    for name in ("receiver", "sender"):
        key = new_private_key()
        save_private_key(folder / f"{name}.key", key)
        save_cert(folder / f"{name}.pem", sign_member(ca_key, ca, key.public_key(), name))


def credentials(folder: Path, name: str) -> Credentials:
    return Credentials(load_private_key(folder / f"{name}.key"), load_cert(folder / f"{name}.pem"),
                       load_cert(folder / "ca.pem"))


class Acker:
    """Receiver side: answer every activation frame with a small control frame on its stream."""

    def connection_made(self, conn: SwarmProtocol) -> None:
        pass

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        conn.send(stream_id, encode_control({"type": "ack", "bytes": len(frame.body)}))

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        pass

    def connection_lost(self, conn: SwarmProtocol) -> None:
        pass


async def serve_quic(folder: Path, port: int, datagram: int) -> None:
    creds = credentials(folder, "receiver")
    await serve_member(Address("127.0.0.1", port), creds, Acker(), client_check=lambda cert: None,
                       max_datagram_size=datagram)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def serve_tls(folder: Path, port: int) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(folder / "receiver.pem", folder / "receiver.key")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                length, _ = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
                await reader.readexactly(length - 1)
                writer.write(b"k")
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
    print("ready", flush=True)
    await asyncio.Event().wait()


def start_receiver(folder: Path, mode: str, port: int, datagram: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--port", str(port), "--datagram",
                          str(datagram), "--creds", str(folder)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


async def time_quic(folder: Path, port: int, datagram: int, size: int, repeats: int) -> list[float]:
    creds = credentials(folder, "sender")
    conn = await connect_member(Address("127.0.0.1", port), creds, "receiver", RequestOnlyHandler(),
                                max_datagram_size=datagram)
    frame = encode_frame(FrameType.ACTIVATION, os.urandom(size))
    times = []
    try:
        for _ in range(repeats + 1):  # the first trial warms the congestion window up; dropped
            t0 = time.perf_counter()
            await conn.request(frame, timeout=120)
            times.append(time.perf_counter() - t0)
    finally:
        await close(conn)
    return times[1:]


async def time_tls(folder: Path, port: int, size: int, repeats: int) -> list[float]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(folder / "ca.pem")
    ctx.load_cert_chain(folder / "sender.pem", folder / "sender.key")
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="receiver")
    frame = encode_frame(FrameType.ACTIVATION, os.urandom(size))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        writer.write(frame)
        await writer.drain()
        await reader.readexactly(1)
        times.append(time.perf_counter() - t0)
    writer.close()
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--serve", choices=["quic", "tls"])
    p.add_argument("--port", type=int)
    p.add_argument("--datagram", type=int, default=1350)
    p.add_argument("--creds")
    p.add_argument("--datagrams", default=",".join(map(str, DATAGRAMS)), help="datagram sizes to time (comma-separated)")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"frame sizes to time, of {', '.join(SIZES)}")
    args = p.parse_args()
    if args.serve:
        coro = serve_quic(Path(args.creds), args.port, args.datagram) if args.serve == "quic" else \
            serve_tls(Path(args.creds), args.port)
        asyncio.run(coro)
        return

    from swarmctl.node.local_swarm import free_udp_port

    folder = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    make_credentials(folder)
    results: dict = {"repeats": args.repeats, "quic": {}, "tcp_tls": {}}
    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    for datagram in [int(d) for d in args.datagrams.split(",")]:
        port = free_udp_port()
        receiver = start_receiver(folder, "quic", port, datagram)
        try:
            row = {}
            for label, size in sizes.items():
                try:
                    times = asyncio.run(time_quic(folder, port, datagram, size, args.repeats))
                except (ConnectionError, asyncio.TimeoutError) as e:  # reported, not hidden
                    row[label] = {"error": str(e)}
                    continue
                row[label] = {"median_ms": statistics.median(times) * 1e3,
                              "mb_per_s": size / statistics.median(times) / 1e6}
            results["quic"][f"datagram_{datagram}"] = row
        finally:
            receiver.kill()
    port = free_udp_port()
    receiver = start_receiver(folder, "tls", port, 0)
    try:
        for label, size in sizes.items():
            times = asyncio.run(time_tls(folder, port, size, args.repeats))
            results["tcp_tls"][label] = {"median_ms": statistics.median(times) * 1e3,
                                         "mb_per_s": size / statistics.median(times) / 1e6}
    finally:
        receiver.kill()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
