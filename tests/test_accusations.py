"""Issue 43 item 4: askers' accusations, I/O-free (the host's handler and checks, fake connections).

Two invites' askers that name an honest stage (``bad_result``, attributed) used to take it out of
the plan at once, on their word, whether or not they had ever sent it a step, and for good while
it stayed connected; reports never aged. Now a report counts only with the accused stage's own
record of the accuser's re-check steps (swarmctl/trunk/one_stage.py), a counted report only makes
the host check the stage itself (swarmctl/host/recheck.py; faked here), only a failed check of the
host's evicts, a refusal ends after its hold, and reports age out.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec

from net import messages as m
from net.wire import FrameDecoder, decode_control
from plans.layout import ModelLayout
from plans.plan import Plan
from swarmctl.asker.verify import Verdict
from swarmctl.host import TrunkInfo
from swarmctl.host.accusations import Accusations
from swarmctl.host.checks import CheckTimings, ClaimChecks
from swarmctl.host.planning import PlanKeeper
from swarmctl.host.recheck import StageCheck
from swarmctl.host.reports import REPORT_WINDOW_S, AskerReports
from swarmctl.trunk.one_stage import MAX_ACCOUNTS, OneStageLedger

GB = 1e9
SMOL = ModelLayout("smol", 30, 576, (4_000_000,) * 30, (1,) * 30, 1024, 0, 0)  # 22 trunk layers
HONEST_ROWS = Verdict(True, 8, 0, 0.0, 1.0)
WRONG_ROWS = Verdict(False, 8, 8, 0.3, 0.95)


def stats_body(name: str, one_stage: dict[str, list[int]]) -> bytes:
    """A trunk's ``stats`` reply as the host reads it (only ``one_stage`` matters here)."""
    return msgspec.json.encode(m.Stats(
        name=name, role="stage", layers=None, expert_range=None, time=0.0, recent_batches=[], requests_detail=[],
        requests=0, routes=0, kv_bytes=0, peak_kv_bytes=0, queue_depth=0, batches=0, steps=0, tokens=0, busy_s=0.0,
        largest_batch=0, tensor_bytes=0, rss=0, peak_rss=0, fetched_bytes=0, expert_rows_served=0,
        expert_call_bytes=0, activation_bytes_sent=0, ms_per_layer_token=None, one_stage=one_stage))


class FakeStage:
    """A trunk's connection to the host: it answers ``stats`` with its record of re-checks."""

    def __init__(self, name: str) -> None:
        self.peer_name, self.is_open = name, True
        self.ledger = OneStageLedger()

    def send(self, *args, **kwargs) -> None:
        pass

    async def request(self, data: bytes, timeout: float = 30.0):
        assert data == m.encode(m.GetStats())
        return SimpleNamespace(body=stats_body(self.peer_name, self.ledger.stats()))


class FakeHost:
    """The host's ``bad_result`` handler over a PlanKeeper of two proven trunks, "honest" and
    "liar", each a stage; ClaimChecks with the host's own re-check faked: the liar's rows come
    back wrong, the honest one's right."""

    def __init__(self, tmp_path, wrong_hold_s: float = 300.0) -> None:
        self.stages = {name: FakeStage(name) for name in ("honest", "liar")}
        self.trunks = {name: TrunkInfo(conn=conn, plan_stream=0, listen=f"127.0.0.1:{i + 1}", memory=int(2 * GB),
                                       ms_per_layer_token=1.0, registered_at=float(i), passed_check=True,
                                       measured_ms_per_layer=1.0)
                       for i, (name, conn) in enumerate(self.stages.items())}
        config = SimpleNamespace(head_layers=4, plan_context=1024, plan_concurrent=4, objective="throughput",
                                 plan_max_stages=0, expert_nodes=0, wire_dtype="f32", kernels="plain")
        home = SimpleNamespace(file=lambda name: tmp_path / name, members=dict)
        self.planning = PlanKeeper(home, config, SMOL, Plan(0, "m", 30, 4), self.trunks)
        self.checked: list[str] = []
        self.checks = ClaimChecks(None, self.planning, stage_check=self._stage_check,
                                  timings=CheckTimings(wrong_hold_s=wrong_hold_s))
        self.checks.measured_speeds.update({name: 1.0 for name in self.trunks})  # (the host timed them)
        self.host = Accusations(self.trunks, self.planning, self.checks, AskerReports())  # the bad_result handler
        self.replies: list[dict] = []  # what the handler answered the accusers, as they read it
        self.planning.replan()
        for stage in self.planning.plan.stages:
            stage.ready = True

    async def _stage_check(self, name: str, trunk: TrunkInfo, stage) -> StageCheck:
        self.checked.append(name)
        verdict = WRONG_ROWS if name == "liar" else HONEST_ROWS
        return StageCheck(verdict, verdict.describe())

    def asker(self, name: str) -> SimpleNamespace:
        """An accuser's connection to the host: the replies it reads land in ``replies``."""
        return SimpleNamespace(peer_name=name, is_open=True, send=lambda sid, data, end=False: self.replies.extend(
            decode_control(frame.body) for frame in FrameDecoder().feed(data)))

    def in_plan(self) -> set[str]:
        return {s.member for s in self.planning.plan.stages}

    def re_checked(self, account: str, name: str) -> None:
        """``account``'s asker sent a re-check step through stage ``name`` (the stage records it)."""
        self.stages[name].ledger.record(account, self.planning.plan.version)

    async def accuse(self, accuser: str, name: str, version: int | None = None) -> list[str]:
        report = m.BadResult(members=[name], attributed=True,
                             plan_version=self.planning.plan.version if version is None else version)
        answered = len(self.replies)
        self.host.bad_result(self.asker(accuser), 0, report)
        for _ in range(100):  # the handler asks the stage for its record, then answers
            if len(self.replies) > answered:
                break
            await asyncio.sleep(0)
        assert len(self.replies) == answered + 1 and self.replies[-1]["type"] == "ok"
        await self.settle()
        return self.replies[-1].get("counted", [])

    async def settle(self) -> None:
        """Let the host's checks run (they are tasks; the fake check never waits)."""
        for _ in range(20):
            await asyncio.sleep(0)


