"""The host's answer to ``status``: the swarm, its plan and every member's health
(``net.messages.Status``, what `swarmctl status`, `top` and the monitor read)."""

from __future__ import annotations

import math
from net import clock
from dataclasses import dataclass, field

from net.messages import FetchStatus, LinkStatus, MemberStatus, RecoveryStatus, Status
from plans.links import RELAYED, LinkModel
from plans.nodes import ASKER, NodeDescriptor
from plans.plan import Plan
from swarmctl.node.home import SwarmHome

from .rendezvous import Rendezvous
from .reports import AskerReports
from .trunks import Trunks


@dataclass
class StatusSources:
    """Everything a status is read from."""

    home: SwarmHome  # the member records (who joined, who is revoked)
    host_name: str
    host_address: str  # as members reach it
    swarm_name: str
    plan: Plan
    trunks: Trunks
    online: set[str]  # members with at least one open connection
    reports: AskerReports
    # (trunk, peer) links whose last report carried a measured bandwidth (the others plan at a default)
    bandwidth_measured: set[tuple[str, str]] = field(default_factory=set)
    rendezvous: Rendezvous | None = None  # the paths the host gave members to reach trunks
    last_seen: dict[str, float] = field(default_factory=dict)  # member → clock.now() as its last connection closed
    staged: Plan | None = None  # a plan staged to follow ``plan`` (make-before-break: planning.py)


def health(src: StatusSources, name: str, revoked: bool) -> str:
    stage, expert, trunk = src.plan.stage_for(name), src.plan.expert_for(name), src.trunks.get(name)
    if revoked:
        return "revoked"
    if name == src.host_name:
        return "up (host)"
    if trunk is not None and trunk.refused:
        return f"refused: {trunk.refused}"
    if trunk is not None and trunk.check_error:  # a check the host could not make: why, and when again
        return f"{'checking its claims' if trunk.checking else 'loading'}: {trunk.check_problem()}"
    if trunk is not None and trunk.checking:
        return "checking its claims"
    if trunk is not None and trunk.trial is not None:  # (planning.py: it proves itself before it is planned)
        return f"on trial: proving layers [{trunk.trial[1]}, {trunk.trial[2]})"
    if stage is not None:
        return "ready" if stage.ready else "loading"
    if expert is not None:
        return "ready" if expert.ready else "loading"
    return "up" if name in src.online else "down"


def member_row(src: StatusSources, name: str, may: str, revoked: bool) -> MemberStatus:
    stage, expert, trunk = src.plan.stage_for(name), src.plan.expert_for(name), src.trunks.get(name)
    is_host = name == src.host_name
    return MemberStatus(
        name=name, role="host" if is_host else ("trunk" if trunk is not None else "member"), may=may,
        address=src.host_address if is_host else (_address(src, name) if trunk else ""),
        layers=[stage.start, stage.stop] if stage else None,
        experts=[expert.start, expert.stop] if expert else None,
        memory=trunk.memory if trunk else None, device=trunk.device if trunk else "",
        ram_bytes=trunk.ram_bytes if trunk else 0, ram_gb_s=trunk.ram_gb_s if trunk else 0.0,
        placement=trunk.placement if trunk and trunk.placement not in ("", trunk.device) else "",
        health=health(src, name, revoked),
        ms_per_layer_token=trunk.ms_per_layer_token if trunk else None,
        measured_ms_per_layer=trunk.measured_ms_per_layer if trunk else None,
        planned_ms_per_layer=trunk.planning_speed if trunk else None,
        slice_bytes_sent=trunk.served_bytes if trunk else 0,
        bad_results=src.reports.reports_on(name), bad_result_reporters=src.reports.reporters_of(name),
        last_seen_s=(round(clock.now() - src.last_seen[name], 1)
                     if name in src.last_seen and name not in src.online else None),
        fetch=_fetch(trunk.fetch) if trunk is not None and trunk.fetch is not None else None,
        cached_tokens=trunk.cached[0] if trunk else 0, cached_kv_bytes=trunk.cached[1] if trunk else 0)


