"""The links the planner charges: measured where measured, bounded from the measurements where not.

In a running swarm trunks measure their link to the host, and a few to their neighbours; most
trunk-to-trunk links are nobody's measurement. Planning those at a fixed optimistic figure makes a
node whose links are unknown look like the best bridge between two others. Instead, the triangle
inequality bounds such a link from any machine both ends measured (the asker's side, which the host
stands in for, counts as one):

    |rtt(a,c) − rtt(c,b)|  ≤  rtt(a,b)  ≤  rtt(a,c) + rtt(c,b)

and the planner charges the pessimistic end: the cheapest chain of known links between the two
(measured, relayed, or within a site; a common peer is a chain of two, and a longer chain is an upper
bound as well), never less than the largest lower bound, at the bandwidth of the chain's weakest leg. Two machines that say they share a
site are charged a LAN link unless measured. With no measured chain at all, FALLBACK: worse than any
link worth planning over, and said in the plan's warnings.

A relayed link (``Link.via``) crosses its relay: it is charged both hops (their round trips added,
the smaller bandwidth), or its own end-to-end measurement where that is worse.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .nodes import Link, NodeDescriptor
from . import units

LAN = Link(1.0, 100.0)  # same site, not measured: a switch and gigabit Ethernet, roughly
FALLBACK = Link(1000.0, 1.0)  # nothing measured joins the two: a second per round trip, 1 MB/s

MEASURED, RELAYED, SITE, BOUND, UNKNOWN = "measured", "relayed", "site", "bound", "unknown"


@dataclass(frozen=True)
class LinkEstimate:
    link: Link  # what the planner charges
    basis: str  # MEASURED, RELAYED (measured, charged its relay's hops), SITE, BOUND or UNKNOWN
    low_ms: float = 0.0  # the triangle inequality's lower bound on the round trip (0: no common peer)
    high_ms: float = math.inf  # the cheapest measured chain's round trip (inf: none)
    through: tuple[str, ...] = ()  # the relay, or the machines on the chain that bounds it

    @property
    def measured(self) -> bool:
        return self.basis in (MEASURED, RELAYED)

    def describe(self, a: str, b: str) -> str:
        """One line for a plan's warnings (empty for a direct measured link)."""
        rate = "" if math.isinf(self.link.bandwidth_mb_s) else f", {units.rate(self.link.bandwidth_mb_s)}"
        planned = f"{self.link.rtt_ms:.1f} ms round trip{rate}"
        if self.basis == RELAYED:
            return f"link {a} → {b} is relayed through {self.through[0]}: charged both hops, {planned}"
        if self.basis == SITE:
            return f"link {a} → {b} is not measured: planned as a LAN link within their site, {planned}"
        if self.basis == BOUND:
            low = f"{self.low_ms:.1f}" if self.low_ms > 0 else "0"
            return (f"link {a} → {b} is not measured: planned at {planned}, the pessimistic end of its "
                    f"triangle bounds through {', '.join(self.through)} ({low}–{self.high_ms:.1f} ms)")
        if self.basis == UNKNOWN:
            return (f"link {a} → {b} is not measured and no measured link joins its ends: planned at "
                    f"{planned}; measure it")
        return ""


