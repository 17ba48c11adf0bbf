"""Members behind NAT routers reach each other with nothing forwarded (issue 17): hole punching
through port-preserving NATs, a relay through the host where a symmetric NAT defeats it, and a
punched link that recovers when its router forgets the mapping. Real namespaces, real iptables
NAT, real UDP sockets and the swarm's real mutual-TLS QUIC (harness/nat_lab.py).

The host (198.51.100.1) is the only public machine: it runs the observed-address echo and the
relay. alice and bob sit behind cone NATs, carol behind a symmetric one, dan behind a router that
filters only what it forwards (FORWARD DROP, INPUT ACCEPT); every member's private address is
192.168.1.2.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import socket

import pytest

from net.endpoint import Address, close
from net.identity import Credentials, make_ca, new_private_key, sign_member
from net.punch import KEEPALIVE_INTERVAL, PunchFailed, SharedSocket, connect_on, open_shared, punch, serve_on
from net.rendezvous import ObservedAddressEcho, introduce, observe
from net.turn import NatRelay, RelayFull, keep_registered, register
from net.wire import FrameType, encode_frame
from harness.nat_lab import HOST_IP, PRIVATE_MEMBER, NatLab
from harness.netns import LabUnavailable

QUIC_PORT = 7471  # every member's swarm port, the same behind each router
ECHO_PORT = 3478
PUNCH_TIMEOUT = 1.5
MARKER = b"ACTIVATION-PLAINTEXT-MARKER-1717"  # sent inside QUIC: must never show on the relay


@pytest.fixture
def lab(tmp_path):
    if shutil.which("iptables") is None:
        pytest.skip("the NAT lab needs iptables (apt-get install -y iptables conntrack)")
    try:
        lab = NatLab({"alice": "cone", "bob": "cone", "carol": "symmetric", "dan": "open-input"}, tmp_path)
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


def test_a_symmetric_nat_fails_to_punch_and_goes_through_the_relay_which_sees_only_ciphertext(lab):
    """carol's NAT gives each destination its own port, so the port the host saw is not the one
    alice's probes must answer: punching fails, with a clear error, within its timeout. The link
    then goes through a relay on the host; mutual TLS stays end to end (alice sees carol's
    certificate), and what the relay forwarded is QUIC packets that never show the plaintext."""

    async def main():
        echo = await _echo(lab)
        swarm = Swarm()
        relay = NatRelay(HOST_IP, make_socket=lambda host, port: lab.udp_socket("host", port, host))
        conn = None
        (c_sock, c_pub), (a_sock, a_pub) = await _member(lab, "carol"), await _member(lab, "alice")
        try:
            c_ticket, a_ticket = introduce(c_pub, a_pub)
            start = asyncio.get_running_loop().time()
            results = await asyncio.gather(punch(c_sock, c_ticket, timeout=PUNCH_TIMEOUT),
                                           punch(a_sock, a_ticket, timeout=PUNCH_TIMEOUT), return_exceptions=True)
            took = asyncio.get_running_loop().time() - start
            assert all(isinstance(r, PunchFailed) for r in results), results
            assert "use a relay" in str(results[0]) and str(a_pub) in str(results[0])
            assert took < PUNCH_TIMEOUT + 0.5, took

            link = await relay.allocate(record=True)
            await asyncio.gather(register(c_sock, link.address, link.token_a), register(a_sock, link.address, link.token_b))
            serve_on(a_sock, swarm.creds("alice"), Echo(), client_check=lambda cert: None)
            conn = await connect_on(c_sock, link.address, swarm.creds("carol"), "alice", Echo(), timeout=5)
            assert conn.peer_name == "alice"
            body = MARKER * 200  # several datagrams' worth
            reply = await conn.request(encode_frame(FrameType.ACTIVATION, body), timeout=5)
            assert reply.body == body
            await asyncio.wait_for(conn.ping(), 2)
            server_side = next(iter(a_sock.server._protocols.values()))
            assert server_side.peer_name == "carol"
            assert server_side.peer_address == (link.address.host, link.address.port)  # via the relay

            relayed = link.recorded
            assert len(relayed) == link.stats.forwarded > 10
            assert all(d[0] & 0xC0 for d in relayed)  # QUIC packets: long header or fixed bit set
            assert not any(MARKER in d for d in relayed) and MARKER[:8] not in b"".join(relayed)
            # Anyone else who sends to the link's port is dropped, not forwarded (a datagram is one
            # or the other; the connection's own keepalives may pass meanwhile, so count drops).
            stranger = await open_shared(lab.udp_socket("bob", 9999))
            stranger.sendto(relayed[-1], link.address)
            stranger.sendto(b"\x00swR" + b"x" * 16, link.address)  # a guessed token
            await asyncio.sleep(0.2)
            assert link.stats.dropped_stranger == 2
            stranger.close()
        finally:
            if conn is not None:
                await close(conn)
            relay.close()
            for s in (echo, c_sock, a_sock):
                s.close()

    _run(main())


async def _punch_pair(lab: NatLab, first: str, second: str, port: int, **options) -> bool:
    """Both observe, are introduced and punch from fresh sockets on ``port``; ``second``'s ticket
    arrives 0.1 s after ``first``'s (the host's two messages cross different paths). True if
    both ends opened the path."""
    sockets = [await open_shared(lab.udp_socket(name, port)) for name in (first, second)]
    try:
        publics = [await observe(s, Address(HOST_IP, ECHO_PORT)) for s in sockets]
        tickets = introduce(*publics)

        async def later():
            await asyncio.sleep(0.1)
            return await punch(sockets[1], tickets[1], timeout=PUNCH_TIMEOUT, **options)

        results = await asyncio.gather(punch(sockets[0], tickets[0], timeout=PUNCH_TIMEOUT, **options), later(),
                                       return_exceptions=True)
        if all(isinstance(r, PunchFailed) for r in results):
            return False
        assert results == [publics[1], publics[0]], results  # both, each at the other's observed address
        return True
    finally:
        for s in sockets:
            s.close()


def test_punching_through_a_router_that_drops_only_what_it_forwards(lab):
    """dan's router lets unasked datagrams in to itself (only forwarding is dropped). bob's probes,
    sent first, used to reach it before dan's first datagram had opened his mapping: the router
    kept a conntrack entry for them that holds dan's port, dan's own probes left from another one,
    and both ends gave up (issue 29 item 4). Opening probes with a low TTL open each end's own
    mapping without reaching the other's router (the lab's routers drop what arrives with a TTL
    that would have died on the internet); then the punch gets through, in either order."""

    async def main():
        echo = await _echo(lab)
        try:
            # The failure, as it was: full-TTL probes from the first probe on.
            assert not await _punch_pair(lab, "bob", "dan", 21000, opening_ttl=None)
            assert await _punch_pair(lab, "dan", "bob", 21001, opening_ttl=None)  # (dan first: it worked)
            # Now: every pair punches, whoever's ticket comes first.
            for port, pair in zip(range(21002, 21006), [("bob", "dan"), ("bob", "dan"), ("alice", "dan"), ("dan", "bob")]):
                assert await _punch_pair(lab, *pair, port), (pair, port)
        finally:
            echo.close()

    _run(main())


def test_a_punched_link_whose_nat_mapping_changes_recovers_by_punching_again(lab):
    """alice's router forgets its mappings and takes new ports (a reboot): bob's router drops
    what now comes from alice's new port, so the QUIC connection goes quiet. alice asks the
    rendezvous again, both punch again, and the same QUIC connection carries on from the new
    port (QUIC migrates to it): no new handshake, no restart."""

    async def main():
        echo = await _echo(lab)
        swarm = Swarm()
        conn, (a_sock, a_pub, _), (b_sock, b_pub, _) = await _punched_quic(lab, swarm, "alice", "bob")
        try:
            await asyncio.wait_for(conn.ping(), 2)
            lab.renumber("alice", 40000, 40999)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(conn.ping(), 1.0)
            a_new = await observe(a_sock, Address(HOST_IP, ECHO_PORT))
            assert a_new.host == a_pub.host and 40000 <= a_new.port <= 40999
            a_ticket, b_ticket = introduce(a_new, b_pub)
            a_peer, b_peer_now = await asyncio.gather(punch(a_sock, a_ticket, timeout=PUNCH_TIMEOUT),
                                                      punch(b_sock, b_ticket, timeout=PUNCH_TIMEOUT))
            assert b_peer_now == a_new and a_peer == b_pub
            await asyncio.wait_for(conn.ping(), 3)
            reply = await conn.request(encode_frame(FrameType.CONTROL, b'{"type":"again"}'), timeout=3)
            assert reply.body == b'{"type":"again"}'
            server_side = next(iter(b_sock.server._protocols.values()))
            assert server_side.peer_address == (a_new.host, a_new.port)
        finally:
            await close(conn)
            for s in (echo, a_sock, b_sock):
                s.close()

    _run(main())


# --- the pieces, on loopback (no namespaces) ---


def _loopback() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_probes_with_another_nonce_are_ignored_and_a_silent_peer_times_out_clearly():
    async def main():
        a, b = await open_shared(_loopback()), await open_shared(_loopback())
        try:
            a_ticket, _ = introduce(a.local_address, b.local_address)
            _, stale = introduce(a.local_address, b.local_address)  # an older introduction's nonce
            start = asyncio.get_running_loop().time()
            results = await asyncio.gather(punch(a, a_ticket, timeout=0.5), punch(b, stale, timeout=0.5),
                                           return_exceptions=True)
            assert all(isinstance(r, PunchFailed) for r in results), results
            assert str(results[0]) == (f"hole punching with {b.local_address}: no probe from it within 0.5 s (a NAT "
                                       "that maps each destination to a new port, or a firewall that drops UDP); "
                                       "use a relay")
            assert asyncio.get_running_loop().time() - start < 1.0
            assert a.dropped > 0 and b.dropped > 0
        finally:
            a.close()
            b.close()

    _run(main())


class _Sink:
    def __init__(self, got: list[bytes]) -> None:
        self.got = got

    def datagram_received(self, data: bytes, addr) -> None:
        self.got.append(data)

    def close(self) -> None:
        pass


def test_the_relay_is_bounded_and_follows_an_end_that_moves():
    async def main():
        relay = NatRelay("127.0.0.1", max_links=1, max_bytes_per_s=3000)
        a, b, b_moved = [await open_shared(_loopback()) for _ in range(3)]
        got: list[bytes] = []
        try:
            link = await relay.allocate()
            with pytest.raises(RelayFull, match="1 links"):
                await relay.allocate()
            await register(a, link.address, link.token_a)
            a.sendto(b"\x40early", link.address)  # b has not registered: nowhere to send it
            await register(b, link.address, link.token_b)
            for sock in (b, b_moved):
                sock.server = _Sink(got)  # stands in for QUIC: takes what the relay forwards
            for i in range(5):  # 5 x 1000 bytes against 3000 bytes/s: the last ones are over
                a.sendto(b"\x40" + bytes([i]) * 999, link.address)
            await asyncio.sleep(0.1)
            assert link.stats.dropped_unpaired == 1 and link.stats.forwarded == 3 and link.stats.dropped_rate == 2
            assert got == [b"\x40" + bytes([i]) * 999 for i in range(3)]  # byte for byte
            await asyncio.sleep(1.0)  # the allowance refills
            await register(b_moved, link.address, link.token_b)  # b's mapping changed
            a.sendto(b"\x40moved", link.address)
            await asyncio.sleep(0.1)
            assert got[-1] == b"\x40moved" and len(got) == 4
            keepalive = asyncio.ensure_future(keep_registered(a, link.address, link.token_a, interval=0.05))
            before = link.stats.registrations
            await asyncio.sleep(0.3)
            keepalive.cancel()
            assert link.stats.registrations >= before + 3
            assert KEEPALIVE_INTERVAL <= 15  # well inside the 30 s after which routers drop idle UDP mappings
        finally:
            relay.close()
            for sock in (a, b, b_moved):
                sock.close()

    _run(main())
