"""What one datagram of an activation hop costs this machine's CPU, measured.

Moving activations over our QUIC link costs CPU per datagram (packet building and parsing,
congestion control, AES-GCM, header protection, syscalls), on the sender and on the receiver; at
a path's 1350-byte datagrams a 28 KB activation row is 23 of them. The planner charges a
hop that cost (plans/cost.py), so each member measures it once at start:

    cost = await measure_datagram_cost()      # DatagramCost(us_per_datagram, datagram_bytes, ...)

How: a sender and a receiver in this process, over real QUIC with mutual TLS (throwaway
certificates) on loopback, at the datagram size paths use (not loopback's larger one), move
``PAYLOAD`` bytes as one frame; the process's CPU time over the datagrams that carried it is the
cost of one datagram with both ends' work in it (a hop's sender and receiver, when both are
machines like this one). The best of a few runs: another process can only add time.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from .endpoint import Address, close, connect_member, serve_member
from .identity import Credentials, make_ca, new_private_key, sign_member
from .protocol import RequestOnlyHandler, SwarmProtocol
from .tls import DEFAULT_DATAGRAM_SIZE
from .wire import Frame, FrameType, encode_control, encode_frame

PAYLOAD = 256 * 1024  # bytes per run: ~200 datagrams at 1350, a few tens of ms
RUNS = 3
QUIC_OVERHEAD = 60  # bytes of a 1-RTT packet that are not stream data (header, frame header, AEAD tag), about


@dataclass(frozen=True)
class DatagramCost:
    us_per_datagram: float  # CPU of one datagram, sender's and receiver's work together
    datagram_bytes: int  # the datagram size it was measured at
    runs_ms: tuple[float, ...]  # the CPU time of each run

    @staticmethod
    def datagrams(n_bytes: int, datagram_bytes: int = DEFAULT_DATAGRAM_SIZE) -> int:
        """Datagrams that carry ``n_bytes`` of a frame."""
        return max(1, math.ceil(n_bytes / max(1, datagram_bytes - QUIC_OVERHEAD)))


class _Acker(RequestOnlyHandler):
    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        conn.send(stream_id, encode_control({"type": "ok"}), end=True)


def _throwaway_credentials() -> tuple[Credentials, Credentials]:
    ca_key, ca = make_ca("packet-cost")
    pair = []
    for name in ("receiver", "sender"):
        key = new_private_key()
        pair.append(Credentials(key, sign_member(ca_key, ca, key.public_key(), name), ca))
    return pair[0], pair[1]


async def measure_datagram_cost(datagram_bytes: int = DEFAULT_DATAGRAM_SIZE, payload: int = PAYLOAD,
                                runs: int = RUNS) -> DatagramCost:
    receiver, sender = _throwaway_credentials()
    server = await serve_member(Address("127.0.0.1", 0), receiver, _Acker(), client_check=lambda cert: None,
                                max_datagram_size=datagram_bytes)
    port = server._transport.get_extra_info("sockname")[1]
    conn = await connect_member(Address("127.0.0.1", port), sender, "receiver", RequestOnlyHandler(),
                                max_datagram_size=datagram_bytes)
    frame = encode_frame(FrameType.ACTIVATION, bytes(payload))
    try:
        await conn.request(frame, timeout=60)  # warms the congestion window up; not counted
        cpu_ms = []
        for _ in range(runs):
            t0 = time.process_time()
            await conn.request(frame, timeout=60)
            cpu_ms.append((time.process_time() - t0) * 1e3)
    finally:
        await close(conn)
        server.close()
    n = DatagramCost.datagrams(len(frame), datagram_bytes)
    return DatagramCost(min(cpu_ms) * 1e3 / n, datagram_bytes, tuple(round(ms, 2) for ms in cpu_ms))


def main() -> None:
    """``python -m net.packet_cost``: this machine's figure."""
    cost = asyncio.run(measure_datagram_cost())
    print(f"{cost.us_per_datagram:.1f} us per {cost.datagram_bytes}-byte datagram (both ends; runs "
          f"{', '.join(f'{ms:.1f}' for ms in cost.runs_ms)} ms of CPU for {PAYLOAD // 1024} KB)")


if __name__ == "__main__":
    main()
