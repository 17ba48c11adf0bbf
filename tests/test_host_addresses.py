"""Where `status` says each trunk is (issue 29 item 11), from what the host sees: two members
behind one router share its public IP but not a port, and a symmetric NAT's port is the host's
own view of it, marked. I/O-free: the host's bookkeeping with stand-in connections."""

from __future__ import annotations

from types import SimpleNamespace

from swarmctl.host.rendezvous import Rendezvous
from swarmctl.host.trunks import TrunkInfo, reachable_address
from net.endpoint import Address

ALICE_ROUTER, CAROL_ROUTER = "198.51.100.10", "198.51.100.12"


def _trunk(local: str, seen: tuple[str, int]) -> TrunkInfo:
    """A trunk that registered with ``--listen 0.0.0.0:7471`` (the default) from ``local``, its
    connection seen by the host at ``seen``."""
    conn = SimpleNamespace(peer_address=seen, validated_peer_address=seen, is_open=True)
    listen = str(reachable_address(Address.parse("0.0.0.0:7471"), conn))
    return TrunkInfo(conn, 0, listen, 1 << 30, local=local)


def test_two_trunks_behind_one_router_and_a_symmetric_one_each_show_their_own_address():
    trunks = {
        "alice": _trunk("192.168.1.2:7471", (ALICE_ROUTER, 7471)),  # the router kept her port
        "frank": _trunk("192.168.1.3:7471", (ALICE_ROUTER, 40001)),  # same router: 7471 was alice's
        "carol": _trunk("192.168.1.2:7471", (CAROL_ROUTER, 51234)),  # symmetric: a port per destination
        "erin": _trunk("198.51.100.2:7471", ("198.51.100.2", 7471)),  # no NAT
    }
    assert trunks["frank"].listen == trunks["alice"].listen  # what status showed for both before
    rendezvous = Rendezvous("host", trunks, relay=None, relay_host=None)
    shown = {name: rendezvous.shown_address(name, t) for name, t in trunks.items()}
    assert shown == {"alice": f"{ALICE_ROUTER}:7471", "frank": f"{ALICE_ROUTER}:40001",
                     "carol": f"{CAROL_ROUTER}:51234", "erin": "198.51.100.2:7471"}
    # alice's punch to carol fails and she asks for a relay: carol's port (not kept) is one of
    # many; alice's (kept) is what every peer sees.
    rendezvous._record("alice", "carol", "punched", asking=False)
    rendezvous._record("alice", "carol", "relayed via erin", asking=False)
    assert rendezvous.shown_address("carol", trunks["carol"]) == f"{CAROL_ROUTER}:51234 (symmetric)"
    assert rendezvous.shown_address("alice", trunks["alice"]) == f"{ALICE_ROUTER}:7471"
    # Its router renumbers: the host's connection follows the new mapping, and so does status.
    trunks["alice"].conn.peer_address = trunks["alice"].conn.validated_peer_address = (ALICE_ROUTER, 40500)
    assert rendezvous.shown_address("alice", trunks["alice"]) == f"{ALICE_ROUTER}:40500"
