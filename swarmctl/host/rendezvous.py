"""The host as rendezvous: how a member reaches a trunk (swarmctl/reaching/reach.py).

Every member's connection to the host leaves from its swarm socket, so the host sees each
socket's public ip:port on the connection itself. A trunk also says where it sees that socket
(``register.local``). Where the two differ, a NAT sits in front of the trunk and nobody can
connect to it unasked: the host introduces the two ends (a nonce, each one's public address) and
they punch; where punching fails, the host gives the link a relay (net/turn.py) on its own
address, through which QUIC runs end to end.

Every address handed out is one the host observed: a member's public ip:port
as it sees its connection on a validated path (trunks.observed), a trunk's stated port only at
its observed IP, and its stated LAN address only to members behind the same public IP. Punch
tickets, which make a trunk send probes, are rate-limited per member (reach_limit.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from net import clock, messages as m
from net.endpoint import Address
from net.protocol import SwarmProtocol
from net.rendezvous import introduce
from net.turn import IDLE_TIMEOUT, NatRelay, RelayFull, RelayLink
from net.wire import WireError

from .reach_limit import ReachLimit
from .trunks import TrunkInfo, Trunks, lan_address, observed

log = logging.getLogger("swarmctl.host")

# Relayed links one member may hold at once on the host's relay: asking for more lets its oldest
# go (a member cannot take the relay's every port; it needs one per trunk it talks to, and talks
# to few at once). And relayed links one member may be given per RELAY_WINDOW_S, on any relay:
# more is refused until the window moves (member relays bound their links but not per member).
MAX_RELAYED_PER_MEMBER = 8
RELAY_WINDOW_S = IDLE_TIMEOUT
ASKING = "ask:"  # (in ``paths``) a route given for an ask, not for a trunk's own link


class NoRoute(Exception):
    """The member cannot be told a way to the trunk (the message says why)."""


class Rendezvous:
    def __init__(self, host_name: str, trunks: Trunks, relay: NatRelay | None, relay_host: str | None,
                 limit: ReachLimit | None = None, account: Callable[[str], str] = lambda name: name) -> None:
        """``relay_host``: the address members reach the relay's ports at (the host's advertised one).
        ``account``: whose limits a member spends (one per invite: plans.plan.Plan.account), so a
        person with several names does not get several members' relay ports and punches."""
        self.host_name = host_name
        self.account = account
        self.limit = limit if limit is not None else ReachLimit()
        self.trunks = trunks
        self.given: dict[str, int] = {}  # relay member → links it was asked for
        self._asked: dict[str, list[float]] = {}  # account → when it was given relayed links (this window)
        self.relay = relay
        self.relay_host = relay_host
        self._held: dict[str, list[RelayLink]] = {}  # account → its relayed links, oldest first
        # (requester, trunk) → the path the host last gave: "direct", "punched" or "relayed via X",
        # most recent last. (A punch that failed is followed by a relay request, which replaces it.)
        self.paths: dict[tuple[str, str], str] = {}
        self.punch_failed: set[str] = set()  # trunks with a port per destination that a punch failed with

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
        if self.paths.get(key) == "punched" and path.startswith("relayed"):
            # A punch failed (or the requester skipped it: it failed before). The ends to blame are
            # those whose NAT did not keep their port: a port per destination defeats punching.
            for name in (requester, trunk):
                t = self.trunks.get(name)
                if t is not None and t.behind_nat and not t.port_kept:
                    self.punch_failed.add(name)
        self.paths.pop(key, None)
        self.paths[key] = path

    def shown_address(self, name: str, trunk: TrunkInfo) -> str:
        """The trunk's address as `status` shows it: where the host sees it (TrunkInfo.seen_address),
        marked "(symmetric)" where its NAT did not keep its port and a punch with it failed then:
        its port is one per destination, and the one shown is the host's."""
        address = trunk.seen_address
        if trunk.behind_nat and not trunk.port_kept and name in self.punch_failed:
            return f"{address} (symmetric)"
        return address

    async def route(self, requester: SwarmProtocol, trunk_name: str, trunk: TrunkInfo, relay: bool,
                    asking: bool = False) -> m.Route:
        """What the requester does to reach ``trunk``; pushes the trunk's half (punch_with or
        relay_end) on its plan stream first, so it starts while the requester does."""
        route = await self._route(requester, trunk_name, trunk, relay)
        path = {"direct": "direct", "punch": "punched"}.get(route.kind) or f"relayed via {route.via}"
        self._record(requester.peer_name, trunk_name, path, asking)
        return route

    async def _route(self, requester: SwarmProtocol, trunk_name: str, trunk: TrunkInfo, relay: bool) -> m.Route:
        seen = observed(trunk.conn)
        if not relay:
            if not trunk.local or seen is None or not trunk.behind_nat:
                # (``listen`` is its stated port at the IP the host saw it at: trunks.reachable_address)
                return m.Route(kind="direct", address=trunk.listen)
            mine = observed(requester)
            if mine is None:
                raise NoRoute("the host does not see where your connection comes from")
            lan = lan_address(trunk.local)
            if mine[0] == seen[0] and lan:  # behind the same router: its address on their network
                return m.Route(kind="direct", address=lan)
            self._charge(self.account(requester.peer_name), trunk_name)
            ticket_requester, ticket_trunk = introduce(Address(*mine), Address(*seen))
            trunk.conn.send(trunk.plan_stream, m.encode(m.PunchWith(
                peer=str(ticket_trunk.peer), member=requester.peer_name, nonce=ticket_trunk.nonce.hex(),
                side=ticket_trunk.side)))
            return m.Route(kind="punch", address=str(ticket_requester.peer), nonce=ticket_requester.nonce.hex(),
                           side=ticket_requester.side)
        return await self._relayed(requester, trunk_name, trunk)

    def _charge(self, requester: str, trunk_name: str) -> None:
        """A punch makes the trunk send probes: it takes one of the requester's tokens. (Relayed
        links have a limit of their own: MAX_RELAYED_PER_MEMBER.)"""
        if not self.limit.allow(requester):
            raise NoRoute(f"too many punched routes asked for (at most {self.limit.burst} at once, then "
                          f"{self.limit.rate:g} per second); try {trunk_name} again in "
                          f"{max(0.1, self.limit.retry_after(requester)):.1f} s")

    async def _relayed(self, requester: SwarmProtocol, trunk_name: str, trunk: TrunkInfo) -> m.Route:
        """A relayed link: through a reachable member that offers to relay (the one that was given
        fewest links so far), else through the host's own relay."""
        now = clock.now()
        account = self.account(requester.peer_name)
        asked = [t for t in self._asked.get(account, []) if now - t < RELAY_WINDOW_S]
        if len(asked) >= MAX_RELAYED_PER_MEMBER:
            whose = requester.peer_name if account == requester.peer_name else \
                f"{requester.peer_name} (with the other names of its invite)"
            raise NoRoute(f"{whose} was given {len(asked)} relayed links in the last "
                          f"{RELAY_WINDOW_S:g} s, the most a member may; try again later")
        self._asked[account] = [*asked, now]
        for name in self._relay_members(requester.peer_name, trunk_name):
            candidate = self.trunks[name]
            try:
                reply = m.decode((await candidate.conn.request(m.encode(m.AllocateRelay()), timeout=5)).body,
                                 m.RelayAllocated)
            except (m.Refused, WireError, ConnectionError, asyncio.TimeoutError) as e:
                log.warning("relay %s could not take a link: %s", name, e)
                continue
            seen = observed(candidate.conn)
            if seen is None:
                continue
            self.given[name] = self.given.get(name, 0) + 1
            return self._relay_route(requester, trunk_name, trunk, Address(seen[0], reply.port),
                                     reply.token_a, reply.token_b, name)
        if self.relay is None or self.relay_host is None:
            raise NoRoute(f"hole punching to {trunk_name} failed and no relay is available")
        held = [link for link in self._held.get(account, []) if link.address in self.relay.ports]
        while len(held) >= MAX_RELAYED_PER_MEMBER:
            self.relay.release(held.pop(0))
        try:
            link = await self.relay.allocate()
        except RelayFull as e:
            raise NoRoute(str(e)) from None
        self._held[account] = [*held, link]
        return self._relay_route(requester, trunk_name, trunk, Address(self.relay_host, link.address.port),
                                 link.token_a.hex(), link.token_b.hex(), self.host_name)

    def _relay_members(self, *ends: str) -> list[str]:
        """Trunks that offered to relay, can be reached unasked, and are neither end of the link."""
        names = [name for name, t in self.trunks.items()
                 if t.relay and t.conn.is_open and not t.behind_nat and name not in ends]
        return sorted(names, key=lambda name: self.given.get(name, 0))

    def _relay_route(self, requester: SwarmProtocol, trunk_name: str, trunk: TrunkInfo, address: Address,
                     token_a: str, token_b: str, via: str) -> m.Route:
        """Tell the trunk its end of the relayed link (on its plan stream), and answer the requester."""
        trunk.conn.send(trunk.plan_stream, m.encode(m.RelayEnd(
            address=str(address), member=requester.peer_name, token=token_b, via=via)))
        log.info("relaying %s → %s through %s at %s", requester.peer_name, trunk_name, via, address)
        return m.Route(kind="relay", address=str(address), token=token_a, via=via)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
