"""Planning under the swarm's own load (issue 29, items 5, 7 and 8), I/O-free.

Item 5: eight streams on a two-trunk swarm re-planned in a loop (every trunk layer moved four
times in 45 s), because a stage's figure taken beside its own work (4.51 ms per layer) was
compared with the idle trunk's (0.41); and the opposite: a trunk timed 61.6 then 36.9 was never
re-planned although 17% faster than the stage in use, and a contended start-up figure stayed in
the plan 15% above what the stage served. Item 7: a claim check that raised was never retried
and never shown. Item 8: speed figures swung 20-30x from one probe to the next on a loaded machine.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from types import SimpleNamespace

import pytest

from kernels.speed import Repeat, SpeedTracker, collect
from net.messages import Speed
from kernels.speed import REPORT_INTERVAL_S, RESEND_S
from plans.hysteresis import (CONVERGE_FACTOR, MAX_DEFER_S, MIN_GAIN, PAYBACK_S, REPLAY_S, SERVED_REPORTS, SETTLE_S, SPEED_FACTOR,
                              SUSTAIN_S, ReplanGate, move_cost_s, replan_gain, required_gain, served_figure)
from plans.layout import ModelLayout
from plans.nodes import ASKER, Link, NodeDescriptor
from plans.plan import Plan
from plans.planner import Constraints
from swarmctl.batching import BatchRecord
from swarmctl.host import TrunkInfo
from swarmctl.host.checks import CheckTimings, ClaimChecks
from swarmctl.host.planning import IDLE_RECHECK_S, PlanKeeper
from swarmctl.host.status import health
from swarmctl.host.trunk_reports import TrunkReports
from swarmctl.node.layer_proof import Outcome

GB = 1e9
SMOL = ModelLayout("smol", 30, 576, (4_000_000,) * 30, (1,) * 30, 1024, 0, 0)  # 22 trunk layers


def constraints(objective: str = "latency") -> Constraints:
    return Constraints(head_layers=4, context_tokens=256, max_concurrent=2, objective=objective)


class FakeHost:
    """A PlanKeeper over fake trunk connections, its clock in the test's hands, and the host's
    ``speed`` handler on it."""

    def __init__(self, tmp_path, figures: dict[str, float], objective: str = "latency") -> None:
        self.conns = {name: SimpleNamespace(peer_name=name, is_open=True, send=lambda *a, **k: None)
                      for name in figures}
        self.trunks = {name: TrunkInfo(conn=conn, plan_stream=0, listen=f"127.0.0.1:{i + 1}", memory=int(2 * GB),
                                       ms_per_layer_token=figures[name], rtt_ms=1.0, registered_at=float(i),
                                       passed_check=True)  # (trunks that proved their layers: planned)
                       for i, (name, conn) in enumerate(self.conns.items())}
        config = SimpleNamespace(head_layers=4, plan_context=256, plan_concurrent=2, objective=objective,
                                 plan_max_stages=0, expert_nodes=0, wire_dtype="f32", kernels="plain")
        self.planning = PlanKeeper(SimpleNamespace(file=lambda name: tmp_path / name, members=dict), config, SMOL,
                                   Plan(0, "m", 30, 4), self.trunks)
        self.planning.constraints = constraints(objective)
        self.now = 0.0
        self.planning.clock = lambda: self.now
        self.reprobed: list[str] = []
        # the host's handlers of what trunks report (its speed handler), checks faked to a list of reprobes
        self.host = TrunkReports(self.trunks, self.planning,
                                 SimpleNamespace(reprobe=lambda name, trunk: self.reprobed.append(name)))
        self.planning.replan()

    def speed(self, name: str, figure: float, serving: bool = False) -> None:
        self.host.speed(self.conns[name], 0, Speed(ms_per_layer_token=figure, serving=serving))

    def wait(self, seconds: float) -> None:
        """Time passes; the gate's timer, if it was set and is due, looks again."""
        self.now += seconds
        due = self.planning.gate.due()
        if due is not None and due <= self.now:
            self.planning.reconsider()

    @property
    def version(self) -> int:
        return self.planning.plan.version

    @property
    def holders(self) -> list[str]:
        return [s.member for s in self.planning.plan.stages]


# --- item 5: the host ---