def test_two_invites_framing_an_honest_stage_leave_it_in_the_plan(tmp_path):
    """The issue's scenario: askers of two invites (alice, bob) name the honest stage. Without
    having re-checked it, their word is not even counted; having re-checked it (steps the stage
    recorded), it only makes the host check it, and the host's check passes: it stays."""

    async def scenario():
        host = FakeHost(tmp_path)
        version = host.planning.plan.version
        assert host.in_plan() == {"honest", "liar"}
        out_of_plan = []  # honest members out of the plan, after each report

        for accuser in ("alice", "bob", "alice", "bob"):  # (before: out after bob's first)
            assert await host.accuse(accuser, "honest") == []
            out_of_plan.append(len({"honest"} - host.in_plan()))
        assert host.checked == [] and host.host.reports.reports_on("honest") == 0

        for accuser in ("alice", "bob"):  # now they did send it re-check steps
            host.re_checked(accuser, "honest")
            assert await host.accuse(accuser, "honest") == ["honest"]
            out_of_plan.append(len({"honest"} - host.in_plan()))
        assert host.checked == ["honest"]  # one check of the host's: at most one per member per minute
        for accuser in ("alice", "bob"):  # the same steps back one report each, not more
            assert await host.accuse(accuser, "honest") == []
        assert host.host.reports.reports_on("honest") == 2 and host.host.reports.reporters_of("honest") == 2

        assert host.in_plan() == {"honest", "liar"} and host.planning.plan.version == version
        assert host.trunks["honest"].refused == ""
        assert out_of_plan == [0] * 6
        host.checks.close()

    asyncio.run(scenario())


def test_evidence_names_the_accusers_account_and_plan_version(tmp_path):
    """Steps of another account's, or under another plan version, back nothing; neither does a
    report against a member that is not a stage, or against the accuser itself."""

    async def scenario():
        host = FakeHost(tmp_path)
        host.re_checked("carol", "honest")
        assert await host.accuse("alice", "honest") == []  # carol's steps, not alice's
        host.re_checked("alice", "honest")
        assert await host.accuse("alice", "honest", version=host.planning.plan.version + 7) == []
        assert await host.accuse("honest", "honest") == []
        assert await host.accuse("alice", "nobody") == []
        assert host.checked == [] and host.in_plan() == {"honest", "liar"}
        host.checks.close()

    asyncio.run(scenario())


def test_a_stage_that_returns_wrong_results_to_the_host_is_taken_out(tmp_path):
    """One invite's report with evidence is enough to make the host look; its own check, which
    the liar fails, takes it out."""

    async def scenario():
        host = FakeHost(tmp_path)
        host.re_checked("alice", "liar")
        assert await host.accuse("alice", "liar") == ["liar"]
        assert host.checked == ["liar"]
        assert "returned wrong results to the host's own re-check" in host.trunks["liar"].refused
        assert host.in_plan() == {"honest"}
        host.checks.close()

    asyncio.run(scenario())


