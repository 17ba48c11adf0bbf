"""What the planner knows about each machine: memory it offers, how fast it runs one layer, and its
links to the others. Filled from measurements at join, or from a JSON file for plans on paper."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
ASKER = "asker"  # link key for the asker's side of a node (the host stands in for it when planning)


@dataclass(frozen=True)
class Link:
    rtt_ms: float = 20.0
    bandwidth_mb_s: float = 50.0  # megabytes per second

    def cost_ms(self, n_bytes: int) -> float:
        """One-way time to move ``n_bytes``: half the round trip plus the bytes at the link's rate."""
        return self.rtt_ms / 2 + n_bytes / (self.bandwidth_mb_s * 1e3)


DEFAULT_LINK = Link()


@dataclass(frozen=True)
class NodeDescriptor:
    name: str
    memory_bytes: int  # what the node offers for weights and KV cache
    ms_per_layer_token: float  # one layer of this model, one decode token (measured at join)
    device: str = "cpu"
    address: str = ""
    links: dict[str, Link] = field(default_factory=dict)  # to other nodes by name, and to ASKER

    def link_to(self, other: str) -> Link:
        return self.links.get(other, DEFAULT_LINK)


def link_between(a: NodeDescriptor, b: NodeDescriptor) -> Link:
    """Measured from either end; a missing measurement falls back to the other end's, then the default."""
    if b.name in a.links:
        return a.links[b.name]
    return b.links.get(a.name, DEFAULT_LINK)


def load_nodes(path: str | Path) -> list[NodeDescriptor]:
    """Nodes from JSON: a list of {"name", "memory_gb", "ms_per_layer_token", "device"?, "links"?:
    {other: {"rtt_ms", "bandwidth_mb_s"}}}."""
    from kernels.errors import EngineError

    try:
        raw = json.loads(Path(path).read_text())
        return [NodeDescriptor(name=str(n["name"]), memory_bytes=int(float(n["memory_gb"]) * GB),
                               ms_per_layer_token=float(n["ms_per_layer_token"]), device=str(n.get("device", "cpu")),
                               links={k: Link(**v) for k, v in (n.get("links") or {}).items()})
                for n in raw]
    except FileNotFoundError:
        raise EngineError(f"nodes file not found: {path}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise EngineError(f"nodes file {path} is malformed ({type(e).__name__}: {e})") from None
