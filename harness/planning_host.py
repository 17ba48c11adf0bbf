"""A host's plan keeper (swarmctl/host/planning.py) driven with no sockets and a clock in the
caller's hands: members register, load, say ready and leave as calls; every plan the keeper pushes
is recorded per connection. Shared by tests/test_make_before_break.py and
benchmarks/bench_plan_damping.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from net.wire import FRAME_HEADER
from plans.layout import ModelLayout
from plans.nodes import ASKER, Link
from plans.plan import Plan
from plans.planner import Constraints
from swarmctl.host import TrunkInfo
from swarmctl.host.planning import PlanKeeper

GB = 1e9
SMOL = ModelLayout("smol", 30, 576, (4_000_000,) * 30, (1,) * 30, 1024, 0, 0)  # 22 trunk layers


class Recorder:
    """A connection that keeps every plan pushed on it."""

    def __init__(self, name: str) -> None:
        self.peer_name, self.is_open, self.plans = name, True, []

    def send(self, stream_id: int, frame: bytes, end: bool = False) -> None:
        self.plans.append(Plan.from_dict(json.loads(frame[FRAME_HEADER.size:])["plan"]))  # (past the binary header)


class Host:
    def __init__(self, tmp_path, figures: dict[str, float], objective: str = "throughput",
                 memory: float = 2 * GB) -> None:
        self.trunks = {}
        self.now = 0.0  # the keeper's clock, in the test's hands
        self.memory = memory
        config = SimpleNamespace(head_layers=4, plan_context=256, plan_concurrent=2, objective=objective,
                                 plan_max_stages=0, expert_nodes=0, wire_dtype="f32", kernels="plain")
        self.planning = PlanKeeper(SimpleNamespace(file=lambda name: tmp_path / name, members=dict), config, SMOL,
                                   Plan(0, "m", 30, 4), self.trunks)
        self.planning.clock = lambda: self.now
        self.planning.constraints = Constraints(head_layers=4, context_tokens=256, max_concurrent=2,
                                                objective=objective)
        self.asker = Recorder("asker")
        self.planning.watch(self.asker, 0)
        self.conns: list[Recorder] = []  # every trunk connection there was
        for name, figure in figures.items():
            self.join(name, figure)

    def join(self, name: str, figure: float = 1.0) -> None:
        """A member the host timed before registers (its claims need no check: checks.py), and the
        host re-plans (trunk_reports.py's ``register``)."""
        replaced = name in self.trunks
        self.conns.append(Recorder(name))
        self.trunks[name] = TrunkInfo(conn=self.conns[-1], plan_stream=0, listen=f"127.0.0.1:{len(self.conns)}",
                                      memory=int(self.memory), ms_per_layer_token=figure, rtt_ms=1.0,
                                      registered_at=self.now + len(self.conns) * 1e-3, passed_check=True)
        self.planning.registered(name, replaced=replaced)

    def leave(self, name: str) -> None:
        """``name`` disconnects (service.py's ``connection_lost``)."""
        self.trunks[name].conn.is_open = False
        del self.trunks[name]
        self.planning.lost(name)

    def wait(self, seconds: float, step: float = 1.0) -> None:
        """Time passes: the keeper's timers (its deadlines and holds, the gate's look) fire when due."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + step)
            if (due := self.planning.due()) is not None and due <= self.now:
                self.planning.tick()
            if (due := self.planning.gate.due()) is not None and due <= self.now:
                self.planning.reconsider()

    def load(self, but: str = "") -> None:
        """Every member but ``but`` loads what the plans (in use, staged) give it, and passes its check."""
        for plan in (self.planning.plan, self.planning.staged):
            for s in plan.stages if plan is not None else []:
                if s.member != but and not s.ready and self.planning.plan_of(plan.version) is plan:
                    self.ready(s.member, plan.version)

    def members(self, plan: Plan | None = None) -> list[str]:
        return [s.member for s in (plan or self.planning.plan).stages]

    def issued(self) -> dict[int, set]:
        """Every plan version anyone was sent (trunks and askers; trials apart) → its assignments."""
        plans = [p for conn in [self.asker, *self.conns] for p in conn.plans if p.version < 2**40]
        versions: dict[int, set] = {}
        for p in plans:
            versions.setdefault(p.version, set()).add(p.assignments())
        return versions

    def ready(self, name: str, version: int) -> None:
        """``name`` said ready for ``version`` and passed its layer check (checks.py)."""
        self.planning.plan_of(version).stage_for(name).ready = True
        self.planning.stage_ready()

    def serve(self) -> Plan:
        """Every stage of the plan in use gets ready: it serves."""
        plan = self.planning.plan
        for s in plan.stages:
            self.ready(s.member, plan.version)
        assert self.planning.plan.complete
        return self.planning.plan

    def sent(self, name: str) -> list[Plan]:
        return self.trunks[name].conn.plans


def flapping(tmp_path, seconds: int, bad_until: float = 0.0) -> tuple[Host, int]:
    """Two trunks that can each hold the model, planned for latency; alice's link to the asker is
    claimed 100 ms and 1 ms by turns each second (bob's is 20 ms), then, up to ``bad_until``,
    stays at 100 ms. Returns the host and how many plans were issued meanwhile."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0}, objective="latency")
    host.planning.consider_links("bob", {ASKER: Link(20.0)})
    host.planning.replan()
    host.serve()
    assert host.members() == ["alice"]
    before = set(host.issued())
    for second in range(seconds):
        bad = second % 2 == 0 or host.now < bad_until
        host.planning.consider_links("alice", {ASKER: Link(100.0 if bad else 1.0)})
        host.load()  # a new plan's stages load at once
        host.wait(1.0)
    return host, len(set(host.issued()) - before)