def test_the_issues_loop_figures_reach_the_host_and_nothing_moves_while_they_swing(tmp_path):
    """The issue's figures, as a loaded stage's served reports would bring them if starved batches
    got through: the stage reads 4.51 and 0.41 by turns, a report every REPORT_INTERVAL_S, while
    the idle trunk stays at 0.45. The stage is judged by its best recent report and the gain must
    hold for SUSTAIN_S: no re-plan and no reroute. (Before: the first 4.51 re-planned at once.)"""
    host = FakeHost(tmp_path, {"alice": 0.41, "bob": 0.45})
    assert host.holders == ["alice"] and host.version == 1
    for figure in [4.51, 0.41] * 10:
        host.speed("alice", figure, serving=True)
        host.wait(REPORT_INTERVAL_S)
        assert host.version == 1, host.holders
    assert host.holders == ["alice"]


def test_a_sustained_slowdown_replans_once_and_not_back(tmp_path):
    """A stage that really got slower (its served batches had the CPU and still took 3x as long)
    loses its layers once the gain held for SUSTAIN_S; the other trunk's figure stays, so nothing
    moves back."""
    host = FakeHost(tmp_path, {"alice": 0.41, "bob": 0.45})
    host.now = SETTLE_S  # the first plan has stood long enough
    for _ in range(3):
        host.speed("alice", 1.4, serving=True)
        assert host.version == 1  # adopted, but the gain must hold first
    assert host.planning.speed_basis["alice"] == pytest.approx(1.4)
    host.wait(SUSTAIN_S)
    assert host.version == 2 and host.holders == ["bob"]
    for _ in range(5):
        host.wait(SUSTAIN_S + SETTLE_S)
        host.speed("bob", 0.47, serving=True)  # within its band
    assert host.version == 2


def test_a_replan_on_speed_waits_until_the_stages_hold_no_request(tmp_path):
    """Moving replays every request in flight: a sustained gain found under load re-plans once
    the stages are idle (or after MAX_DEFER_S of a gain held under load), never mid-load."""
    for i, (held, replanned_after) in enumerate((([8, 3, 0], 2), ([8] * 200, None))):
        (tmp_path / str(i)).mkdir()
        host = FakeHost(tmp_path / str(i), {"alice": 0.41, "bob": 0.45})
        answers = list(held)

        async def stage_requests():
            return answers.pop(0)

        host.planning.stage_requests = stage_requests

        async def scenario():
            host.now = SETTLE_S
            host.speed("alice", 1.4, serving=True)
            looks = 0
            while host.version == 1 and host.now < SETTLE_S + MAX_DEFER_S + 60:
                host.now += SUSTAIN_S if looks == 0 else IDLE_RECHECK_S
                host.planning.reconsider()
                for _ in range(3):
                    await asyncio.sleep(0)
                looks += 1
            host.planning.close()
            return looks

        looks = asyncio.run(scenario())
        assert host.version == 2 and host.holders == ["bob"]
        if replanned_after is not None:
            assert looks == replanned_after + 1  # asked three times: 8, 3, then 0 requests held
        else:  # held forever: the gain held under load for MAX_DEFER_S
            assert host.now - SETTLE_S >= MAX_DEFER_S


def test_a_stage_judged_slower_must_say_so_several_times(tmp_path):
    """After good served reports, one slow one is not enough: the best of the last
    SERVED_REPORTS decides (the trunk sends its figure again every RESEND_S while it holds)."""
    host = FakeHost(tmp_path, {"alice": 0.41, "bob": 0.45})
    host.now = SETTLE_S
    for figure in (0.41, 0.42, 1.4, 1.4):
        host.speed("alice", figure, serving=True)
        assert host.planning.speed_basis["alice"] == pytest.approx(0.41)
    host.speed("alice", 1.4, serving=True)
    assert host.planning.speed_basis["alice"] == pytest.approx(1.4)


def test_a_trunk_timed_faster_is_replanned_on(tmp_path):
    """The issue's Kimi-width figures: timed 61.6 at join, then 36.9 ("planned with 37.2"), 17%
    faster than the stage in use at 44.6. The old host adopted 37.2 inside its own look at the
    nodes, then compared 37.2 with 37.2: 'kept', and never re-planned."""
    host = FakeHost(tmp_path, {"stage": 44.6, "newcomer": 37.2})
    newcomer = host.trunks["newcomer"]
    newcomer.measured_ms_per_layer = 61.6
    host.planning.speed_basis.clear()
    host.planning.replan()
    assert host.holders == ["stage"] and host.planning.speed_basis["newcomer"] == 61.6
    host.now = SETTLE_S
    newcomer.measured_ms_per_layer = 36.9  # the host timed it again (ClaimChecks._took_measurement)
    assert newcomer.planning_speed == 37.2
    host.planning.consider_speed("newcomer", newcomer.planning_speed, " as timed")
    assert host.planning.speed_basis["newcomer"] == 37.2
    host.wait(SUSTAIN_S)
    assert host.holders == ["newcomer"]


