"""How a member reaches another: one UDP socket for all its swarm connections, and the path to
each trunk the host tells it to take.

A member behind a home router cannot be reached at an address it listens on. So every member
(trunk or asker) keeps one swarm socket (``net.punch.SharedSocket``): its connection to the host
leaves from it, so the host sees that socket's public ip:port (its NAT mapping) on the
connection itself, and keeps seeing the current one (QUIC follows a peer whose address changed).
A trunk also accepts connections on it. To connect to a trunk, a member asks the host (``reach``):

    direct   the trunk is not behind a NAT (or both sit behind the same one: its LAN address)
    punch    both ends send probes to each other's public address at once (net/punch.py); the
             host tells the trunk on its plan stream (``punch_with``) as it answers the asker
    relay    punching failed (a symmetric NAT, a strict firewall): the host allocates a relayed
             link (net/turn.py); both ends register, and QUIC runs through it end to end

Without a host answer (an older host, the host unreachable) the member connects directly.

What each attempt found is remembered (swarmctl/reaching/path_memo.py; an asker keeps it in its home, so
the next `swarmctl ask` benefits): where punching to a trunk failed lately, the member asks for
the relay at once and punches again in the background, off the ask's clock.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from net import messages as m
from net.endpoint import Address, connect_first, connect_member, resolve
from net.identity import Credentials
from net.protocol import ConnectionHandler, SwarmProtocol
from net.punch import KEEPALIVE_INTERVAL, PunchFailed, PunchTicket, SharedSocket, connect_on, open_shared, punch
from net.turn import keep_registered, register, udp_socket
from net.wire import WireError
from swarmctl.reaching.path_memo import PathKey, PathMemoFile

log = logging.getLogger("swarmctl.reaching.reach")

ConnectPeer = Callable[[str, str, ConnectionHandler], Awaitable[SwarmProtocol]]  # (member, address, handler)
AskHost = Callable[[m.Message], Awaitable[m.Route]]
# A relayed link the trunk end registered for, but nobody connected through within this long, is
# let go (the member that asked gave up, or connected another way).
RELAY_GRACE_S = 3 * KEEPALIVE_INTERVAL


@dataclass(frozen=True)
class Path:
    kind: str  # "direct", "punched" or "relayed"
    via: str = ""  # the relay's member name

    def __str__(self) -> str:
        return f"relayed via {self.via}" if self.kind == "relayed" else self.kind


DIRECT = Path("direct")


def local_ip_towards(address: Address) -> str | None:
    """This machine's own IP on the route to ``address`` (no datagram is sent)."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address.host, address.port))
            return s.getsockname()[0]
    except OSError:
        return None


