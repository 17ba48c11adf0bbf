"""Members behind NAT routers reach each other with nothing forwarded (issue 17): hole punching
through port-preserving NATs, a relay through the host where a symmetric NAT defeats it, and a
punched link that recovers when its router forgets the mapping. Real namespaces, real iptables
NAT, real UDP sockets and the swarm's real mutual-TLS QUIC (tests/nat_lab.py).

The host (198.51.100.1) is the only public machine: it runs the observed-address echo and the
relay. alice and bob sit behind cone NATs, carol behind a symmetric one; every member's private
address is 192.168.1.2.
"""

from __future__ import annotations

import asyncio
import errno
import shutil

import pytest

from net.endpoint import Address, close
from net.identity import Credentials, make_ca, new_private_key, sign_member
from net.punch import PunchFailed, SharedSocket, connect_on, open_shared, punch, serve_on
from net.rendezvous import ObservedAddressEcho, introduce, observe
from net.turn import NatRelay, register
from net.wire import FrameType, encode_frame
from tests.nat_lab import HOST_IP, PRIVATE_MEMBER, NatLab
from tests.netns import LabUnavailable

QUIC_PORT = 7471  # every member's swarm port, the same behind each router
ECHO_PORT = 3478
PUNCH_TIMEOUT = 1.5
MARKER = b"ACTIVATION-PLAINTEXT-MARKER-1717"  # sent inside QUIC: must never show on the relay


@pytest.fixture
def lab(tmp_path):
    if shutil.which("iptables") is None:
        pytest.skip("the NAT lab needs iptables (apt-get install -y iptables conntrack)")
    try:
        lab = NatLab({"alice": "cone", "bob": "cone", "carol": "symmetric"}, tmp_path)
    except LabUnavailable as e:
        pytest.skip(f"the NAT lab needs network namespaces: {e}")
    try:
        yield lab
    finally:
        lab.close()


class Echo:
    """A member's handler that answers each frame with the same bytes (a stand-in for a stage)."""

    def connection_made(self, conn) -> None:
        pass

    def frame_received(self, conn, stream_id, frame) -> None:
        conn.send(stream_id, encode_frame(frame.type, frame.body), end=True)

    def stream_ended(self, conn, stream_id) -> None:
        pass

    def connection_lost(self, conn) -> None:
        pass


class Swarm:
    """One CA and a member certificate per name, as the host issues them."""

    def __init__(self) -> None:
        self.ca_key, self.ca_cert = make_ca("lab")

    def creds(self, name: str) -> Credentials:
        key = new_private_key()
        return Credentials(key, sign_member(self.ca_key, self.ca_cert, key.public_key(), name), self.ca_cert)


async def _member(lab: NatLab, name: str) -> tuple[SharedSocket, Address]:
    """The member's QUIC socket, and how it looks from the host."""
    shared = await open_shared(lab.udp_socket(name, QUIC_PORT))
    return shared, await observe(shared, Address(HOST_IP, ECHO_PORT))


async def _echo(lab: NatLab, port: int = ECHO_PORT) -> ObservedAddressEcho:
    echo = ObservedAddressEcho()
    await echo.start(lab.udp_socket("host", port))
    return echo


async def _punched_quic(lab, swarm, client: str, server: str):
    """Observe both, introduce them, punch, then the client connects to the server over QUIC."""
    (c_sock, c_pub), (s_sock, s_pub) = await _member(lab, client), await _member(lab, server)
    c_ticket, s_ticket = introduce(c_pub, s_pub)
    c_peer, s_peer = await asyncio.gather(punch(c_sock, c_ticket, timeout=PUNCH_TIMEOUT),
                                          punch(s_sock, s_ticket, timeout=PUNCH_TIMEOUT))
    serve_on(s_sock, swarm.creds(server), Echo(), client_check=lambda cert: None)
    conn = await connect_on(c_sock, c_peer, swarm.creds(client), server, Echo(), timeout=5)
    return conn, (c_sock, c_pub, c_peer), (s_sock, s_pub, s_peer)


def test_the_lab_is_a_nat(lab):
    """Each member is seen from the public side at its router's address; alice's NAT keeps her
    port for every destination, carol's gives each destination a new one; and nothing on the
    public side can send to a private address."""

    async def main():
        echoes = [await _echo(lab, ECHO_PORT), await _echo(lab, ECHO_PORT + 1)]
        shared = {}
        try:
            for name in ("alice", "carol"):
                shared[name], public = await _member(lab, name)
                again = await observe(shared[name], Address(HOST_IP, ECHO_PORT + 1))
                assert public.host == again.host == lab.public_ip(name) != PRIVATE_MEMBER
                if name == "alice":
                    assert public.port == again.port == QUIC_PORT
                else:
                    assert public.port != again.port
            outsider = lab.udp_socket("host")
            with pytest.raises(OSError) as unreachable:
                outsider.sendto(b"hello", (PRIVATE_MEMBER, QUIC_PORT))
            assert unreachable.value.errno == errno.ENETUNREACH
            outsider.close()
        finally:
            for s in [*echoes, *shared.values()]:
                s.close()

    _run(main())


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_two_members_behind_cone_nats_punch_through_and_talk_quic(lab):
    """No port forwarding anywhere: QUIC from alice to bob's public address gets no answer until
    both punch; then mutual-TLS QUIC runs over the punched path, from the same sockets."""

    async def main():
        echo = await _echo(lab)
        swarm = Swarm()
        conn = None
        (a_sock, a_pub), (b_sock, b_pub) = await _member(lab, "alice"), await _member(lab, "bob")
        try:
            serve_on(b_sock, swarm.creds("bob"), Echo(), client_check=lambda cert: None)
            with pytest.raises(ConnectionError, match="no answer"):  # bob's router drops it
                await connect_on(a_sock, b_pub, swarm.creds("alice"), "bob", Echo(), timeout=1.0)
            a_ticket, b_ticket = introduce(a_pub, b_pub)
            start = asyncio.get_running_loop().time()
            a_peer, b_peer = await asyncio.gather(punch(a_sock, a_ticket, timeout=PUNCH_TIMEOUT),
                                                  punch(b_sock, b_ticket, timeout=PUNCH_TIMEOUT))
            took = asyncio.get_running_loop().time() - start
            assert (a_peer, b_peer) == (Address(lab.public_ip("bob"), QUIC_PORT), Address(lab.public_ip("alice"), QUIC_PORT))
            assert took < 1.0, took
            conn = await connect_on(a_sock, a_peer, swarm.creds("alice"), "bob", Echo(), timeout=5)
            assert conn.peer_name == "bob"
            await asyncio.wait_for(conn.ping(), 2)
            reply = await conn.request(encode_frame(FrameType.CONTROL, b'{"type":"hello"}'), timeout=2)
            assert reply.body == b'{"type":"hello"}'
            server_side = next(iter(b_sock.server._protocols.values()))
            assert server_side.peer_name == "alice" and server_side.peer_address == (lab.public_ip("alice"), QUIC_PORT)
        finally:
            if conn is not None:
                await close(conn)
            for s in (echo, a_sock, b_sock):
                s.close()

    _run(main())