class LinkModel:
    """Every pair's link over ``nodes`` and the machines they measured (ASKER among them)."""

    def __init__(self, nodes: Sequence[NodeDescriptor]) -> None:
        self.sites = {n.name: n.site for n in nodes if n.site}
        # measured, both ways round: (a, b) is a's own measurement where a made one, else b's
        self.claims: dict[tuple[str, str], Link] = {}
        for n in nodes:
            for peer, link in n.links.items():
                if peer != n.name:
                    self.claims[(n.name, peer)] = link
        for (a, b), link in list(self.claims.items()):
            self.claims.setdefault((b, a), link)
        self.direct: dict[str, dict[str, Link]] = {}  # measured direct links, by end
        for (a, b), link in self.claims.items():
            if not link.via:
                self.direct.setdefault(a, {})[b] = link
        # the graph the bounds walk: measured direct links, unmeasured same-site pairs as LAN links,
        # then relayed links at what they are charged (their hops bounded from the first two)
        self.graph: dict[str, dict[str, Link]] = {a: dict(peers) for a, peers in self.direct.items()}
        names = sorted(self.sites)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if self.sites[a] == self.sites[b] and (a, b) not in self.claims:
                    lan = self._site_link(a, b)
                    self.graph.setdefault(a, {})[b] = self.graph.setdefault(b, {})[a] = lan
        relayed = {pair: self._relay_charge(*pair, link) for pair, link in self.claims.items() if link.via}
        for (a, b), link in relayed.items():
            self.graph.setdefault(a, {})[b] = link
        self.relayed = relayed
        self._cache: dict[tuple[str, str], LinkEstimate] = {}

    def link(self, a: str, b: str) -> LinkEstimate:
        key = (a, b)
        if key not in self._cache:
            self._cache[key] = self._estimate(a, b)
        return self._cache[key]

    def _estimate(self, a: str, b: str) -> LinkEstimate:
        claim = self.claims.get((a, b))
        if claim is not None and not claim.via:
            return LinkEstimate(claim, MEASURED, high_ms=claim.rtt_ms)
        if claim is not None:
            charged = self.relayed[(a, b)]
            return LinkEstimate(charged, RELAYED, high_ms=charged.rtt_ms, through=(claim.via,))
        low = self.lower_bound(a, b)
        if self._same_site(a, b):
            lan = self._site_link(a, b)
            return LinkEstimate(lan, SITE, low, lan.rtt_ms)
        chain = self._walk(a, b, self.graph)
        if chain is None:
            return LinkEstimate(Link(max(FALLBACK.rtt_ms, low), FALLBACK.bandwidth_mb_s), UNKNOWN, low)
        rtt, bandwidth, through = chain
        return LinkEstimate(Link(max(rtt, low), bandwidth), BOUND, low, rtt, through)

    def measures(self, name: str) -> bool:
        """Whether any measured link (direct or relayed) has ``name`` at one end."""
        return any(name in pair for pair in self.claims)

    def lower_bound(self, a: str, b: str) -> float:
        """The largest |rtt(a,c) − rtt(c,b)| over machines c with a measured direct link to both."""
        near_a, near_b = self.direct.get(a, {}), self.direct.get(b, {})
        common = (set(near_a) & set(near_b)) - {a, b}
        return max((abs(near_a[c].rtt_ms - near_b[c].rtt_ms) for c in common), default=0.0)

    def _same_site(self, a: str, b: str) -> bool:
        return a in self.sites and self.sites.get(b) == self.sites[a]

    def _site_link(self, a: str, b: str) -> Link:
        return Link(max(LAN.rtt_ms, self.lower_bound(a, b)), LAN.bandwidth_mb_s)

    def _relay_charge(self, a: str, b: str, link: Link) -> Link:
        """Both hops through the relay, from the direct graph (their own measurement, a LAN within a
        site, a bound, or FALLBACK); the link's own end-to-end figure where that is worse."""
        legs = []
        for x, y in ((a, link.via), (link.via, b)):
            hop = self.graph.get(x, {}).get(y)
            if hop is None:
                chain = self._walk(x, y, self.graph)
                hop = Link(chain[0], chain[1]) if chain is not None else FALLBACK
            legs.append(hop)
        return Link(max(link.rtt_ms, legs[0].rtt_ms + legs[1].rtt_ms),
                    min(link.bandwidth_mb_s, legs[0].bandwidth_mb_s, legs[1].bandwidth_mb_s), link.via)

    @staticmethod
    def _walk(a: str, b: str, graph: dict[str, dict[str, Link]]) -> tuple[float, float, tuple[str, ...]] | None:
        """The chain of links from ``a`` to ``b`` with the smallest summed round trip (Dijkstra):
        (round trip, its weakest bandwidth, the machines in between), or None."""
        dist, prev, done = {a: 0.0}, {}, set()
        queue = [(0.0, a)]
        while queue:
            d, u = heapq.heappop(queue)
            if u in done:
                continue
            done.add(u)
            if u == b:
                break
            for v, link in graph.get(u, {}).items():
                if d + link.rtt_ms < dist.get(v, math.inf):
                    dist[v], prev[v] = d + link.rtt_ms, u
                    heapq.heappush(queue, (dist[v], v))
        if b not in done or a == b:
            return None
        hops, v = [], b
        while v != a:
            hops.append((prev[v], v))
            v = prev[v]
        hops.reverse()
        bandwidth = min(graph[u][v].bandwidth_mb_s for u, v in hops)
        return dist[b], bandwidth, tuple(v for _, v in hops[:-1])
