"""What the planner knows about each machine: memory it offers, how fast it runs one layer, where it
sits, and its measured links to the others. Filled from measurements at join, or from a JSON file for
plans on paper. Links nobody measured are not guessed here: plans/links.py bounds them from the
measured ones."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
ASKER = "asker"  # link key for the asker's side of a node (the host stands in for it when planning)
# The datagram size paths between machines carry (net/tls.py's DEFAULT_DATAGRAM_SIZE: no path MTU
# discovery yet), and what one datagram of a hop costs the CPU, sender's and receiver's work
# together, where a member has not measured its own (net/packet_cost.py): the median of runs on the
# 2-core development box (AMD EPYC, Python 3.11, aioquic 1.7), 74-75 us.
PATH_DATAGRAM_BYTES = 1350
DATAGRAM_OVERHEAD_BYTES = 60  # of a 1-RTT packet that are not stream data, about
DEFAULT_DATAGRAM_US = 75.0
MAX_DATAGRAM_US = 100_000.0  # a claim above this is not a machine's (it would take a member out of every plan)


def hop_datagrams(n_bytes: int, datagram_bytes: int = PATH_DATAGRAM_BYTES) -> int:
    """The datagrams that carry ``n_bytes`` of activations over one hop."""
    return max(1, math.ceil(n_bytes / (datagram_bytes - DATAGRAM_OVERHEAD_BYTES)))


@dataclass(frozen=True)
class Link:
    """A measured link. ``via`` names the machine it is relayed through ("" for a direct path; ASKER
    for the host): the planner charges such a link both of the relay's hops (plans/links.py)."""

    rtt_ms: float = 20.0  # (a constructor default for claims that carry only a bandwidth; a link
    bandwidth_mb_s: float = 50.0  # nobody measured is never planned at these: plans/links.py)
    via: str = ""

    def cost_ms(self, n_bytes: int) -> float:
        """One-way time to move ``n_bytes``: half the round trip plus the bytes at the link's rate."""
        return self.rtt_ms / 2 + n_bytes / (self.bandwidth_mb_s * 1e3)


@dataclass(frozen=True)
class NodeDescriptor:
    name: str
    memory_bytes: int  # what the node offers for weights and KV cache
    ms_per_layer_token: float  # one layer of this model, one decode token (measured at join)
    device: str = "cpu"
    address: str = ""
    links: dict[str, Link] = field(default_factory=dict)  # measured, to other nodes by name, and to ASKER
    site: str = ""  # machines that share a site (a house, a lab) and have no measured link count as on a LAN
    datagram_us: float | None = None  # CPU per datagram of a hop, both ends (net/packet_cost.py); None: not measured
    # A GPU member's host RAM for the routed experts its device cannot hold (kernels/device_split.py),
    # and the rate it reads their weights there; 0: it offers none (its memory is all there is)
    ram_bytes: int = 0
    ram_gb_s: float = 0.0
    # One prompt row through one layer, in a prompt's chunk (kernels/speed.py measure_prompt_rate):
    # for the first-token time (plans/prefill.py) only; None: not measured
    prompt_ms_per_layer_row: float | None = None
    # It has no model file: layers moved to it are fetched (plans/hysteresis.py move_cost_s prices
    # them at ``fetch_mb_s``, the rate it last fetched at; None: not measured yet, a default).
    fetches: bool = False
    fetch_mb_s: float | None = None

    @property
    def packet_us(self) -> float:
        """What a datagram through this machine costs its CPU: measured, else the default."""
        return self.datagram_us if self.datagram_us is not None else DEFAULT_DATAGRAM_US

    def measured_link(self, other: str) -> Link | None:
        return self.links.get(other)


def measured_between(a: NodeDescriptor, b: NodeDescriptor) -> Link | None:
    """Measured from either end (``a``'s own measurement first), or None."""
    return a.links.get(b.name) or b.links.get(a.name)


