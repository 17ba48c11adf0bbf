"""First-token time: a prompt through a plan, in the chunks the asker sends it in.

The asker cuts a prompt into chunks of ``PREFILL_CHUNK`` rows and streams them (swarmctl/asker/
head_tail.py): its head layers run chunk 1 and hand it on, then chunk 2 while a stage works on
chunk 1, and so on to its tail layers and, for the last chunk's last row, the LM head. Every part
of the trip is a station a chunk queues for: the asker's head, each link's bytes, each stage, the
asker's tail. A chunk leaves a station when both it has arrived and the chunk before it has left
(a flow shop), and a link adds half its round trip on top of its bytes without holding the link.

What a station charges a chunk of ``r`` rows:
- a stage: its plan's compute for one token (memory reads: the weights once) and, for each further
  row, its member's measured prompt row per layer (NodeDescriptor.prompt_ms_per_layer_row: compute,
  the rows sharing that one read), times its layers; expert calls as ``plans/whatif.py`` prices rows;
- a link: half its round trip, a token's bytes and datagrams for the first row, and for each
  further row the larger of its bytes' time and one end's share of its datagrams' CPU (``_link``);
- the asker: its head and tail layers the same way at its own prompt figure (AskerModel), the
  model's last layer at its attention's share of it (only rows that need logits run its FFN), and
  the LM head once, after the last chunk (only the prompt's last row needs logits).

Not modelled: attention's growth with the context (measured at 1,500 positions: +8 to +25 % per
row on one layer; a first chunk sees none), the asker's head and tail sharing one machine's cores
(and, on one machine, stages sharing cores: there chunks do not overlap), and ggml's prompt path on
RAM-held experts (charged at the device's prompt figure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layout import ModelLayout
from .nodes import NodeDescriptor
from .proposal import AskerModel, Proposal

PREFILL_CHUNK = 512  # the asker's prompt rows per step (swarmctl/asker/head_tail.py PREFILL_CHUNK)


@dataclass(frozen=True)
class Station:
    """One place a chunk passes: ``fixed_ms`` once per chunk plus ``row_ms`` per row beyond the
    first, then ``delay_ms`` in flight that does not hold the station (a link's half round trip)."""

    name: str
    fixed_ms: float
    row_ms: float
    delay_ms: float = 0.0

    def busy_ms(self, rows: int) -> float:
        return self.fixed_ms + self.row_ms * (rows - 1)


@dataclass(frozen=True)
class FirstToken:
    prompt_tokens: int
    chunks: int
    ms: float  # from the prompt's first chunk leaving the asker to the first token's logits (nan: unknown)
    streamed: bool
    unmeasured: tuple[str, ...] = ()  # members (or "asker") with no prompt figure: nothing predicted

    def describe(self) -> str:
        if self.unmeasured:
            named = ", ".join(self.unmeasured[:3]) + (f" and {len(self.unmeasured) - 3} more" if len(self.unmeasured) > 3 else "")
            return (f"first token for a {self.prompt_tokens}-token prompt: not predicted ({named} measured no prompt "
                    "rate: a nodes file's prompt_ms_per_layer_row, or --asker MEMBER for the asker)")
        how = "streamed through the plan" if self.streamed and self.chunks > 1 else "one after another"
        return (f"first token for a {self.prompt_tokens}-token prompt: {self.ms / 1e3:.2f} s ({self.chunks} "
                f"chunk{'s' if self.chunks != 1 else ''} of up to {PREFILL_CHUNK} rows, {how})")


def stations(proposal: Proposal, layout: ModelLayout, nodes: list[NodeDescriptor], asker: AskerModel,
             head_layers: int) -> tuple[list[Station], tuple[str, ...]]:
    """The plan's trip as stations (the LM head apart: ``lm_head_ms``), and who has no prompt
    figure to charge with."""
    by_name = {n.name: n for n in nodes}
    unmeasured = [] if asker.prompt_ms_per_layer_row else ["asker"]
    unmeasured += [s.member for s in proposal.stages if by_name[s.member].prompt_ms_per_layer_row is None]
    if unmeasured:
        return [], tuple(unmeasured)
    per_byte = 1 / (asker.gb_s * 1e6)  # the asker's decode: its layers' bytes at its rate
    head = range(head_layers)
    tail = range(layout.n_layer - head_layers, layout.n_layer)
    row = asker.prompt_ms_per_layer_row * head_layers
    out = [Station("asker head", sum(layout.read_bytes(il) for il in head) * per_byte, row)]
    for hop, stage in zip(proposal.hops, proposal.stages):
        out.append(_link(hop))
        layers = stage.stop - stage.start
        bytes_ms = stage.expert_ms - stage.expert_latency_ms
        out.append(Station(stage.member, stage.compute_ms + stage.expert_ms,
                           layers * by_name[stage.member].prompt_ms_per_layer_row + bytes_ms))
    out += [_link(h) for h in proposal.hops[len(proposal.stages):]]
    tail_row = asker.prompt_ms_per_layer_row * sum(last_layer_share(layout, il) for il in tail)
    out.append(Station("asker tail", sum(layout.read_bytes(il) for il in tail) * per_byte, tail_row))
    return out, ()


def last_layer_share(layout: ModelLayout, il: int) -> float:
    """What a prompt row costs in layer ``il`` against a layer's whole row: the model's last layer
    runs its FFN (or experts) only on the rows that need logits, as llama.cpp's graphs do, so the
    other rows cost it their attention (measured at Kimi's width: the asker's last layer 2.6-3.2 ms
    per row against 10-16 in its others); a layout that does not say its attention's share, all of it."""
    if il != layout.n_layer - 1 or not layout.attention_flops or not layout.layer_flops[il]:
        return 1.0
    return layout.attention_flops[il] / layout.layer_flops[il]


def lm_head_ms(layout: ModelLayout, asker: AskerModel) -> float:
    """The LM head, once: only the prompt's last row needs logits."""
    return layout.lm_head_bytes / (asker.gb_s * 1e6)


def _link(hop) -> Station:
    """A hop as a station: one row as a token's (plans/cost.py link_ms: the bytes at the link's rate,
    then both ends' datagram work one after the other); each further row at the larger of its
    bytes' time and one end's datagram work, since a stream keeps the wire, the sender and the
    receiver busy at once (measured on loopback at Kimi's width: 3 hops of a 400-row chunk took
    0.4-0.6 s, where summing as for one token charged 4.9 s)."""
    first = hop.ms - hop.rtt_ms / 2
    wire = first - hop.packet_ms
    return Station(f"{hop.src} → {hop.dst}", first, max(wire, hop.packet_ms / 2), hop.rtt_ms / 2)


def chunk_rows(prompt_tokens: int, chunk: int = PREFILL_CHUNK) -> list[int]:
    return [min(chunk, prompt_tokens - i) for i in range(0, prompt_tokens, chunk)]


def flow_ms(trip: list[Station], chunks: list[int], streamed: bool = True) -> float:
    """When the last chunk leaves the last station, the first leaving the first at 0: streamed,
    a chunk waits only for its station to be free; else each chunk starts once the one before it
    has come back."""
    left = [0.0] * len(trip)  # when each station last let a chunk go
    back = 0.0
    for rows in chunks:
        arrive = back if not streamed else 0.0
        for i, station in enumerate(trip):
            left[i] = max(left[i], arrive) + station.busy_ms(rows)
            arrive = left[i] + station.delay_ms
        back = arrive
    return back


def first_token(proposal: Proposal, layout: ModelLayout, nodes: list[NodeDescriptor], asker: AskerModel,
                head_layers: int, prompt_tokens: int, streamed: bool = True) -> FirstToken:
    rows = chunk_rows(max(1, prompt_tokens))
    streamed = streamed and bool(proposal.stages)  # (an asker running every layer itself has nothing to overlap)
    trip, unmeasured = stations(proposal, layout, nodes, asker, head_layers)
    if unmeasured:
        return FirstToken(prompt_tokens, len(rows), math.nan, streamed, unmeasured)
    return FirstToken(prompt_tokens, len(rows), flow_ms(trip, rows, streamed) + lm_head_ms(layout, asker), streamed)
