"""Plan which members serve which layers, without running anything.

examples:
  swarmctl plan --layout llama-3-70b-q4_k_m --nodes plans/examples/four-friends.json
  swarmctl plan --layout kimi-k2 --nodes plans/examples/kimi-thirty-gpus.json --head-layers 1
  swarmctl plan --model ~/models/qwen3-8b.Q4_K_M.gguf --nodes nodes.json --objective throughput --json
  swarmctl plan                      # inside a swarm: the running swarm's model and members

A nodes file is a JSON list of {"name", "memory_gb", "ms_per_layer_token", "device", "site",
"links": {"other-node" or "asker": {"rtt_ms", "bandwidth_mb_s", "via"}}}: "site" groups machines on
one LAN; a link with "via": "NAME" is relayed through NAME. Links left out are bounded from the
measured ones (plans/links.py), never assumed cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict

from kernels.errors import EngineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="a GGUF (only its metadata is read)")
    source.add_argument("--layout", metavar="NAME", help="a model on paper, e.g. llama-3-70b-q4_k_m")
    parser.add_argument("--nodes", metavar="FILE", help="JSON list of nodes (default: the running swarm's)")
    parser.add_argument("--objective", choices=["latency", "throughput", "even"], default="latency")
    parser.add_argument("--head-layers", type=int, default=4, metavar="K")
    parser.add_argument("--context", type=int, default=4096, metavar="TOKENS", help="KV room per request")
    parser.add_argument("--concurrent", type=int, default=4, metavar="N", help="requests whose KV each stage holds")
    parser.add_argument("--expert-nodes", type=int, default=0, metavar="N",
                        help="mixture-of-experts models: N nodes hold the experts, the rest run the stages")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from plans.layout import ModelLayout, layout_by_name
    from plans.nodes import load_nodes
    from plans.planner import Constraints, add_expert_calls, place_experts, plan_layers, time_breakdown
    from swarmctl.models import resolve_model

    if args.nodes:
        nodes = load_nodes(args.nodes)
        layout = layout_by_name(args.layout) if args.layout else ModelLayout.from_gguf(resolve_model(args.model))
    else:
        layout, nodes = asyncio.run(_from_swarm(args))
    if args.expert_nodes < 0:
        raise EngineError("--expert-nodes must be 0 or more")
    constraints = Constraints(args.head_layers, args.context, args.concurrent, args.objective)
    placement = place_experts(layout, nodes, constraints, args.expert_nodes)
    if args.expert_nodes and not layout.n_expert:
        placement.warnings.append(f"{layout.name} has no experts: --expert-nodes ignored")
    proposal = plan_layers(placement.stage_layout, placement.stage_nodes, constraints)
    proposal.warnings += placement.warnings
    add_expert_calls(proposal, placement, nodes, layout)
    if args.json:
        print(json.dumps({"model": layout.name, "n_layer": layout.n_layer, "head_layers": args.head_layers,
                          **asdict(proposal), "experts": [asdict(e) for e in placement.experts],
                          "time": [asdict(t) for t in time_breakdown(proposal, nodes)]}, indent=2))
    else:
        print(format_plan(layout, args.head_layers, proposal, placement.experts, nodes))
    return 0


async def _from_swarm(args: argparse.Namespace):
    from plans.layout import ModelLayout, layout_by_name
    from net import messages as m
    from swarmctl.commands.status import ask_host
    from swarmctl.home import SwarmHome
    from swarmctl.models import resolve_model

    home = SwarmHome()
    if not home.exists:
        raise EngineError("give --nodes FILE (no swarm is joined here to take the members from)")
    answer = await ask_host(home, m.GetNodes(), m.Nodes)
    from plans.nodes import Link, NodeDescriptor

    nodes = [NodeDescriptor(n.name, n.memory_bytes, n.ms_per_layer_token, n.device, n.address,
                            {k: Link(v.rtt_ms, v.bandwidth_mb_s) for k, v in n.links.items()})
             for n in answer.nodes]
    if not nodes:
        raise EngineError("the swarm has no trunk members to plan with yet")
    if args.layout:
        return layout_by_name(args.layout), nodes
    return ModelLayout.from_gguf(resolve_model(args.model or home.load_config().model)), nodes


def format_plan(layout, head_layers: int, p, experts=(), nodes=()) -> str:
    from plans.planner import time_breakdown

    gb = 1e9
    lines = [f"plan for {layout.name}: {layout.n_layer} layers, the asker keeps [0, {head_layers}) and "
             f"[{layout.n_layer - head_layers}, {layout.n_layer}); objective {p.objective}"]
    calls = any(s.expert_calls for s in p.stages)
    rows = [("STAGE", "MEMBER", "LAYERS", "USED", "FREE", "MS/TOKEN") + (("EXPERT CALLS",) if calls else ())]
    for i, s in enumerate(p.stages, start=1):
        rows.append((str(i), s.member, f"[{s.start}, {s.stop})", f"{s.memory_used / gb:.1f} GB",
                     f"{s.memory_free / gb:.1f} GB", f"{s.compute_ms:.1f}")
                    + ((f"{s.expert_calls} × {s.expert_ms / max(1, s.expert_calls):.1f} ms",) if calls else ()))
    for e in experts:
        rows.append(("experts", e.member, f"experts [{e.start}, {e.stop})", "", "", "") + (("",) if calls else ()))
    lines += _table(rows)
    single = 1000 / p.ms_per_token if p.ms_per_token else float("inf")
    # one request has one token on its way at a time: the pipeline fills only with this many
    in_flight = max(1, math.ceil(p.ms_per_token * p.tokens_per_s / 1000 - 0.05)) if math.isfinite(p.tokens_per_s) else 1
    lines.append(f"expected: {p.ms_per_token:.1f} ms per token for one stream ({single:.2f} tokens/s; trunk compute + "
                 f"links; the asker's own layers not included), at most {p.tokens_per_s:.1f} tokens/s pipelined "
                 f"(with {in_flight} or more requests in flight)")
    lines.append(f"bottleneck: {p.bottleneck}")
    if p.stages:
        lines.append("where one stream's token spends its time:")
        parts = [("PART", "COUNT", "MS", "SHARE", "OF WHICH LATENCY")]
        for t in time_breakdown(p, list(nodes)):
            share = t.ms / p.ms_per_token if p.ms_per_token else 0.0
            latency = f"{t.latency_ms:.1f} ms" if t.part != "compute on the stages" else ""
            parts.append((t.part, str(t.count), f"{t.ms:.1f}", f"{share:.0%}", latency))
        parts.append(("total", "", f"{p.ms_per_token:.1f}", "100%", ""))
        lines += ["  " + line for line in _table(parts)]
    held = (layout.range_bytes(0, head_layers) + layout.range_bytes(layout.n_layer - head_layers, layout.n_layer)
            + layout.embedding_bytes + layout.lm_head_bytes)
    lines.append(f"the asker holds {held / gb:.1f} GB itself (embedding, LM head, its {2 * head_layers} layers)")
    if p.search == "by site":
        lines.append(f"search: every member, sites in their cheapest order (more than the exact search's "
                     f"{_exact_nodes()} fastest)")
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _exact_nodes() -> int:
    from plans.planner import EXACT_NODES

    return EXACT_NODES
