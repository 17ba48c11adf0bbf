"""What the host knows of each trunk that registered: where it is reached, what it claims, and
what the host saw itself."""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field

from net import clock
from net.endpoint import Address
from net.protocol import SwarmProtocol
from plans.nodes import ASKER, Link


def observed(conn: SwarmProtocol) -> tuple[str, int] | None:
    """Where the host sees a member's connection come from, on a path the member proved it
    receives on (net.protocol.SwarmProtocol.validated_peer_address): not where a datagram of an
    unvalidated migration said it came from."""
    return conn.validated_peer_address


def reachable_address(stated: Address, conn: SwarmProtocol) -> Address:
    """Where the swarm reaches a trunk: the port it stated (its ``--advertise`` or listen port) at
    the IP the host sees its connection come from. Never another IP it names: the others would
    send QUIC handshakes to whatever address a member wrote (a reflection of the swarm's traffic
    at anyone it picks), so an address is observed, not claimed. The stated one when the host does
    not see the connection's (cannot happen on a handshaken connection; callers check)."""
    seen = observed(conn)
    if seen is None:
        return stated
    return Address(seen[0], stated.port)


@dataclass(frozen=True)
class FetchReport:
    """A trunk's latest word on a fetch of layers or experts (``fetching``), and when it came."""

    what: str
    done: int
    total: int
    bytes_per_s: float | None
    finished: bool
    at: float = field(default_factory=clock.now)

    @property
    def eta_s(self) -> float | None:
        if self.finished:
            return 0.0
        return (self.total - self.done) / self.bytes_per_s if self.bytes_per_s else None


def lan_address(text: str) -> str:
    """A trunk's own view of its socket (``register.local``) if it is an address on a local network
    (private, loopback, link-local, carrier-grade NAT): the address members behind the same
    public IP are given. "" for a global address: nobody behind that IP is sent to it."""
    try:
        address = Address.parse(text)
        return str(address) if not ipaddress.ip_address(address.host).is_global else ""
    except ValueError:  # (not an address, or a host name)
        return ""


