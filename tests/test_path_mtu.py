"""Path MTU discovery (issue 32 item 2, net/path_mtu.py): a member sizes its datagrams to what
the path carries, as answered probes show, and falls back to the Internet-safe default where the
path drops large datagrams. The paths are the project's impairing relay on loopback (net/relay.py)
set to drop datagrams above an MTU, as a tunnel or a smaller link further on does: real sockets,
real QUIC with mutual TLS."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from net import path_mtu
from net.endpoint import Address, close
from net.identity import Credentials, make_ca, new_private_key, sign_member
from net.protocol import RequestOnlyHandler
from net.punch import connect_on, open_shared, serve_on
from net.relay import ImpairedLink
from net.tls import DEFAULT_DATAGRAM_SIZE
from net.turn import udp_socket
from net.wire import FrameType, decode_control, encode_control, encode_frame

JUMBO, ETHERNET = 9000 - 28, 1500 - 28


def _creds() -> dict[str, Credentials]:
    ca_key, ca = make_ca("mtu")
    out = {}
    for name in ("alice", "bob"):
        key = new_private_key()
        out[name] = Credentials(key, sign_member(ca_key, ca, key.public_key(), name), ca)
    return out


class Echo(RequestOnlyHandler):
    def frame_received(self, conn, stream_id, frame) -> None:
        conn.send(stream_id, encode_control({"type": "echo", "n": len(frame.body)}), end=True)


async def _over_a_path(mtu: int, sizes: list[int], transfer: bool = True):
    """alice probes bob through a relay that drops datagrams over ``mtu``, then sends bob 1 MB on
    a QUIC connection sized by what the probe found. Returns (size, seconds the probe took, the
    echo, the largest datagram the relay forwarded)."""
    creds = _creds()
    alice, bob = await open_shared(udp_socket("127.0.0.1", 0)), await open_shared(udp_socket("127.0.0.1", 0))
    # (bob accepts as a member listening on a non-loopback address does: at the default size,
    # which aioquic fixes for all of a server's connections)
    serve_on(bob, creds["bob"], Echo(), client_check=lambda cert: None, max_datagram_size=DEFAULT_DATAGRAM_SIZE)
    link = ImpairedLink(Address("127.0.0.1", bob.local_address.port), mtu=mtu, record=True)
    relay = await link.start()
    try:
        t0 = time.perf_counter()
        size = await alice.datagram_size_to(relay, sizes)
        took = time.perf_counter() - t0
        echo = None
        if transfer:
            conn = await connect_on(alice, relay, creds["alice"], "bob", RequestOnlyHandler(), max_datagram_size=size)
            try:
                echo = decode_control((await conn.request(encode_frame(FrameType.DATA, bytes(1 << 20)), timeout=20)).body)
            finally:
                await close(conn)
        largest = max(len(d) for d in link.recorded if d[:1] != b"\x00") if transfer else 0
        return size, took, echo, largest
    finally:
        link.close()
        alice.close()
        bob.close()


@pytest.mark.skipif(sys.platform != "linux", reason="Don't Fragment is set through Linux's socket options")
def test_a_jumbo_path_is_used_whole():
    size, _, echo, largest = asyncio.run(_over_a_path(9000, [JUMBO, ETHERNET]))
    assert size == JUMBO and echo == {"type": "echo", "n": 1 << 20}
    assert ETHERNET < largest <= JUMBO  # the connection did send datagrams above Ethernet's size


@pytest.mark.skipif(sys.platform != "linux", reason="Don't Fragment is set through Linux's socket options")
def test_a_path_that_drops_large_datagrams_falls_back_size_by_size():
    size, took, echo, largest = asyncio.run(_over_a_path(1400, [JUMBO, ETHERNET]))
    assert size == DEFAULT_DATAGRAM_SIZE and echo == {"type": "echo", "n": 1 << 20} and largest <= 1400
    assert took < 2 * path_mtu.PROBE_WAIT_S + 0.5  # two unanswered sizes, a quarter second each


@pytest.mark.skipif(sys.platform != "linux", reason="Don't Fragment is set through Linux's socket options")
def test_a_plain_ethernet_path_gets_its_1472_bytes():
    size, _, echo, largest = asyncio.run(_over_a_path(1500, [JUMBO, ETHERNET]))
    assert size == ETHERNET and echo == {"type": "echo", "n": 1 << 20} and DEFAULT_DATAGRAM_SIZE < largest <= 1500


def test_what_is_probed_comes_from_the_kernel_and_loopback_is_not_probed(monkeypatch):
    assert path_mtu.candidates("127.0.0.1", 9) == []
    if sys.platform == "linux":
        assert path_mtu.kernel_path_mtu("127.0.0.1", 9) >= 65535  # the loopback interface's MTU (64 KiB)
        monkeypatch.setattr(path_mtu, "kernel_path_mtu", lambda host, port: 9000)
        assert path_mtu.candidates("192.0.2.7", 9) == [JUMBO, ETHERNET]
        monkeypatch.setattr(path_mtu, "kernel_path_mtu", lambda host, port: 1500)
        assert path_mtu.candidates("192.0.2.7", 9) == [ETHERNET]
        assert path_mtu.candidates("2001:db8::7", 9) == [1500 - 48]
        monkeypatch.setattr(path_mtu, "kernel_path_mtu", lambda host, port: 1280)  # a tunnel: the default, no probe
        assert path_mtu.candidates("192.0.2.7", 9) == []
        monkeypatch.setenv("SWARMCTL_MAX_DATAGRAM", "4000")  # the user's word for every path
        monkeypatch.setattr(path_mtu, "kernel_path_mtu", lambda host, port: 9000)
        assert path_mtu.candidates("192.0.2.7", 9) == []


def test_answers_are_smaller_than_probes_and_only_for_their_nonce():
    probe = path_mtu.probe(b"n" * path_mtu.NONCE, 1472)
    assert len(probe) == 1472
    reply = path_mtu.answer(probe)
    assert len(reply) < 20
    body = reply[len(path_mtu.SIZE_ANSWER):]
    assert path_mtu.read_answer(body, b"n" * path_mtu.NONCE) == 1472
    assert path_mtu.read_answer(body, b"m" * path_mtu.NONCE) is None


class _Sent:
    """A transport that keeps what a shared socket sends (no socket: the answering rule alone)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, tuple]] = []

    def sendto(self, data: bytes, addr) -> None:
        self.sent.append((data, addr))

    def is_closing(self) -> bool:
        return False