def test_figures_planned_with_converge_to_what_the_stage_serves(tmp_path):
    """A contended start-up figure (44.6) against the 38.6 the stage serves: a 15% difference,
    inside the 1.5x band a single measurement needs, used to stay in the plan for good (the trunk
    did not even report it: its own band was 1.25x). Served figures converge, and a served wobble
    within CONVERGE_FACTOR then leaves the figure alone."""
    host = FakeHost(tmp_path, {"stage": 44.6, "standby": 60.0})
    host.speed("stage", 38.6, serving=True)
    assert host.planning.speed_basis["stage"] == pytest.approx(38.6)
    rng = random.Random(3)
    for _ in range(20):
        host.speed("stage", 38.6 * rng.uniform(0.95, 1.05), serving=True)
    assert host.planning.speed_basis["stage"] == pytest.approx(38.6)  # within the band: not moved
    assert host.version == 1
    for _ in range(6):  # then the stage serves steadily at 30: the figure follows within a few reports
        host.speed("stage", 30.0, serving=True)
    assert 30.0 <= host.planning.speed_basis["stage"] <= 30.0 * CONVERGE_FACTOR


def test_a_fresh_measurement_replaces_what_was_served(tmp_path):
    host = FakeHost(tmp_path, {"alice": 1.0, "bob": 1.0}, objective="throughput")
    host.speed("alice", 1.2, serving=True)
    assert host.trunks["alice"].served == [1.2]
    host.speed("alice", 3.0)  # measured again, idle
    assert host.trunks["alice"].served == [] and host.trunks["alice"].ms_per_layer_token == 3.0
    assert host.planning.speed_basis["alice"] == 3.0


def test_the_served_figure_is_the_best_of_the_last_few_reports():
    assert served_figure([]) is None
    assert served_figure([5.0, 1.0, 2.0, 3.0]) == 1.0
    assert served_figure([1.0, 2.0, 3.0, 4.0]) == 2.0  # only the last SERVED_REPORTS count
    assert SERVED_REPORTS == 3


# --- item 5: the gate and what moving costs ---

def test_the_gate_needs_the_gain_at_every_look_for_sustain_s():
    gate = ReplanGate(sustain_s=20, settle_s=60)
    gate.plan_changed(0)
    assert not gate.look(True, 100) and gate.due() == 120
    assert not gate.look(True, 110)
    assert not gate.look(False, 115) and gate.due() is None  # one look without the gain: start over
    assert not gate.look(True, 116) and not gate.look(True, 135)
    assert gate.look(True, 136)
    gate.plan_changed(136)
    assert not gate.look(True, 160) and gate.due() == 196  # sustained since 160, settled at 196
    assert gate.look(True, 196)


def test_moving_costs_reloads_and_replays():
    current = [("a", 4, 26)]
    assert move_cost_s(SMOL, current, current) == 0.0
    half = [("a", 4, 15), ("b", 15, 26)]
    assert move_cost_s(SMOL, current, half) == pytest.approx(11 * 4e6 / 200e6 + REPLAY_S)
    assert required_gain(0.0) == MIN_GAIN
    # Kimi-width layers: moving 22 of them (≈ 11 GB each... here 9 GB) needs far more than 10%
    heavy = ModelLayout("heavy", 30, 7168, (9_000_000_000,) * 30, (1,) * 30, 1024, 0, 0)
    cost = move_cost_s(heavy, current, [("b", 4, 26)])
    assert cost > 900 and required_gain(cost) == pytest.approx(cost / PAYBACK_S) and required_gain(cost) > 1


def test_a_gain_that_does_not_repay_the_move_is_kept():
    """Two trunks 17% apart: worth a move of a small model, not of one whose layers take many
    minutes to load again."""
    nodes = [NodeDescriptor("stage", int(1e12), 44.6, links={ASKER: Link(1.0, 100.0)}),
             NodeDescriptor("other", int(1e12), 37.2, links={ASKER: Link(1.0, 100.0)})]
    current = [("stage", 4, 26)]
    assert replan_gain(SMOL, nodes, constraints(), current).worth
    heavy = ModelLayout("heavy", 30, 7168, (2_000_000_000,) * 30, (1,) * 30, 1024, 0, 0)
    gain = replan_gain(heavy, nodes, constraints(), current)
    assert not gain.worth and gain.needed > 1 - gain.proposed_ms / gain.current_ms, gain.describe()


