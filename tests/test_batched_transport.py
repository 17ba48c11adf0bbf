"""Datagrams by the batch (issue 32 item 1, net/batch.py): the reader drains what waits on the
socket and each connection transmits once per batch. Real sockets on loopback; the speed is
benchmarks/bench_transport.py's to show, not asserted here."""

from __future__ import annotations

import asyncio
import socket

from net import batch
from net.endpoint import Address, close, connect_member, serve_member
from net.identity import Credentials, make_ca, new_private_key, sign_member
from net.protocol import RequestOnlyHandler
from net.wire import FrameType, decode_control, encode_control, encode_frame


class Echo(RequestOnlyHandler):
    """Answers a frame with its length and a sample of its bytes."""

    def frame_received(self, conn, stream_id, frame) -> None:
        body = frame.body
        conn.send(stream_id, encode_control({"type": "echo", "n": len(body), "sum": sum(body[::4096])}), end=True)


async def _link():
    """A server and a member connected to it over real QUIC with mutual TLS, at Ethernet-sized
    datagrams (what non-loopback paths use): (server, its port, the member's connection)."""
    ca_key, ca = make_ca("batch")
    creds = {}
    for name in ("host", "member"):
        key = new_private_key()
        creds[name] = Credentials(key, sign_member(ca_key, ca, key.public_key(), name), ca)
    server = await serve_member(Address("127.0.0.1", 0), creds["host"], Echo(), client_check=lambda cert: None,
                                max_datagram_size=1350)
    port = server._transport.get_extra_info("sockname")[1]
    conn = await connect_member(Address("127.0.0.1", port), creds["member"], "host", RequestOnlyHandler(),
                                max_datagram_size=1350)
    return server, port, conn


def _udp_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for s in (a, b):
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    return a, b


class Conn:
    def __init__(self) -> None:
        self.received, self.flushes = [], 0

    def flush(self) -> None:
        self.flushes += 1


def test_a_wake_up_reads_what_waits_and_each_connection_flushes_once():
    sender, receiver = _udp_pair()
    for i in range(100):
        sender.sendto(bytes([i]) * 10, receiver.getsockname())
    conns = [Conn(), Conn()]

    def deliver(data: bytes, addr) -> None:
        conn = conns[data[0] % 2]
        conn.received.append(data[0])
        assert batch.defer(conn)  # inside a batch: deferred, not flushed now

    first, addr = receiver.recvfrom(100)  # what asyncio's reader hands the protocol
    batch.drain(receiver, first, addr, deliver)
    assert conns[0].received + conns[1].received and \
        sorted(conns[0].received + conns[1].received) == list(range(batch.MAX_BATCH))  # bounded per wake-up
    assert [c.flushes for c in conns] == [1, 1] and not batch.active()
    rest = []
    batch.drain(receiver, *receiver.recvfrom(100), lambda d, a: rest.append(d[0]))
    assert rest == list(range(batch.MAX_BATCH, 100))  # the next wake-up takes the rest
    assert not batch.defer(Conn())  # outside a batch: the caller flushes at once
    sender.close(), receiver.close()


def test_a_frame_of_a_megabyte_crosses_a_real_link_intact_at_ethernet_sized_datagrams():
    """The whole path (batched reads, deferred transmits) under mutual TLS: the frame arrives
    byte for byte, three times over."""
    payload = bytes(range(256)) * 4096

    async def scenario():
        server, _, conn = await _link()
        try:
            return [decode_control((await conn.request(encode_frame(FrameType.DATA, payload))).body) for _ in range(3)]
        finally:
            await close(conn)
            server.close()

    answers = asyncio.run(scenario())
    assert answers == [{"type": "echo", "n": len(payload), "sum": sum(payload[::4096])}] * 3


def test_a_burst_of_tiny_datagrams_at_the_socket_does_not_stall_a_transfer():
    """Bad input: up to 20,000 one-byte datagrams from a stranger land on the server's socket while
    a member moves 1 MB on it; the batches they fill are bounded, the transfer completes intact."""

    async def flood(port: int, stop: asyncio.Event) -> int:
        sock, sent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 0
        sock.setblocking(False)
        while not stop.is_set() and sent < 20000:
            for _ in range(200):
                try:
                    sock.sendto(b"x", ("127.0.0.1", port))
                    sent += 1
                except BlockingIOError:
                    break
            await asyncio.sleep(0)
        sock.close()
        return sent

    async def scenario():
        server, port, conn = await _link()
        stop = asyncio.Event()
        flooding = asyncio.ensure_future(flood(port, stop))
        try:
            answer = decode_control((await conn.request(encode_frame(FrameType.DATA, bytes(1 << 20)), timeout=30)).body)
        finally:
            stop.set()
            sent = await flooding
            await close(conn)
            server.close()
        return answer, sent

    answer, sent = asyncio.run(scenario())
    assert answer == {"type": "echo", "n": 1 << 20, "sum": 0} and sent > 1000


def test_only_a_socket_the_transport_reads_is_read_for_more():
    """A transport with no socket of its own (harness/sim's in-memory network) gets its datagrams
    from elsewhere: reading the socket behind it would only fail, once per datagram."""
    sock, other = _udp_pair()

    async def scenario():
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(asyncio.DatagramProtocol, sock=sock)
        try:
            return batch.readable(transport, sock), batch.readable(asyncio.DatagramTransport(), sock)
        finally:
            transport.close()

    real, in_memory = asyncio.run(scenario())
    other.close()
    assert real is sock and in_memory is None
