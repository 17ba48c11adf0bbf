"""Writes kimi-thirty-gpus.json: eight homes, thirty consumer GPUs and each home's spare RAM, with
links that look measured. Nothing here was measured: every figure follows from the assumptions
below, so that the example can be read, checked and changed.

    python plans/examples/make_kimi_thirty_gpus.py     # rewrites plans/examples/kimi-thirty-gpus.json
                                                       # and kimi-thirty-gpus-ram.json

Memory: a GPU trunk offers its device memory less the larger of 512 MiB and 5 % (what
`swarmctl run --role trunk` offers by default); a home's RAM appears as one CPU member (a second
swarmctl process on the home's main machine) offering what the family leaves free. In
kimi-thirty-gpus-ram.json the same RAM is instead shared out among the home's GPU members, for the
routed experts their cards cannot hold (ram_gb, and ram_gb_s at 65 % of the
RAM's bandwidth, the whole of it per member: for one stream the stages take turns).

Speed: decoding is bound by memory bandwidth, so one Kimi K2 layer per token costs the bytes a
token reads there (attention, router, shared expert and the 8 routed experts it picks: 0.29 GB at
Q4_K) over 65 % of the device's nominal bandwidth, plus 0.25 ms of kernel launches on a GPU.

Links: within a home, wired gigabit (0.3 ms; 1 ms to a machine on Wi-Fi), 110 MB/s. Between homes,
the round trip is each home's distance to a common exchange added up (plus 2 ms), and a transfer
runs at the sender's up-link or the receiver's down-link, whichever is smaller, at 90 % of the
contract (home internet is asymmetric: cable and DSL upload far less than they download). Every
member lists what it measured from its own end (its upload), so a pair's two directions differ.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

GIB = 1024 ** 3
GB = 1e9
LAYER_READ_BYTES = 0.2909e9  # Kimi K2 at Q4_K, per token and MoE layer: plans/layout.py (see check below)
GPU_OVERHEAD_MS = 0.25
EFFICIENCY = 0.65

# card: (memory GiB, memory bandwidth GB/s)
CARDS = {"rtx4090": (24, 1008), "rtx3090": (24, 936), "rtx4080": (16, 717), "rtx4070tis": (16, 672),
         "a4000": (16, 448), "rtx4060ti": (16, 288), "rtx3080ti": (12, 912), "rtx3080": (12, 760),
         "rtx4070": (12, 504), "rtx3060": (12, 360)}
# RAM: (GB offered, bandwidth GB/s: dual-channel DDR4-3200 51, DDR5-5600 90, quad-channel DDR4 102)


@dataclass(frozen=True)
class Home:
    name: str
    cards: tuple[str, ...]
    ram_gb: int  # offered by the home's CPU member
    ram_bandwidth: float
    exchange_ms: float  # round trip from the home to a common internet exchange
    down_mbit: float
    up_mbit: float
    wifi: tuple[int, ...] = ()  # indices of cards in machines on Wi-Fi


# The asker sits in ana's home. 30 cards: 9 with 24 GB, 9 with 16 GB, 12 with 12 GB (514 GB, less
# than Kimi K2's 578 GB at Q4_K: hence the RAM). The RAM offered (584 GB in all) also lets the eight
# CPU members hold every routed expert of the trunk with --expert-nodes 8, to compare placements.
HOMES = (
    Home("ana", ("rtx4090", "rtx3090", "rtx4060ti", "rtx3060"), 112, 90, 4, 500, 500),
    Home("ben", ("rtx3090", "rtx3090", "rtx3060", "rtx3060"), 64, 51, 6, 1000, 50, wifi=(3,)),
    Home("chloe", ("rtx4080", "rtx4070tis", "rtx4070", "rtx3060"), 64, 51, 10, 300, 300),
    Home("dev", ("rtx3090", "rtx3060", "rtx3060"), 48, 51, 16, 100, 20),
    Home("eli", ("rtx4090", "rtx4090", "rtx4060ti", "rtx4060ti"), 112, 102, 5, 1000, 500),
    Home("fatima", ("rtx3080ti", "rtx3060", "rtx4060ti", "a4000"), 64, 51, 12, 500, 40, wifi=(1,)),
    Home("gus", ("rtx3090", "rtx4070tis", "rtx3060"), 56, 90, 28, 250, 100),
    Home("hana", ("rtx3090", "rtx3080", "rtx4060ti", "rtx4070"), 64, 51, 8, 300, 30),
)


@dataclass(frozen=True)
class Member:
    name: str
    home: Home
    memory_gb: float
    ms_per_layer: float
    device: str
    wifi: bool = False
    ram_gb: float = 0.0  # host RAM for the routed experts its card cannot hold
    ram_gb_s: float = 0.0


def members(experts_in_ram: bool = False) -> list[Member]:
    out = []
    for home in HOMES:
        for i, card in enumerate(home.cards):
            gib, bandwidth = CARDS[card]
            offered = gib * GIB - max(512 * 1024 ** 2, 0.05 * gib * GIB)
            ms = LAYER_READ_BYTES / (EFFICIENCY * bandwidth * GB) * 1e3 + GPU_OVERHEAD_MS
            ram = (round(home.ram_gb / len(home.cards), 2), round(EFFICIENCY * home.ram_bandwidth, 2)) \
                if experts_in_ram else (0.0, 0.0)
            out.append(Member(f"{home.name}-{card}-{i + 1}", home, round(offered / GB, 2), round(ms, 2), "cuda",
                              i in home.wifi, *ram))
        if not experts_in_ram:
            ms = LAYER_READ_BYTES / (EFFICIENCY * home.ram_bandwidth * GB) * 1e3
            out.append(Member(f"{home.name}-ram", home, home.ram_gb, round(ms, 2), "cpu"))
    return out


def link(a: Member, b: Member) -> dict:
    """What ``a`` would measure to ``b``: round trip and its upload towards ``b``."""
    if a.home is b.home:
        rtt = 1.0 if (a.wifi or b.wifi) else 0.3
        return {"rtt_ms": rtt, "bandwidth_mb_s": 110}
    rtt = a.home.exchange_ms + b.home.exchange_ms + 2
    mbit = min(a.home.up_mbit, b.home.down_mbit)
    return {"rtt_ms": rtt, "bandwidth_mb_s": round(0.9 * mbit / 8, 2)}


def asker_link(a: Member) -> dict:
    asker = HOMES[0]
    if a.home is asker:
        return {"rtt_ms": 1.0 if a.wifi else 0.3, "bandwidth_mb_s": 110}
    return {"rtt_ms": a.home.exchange_ms + asker.exchange_ms + 2,
            "bandwidth_mb_s": round(0.9 * min(a.home.up_mbit, asker.down_mbit) / 8, 2)}


def render(nodes: list[Member]) -> str:
    """One member per block, one measured link per line: long, but each figure can be found."""
    blocks = []
    for a in nodes:
        links = [f'    "asker": {json.dumps(asker_link(a))}']
        links += [f'    "{b.name}": {json.dumps(link(a, b))}' for b in nodes if b is not a]
        ram = {"ram_gb": a.ram_gb, "ram_gb_s": a.ram_gb_s} if a.ram_gb else {}
        head = json.dumps({"name": a.name, "site": a.home.name, "memory_gb": a.memory_gb,
                           "ms_per_layer_token": a.ms_per_layer, "device": a.device, **ram})[:-1]
        blocks.append(f'  {head}, "links": {{\n' + ",\n".join(links) + "\n  }}")
    return "[\n" + ",\n".join(blocks) + "\n]\n"


def main() -> None:
    from plans.layout import layout_by_name

    kimi = layout_by_name("kimi-k2")
    il = kimi.n_layer - 1  # an MoE layer: what a token reads there
    read = (kimi.layer_bytes[il] - kimi.expert_bytes[il]) + kimi.expert_bytes[il] * kimi.n_expert_used // kimi.n_expert
    assert abs(read - LAYER_READ_BYTES) < 0.001e9, read
    nodes = members()
    Path(__file__).with_name("kimi-thirty-gpus.json").write_text(render(nodes))
    Path(__file__).with_name("kimi-thirty-gpus-ram.json").write_text(render(members(experts_in_ram=True)))
    cards = sum(1 for m in nodes if m.device == "cuda")
    print(f"{cards} GPUs, {len(HOMES)} homes, {sum(m.memory_gb for m in nodes):.0f} GB offered "
          f"({sum(m.memory_gb for m in nodes if m.device == 'cuda'):.0f} GB of it on GPUs)")


if __name__ == "__main__":
    main()