class Dialer:
    """A member's swarm socket and the paths it took to each trunk. ``ask_host`` sends a
    ``reach`` to the host over the connection that leaves from this socket."""

    def __init__(self, shared: SharedSocket, creds: Credentials, memo: PathMemoFile | None = None, *,
                 ask_host: AskHost | None = None, asking: bool = False) -> None:
        """``asking``: an asker's dialer (the host tells its routes apart from trunks' own links)."""
        self.shared = shared
        self.creds = creds
        self.ask_host = ask_host
        self.paths: dict[str, Path] = {}  # trunk → how we reached it last
        self.memo = memo if memo is not None else PathMemoFile()  # what attempts found (in memory by default)
        self.asking = asking
        self._tasks: dict[asyncio.Task, None] = {}  # (cancelled in the order they began, on every run)

    @classmethod
    async def open(cls, creds: Credentials, listen: Address | None = None, memo: PathMemoFile | None = None, *,
                   ask_host: AskHost | None = None, asking: bool = False) -> "Dialer":
        """A dialer on a new socket: ``listen`` for a trunk (its swarm port), else any port."""
        host, port = (listen.host, listen.port) if listen is not None else ("0.0.0.0", 0)
        return cls(await open_shared(udp_socket(host, port)), creds, memo, ask_host=ask_host, asking=asking)

    async def connect_host(self, addresses: Iterable[str], host_name: str, handler: ConnectionHandler) -> SwarmProtocol:
        """The connection to the host, from this socket (so the host sees where it leads)."""
        return await connect_first(addresses, lambda address: connect_on(self.shared, address, self.creds,
                                                                          host_name, handler))

    async def connect(self, member: str, address: str, handler: ConnectionHandler) -> SwarmProtocol:
        """A connection to the trunk ``member`` (registered at ``address``) by the path the host
        gives; ConnectionError (with the reason) if none works."""
        route = await self._route(member, relay=False)
        if route is None or route.kind == "direct":
            # (an address from `status` may carry a note after it: "ip:port (symmetric)")
            target = Address.parse(route.address if route is not None else (address.split() or [""])[0])
            conn = await connect_on(self.shared, target, self.creds, member, handler, probe_size=True)
            self.memo.record(_key(member, target, "direct"), "direct")
            return self._reached(member, DIRECT, conn)
        if route.kind == "punch":
            ticket = PunchTicket(Address.parse(route.address), bytes.fromhex(route.nonce or ""), route.side)
            key = _key(member, ticket.peer, "punch")
            failed_ago = self.memo.punch_failed(key)
            if failed_ago is not None:
                # The trunk was told to punch too: punching with it in the background is a real
                # retry, and the ask goes on through the relay meanwhile.
                log.info("%s: punching to %s failed %.0f s ago from here; relayed at once, punching again "
                         "in the background", member, ticket.peer, failed_ago)
                self._spawn(self._punch_in_background(member, key, ticket))
                why = f"punching failed {failed_ago:.0f} s ago"
            else:
                try:
                    peer = await punch(self.shared, ticket)
                except PunchFailed as e:
                    log.info("%s: %s", member, e)
                    self.memo.record(key, "relayed")
                    why = str(e)
                else:
                    conn = await connect_on(self.shared, peer, self.creds, member, handler, probe_size=True)
                    self.memo.record(key, "punched")
                    return self._reached(member, Path("punched"), conn)
            route = await self._route(member, relay=True)
            if route is None or route.kind != "relay":
                raise ConnectionError(f"cannot reach {member}: {why}, and the host has no relay")
        relay = await resolve(Address.parse(route.address))
        token = bytes.fromhex(route.token or "")
        await register(self.shared, relay, token)
        conn = await connect_on(self.shared, relay, self.creds, member, handler)
        self._spawn(self._keep_registered(relay, token, lambda: conn.is_open))
        return self._reached(member, Path("relayed", route.via), conn)

    async def _punch_in_background(self, member: str, key: PathKey, ticket: PunchTicket) -> None:
        """Try the punch the memo said fails; what it finds decides the next connection's path."""
        try:
            await punch(self.shared, ticket)
        except PunchFailed as e:
            log.info("%s: punching again in the background: %s", member, e)
            self.memo.record(key, "relayed")
        else:
            log.info("%s: punching again in the background got through: the next connection punches", member)
            self.memo.record(key, "punched")

    def _reached(self, member: str, path: Path, conn: SwarmProtocol) -> SwarmProtocol:
        if self.paths.get(member) != path or path != DIRECT:
            log.info("reached %s (%s)", member, path)
        self.paths[member] = path
        return conn

    async def _route(self, member: str, relay: bool) -> m.Route | None:
        if self.ask_host is None:
            return None
        try:
            return await self.ask_host(m.Reach(member=member, relay=relay, asking=self.asking))
        except m.Refused as e:
            raise ConnectionError(f"cannot reach {member}: {e}") from None
        except (ConnectionError, asyncio.TimeoutError, WireError) as e:
            if relay:
                raise ConnectionError(f"cannot reach {member}: the host did not answer ({e})") from None
            log.info("the host did not say how to reach %s (%s): connecting directly", member, e)
            return None

    # --- the trunk's end: what the host asks of it on its plan stream ---

    def punch_with(self, message: m.PunchWith) -> None:
        ticket = PunchTicket(Address.parse(message.peer), bytes.fromhex(message.nonce), message.side)
        self._spawn(self._punch_quietly(message.member, ticket))

    async def _punch_quietly(self, member: str, ticket: PunchTicket) -> None:
        try:
            await punch(self.shared, ticket)
        except PunchFailed as e:  # the member asks for a relay; nothing to do here
            log.info("%s: %s", member, e)

    def relay_end(self, message: m.RelayEnd, held: Callable[[Address], bool]) -> None:
        """Register at the relay; keep registered while ``held(relay)`` (a connection through it
        is open) or, until one is, for RELAY_GRACE_S."""
        self._spawn(self._register_end(message, Address.parse(message.address), held))

    async def _register_end(self, message: m.RelayEnd, relay: Address, held: Callable[[Address], bool]) -> None:
        try:
            relay = await resolve(relay)
        except ConnectionError as e:
            log.warning("relay %s for %s: %s", message.via, message.member, e)
            return
        token = bytes.fromhex(message.token)
        try:
            await register(self.shared, relay, token)
        except ConnectionError as e:
            log.warning("relay %s for %s: %s", message.via, message.member, e)
            return
        loop = asyncio.get_running_loop()
        grace = loop.time() + RELAY_GRACE_S
        await self._keep_registered(relay, token, lambda: held(relay) or loop.time() < grace)

    async def _keep_registered(self, relay: Address, token: bytes, alive: Callable[[], bool]) -> None:
        keep = asyncio.ensure_future(keep_registered(self.shared, relay, token))
        try:
            while alive():
                await asyncio.sleep(1.0)
        finally:
            keep.cancel()

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks[task] = None
        task.add_done_callback(lambda done: self._tasks.pop(done, None))

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.shared.close()


def _key(member: str, address: Address, plan: str) -> PathKey:
    """The memo's key for reaching ``member`` at ``address`` as the host planned, from here."""
    return PathKey(member, str(address), plan, local_ip_towards(address) or "")


async def ask_route(conn: SwarmProtocol | None, message: m.Reach) -> m.Route:
    """The host's answer to ``reach`` over ``conn`` (m.Refused if it refused; ConnectionError if
    the connection is down)."""
    if conn is None or not conn.is_open:
        raise ConnectionError("not connected to the host")
    return m.decode((await conn.request(m.encode(message), timeout=10)).body, m.Route)


async def connect_direct(member: str, address: str, creds: Credentials, handler: ConnectionHandler) -> SwarmProtocol:
    """A connection on a socket of its own, with no rendezvous (a member without a dialer)."""
    return await connect_member(Address.parse(address), creds, member, handler)
