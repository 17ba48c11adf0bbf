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
