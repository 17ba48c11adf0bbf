"""Plan which members serve which layers, without running anything.

examples:
  swarmctl plan --layout llama-3-70b-q4_k_m --nodes plans/examples/four-friends.json
  swarmctl plan --layout kimi-k2 --nodes plans/examples/kimi-thirty-gpus.json --head-layers 1
  swarmctl plan --model ~/models/qwen3-8b.Q4_K_M.gguf --nodes nodes.json --objective throughput --json
  swarmctl plan                      # inside a swarm: the running plan, and what a re-plan now would
                                     # change, under the swarm's settings (options override them)

A nodes file is a JSON list of {"name", "memory_gb", "ms_per_layer_token", "device", "site",
"prompt_ms_per_layer_row", "links": {"other-node" or "asker": {"rtt_ms", "bandwidth_mb_s", "via"}}}:
"site" groups machines on one LAN; a link with "via": "NAME" is relayed through NAME. Links left
out are bounded from the measured ones (plans/links.py), never assumed cheap. The first-token time
for --prompt-tokens (plans/prefill.py) needs every stage's "prompt_ms_per_layer_row" (a trunk in a
swarm measures its own) and --asker MEMBER for the asker's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict, dataclass, replace

from kernels.errors import EngineError
from plans import options, units
from plans.options import PlannerSettings

@dataclass(frozen=True)
class Settings:
    """What the planner is asked to plan under: the host's settings (`swarmctl config`), or the
    defaults `swarmctl init` gives a new swarm (on paper), with any option given in their place."""

    planner: PlannerSettings
    source: str = "on paper"  # where the ones not given as options came from

    def constraints(self):
        return self.planner.constraints()

    def as_dict(self) -> dict:
        return {**asdict(self.planner), "source": self.source}

    def describe(self) -> str:
        p = self.planner
        return (f"objective {p.objective}, head layers {p.head_layers}, KV for {p.context} tokens × "
                f"{p.concurrent} requests, max stages {p.max_stages or 'no limit'}, expert nodes "
                f"{p.expert_nodes} ({self.source})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="a GGUF (only its metadata is read)")
    source.add_argument("--layout", metavar="NAME", help="a model on paper, e.g. llama-3-70b-q4_k_m")
    parser.add_argument("--nodes", metavar="FILE", help="JSON list of nodes (default: the running swarm's)")
    # Each setting defaults to the running swarm's (on paper: init's defaults), so a plan asked for
    # inside a swarm is the swarm's plan unless an option says otherwise.
    options.add_arguments(parser, inherit="the swarm's")
    parser.add_argument("--acceptance", type=_share, default=0.8, metavar="A",
                        help="the share of drafted tokens kept, for the speculative figures (default 0.8)")
    parser.add_argument("--asker", metavar="MEMBER", help="a member whose measured speed the asker's own layers and "
                        "LM head are charged at (default: this machine where it is a member of the swarm, "
                        "else a desktop reading 58.5 GB/s)")
    parser.add_argument("--prompt-tokens", type=_prompt_tokens, default=1000, metavar="N",
                        help="the prompt length the first-token time is given for (default 1000)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _prompt_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 10_000_000:
        raise argparse.ArgumentTypeError(f"must be a whole number of tokens from 1, not {text!r}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a share from 0 up to (not including) 1, not {text!r}")
    return value


def settings_from(args: argparse.Namespace, base: PlannerSettings, source: str) -> Settings:
    """``base`` (the swarm's settings, or the defaults) with the options given in their place."""
    given = options.given(args)
    return Settings(replace(base, **given), source + (" and options" if given else ""))


def run(args: argparse.Namespace) -> int:
    from plans.layout import ModelLayout, layout_by_name
    from plans.nodes import load_nodes
    from swarmctl.model_files.models import resolve_model

    running = None
    if args.nodes:
        nodes = load_nodes(args.nodes)
        layout = layout_by_name(args.layout) if args.layout else ModelLayout.from_gguf(resolve_model(args.model))
        settings = settings_from(args, PlannerSettings(), "on paper")
    else:
        layout, nodes, running, base, source = asyncio.run(_from_swarm(args))
        settings = settings_from(args, base, source)
    asker = _asker_model(layout, nodes, args.asker or (_this_member(nodes) if running is not None else None))
    proposal, placement = plan_with(layout, nodes, settings, asker)
    if args.json:
        shown = {"model": layout.name, "n_layer": layout.n_layer, "head_layers": settings.planner.head_layers,
                 "settings": settings.as_dict(), **asdict(proposal), "whole_ms_per_token": proposal.whole_ms_per_token,
                 "experts": [asdict(e) for e in placement.experts],
                 "time": [asdict(t) for t in _time_breakdown(proposal, nodes)],
                 "speculation": _speculation(layout, proposal, args.acceptance),
                 "first_token": _first_token(layout, nodes, settings, asker, proposal, args.prompt_tokens)}
        if running is not None:
            shown["running"] = running.to_dict()
            shown["changes"] = plan_changes(running, proposal, placement.experts, settings)
        print(json.dumps(shown, indent=2))
        return 0
    if running is not None:
        print(format_running(running))
        print()
        print(f"a re-plan now, with the members' current figures ({settings.describe()}):")
    print(format_plan(layout, settings.planner.head_layers, proposal, placement.experts, nodes))
    if proposal.stages:
        print(format_speculation(_speculation(layout, proposal, args.acceptance)))
        print(_first_token(layout, nodes, settings, asker, proposal, args.prompt_tokens)["said"])
        print(format_other_head_layers(layout, nodes, settings, asker, proposal))
    if running is not None:
        changes = plan_changes(running, proposal, placement.experts, settings)
        print("a re-plan would change: " + ("; ".join(changes) if changes else "nothing"))
    return 0


def _speculation(layout, proposal, acceptance: float) -> dict:
    """One stream's tokens/s with speculative steps at ``acceptance`` (plans/whatif.py): the best
    draft count with one window per round trip, and with windows in flight (up to the asker's
    limit), each row reading its own experts on an MoE model. Both modelled."""
    from plans.whatif import best_speculation, best_windows, speculation

    if not proposal.stages:
        return {}
    one = next(s for s in best_speculation(speculation(proposal, layout, acceptances=(acceptance,)))
               if s.routing == "independent")
    many = best_windows(proposal, layout, acceptance)
    return {"acceptance": acceptance, "plain_tokens_per_s": 1000 / proposal.whole_ms_per_token,
            "one_window": asdict(one), "windows_in_flight": asdict(many)}


def _first_token(layout, nodes, settings: Settings, asker, proposal, prompt_tokens: int) -> dict:
    """The first-token time for a prompt of ``prompt_tokens`` (plans/prefill.py), streamed in chunks
    as a swarm's asker sends it; unknown where a member, or the asker (see --asker), measured no
    prompt rate."""
    from plans.prefill import first_token
    from plans.proposal import ASSUMED_ASKER

    found = first_token(proposal, layout, nodes, asker or ASSUMED_ASKER, settings.planner.head_layers, prompt_tokens)
    return {**asdict(found), "ms": None if math.isnan(found.ms) else found.ms, "said": found.describe()}


def format_speculation(sp: dict) -> str:
    one, many = sp["one_window"], sp["windows_in_flight"]
    def drafts(k: int) -> str:
        return f"{k} draft" + ("s" if k != 1 else "")

    return (f"with speculative steps at {sp['acceptance']:.0%} of drafts kept, one stream: "
            f"{one['tokens_per_s']:.2f} tokens/s with one window per round trip ({drafts(one['drafts'])}), "
            f"{many['tokens_per_s']:.2f} tokens/s with up to {many['windows']} windows in flight "
            f"({drafts(many['drafts'])} each; modelled: the asker sends them where the drafts it measures are kept "
            f"often enough)")


def _this_member(nodes) -> str | None:
    """This machine's name when it is one of the swarm's trunk members: a member that both serves
    and asks is the asker's machine, so its own figures price the asker's part."""
    from swarmctl.node.home import SwarmHome

    name = SwarmHome().load_config().name
    return name if any(n.name == name for n in nodes) else None


def _asker_model(layout, nodes, member: str | None):
    """What the asker's own part is charged at: ``member``'s measured speed, or the assumed desktop."""
    from plans.proposal import ASSUMED_ASKER, AskerModel

    if member is None:
        return ASSUMED_ASKER
    node = next((n for n in nodes if n.name == member), None)
    if node is None:
        raise EngineError(f"--asker {member}: no such member (members: {', '.join(n.name for n in nodes)})")
    return AskerModel.from_member(layout, node)


def format_other_head_layers(layout, nodes, settings: Settings, asker, proposal) -> str:
    """The same plan with the asker keeping other numbers of layers at each end: fewer cost the
    asker less and the trunk more (a layer more at a stage, or another stage and its hop)."""
    from plans.plan import PlanError

    here = settings.planner.head_layers
    shown = []
    for k in sorted({1, 2, 4} - {here}):
        if 2 * k > layout.n_layer:
            continue
        try:
            other, _ = plan_with(layout, nodes, Settings(replace(settings.planner, head_layers=k), settings.source),
                                 asker)
        except (PlanError, EngineError):
            shown.append(f"{k}: does not fit")
            continue
        shown.append(f"{k}: {other.whole_ms_per_token:.1f} ms ({other.asker_ms:.1f} at the asker)")
    return (f"with the asker keeping other layers at each end (now {here}: {proposal.whole_ms_per_token:.1f} ms per "
            f"token, {proposal.asker_ms:.1f} at the asker): " + "; ".join(shown))


def plan_with(layout, nodes, settings: Settings, asker=None):
    """The planner's proposal and expert placement under ``settings``: what the host computes.
    ``asker``: what the asker's own layers are charged at (plans.proposal.AskerModel; None: assumed)."""
    from plans.planner import add_expert_calls, place_experts, plan_layers

    constraints = settings.constraints()
    if asker is not None:
        constraints = replace(constraints, asker=asker)
    placement = place_experts(layout, nodes, constraints, settings.planner.expert_nodes)
    if settings.planner.expert_nodes and not layout.n_expert:
        placement.warnings.append(f"{layout.name} has no experts: --expert-nodes ignored")
    proposal = plan_layers(placement.stage_layout, placement.stage_nodes, constraints)
    proposal.warnings += placement.warnings
    add_expert_calls(proposal, placement, nodes, layout)
    return proposal, placement


def _time_breakdown(proposal, nodes):
    from plans.planner import time_breakdown

    return time_breakdown(proposal, nodes)


async def _from_swarm(args: argparse.Namespace):
    """The running swarm's model layout, members (as the host plans with them), plan, and
    settings: this host's own node.json where this is the host, else what the running plan says
    (the host keeps max-stages to itself: taken as no limit unless given)."""
    from plans.layout import ModelLayout, layout_by_name
    from plans.nodes import Link, NodeDescriptor
    from plans.plan import Plan
    from net import messages as m
    from swarmctl.commands.status import ask_host
    from swarmctl.node.home import SwarmHome
    from swarmctl.model_files.models import resolve_model

    home = SwarmHome()
    if not home.exists:
        raise EngineError("give --nodes FILE (no swarm is joined here to take the members from)")
    answer = await ask_host(home, m.GetNodes(), m.Nodes)
    running = Plan.from_dict((await ask_host(home, m.GetPlan(), m.PlanPush)).plan)
    nodes = [NodeDescriptor(n.name, n.memory_bytes, n.ms_per_layer_token, n.device, n.address,
                            {k: Link(v.rtt_ms, v.bandwidth_mb_s) for k, v in n.links.items()},
                            datagram_us=n.datagram_us, ram_bytes=n.ram_bytes, ram_gb_s=n.ram_gb_s,
                            prompt_ms_per_layer_row=n.prompt_ms_per_layer_row)
             for n in answer.nodes]
    if not nodes:
        raise EngineError("the swarm has no trunk members to plan with yet")
    config = home.load_config()
    if config.role == "host":
        base = PlannerSettings.from_config(config)
        source = "the swarm's settings"
    else:
        base = PlannerSettings(objective=running.objective, head_layers=running.head_layers,
                               context=running.context_tokens, concurrent=running.max_concurrent, max_stages=0,
                               expert_nodes=len(running.experts))
        source = "the running plan's settings"
    if args.layout:
        layout = layout_by_name(args.layout)
    else:
        layout = ModelLayout.from_gguf(resolve_model(args.model or config.model))
        if layout.n_layer != running.n_layer:  # (a member that joined without --model has the bundled one)
            raise EngineError(f"the model here ({layout.name}, {layout.n_layer} layers) is not the swarm's "
                              f"({running.model_name}, {running.n_layer} layers): give --model PATH")
    return layout, nodes, running, base, source


def format_running(plan) -> str:
    """The plan the swarm runs now, as the host holds it."""
    lines = [f"running plan v{plan.version}: {plan.n_layer} layers, the asker keeps [0, {plan.head_layers}) and "
             f"[{plan.n_layer - plan.head_layers}, {plan.n_layer}); objective {plan.objective}, "
             + ("complete" if plan.complete else "INCOMPLETE")]
    rows = [("STAGE", "MEMBER", "LAYERS", "MS/TOKEN", "READY")]
    rows += [(str(i), s.member, f"[{s.start}, {s.stop})", f"{s.compute_ms:.1f}", "yes" if s.ready else "no")
             for i, s in enumerate(plan.stages, start=1)]
    rows += [("experts", e.member, f"experts [{e.start}, {e.stop})", "", "yes" if e.ready else "no")
             for e in plan.experts]
    lines += _table(rows) if plan.stages or plan.experts else ["no stages: no trunk serves yet"]
    if plan.expected_ms_per_token:
        lines.append(f"expected: {plan.expected_ms_per_token:.1f} ms per token for one stream")
    return "\n".join(lines)


def plan_changes(running, proposal, experts, settings: Settings) -> list[str]:
    """What taking ``proposal`` would change in the running plan, one phrase per change (none:
    the same assignments)."""
    def span(start_stop) -> str:
        return f"[{start_stop[0]}, {start_stop[1]})" if start_stop else "standby"

    changes = []
    if settings.planner.head_layers != running.head_layers:
        changes.append(f"head layers {running.head_layers} → {settings.planner.head_layers}")
    before = {s.member: (s.start, s.stop) for s in running.stages}
    after = {s.member: (s.start, s.stop) for s in proposal.stages}
    for member in [*after, *(n for n in before if n not in after)]:
        if before.get(member) != after.get(member):
            changes.append(f"{member} {span(before.get(member))} → {span(after.get(member))}")
    before_e = {e.member: (e.start, e.stop) for e in running.experts}
    after_e = {e.member: (e.start, e.stop) for e in experts}
    for member in [*after_e, *(n for n in before_e if n not in after_e)]:
        if before_e.get(member) != after_e.get(member):
            changes.append(f"{member} experts {span(before_e.get(member))} → {span(after_e.get(member))}")
    if changes and running.expected_ms_per_token and proposal.ms_per_token:
        changes.append(f"expected {running.expected_ms_per_token:.1f} → {proposal.ms_per_token:.1f} ms per token")
    return changes


def format_plan(layout, head_layers: int, p, experts=(), nodes=()) -> str:
    from plans.planner import time_breakdown

    gb = 1e9
    lines = [f"plan for {layout.name}: {layout.n_layer} layers, the asker keeps [0, {head_layers}) and "
             f"[{layout.n_layer - head_layers}, {layout.n_layer}); objective {p.objective}"]
    calls = any(s.expert_calls for s in p.stages)
    ram = any(s.ram_used for s in p.stages)
    rows = [("STAGE", "MEMBER", "LAYERS", "USED", "FREE", "MS/TOKEN") + (("EXPERTS IN RAM",) if ram else ())
            + (("EXPERT CALLS",) if calls else ())]
    for i, s in enumerate(p.stages, start=1):
        rows.append((str(i), s.member, f"[{s.start}, {s.stop})", f"{s.memory_used / gb:.1f} GB",
                     f"{s.memory_free / gb:.1f} GB", f"{s.compute_ms:.1f}")
                    + ((f"{s.ram_used / gb:.1f} GB" if s.ram_used else "",) if ram else ())
                    + ((f"{s.expert_calls} × {s.expert_ms / max(1, s.expert_calls):.1f} ms",) if calls else ()))
    for e in experts:
        rows.append(("experts", e.member, f"experts [{e.start}, {e.stop})", "", "", "") + (("",) if ram else ())
                    + (("",) if calls else ()))
    lines += _table(rows)
    whole = p.whole_ms_per_token
    single = 1000 / whole if whole else float("inf")
    # one request has one token on its way at a time: the pipeline fills only with this many
    in_flight = max(1, math.ceil(whole * p.tokens_per_s / 1000 - 0.05)) if math.isfinite(p.tokens_per_s) else 1
    lines.append(f"expected: {whole:.1f} ms per token for one stream ({single:.2f} tokens/s; the asker's own layers "
                 f"and LM head {p.asker_ms:.1f} ms, {p.asker_basis}; trunk compute and links {p.ms_per_token:.1f} ms), "
                 f"at most {p.tokens_per_s:.1f} tokens/s pipelined over many askers "
                 f"(with {in_flight} or more requests in flight)")
    lines.append(f"bottleneck: {p.bottleneck}")
    if p.stages:
        lines.append("where one stream's token spends its time:")
        parts = [("PART", "COUNT", "MS", "SHARE", "OF WHICH LATENCY")]
        for t in time_breakdown(p, list(nodes)):
            share = t.ms / whole if whole else 0.0
            latency = f"{t.latency_ms:.1f} ms" if t.latency_ms else ""
            parts.append((t.part, str(t.count), f"{t.ms:.1f}", f"{share:.0%}", latency))
        parts.append(("total", "", f"{whole:.1f}", "100%", ""))
        lines += ["  " + line for line in _table(parts)]
    held = (layout.range_bytes(0, head_layers) + layout.range_bytes(layout.n_layer - head_layers, layout.n_layer)
            + layout.embedding_bytes + layout.lm_head_bytes)
    lines.append(f"the asker holds {units.size(held)} itself (embedding, LM head, its {2 * head_layers} layers)")
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
