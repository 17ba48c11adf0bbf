"""The impairing relay's rate cap (net/relay.py, rate_bps): a capped direction carries no more than
its bits per second; datagrams queue behind each other in order, none is dropped. Real UDP
sockets on loopback. (A lower bound on time is what a cap is; no speed is asserted.)"""

from __future__ import annotations

import asyncio
import time

from net.endpoint import Address
from net.relay import ImpairedLink


class Arrivals(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.seen: list[tuple[float, bytes]] = []

    def datagram_received(self, data: bytes, addr) -> None:
        self.seen.append((time.perf_counter(), data))


def test_a_capped_direction_queues_datagrams_at_its_rate_in_order():
    async def scenario():
        loop = asyncio.get_running_loop()
        target, arrivals = await loop.create_datagram_endpoint(Arrivals, local_addr=("127.0.0.1", 0))
        link = ImpairedLink(Address("127.0.0.1", target.get_extra_info("sockname")[1]), rate_bps=800_000)
        relay = await link.start()
        sender, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=(relay.host, relay.port))
        try:
            t0 = time.perf_counter()
            for i in range(25):  # 25 x 1000 bytes = 200 kbit: 0.25 s at 800 kbit/s
                sender.sendto(i.to_bytes(2, "big") + bytes(998))
            while len(arrivals.seen) < 25 and time.perf_counter() - t0 < 10:
                await asyncio.sleep(0.01)
            return t0, arrivals.seen, link.stats
        finally:
            sender.close()
            link.close()
            target.close()

    t0, seen, stats = asyncio.run(scenario())
    assert [int.from_bytes(d[:2], "big") for _, d in seen] == list(range(25))  # all of them, in order
    assert seen[-1][0] - t0 >= 0.24  # the 25th left after the 24 ahead of it: 24 x 10 ms
    assert stats.forwarded == 25 and stats.dropped_loss == 0
