"""Addresses the host hands out are observed, not claimed (issue 30 item 4): a trunk cannot make
honest members send QUIC handshakes or punch probes at an address it names, one member cannot
keep the trunks punching, and a connection that moved to an address it never proved it receives
at is not punched there. I/O-free with stand-in connections, except the migration, which is real
QUIC on loopback in this process."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import SimpleNamespace

from net import messages as m
from net.endpoint import Address, close, connect_member, serve_member
from net.identity import Credentials, make_ca, new_private_key, sign_member
from net.protocol import RequestOnlyHandler, SwarmProtocol
from net.wire import FRAME_HEADER
from swarmctl.host.reach_limit import REACH_BURST, ReachLimit
from swarmctl.host.rendezvous import NoRoute, Rendezvous
from swarmctl.host.trunks import TrunkInfo, reachable_address

TRUNK_ROUTER, MALLORY_ROUTER, BOB_ROUTER = "198.51.100.10", "198.51.100.66", "198.51.100.20"
VICTIM = "93.184.216.34"  # somebody outside the swarm (a global address: documentation ranges are not)


class StandIn(SimpleNamespace):
    """A member's connection as the host's bookkeeping sees it; what is sent on it is kept."""

    def __init__(self, name: str, seen: tuple[str, int]) -> None:
        super().__init__(peer_name=name, peer_address=seen, validated_peer_address=seen, is_open=True, sent=[])

    def send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        self.sent.append(data)


def _registered(name: str, listen: str, seen: tuple[str, int], local: str = "") -> TrunkInfo:
    """A trunk as the host's registration keeps it (trunk_reports.TrunkReports.register): its stated address made
    where the swarm reaches it."""
    conn = StandIn(name, seen)
    return TrunkInfo(conn, 0, str(reachable_address(Address.parse(listen), conn)), 1 << 30, local=local)


def _punches(trunk: TrunkInfo) -> list[m.PunchWith]:
    return [m.decode(frame[FRAME_HEADER.size:], m.PunchWith) for frame in trunk.conn.sent]


def test_a_trunk_that_names_another_ip_is_never_handed_out_there():
    mallory = _registered("mallory", f"{VICTIM}:443", (MALLORY_ROUTER, 7471))  # --advertise VICTIM:443
    # and one behind a NAT saying its "LAN" address is the victim's: given to members behind its router
    lanny = _registered("lanny", "0.0.0.0:7471", (MALLORY_ROUTER, 40001), local=f"{VICTIM}:443")
    trunks = {"mallory": mallory, "lanny": lanny}
    rendezvous = Rendezvous("host", trunks, relay=None, relay_host=None)
    bob = StandIn("bob", (BOB_ROUTER, 5000))
    neighbour = StandIn("neighbour", (MALLORY_ROUTER, 5001))  # behind mallory's router

    async def routes():
        return [await rendezvous.route(asker, name, trunks[name], relay=False)
                for asker in (bob, neighbour) for name in trunks]

    given = [route.address for route in asyncio.run(routes())]
    given += [rendezvous.shown_address(name, t) for name, t in trunks.items()] + [t.listen for t in trunks.values()]
    assert not [address for address in given if VICTIM in address], given
    assert mallory.listen == f"{MALLORY_ROUTER}:443"  # its port, where its connection comes from
    # an honest trunk behind the same router still gets its LAN address handed to its neighbours
    honest = _registered("honest", "0.0.0.0:7471", (MALLORY_ROUTER, 40002), local="192.168.1.3:7471")
    route = asyncio.run(rendezvous.route(neighbour, "honest", honest, relay=False))
    assert (route.kind, route.address) == ("direct", "192.168.1.3:7471")


def test_a_burst_of_reach_gets_only_the_buckets_share_of_punches_and_others_are_undisturbed(caplog):
    trunk = _registered("carol", "0.0.0.0:7471", (TRUNK_ROUTER, 51234), local="192.168.1.2:7471")
    now = [100.0]  # a clock that stands still: the whole burst arrives at once
    rendezvous = Rendezvous("host", {"carol": trunk}, relay=None, relay_host=None,
                            limit=ReachLimit(clock=lambda: now[0]))
    mallory, bob = StandIn("mallory", (MALLORY_ROUTER, 7000)), StandIn("bob", (BOB_ROUTER, 5000))

    async def ask(member: StandIn) -> str:
        try:
            return (await rendezvous.route(member, "carol", trunk, relay=False)).kind
        except NoRoute as e:
            return str(e)

    async def burst():
        return [await ask(mallory) for _ in range(40)]

    with caplog.at_level(logging.INFO, logger="swarmctl.host"):
        answers = asyncio.run(burst())
        punched = len(_punches(trunk))
        refused = [line for line in caplog.messages if "mallory" in line]
        bobs = asyncio.run(ask(bob)), _punches(trunk)[-1].member
        now[0] += 1.0  # a second later mallory has a few tokens again
        later = asyncio.run(ask(mallory))
    assert answers.count("punch") == punched == REACH_BURST
    assert all("too many punched routes" in a for a in answers if a != "punch"), answers
    assert len(refused) == 1, refused  # one line for the streak, not one per request
    assert bobs == ("punch", "bob")  # another member's asks are not touched by mallory's
    assert later == "punch"


class _Accepting(RequestOnlyHandler):
    def __init__(self) -> None:
        self.conns: list[SwarmProtocol] = []

    def connection_made(self, conn: SwarmProtocol) -> None:
        self.conns.append(conn)


def test_a_connection_that_moved_without_proving_the_new_address_is_not_punched_there():
    """Real QUIC: the asker sends a datagram of its connection from another socket (as a spoofed
    source would); the host's QUIC follows it at once, validating after. The trunk is told to
    punch the address the asker proved, not the one its datagram named."""
    ca_key, ca_cert = make_ca("observed")

    def member(name: str) -> Credentials:
        key = new_private_key()
        return Credentials(key, sign_member(ca_key, ca_cert, key.public_key(), name), ca_cert)

    async def scenario():
        accepting = _Accepting()
        server = await serve_member(Address("127.0.0.1", 0), member("host"), accepting, client_check=lambda c: None)
        host_port = server._transport.get_extra_info("sockname")[1]
        asker = await connect_member(Address("127.0.0.1", host_port), member("mallory"), "host", RequestOnlyHandler())
        victim = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        victim.bind(("127.0.0.1", 0))
        try:
            await asker.ping()
            proved = ("127.0.0.1", asker.owned_transport.get_extra_info("sockname")[1])
            at_host = accepting.conns[0]
            assert at_host.peer_address == proved
            # The asker goes quiet on its own socket and sends one packet from the victim's.
            asker.transmit = lambda: None
            asker._quic.send_ping(1)
            loop = asyncio.get_running_loop()
            for data, _ in asker._quic.datagrams_to_send(now=loop.time()):
                victim.sendto(data, ("127.0.0.1", host_port))
            moved = ("127.0.0.1", victim.getsockname()[1])
            deadline = loop.time() + 5
            while at_host.peer_address != moved and loop.time() < deadline:
                await asyncio.sleep(0.01)
            followed = at_host.peer_address
            trunk = _registered("carol", "0.0.0.0:7471", (TRUNK_ROUTER, 51234), local="192.168.1.2:7471")
            rendezvous = Rendezvous("host", {"carol": trunk}, relay=None, relay_host=None)
            route = await rendezvous.route(at_host, "carol", trunk, relay=False)  # (no await before it punches)
            return proved, moved, followed, route, _punches(trunk)
        finally:
            del asker.transmit
            await close(asker)
            server.close()
            victim.close()

    proved, moved, followed, route, punches = asyncio.run(scenario())
    assert followed == moved  # QUIC did follow the unproven address (else this shows nothing)
    assert route.kind == "punch" and route.address == f"{TRUNK_ROUTER}:51234"
    assert [p.peer for p in punches] == [str(Address(*proved))]


def test_the_names_of_one_invite_share_one_members_relay_ports():
    """Issue 30 item 5: eight names took all 64 relay ports. Relayed links (and punches) are
    counted per invite: the names of one invite together get what one member gets."""
    from net.turn import NatRelay
    from swarmctl.host.rendezvous import MAX_RELAYED_PER_MEMBER

    trunk = _registered("carol", "0.0.0.0:7471", (TRUNK_ROUTER, 51234), local="192.168.1.2:7471")
    accounts = {"ivy-2": "ivy", "ivy-3": "ivy"}
    names = [StandIn(name, (MALLORY_ROUTER, 7000 + i)) for i, name in enumerate(("ivy", "ivy-2", "ivy-3"))]

    async def scenario() -> tuple[list[str], str]:
        relay = NatRelay("127.0.0.1")
        rendezvous = Rendezvous("host", {"carol": trunk}, relay=relay, relay_host="127.0.0.1",
                                account=lambda name: accounts.get(name, name))
        answers = []
        try:
            for i in range(3 * MAX_RELAYED_PER_MEMBER):
                try:
                    answers.append((await rendezvous.route(names[i % 3], "carol", trunk, relay=True)).kind)
                except NoRoute as e:
                    answers.append(str(e))
            other = (await rendezvous.route(StandIn("bob", (BOB_ROUTER, 5000)), "carol", trunk, relay=True)).kind
            return answers, other
        finally:
            rendezvous.close()

    answers, other = asyncio.run(scenario())
    assert answers.count("relay") == MAX_RELAYED_PER_MEMBER, answers
    assert "with the other names of its invite" in answers[-1] and other == "relay"