def _fetch(report) -> FetchStatus:
    return FetchStatus(what=report.what, done=report.done, total=report.total, bytes_per_s=report.bytes_per_s,
                       eta_s=report.eta_s, finished=report.finished,
                       age_s=round(clock.now() - report.at, 1))


def _address(src: StatusSources, name: str) -> str:
    """A trunk's own address as the host knows it (behind a NAT, its mapping as
    the host sees it, not its listen port at its router's IP, which another member behind the
    same router may hold)."""
    trunk = src.trunks[name]
    return src.rendezvous.shown_address(name, trunk) if src.rendezvous is not None else trunk.seen_address


def link_rows(src: StatusSources) -> list[LinkStatus]:
    """The plan's links in the order a token crosses them (asker → stage 1 → … → last → asker),
    each as the host plans with it: the trunks' measurements (the one to the host stands for the
    asker's side), or the planner's estimate where nobody measured the pair (plans/links.py)."""
    order = [s.member for s in src.plan.stages]
    if not order:
        return []
    nodes = []
    for name, t in src.trunks.items():  # (as PlanKeeper.descriptors gives them to the planner)
        nodes.append(NodeDescriptor(name, t.memory, 1.0, t.device, t.listen, t.planned_links()))
    model = LinkModel(nodes)
    rows = []
    for a, b in [(ASKER, order[0]), *zip(order, order[1:]), (order[-1], ASKER)]:
        estimate = model.link(a, b)
        # whose measurement it is: a trunk's own report, else the other end's (ASKER reports nothing)
        reporter = next(((x, y) for x, y in ((a, b), (b, a)) if y in (src.trunks[x].links if x in src.trunks
                                                                        else {})), None)
        rows.append(LinkStatus(
            source=a, target=b, path=_path(src, a, b, estimate),
            rtt_ms=estimate.link.rtt_ms, basis=estimate.basis,
            bandwidth_mb_s=estimate.link.bandwidth_mb_s if math.isfinite(estimate.link.bandwidth_mb_s) else None,
            measured=estimate.measured,
            bandwidth_measured=estimate.measured and reporter is not None and reporter in src.bandwidth_measured))
    return rows


def _path(src: StatusSources, a: str, b: str, estimate) -> str:
    """How the link goes: as the host routed it (direct, punched, relayed via X), for the asker's
    side as it routed the newest ask, naming the asker where it was not direct ("punched (dave)");
    else as the planner charges it."""
    if estimate.basis == RELAYED:
        via = estimate.through[0]
        return f"relayed via {src.host_name if via == ASKER else via}"
    if src.rendezvous is not None:
        if ASKER in (a, b):
            seen = src.rendezvous.asker_path(b if a == ASKER else a)
            if seen is not None:
                return seen[1] if seen[1] == "direct" else f"{seen[1]} ({seen[0]})"
        else:
            path = src.rendezvous.path(a, b)
            if path is not None:
                return path
    return "direct"


def swarm_status(src: StatusSources) -> Status:
    plan, recovery = src.plan, src.reports.recovery
    staged = src.staged
    members = [member_row(src, name, record.role, record.revoked)
               for name, record in sorted(src.home.members().items())]
    return Status(swarm=src.swarm_name, model=plan.model_name, n_layer=plan.n_layer, head_layers=plan.head_layers,
                  plan_version=plan.version, complete=plan.complete,
                  missing_layers=[list(gap) for gap in plan.missing_layers()], members=members,
                  objective=plan.objective, expected_ms_per_token=plan.expected_ms_per_token,
                  expected_tokens_per_s=plan.expected_tokens_per_s, bottleneck=plan.bottleneck,
                  warnings=list(plan.warnings),
                  recovery=RecoveryStatus(recoveries=recovery.recoveries, replayed_bytes=recovery.replayed_bytes,
                                          last_recovery_s=recovery.last_recovery_s,
                                          last_marked_down=recovery.last_marked_down),
                  links=link_rows(src), staged=f"v{staged.version}: " + ", ".join(
                      f"{s.member}[{s.start},{s.stop}){'' if s.ready else ' loading'}" for s in staged.stages)
                  if staged else "")
