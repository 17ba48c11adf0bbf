"""The host as rendezvous: how a member reaches a trunk (issue 17, swarmctl/reach.py).

Every member's connection to the host leaves from its swarm socket, so the host sees each
socket's public ip:port on the connection itself. A trunk also says where it sees that socket
(``register.local``). Where the two differ, a NAT sits in front of the trunk and nobody can
connect to it unasked: the host introduces the two ends (a nonce, each one's public address) and
they punch; where punching fails, the host gives the link a relay (net/turn.py) on its own
address, through which QUIC runs end to end.
"""

from __future__ import annotations

import logging

from net import messages as m
from net.endpoint import Address
from net.protocol import SwarmProtocol
from net.rendezvous import introduce
from net.turn import NatRelay, RelayFull, RelayLink

from .trunks import TrunkInfo

log = logging.getLogger("swarmctl.host")

# Relayed links one member may hold at once: asking for more lets its oldest go (a member cannot
# take the relay's every port; a member needs one per trunk it talks to, and few trunks at once).
MAX_RELAYED_PER_MEMBER = 8
ASKING = "ask:"  # (in ``paths``) a route given for an ask, not for a trunk's own link


class NoRoute(Exception):
    """The member cannot be told a way to the trunk (the message says why)."""


class Rendezvous:
    def __init__(self, host_name: str, relay: NatRelay | None, relay_host: str | None) -> None:
        """``relay_host``: the address members reach the relay's ports at (the host's advertised one)."""
        self.host_name = host_name
        self.relay = relay
        self.relay_host = relay_host
        self.introduced = 0
        self.relayed = 0
        self._held: dict[str, list[RelayLink]] = {}  # requester → its relayed links, oldest first
        # (requester, trunk) → the path the host last gave: "direct", "punched" or "relayed via X",
        # most recent last. (A punch that failed is followed by a relay request, which replaces it.)
        self.paths: dict[tuple[str, str], str] = {}

    def path(self, requester: str, trunk: str) -> str | None:
        """The path a trunk's own link to ``trunk`` took."""
        return self.paths.get((requester, trunk))

    def asker_path(self, trunk: str) -> tuple[str, str] | None:
        """(asker, path) of the newest route to ``trunk`` given for an ask."""
        for (requester, target), path in reversed(self.paths.items()):
            if target == trunk and requester.startswith(ASKING):
                return requester[len(ASKING):], path
        return None

    def _record(self, requester: str, trunk: str, path: str, asking: bool) -> None:
        key = (f"{ASKING}{requester}" if asking else requester, trunk)
        self.paths.pop(key, None)
        self.paths[key] = path

    async def route(self, requester: SwarmProtocol, trunk_name: str, trunk: TrunkInfo, relay: bool,
                    asking: bool = False) -> m.Route:
        """What the requester does to reach ``trunk``; pushes the trunk's half (punch_with or
        relay_end) on its plan stream first, so it starts while the requester does."""
        route = await self._route(requester, trunk_name, trunk, relay)
        path = {"direct": "direct", "punch": "punched"}.get(route.kind) or f"relayed via {route.via}"
        self._record(requester.peer_name, trunk_name, path, asking)
        return route

    async def _route(self, requester: SwarmProtocol, trunk_name: str, trunk: TrunkInfo, relay: bool) -> m.Route:
        seen = trunk.conn.peer_address
        if not relay:
            if not trunk.local or seen is None:
                return m.Route(kind="direct", address=trunk.listen)  # advertised, or an older trunk
            local = Address.parse(trunk.local)
            if local.host == seen[0]:
                return m.Route(kind="direct", address=trunk.listen)  # no NAT in front of it
            mine = requester.peer_address
            if mine is None:
                raise NoRoute("the host does not see where your connection comes from")
            if mine[0] == seen[0]:  # behind the same router: its address on their network
                return m.Route(kind="direct", address=trunk.local)
            ticket_requester, ticket_trunk = introduce(Address(*mine), Address(*seen))
            trunk.conn.send(trunk.plan_stream, m.encode(m.PunchWith(
                peer=str(ticket_trunk.peer), member=requester.peer_name, nonce=ticket_trunk.nonce.hex(),
                side=ticket_trunk.side)))
            self.introduced += 1
            return m.Route(kind="punch", address=str(ticket_requester.peer), nonce=ticket_requester.nonce.hex(),
                           side=ticket_requester.side)
        if self.relay is None or self.relay_host is None:
            raise NoRoute(f"hole punching to {trunk_name} failed and this host runs no relay")
        held = [link for link in self._held.get(requester.peer_name, []) if link.address in self.relay.ports]
        while len(held) >= MAX_RELAYED_PER_MEMBER:
            self.relay.release(held.pop(0))
        try:
            link = await self.relay.allocate()
        except RelayFull as e:
            raise NoRoute(str(e)) from None
        self._held[requester.peer_name] = [*held, link]
        address = Address(self.relay_host, link.address.port)
        trunk.conn.send(trunk.plan_stream, m.encode(m.RelayEnd(
            address=str(address), member=requester.peer_name, token=link.token_b.hex(), via=self.host_name)))
        self.relayed += 1
        log.info("relaying %s → %s through %s", requester.peer_name, trunk_name, address)
        return m.Route(kind="relay", address=str(address), token=link.token_a.hex(), via=self.host_name)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