def test_a_member_refused_for_wrong_results_is_readmitted_after_its_hold(tmp_path):
    """Connected, it is planned again once the hold is over (before: refused until its owner
    restarted it after the hold); re-registered within the hold, likewise at the hold's end.
    Each further strike holds it twice as long; a passed check clears the strikes."""

    async def scenario():
        host = FakeHost(tmp_path, wrong_hold_s=0.05)
        liar = host.trunks["liar"]
        host.re_checked("alice", "liar")
        assert await host.accuse("alice", "liar") == ["liar"]
        assert liar.refused and host.in_plan() == {"honest"}
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not liar.refused:
                break
        assert liar.refused == "" and host.in_plan() == {"honest", "liar"}

        # a second strike: held 0.1 s; the trunk restarts meanwhile and registers again
        for stage in host.planning.plan.stages:
            stage.ready = True
        host.checks._rechecked.clear()  # (a minute later)
        host.re_checked("alice", "liar")
        assert await host.accuse("alice", "liar") == ["liar"]
        assert host.checks.strikes["liar"][0] == 2 and liar.refused
        again = host.trunks["liar"] = TrunkInfo(conn=host.stages["liar"], plan_stream=0, listen="127.0.0.1:2",
                                                memory=int(2 * GB), ms_per_layer_token=1.0, registered_at=9.0)
        host.checks.at_registration("liar", again)
        assert "left out for" in again.refused and "returned wrong results" in again.refused
        for _ in range(300):
            await asyncio.sleep(0.01)
            if not again.refused:
                break
        assert again.refused == "" and "liar" in {t for t, i in host.trunks.items() if not i.refused}

        host.checks.strikes["honest"] = (1, time.monotonic())
        host.re_checked("bob", "honest")
        for stage in host.planning.plan.stages:
            stage.ready = True
        assert await host.accuse("bob", "honest") == ["honest"]
        assert "honest" not in host.checks.strikes  # passed: forgotten
        host.checks.close()

    asyncio.run(scenario())


def test_reports_age_out():
    now = [1000.0]
    reports = AskerReports(clock=lambda: now[0])
    route = m.BadResult(members=["a", "b"], plan_version=3)
    assert reports.bad_result("alice", route, {"a", "b"}) == ["a", "b"]
    record = {"alice": [1, 3]}
    assert reports.found("alice", "alice", "a", 0.0, m.BadResult(members=["a"], plan_version=3, attributed=True),
                         record)
    assert reports.reports_on("a") == 2 and reports.reporters_of("a") == 1 and reports.found_by("a") == {"alice"}
    now[0] += REPORT_WINDOW_S / 2
    reports.bad_result("bob", route, {"a", "b"})
    assert reports.reports_on("a") == 3 and reports.reporters_of("a") == 2
    now[0] += REPORT_WINDOW_S / 2 + 1  # alice's reports are older than the window now
    assert reports.reports_on("a") == 1 and reports.reporters_of("a") == 1 and reports.found_by("a") == set()
    now[0] += REPORT_WINDOW_S
    assert reports.reports_on("a") == 0 and reports.reports_on("b") == 0


def test_a_stage_record_that_is_not_a_record_backs_nothing():
    reports = AskerReports()
    report = m.BadResult(members=["a"], plan_version=3, attributed=True)
    for junk in ({"alice": "lots"}, {"alice": [True, 3]}, {"alice": [5]}, {"alice": [5, 3, 1]}, [], None):
        assert not reports.found("alice", "alice", "a", 0.0, report, junk)
    assert reports.reports_on("a") == 0


def test_the_stage_ledger_counts_per_account_and_stays_bounded():
    ledger = OneStageLedger()
    ledger.record("alice", 3)
    ledger.record("alice", 4)
    ledger.record("bob", 4)
    assert ledger.stats() == {"alice": [2, 4], "bob": [1, 4]}
    for i in range(MAX_ACCOUNTS + 5):
        ledger.record(f"m{i}", 5)
    assert len(ledger.stats()) == MAX_ACCOUNTS and "alice" not in ledger.stats()


def test_one_report_of_a_member_is_judged_at_a_time(tmp_path):
    """A flood of reports asks the accused stage once per report being judged, not once each."""

    async def scenario():
        host = FakeHost(tmp_path)
        asked = []
        stage = host.stages["honest"]
        answer = asyncio.get_running_loop().create_future()

        async def slow_request(data, timeout=30.0):
            asked.append(data)
            await answer
            return SimpleNamespace(body=stats_body("honest", stage.ledger.stats()))

        stage.request = slow_request
        report = m.BadResult(members=["honest"], attributed=True, plan_version=host.planning.plan.version)
        alice = host.asker("alice")
        for _ in range(50):
            host.host.bad_result(alice, 0, report)
        await host.settle()
        assert len(asked) == 1 and len(host.replies) == 49 and all(r.get("counted") == [] for r in host.replies)
        answer.set_result(None)
        await host.settle()
        assert len(host.replies) == 50 and host.host.reports.judging == set()
        host.checks.close()

    asyncio.run(scenario())
