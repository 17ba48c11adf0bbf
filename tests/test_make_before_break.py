"""Issue 30 item 2b: a plan change is make-before-break (swarmctl/host/planning.py, I/O-free).

While the plan in use serves (every stage ready, every member there), a new plan is *staged*:
sent to its trunks to load beside the plan in use, never to askers. Askers switch only once every
stage of the new plan proved ready; a member that does not get ready by the deadline is left out
and the plan in use stays. Before this, the host published the new plan at once: askers got a plan
whose stages were not ready, and asks failed until they were (61 s in the issue's case). The same
over real processes: tests/test_swarm.py (a third trunk joins while asks run) and
tests/test_layer_proof.py (a proven member that never loads its staged layers).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from plans.layout import ModelLayout
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
        self.plans.append(Plan.from_dict(json.loads(frame[frame.index(b"{"):])["plan"]))


class Host:
    def __init__(self, tmp_path, figures: dict[str, float]) -> None:
        self.trunks = {}
        config = SimpleNamespace(head_layers=4, plan_context=256, plan_concurrent=2, objective="throughput",
                                 plan_max_stages=0, expert_nodes=0, wire_dtype="f32")
        self.planning = PlanKeeper(SimpleNamespace(file=lambda name: tmp_path / name, members=dict), config, SMOL,
                                   Plan(0, "m", 30, 4), self.trunks)
        self.planning.constraints = Constraints(head_layers=4, context_tokens=256, max_concurrent=2,
                                                objective="throughput")
        self.asker = Recorder("asker")
        self.planning.watch(self.asker, 0)
        for name, figure in figures.items():
            self.join(name, figure)

    def join(self, name: str, figure: float) -> None:
        """A member that proved its claims registers, and the host re-plans (as checks.py does)."""
        self.trunks[name] = TrunkInfo(conn=Recorder(name), plan_stream=0, listen=f"127.0.0.1:{len(self.trunks) + 1}",
                                      memory=int(2 * GB), ms_per_layer_token=figure, rtt_ms=1.0,
                                      registered_at=float(len(self.trunks)), passed_check=True)
        self.planning.replan()

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


def test_a_new_member_loads_beside_the_plan_in_use_and_askers_switch_when_it_is_ready(tmp_path):
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    old = host.serve()
    seen = len(host.asker.plans)
    host.join("carol", 1.0)  # the planner spreads the layers over three now
    staged = host.planning.staged
    assert staged is not None and staged.version > old.version and len(staged.stages) == 3
    assert host.planning.plan is old and old.complete and old.next_version == staged.version
    # askers heard of no other plan than the one in use; every trunk of the new plan got it staged,
    # after the plan in use
    assert {p.version for p in host.asker.plans[seen:]} <= {old.version}
    for name in ("alice", "bob", "carol"):
        assert host.sent(name)[-1].staged and host.sent(name)[-1].version == staged.version
        assert not host.sent(name)[-2].staged and host.sent(name)[-2].next_version == staged.version
    for name in ("alice", "carol"):
        host.ready(name, staged.version)
        assert host.planning.plan is old  # not all of it yet: the old plan serves on
    assert all(p.complete for p in host.asker.plans[seen:])
    host.ready("bob", staged.version)
    now = host.planning.plan
    assert now.version == staged.version and now.complete and not now.staged and host.planning.staged is None
    assert [p.version for p in host.asker.plans[seen:] if p.version != old.version] == [staged.version]
    assert all(p.complete for p in host.asker.plans[seen:])  # never an incomplete plan to askers
    assert all(not p.staged for p in host.asker.plans)
    assert (tmp_path / "plan_version").read_text() == str(staged.version)


def test_a_member_that_never_loads_its_staged_layers_is_left_out_and_the_plan_in_use_stays(tmp_path):
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    old = host.serve()
    seen = len(host.asker.plans)
    host.join("mallory", 1.0)  # proved its claims, then never loads what it is given
    staged = host.planning.staged
    for s in staged.stages:
        if s.member != "mallory":
            host.ready(s.member, staged.version)
    assert host.planning.plan is old
    host.planning._staged_overdue(staged.version)  # (the deadline's timer)
    assert "did not load layers" in host.trunks["mallory"].refused
    assert host.planning.staged is None
    kept = host.planning.plan
    assert kept.assignments() == old.assignments() and kept.complete and kept.next_version == 0
    assert all(p.complete and "mallory" not in [s.member for s in p.stages] for p in host.asker.plans[seen:])
    assert host.sent("alice")[-1].version == kept.version and host.sent("alice")[-1].next_version == 0


def test_a_replan_while_one_is_staged_stages_the_newer_one(tmp_path):
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0})
    old = host.serve()
    host.join("carol", 1.0)
    first = host.planning.staged
    host.join("dave", 1.0)
    second = host.planning.staged
    assert second.version > first.version and len(second.stages) == 4 and host.planning.plan is old
    assert host.planning.plan_of(first.version) is None  # a late ready for the first one counts for nothing
    for s in second.stages:
        host.ready(s.member, second.version)
    assert host.planning.plan.version == second.version and host.planning.plan.complete


def test_a_plan_that_lost_a_member_is_replaced_at_once(tmp_path):
    """Nothing to keep serving: a plan whose member left is broken already, so the new plan goes
    out at once (as before)."""
    host = Host(tmp_path, {"alice": 1.0, "bob": 1.0, "carol": 1.0})
    old = host.serve()
    host.trunks["bob"].conn.is_open = False
    del host.trunks["bob"]
    host.planning.replan()
    assert host.planning.staged is None and host.planning.plan.version > old.version
    assert "bob" not in [s.member for s in host.asker.plans[-1].stages]