# --- item 5: the trunk's served figure ---

def batch(t: float, ms_per_layer: float, cpu_share: float, layers: int = 22) -> BatchRecord:
    seconds = ms_per_layer * layers / 1e3
    return BatchRecord(t, seconds, (b"r" * 16,), 1, seconds * cpu_share)


def test_batches_other_processes_starved_do_not_read_as_slowness():
    """A stage on a shared 2-core machine: while the asker computes its layers, the stage's
    batches get half a core (4.51 ms per layer); alone, they take 0.41. Seven of ten batches were
    starved. The median of them all (the old figure) said 4.51; the batches that had the CPU say
    0.41, and a window with no such batch says nothing at all."""
    rng = random.Random(5)
    now = time.time()
    records = []
    for i in range(30):
        starved = rng.random() < 0.7
        ms = rng.uniform(3.5, 5.5) if starved else rng.uniform(0.40, 0.46)
        records.append(batch(now - 60 + i, ms, 0.5 if starved else 1.95))
    old_figure = statistics.median(r.seconds * 1e3 / 22 for r in records)
    assert old_figure > 3.0
    tracker = SpeedTracker(cpus=2)
    tracker.observe(records, 22, now=now, n_threads=2)
    assert 0.40 <= tracker.serving_estimate() <= 0.46
    only_starved = SpeedTracker(cpus=2)
    only_starved.observe([batch(now - 30 + i, 4.5, 0.5) for i in range(30)], 22, now=now, n_threads=2)
    assert only_starved.serving_estimate() is None and only_starved.serving_report(None, now=0.0) is None


def test_a_stage_that_is_really_slower_says_so():
    """Batches that had the CPU and still took longer: the machine is slower (throttled, or the
    stage's layers do not fit its cache as the one-layer probe did)."""
    now = time.time()
    tracker = SpeedTracker(cpus=2)
    tracker.observe([batch(now - 30 + i, 1.2, 1.9) for i in range(12)], 22, now=now, n_threads=2)
    assert tracker.serving_report(0.41, now=0.0) == pytest.approx(1.2)


def test_a_served_figure_is_sent_again_while_it_holds():
    """The host judges a stage by the best of its last few served reports, so a stage that got
    slower says so again every RESEND_S (and nothing more often than REPORT_INTERVAL_S)."""
    now = time.time()
    tracker = SpeedTracker(cpus=2)
    tracker.observe([batch(now - 30 + i, 1.2, 1.9) for i in range(12)], 22, now=now, n_threads=2)
    assert tracker.serving_report(1.19, now=0.0) is None  # what the host has, and nothing sent yet
    assert tracker.serving_report(0.41, now=0.0) == pytest.approx(1.2)
    assert tracker.serving_report(1.2, now=REPORT_INTERVAL_S) is None
    assert tracker.serving_report(1.2, now=RESEND_S) == pytest.approx(1.2)


# --- item 8: the best of several short runs ---

def loaded_machine_repeat(rng: random.Random, load: float, steps: int = 8) -> Repeat:
    """One short repeat on a loaded 2-core machine: each step either runs undisturbed (0.3 ms)
    or, with probability ``load``, waits for a descheduled thread (10-40x); the repeat's CPU
    share falls with the waits."""
    times = [0.3 * (rng.uniform(10, 40) if rng.random() < load else rng.uniform(1.0, 1.1)) for _ in range(steps)]
    waits = sum(t > 1.0 for t in times) / steps
    wall = sum(times) / 1e3
    return Repeat(statistics.median(times), wall, wall * (2.0 - 1.6 * waits), None, steps, min(times))


