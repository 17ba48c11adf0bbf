"""What the planner is given (Constraints) and what it answers (Proposal: stages, hops, the
expected time per token), and where a proposal's time goes (time_breakdown)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from net.wire import DType

from .nodes import ASKER, NodeDescriptor

if TYPE_CHECKING:
    from .layout import ModelLayout

ASKER_GB_S = 58.5  # an asker on paper: a DDR5-5600 dual-channel desktop reading at 65 % of its 90 GB/s


@dataclass(frozen=True)
class AskerModel:
    """The asker as a plan charges it: decoding reads weights, so its share of a
    token is the bytes of its head and tail layers and the LM head (the LM head's width times the
    vocabulary) at the rate it reads them: measured on a member (``from_member``: a member that
    also asks, or one like the asker's machine), or assumed."""

    gb_s: float
    basis: str
    prompt_ms_per_layer_row: float | None = None  # a prompt row through one of its layers (None: unknown)

    def ms(self, layout: "ModelLayout", head_layers: int) -> float:
        return layout.asker_read_bytes(head_layers) / (self.gb_s * 1e6)

    @classmethod
    def from_member(cls, layout: "ModelLayout", node: NodeDescriptor) -> "AskerModel":
        """The rate ``node``'s measured ms per layer reads this model's mean layer at."""
        mean_read = sum(layout.read_bytes(il) for il in range(layout.n_layer)) / layout.n_layer
        return cls(mean_read / (node.ms_per_layer_token * 1e6),
                   f"as {node.name} measured: {node.ms_per_layer_token:.2f} ms per layer", node.prompt_ms_per_layer_row)


ASSUMED_ASKER = AskerModel(ASKER_GB_S, f"assumed: a desktop reading {ASKER_GB_S:g} GB/s")


HEAD_LAYERS = 4  # layers the asker keeps at each end, unless a swarm's init says otherwise


@dataclass(frozen=True)
class Constraints:
    head_layers: int = HEAD_LAYERS  # the asker keeps [0, K) and [L-K, L)
    context_tokens: int = 4096
    max_concurrent: int = 4  # requests whose KV a stage must hold at once
    objective: str = "latency"  # or "throughput", or "even"
    reserve_bytes: int = 300_000_000  # per node, for the runtime and compute buffers
    max_stages: int = 0  # 0 = no limit; members beyond it stay out as standbys
    wire_dtype: str = "f32"  # how activations travel between machines: f32, f16, q8_0, or auto (plans/wire.py)
    kernels: str = "plain"  # the CPU kernels every member computes with (plans/options.py; carried in the Plan)
    attention: str = "plain"  # plain or flash, as every member computes attention (the same; carried in the Plan)
    asker: AskerModel = ASSUMED_ASKER  # what the asker's own layers and LM head cost it


@dataclass
class StagePlan:
    member: str
    start: int  # layers [start, stop)
    stop: int
    compute_ms: float  # per token
    memory_used: int
    memory_free: int
    expert_calls: int = 0  # expert parallelism: MoE layers whose experts it calls per token
    expert_ms: float = 0.0  # and what waiting for them costs per token
    expert_latency_ms: float = 0.0  # of which round-trip latency (the rest: the rows' bytes)
    ram_used: int = 0  # routed experts its device cannot hold, in its host RAM (NodeDescriptor.ram_bytes)


@dataclass
class Hop:
    """A link the plan uses, as the planner charged it."""

    src: str
    dst: str
    rtt_ms: float
    bandwidth_mb_s: float
    basis: str  # measured, relayed, site (a LAN estimate), bound (from measured links) or unknown
    through: tuple[str, ...] = ()  # the relay, or the machines whose links bound it
    ms: float = 0.0  # what one token's activations cost on it, one way: half the round trip, the bytes, the packets
    packet_ms: float = 0.0  # of which the CPU both ends spend on its datagrams (plans/cost.py packet_ms)
    dtype: DType = DType.F32  # what it carries (plans/wire.py)


@dataclass
class Proposal:
    objective: str
    stages: list[StagePlan]
    ms_per_token: float  # single stream: trunk compute + links (the asker's own part: ``asker_ms``)
    tokens_per_s: float  # pipelined bound: 1000 / bottleneck
    bottleneck: str
    warnings: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    hops: list[Hop] = field(default_factory=list)  # asker → stage 1 → … → asker
    search: str = "exact"  # "exact" (subsets of the fastest EXACT_NODES), or "by site" (every member)
    asker_ms: float = 0.0  # the asker's head and tail layers and LM head, per token (Constraints.asker)
    asker_basis: str = ""

    @property
    def whole_ms_per_token(self) -> float:
        """A single stream's whole token: the asker's own part, the trunk and the links."""
        return self.ms_per_token + self.asker_ms


@dataclass(frozen=True)
class TimePart:
    """One line of where a single stream's token spends its time (``time_breakdown``)."""

    part: str
    count: int  # stages, link crossings or expert calls
    ms: float  # per token
    latency_ms: float = 0.0  # of which half round trips: what no bandwidth buys back


def time_breakdown(proposal: Proposal, nodes: list[NodeDescriptor]) -> list[TimePart]:
    """The proposal's whole token, split into the asker's own layers and LM head, compute on the
    stages, link crossings (to and from the asker, within a site, between sites: their latency and
    bytes), the packets' CPU on every crossing, and expert calls. The parts add up to
    ``proposal.whole_ms_per_token``."""
    site = {n.name: n.site for n in nodes if n.site}
    crossings: dict[str, list[Hop]] = {"links to and from the asker": [], "links within a site": [],
                                       "links between sites": []}
    for h in proposal.hops:
        if ASKER in (h.src, h.dst):
            crossings["links to and from the asker"].append(h)
        elif h.src in site and site.get(h.dst) == site[h.src]:
            crossings["links within a site"].append(h)
        else:
            crossings["links between sites"].append(h)
    parts = [TimePart("the asker's own layers and LM head", 1, proposal.asker_ms),
             TimePart("compute on the stages", len(proposal.stages), sum(s.compute_ms for s in proposal.stages))]
    parts += [TimePart(what, len(hops), sum(h.ms - h.packet_ms for h in hops), sum(h.rtt_ms / 2 for h in hops))
              for what, hops in crossings.items()]
    parts.append(TimePart("packets (CPU per datagram, both ends)", len(proposal.hops),
                          sum(h.packet_ms for h in proposal.hops)))
    parts.append(TimePart("expert calls (round trips)", sum(s.expert_calls for s in proposal.stages),
                          sum(s.expert_ms for s in proposal.stages),
                          sum(s.expert_latency_ms for s in proposal.stages)))
    return parts