def link_between(a: NodeDescriptor, b: NodeDescriptor) -> Link:
    """The link the planner charges between two nodes when it knows only these two: measured, or
    bounded from the peers both measured (plans/links.py; with the whole swarm, use LinkModel)."""
    from .links import LinkModel

    return LinkModel([a, b]).link(a.name, b.name).link


def load_nodes(path: str | Path) -> list[NodeDescriptor]:
    """Nodes from JSON: a list of {"name", "memory_gb", "ms_per_layer_token", "device"?, "site"?,
    "datagram_us"?, "ram_gb"? with "ram_gb_s" (a GPU member's host RAM for routed experts, and
    its read rate), "prompt_ms_per_layer_row"?, "links"?: {other or "asker": {"rtt_ms", "bandwidth_mb_s", "via"?}}}."""
    from kernels.errors import EngineError

    try:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, list):
            raise ValueError("expected a JSON list of nodes")
        nodes = [_node(n) for n in raw]
    except FileNotFoundError:
        raise EngineError(f"nodes file not found: {path}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise EngineError(f"nodes file {path} is malformed ({type(e).__name__}: {e})") from None
    names = [n.name for n in nodes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EngineError(f"nodes file {path} names {', '.join(twice)} more than once")
    return nodes


def _node(n: dict) -> NodeDescriptor:
    name = str(n["name"])
    return NodeDescriptor(name=name, memory_bytes=int(float(n["memory_gb"]) * GB),
                          ms_per_layer_token=float(n["ms_per_layer_token"]), device=str(n.get("device", "cpu")),
                          links={str(k): _link(name, str(k), v) for k, v in (n.get("links") or {}).items()},
                          site=str(n.get("site") or ""), datagram_us=_datagram_us(n.get("datagram_us")),
                          prompt_ms_per_layer_row=_prompt_ms(n.get("prompt_ms_per_layer_row")), **_ram(n))


def _ram(n: dict) -> dict:
    ram_gb, gb_s = float(n.get("ram_gb", 0) or 0), float(n.get("ram_gb_s", 0) or 0)
    if ram_gb < 0 or gb_s < 0 or (ram_gb > 0) != (gb_s > 0):
        raise ValueError(f"{n['name']}: ram_gb and ram_gb_s come together, both more than 0")
    return {"ram_bytes": int(ram_gb * GB), "ram_gb_s": gb_s}


def _prompt_ms(value) -> float | None:
    if value is None:
        return None
    ms = float(value)
    if not 0 < ms < math.inf:
        raise ValueError("prompt_ms_per_layer_row must be more than 0")
    return ms


def _datagram_us(value) -> float | None:
    if value is None:
        return None
    us = float(value)
    if not 0 < us <= MAX_DATAGRAM_US:
        raise ValueError(f"datagram_us must be more than 0 and at most {MAX_DATAGRAM_US:g}")
    return us


def _link(name: str, peer: str, v: dict) -> Link:
    unknown = set(v) - {"rtt_ms", "bandwidth_mb_s", "via"}
    if unknown:
        raise ValueError(f"link {name} → {peer} has unknown keys {sorted(unknown)}")
    via = str(v.get("via") or "")
    # A relayed link measured end to end says so with rtt_ms; one that only names its relay is
    # charged the relay's two hops alone (0 ms and no bandwidth limit of its own).
    if "rtt_ms" not in v and not via:
        raise ValueError(f"link {name} → {peer} has no rtt_ms (leave out a link nobody measured: the planner "
                         "bounds it from the measured ones)")
    rtt = float(v.get("rtt_ms", 0.0))
    bandwidth = float(v.get("bandwidth_mb_s", math.inf if via else Link.bandwidth_mb_s))
    if not (rtt >= 0 and math.isfinite(rtt)) or not bandwidth > 0:
        raise ValueError(f"link {name} → {peer}: rtt_ms must be 0 or more and bandwidth_mb_s more than 0")
    if via in (name, peer):
        raise ValueError(f"link {name} → {peer} cannot be relayed through one of its own ends")
    return Link(rtt, bandwidth, via)