def test_probes_on_a_loaded_machine_agree_within_the_band():
    """Twenty probes on a machine whose load comes and goes. One run's median (one burst of
    steps) swings 20x and more from probe to probe; the best of several short repeats stays
    within the noise band the host ignores, so the plan does not change on it."""
    rng = random.Random(11)
    loads = [rng.uniform(0.0, 0.95) for _ in range(20)]
    single = [loaded_machine_repeat(rng, load, 16).ms for load in loads]
    assert max(single) / min(single) > 20
    figures = []
    for load in loads:
        clock = [0.0]

        def repeat():
            clock[0] += 0.05
            return loaded_machine_repeat(rng, load)

        m = collect(repeat, n_threads=2, n_cpus=2, clock=lambda: clock[0], sleep=lambda s: None)
        figures.append(m.ms_per_layer_token)
    assert max(figures) / min(figures) < SPEED_FACTOR, figures


# --- item 7: a claim check that raised ---

def test_a_check_that_raised_is_retried_and_shown(tmp_path):
    """The host's side of a check raised (a module missing while packages were reinstalled): the
    trunk was 'checking its claims' forever and the plan stayed incomplete. Now the reason shows
    in the trunk's health (status and top show it), and the check is tried again with backoff."""
    host = FakeHost(tmp_path, {})
    calls: list[float] = []

    async def challenge(trunk, layers, probe_layer):
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise ModuleNotFoundError("No module named 'kernels.slice'")
        return Outcome(ms_per_layer=0.3, layer=probe_layer, steps=8, runs_ms=[3.0], rtt_ms=0.1)

    async def scenario():
        checks = ClaimChecks(None, host.planning, timings=CheckTimings(retry_first_s=0.05, retry_max_s=1.0))
        checks._challenge = challenge
        conn = SimpleNamespace(peer_name="carol", is_open=True, send=lambda *a, **k: None)
        trunk = host.trunks["carol"] = TrunkInfo(conn=conn, plan_stream=0, listen="127.0.0.1:9", memory=int(2 * GB),
                                                 ms_per_layer_token=0.3)
        checks.at_registration("carol", trunk)
        seen = []
        for _ in range(200):
            await asyncio.sleep(0.01)
            if trunk.check_error:
                seen.append(health(SimpleNamespace(plan=host.planning.plan, trunks=host.trunks, host_name="host",
                                                   online={"carol"}), "carol", False))
            if not trunk.checking:
                break
        checks.close()
        return trunk, seen

    trunk, seen = asyncio.run(scenario())
    assert seen and seen[0].startswith("checking its claims: the check failed 1×")
    assert "ModuleNotFoundError: No module named 'kernels.slice'" in seen[0] and "trying again in" in seen[0]
    assert any("failed 2×" in h for h in seen)
    assert len(calls) == 3 and calls[2] - calls[1] > calls[1] - calls[0]  # backoff: longer each time
    assert not trunk.checking and trunk.check_error == "" and trunk.measured_ms_per_layer == 0.3
    assert host.holders == ["carol"]


def test_status_and_top_show_why_a_check_could_not_be_made():
    """The reason reaches both views through the member's health, the host's word for it."""
    from net.messages import MemberStatus, RecoveryStatus, Status
    from swarmctl.commands.status import format_table
    from swarmctl.monitor.build import RawPoll, SnapshotBuilder

    conn = SimpleNamespace(peer_name="carol", is_open=True)
    trunk = TrunkInfo(conn=conn, plan_stream=0, listen="127.0.0.1:9", memory=int(2 * GB), ms_per_layer_token=0.3,
                      checking=True)
    trunk.check_failed("ModuleNotFoundError: No module named 'kernels.slice'", 2, time.monotonic() + 10)
    said = health(SimpleNamespace(plan=Plan(1, "m", 30, 4), trunks={"carol": trunk}, host_name="host",
                                  online={"carol"}), "carol", False)
    assert said.startswith("checking its claims: the check failed 2× (ModuleNotFoundError")
    assert said.endswith("trying again in 10 s") or said.endswith("trying again in 9 s")
    members = [MemberStatus(name="host", role="host", may="host", address="127.0.0.1:1", health="up (host)"),
               MemberStatus(name="carol", role="trunk", may="trunk", address="127.0.0.1:9", health=said,
                            memory=int(2 * GB))]
    status = Status(swarm="s", model="m.gguf", n_layer=30, head_layers=4, plan_version=1, complete=False,
                    missing_layers=[[4, 26]], members=members, objective="latency", expected_ms_per_token=0.0,
                    expected_tokens_per_s=0.0, bottleneck="", warnings=[], recovery=RecoveryStatus())
    assert said in format_table(status)
    nodes = {n.name: n for n in SnapshotBuilder().add(RawPoll(time.time(), 0.01, status)).nodes}
    assert nodes["carol"].health == said