@dataclass
class TrunkInfo:
    conn: SwarmProtocol
    plan_stream: int  # the register stream; new plans go out on it
    listen: str  # where it is reached: its stated port at the IP the host sees (reachable_address)
    memory: int
    ms_per_layer_token: float | None = None  # measured at join; None until the trunk has the model
    device: str = "cpu"
    rtt_ms: float | None = None  # to the host, which stands in for the asker when planning
    links: dict[str, Link] = field(default_factory=dict)
    registered_at: float = field(default_factory=time.time)
    refused: str = ""  # why it cannot serve, if it said so
    served_bytes: int = 0  # slice bytes the host sent it
    placement: str = ""  # its stage's layers by device, as it said when ready (partial offload)
    local: str = ""  # its swarm socket as it sees itself ("": it advertises an address of its own)
    relay: bool = False  # it offers to relay links (run --relay)
    datagram_us: float | None = None  # what a hop's datagram costs its CPU, as it measured (net/packet_cost.py)
    ram_bytes: int = 0  # a GPU member's host RAM for routed experts, and its rate, as it measured
    ram_gb_s: float = 0.0
    prompt_ms_per_layer_row: float | None = None  # its word: only first-token times are computed with it
    holds: list[tuple[int, int]] = field(default_factory=list)  # layer ranges it serves to fetching members
    fetches: bool = False  # it has no model file: the layers it is given are fetched
    fetch: FetchReport | None = None  # its latest fetch, as it reported it (status, top)
    # the rate it fetched at, as it last reported it: what the planner prices moving layers to it at
    # (a member without the model file fetches what it is given; plans/hysteresis.py)
    fetch_bytes_per_s: float | None = None
    cached: tuple[int, int] = (0, 0)  # prompt positions and KV bytes its stage keeps as prefixes (``cached``)

    def took_fetch_report(self, report: FetchReport) -> None:
        self.fetch = report
        if report.bytes_per_s is not None and report.bytes_per_s > 0:
            self.fetch_bytes_per_s = report.bytes_per_s

    @property
    def behind_nat(self) -> bool:
        """Seen by the host at another IP than its own: nobody can connect to it unasked."""
        seen = observed(self.conn)
        return bool(self.local) and seen is not None and Address.parse(self.local).host != seen[0]

    @property
    def seen_address(self) -> str:
        """Where this trunk is, as far as the host knows: behind a NAT, the public ip:port of its
        swarm socket as the host sees it on this very connection (its own mapping, current after
        its router renumbers; two members behind one router each have their own; validated: not
        one an unproven migration named), else the address it is reached at (``listen``)."""
        seen = observed(self.conn)
        if not self.behind_nat or seen is None:
            return self.listen
        return str(Address(seen[0], int(seen[1])))

    @property
    def port_kept(self) -> bool:
        """Its NAT kept its swarm socket's port towards the host (a port-preserving NAT that had
        the port free: peers see the same one)."""
        seen = observed(self.conn)
        return seen is None or not self.local or Address.parse(self.local).port == int(seen[1])
    # What the host saw itself (swarmctl/node/layer_proof.py): a claimed speed is planned on only once
    # the host has timed the trunk, and never faster than the host timed it.
    measured_ms_per_layer: float | None = None  # the fastest verified probe so far
    checking: bool = False  # its claims are being checked: not planned until they are
    unchecked: bool = False  # not timed yet: planned with the others' figure, not with its claim
    reprobes: int = 0
    served: list[float] = field(default_factory=list)  # its last served reports ([]: its claim is a fresh measurement)
    # A check of its claims that the host could not make (it raised on the host's side): why, how
    # many times in a row, and when it is tried again (clock.now()); "" once a check ran.
    check_error: str = ""
    check_failures: int = 0
    check_retry_at: float = 0.0

    def check_failed(self, error: str, failures: int, retry_at: float) -> None:
        self.check_error, self.check_failures, self.check_retry_at = error[:200], failures, retry_at

    def check_problem(self, now: float | None = None) -> str:
        """Why its claims are not checked yet, for status ("" when nothing failed)."""
        if not self.check_error:
            return ""
        wait = max(0.0, self.check_retry_at - (clock.now() if now is None else now))
        return (f"the check failed {self.check_failures}× ({self.check_error}); "
                f"trying again in {wait:.0f} s")
    excused: bool = False  # a late answer to a layer check was excused (the plan had moved meanwhile)
    proving: tuple[int, int, int] | None = None  # (plan version, start, stop) of a layer check in flight
    passed_check: bool = False  # it proved layers it loaded (a layer check passed)
    trial: tuple[int, int, int] | None = None  # (private plan version, start, stop) it was sent to prove itself

    @property
    def proven(self) -> bool:
        """The host checked it: timed it itself, or saw it prove layers it loaded. Only a proven
        trunk may change a plan that serves (an unproven one is sent a trial: planning.py)."""
        return self.measured_ms_per_layer is not None or self.passed_check

    def planned_links(self) -> dict[str, Link]:
        """Its links as the host plans with them (and status shows them): what it reported, and
        until it reports its link to the host, the round trip it measured at join."""
        if self.rtt_ms is None or ASKER in self.links:
            return dict(self.links)
        return {**self.links, ASKER: Link(self.rtt_ms)}

    @property
    def planning_speed(self) -> float | None:
        """The figure the host plans this trunk with (None: the others' median)."""
        return self.planning_speed_with(self.ms_per_layer_token)

    def planning_speed_with(self, claim: float | None) -> float | None:
        if self.measured_ms_per_layer is not None:
            return max(claim or 0.0, self.measured_ms_per_layer)
        return None if self.unchecked else claim


Trunks = dict[str, TrunkInfo]  # member name → its registration; shared by the host's parts


def held_ranges(ranges: list[tuple[int, int]], n_layer: int) -> list[tuple[int, int]]:
    """What a trunk says it holds (``register``, ``ready``), within the model's ``n_layer`` layers:
    a claim, listed to fetching members as it is, since every chunk it sends them is checked by
    the fetcher against the host's hashes."""
    return [(a, min(b, n_layer)) for a, b in ranges if a < min(b, n_layer)]