def test_size_probes_below_the_minimum_or_over_the_rates_are_not_answered():
    """Issue 43: a shared socket answered every size probe, of any size, from any (possibly forged)
    source address, as fast as they came: a reflector. Now a probe smaller than any we send is
    dropped, and answers are rate-limited per source address and in all."""
    from net.punch import SharedSocket

    shared, out = SharedSocket(), _Sent()
    shared.transport = out
    nonce = b"n" * path_mtu.NONCE
    for size in (len(path_mtu.SIZE_PROBE) + path_mtu.NONCE, 100, path_mtu.MIN_PROBE - 1):
        shared.datagram_received(path_mtu.probe(nonce, size), ("198.51.100.7", 4000))
    assert out.sent == [] and shared.dropped == 3
    shared.datagram_received(path_mtu.probe(nonce, path_mtu.MIN_PROBE), ("198.51.100.7", 4000))
    assert len(out.sent) == 1 and len(out.sent[0][0]) < path_mtu.MIN_PROBE  # a real probe: answered, smaller

    # one (forged) address sending as fast as it can gets a burst, then a trickle
    t0 = time.monotonic()
    for _ in range(2000):
        shared.datagram_received(path_mtu.probe(nonce, 1472), ("198.51.100.8", 4000))
    elapsed = time.monotonic() - t0
    to_one = sum(1 for _, addr in out.sent if addr[0] == "198.51.100.8")
    assert 1 <= to_one <= path_mtu.ANSWER_BURST_PER_ADDRESS + path_mtu.ANSWERS_PER_S_PER_ADDRESS * elapsed + 1
    # many addresses: the socket's own rate bounds the answers to all of them together
    t0 = time.monotonic()
    for i in range(5000):
        shared.datagram_received(path_mtu.probe(nonce, 1472), (f"10.{i // 250}.{i % 250}.1", 4000))
    elapsed = time.monotonic() - t0
    to_many = sum(1 for _, addr in out.sent if addr[0].startswith("10."))
    assert to_many <= path_mtu.ANSWER_BURST + path_mtu.ANSWERS_PER_S * elapsed + 1, (to_many, elapsed)


def test_the_answer_limit_refills_per_address_and_in_all_and_stays_bounded():
    limit = path_mtu.AnswerLimit(burst_per_address=2, per_address_per_s=1, burst=4, per_s=2)
    assert [limit.allow("a", 0.0) for _ in range(3)] == [True, True, False]  # a's burst
    assert limit.allow("b", 0.0) and limit.allow("b", 0.0)  # b has its own ...
    assert not limit.allow("c", 0.0)  # ... but the socket's burst (4) is spent
    assert limit.allow("a", 1.0) and not limit.allow("a", 1.0)  # a second later: one more for a
    assert limit.allow("c", 1.0) and not limit.allow("c", 1.0)  # (2 a second in all: a's and c's)
    assert limit.refused == 4
    many = path_mtu.AnswerLimit(burst=1e9, per_s=1e9)
    for i in range(3 * path_mtu.AnswerLimit.MAX_ADDRESSES):  # spoofed addresses cannot grow the table for ever
        assert many.allow(f"h{i}", i * 10.0)
    assert len(many._addresses) <= path_mtu.AnswerLimit.MAX_ADDRESSES
