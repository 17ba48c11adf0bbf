"""Checking what trunks claim (swarmctl/node/layer_proof.py): a trunk becomes a ready stage only once it
proved it holds its layers, and a claimed speed is planned on only once the host timed the trunk
itself, and never faster than it timed it. A trunk that fails a check is left out of the plan. A
trunk that proved nothing yet (no model file to be timed on) does not change a plan that serves:
it proves itself on a trial plan of its own first (planning.py, ``_check_trial``).

A check that could not be made (the host's own side raised: a module missing while packages were
being reinstalled, a file it could not read) is not the trunk's failure: it is tried again, after
``RETRY_FIRST_S``, then twice as long each time up to ``RETRY_MAX_S``, and why it failed shows in
``status`` and ``top`` meanwhile (such a trunk was "checking its claims" forever).

A refusal for a failed check ends: the member is left out for a hold (``FAILED_CHECK_HOLD_S``;
for wrong results ``WRONG_RESULT_HOLD_S``, twice as long at each further strike within
``STRIKES_FORGOTTEN_S``, at most ``WRONG_RESULT_HOLD_MAX_S``), then it is checked again as at
registration and planned as before; connected or re-registered meanwhile alike (
a connected trunk used to stay refused until its owner restarted it).

Wrong results: an asker's accusation, with the evidence reports.py asks for,
only makes the host check the member itself, on the path askers' steps take (recheck.py): at most
one such check at a time, and one per member per ``RECHECK_EVERY_S``. Only rows that come back
wrong from the host's own check take a member out; askers' word alone, from any number of
invites, never does. A check that passes clears the member's strikes."""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Awaitable, Callable, Coroutine

from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from net import clock
from plans.hysteresis import SPEED_FACTOR
from net import messages as m
from net.messages import MS_PER_LAYER
from swarmctl.node import layer_proof

from .planning import PlanKeeper
from .recheck import StageAnswers, StageCheck, check_stage
from .trunks import TrunkInfo

log = logging.getLogger("swarmctl.host")

RECHECK_EVERY_S = 60.0  # a member named by askers' reports is checked again at most this often
FAILED_CHECK_HOLD_S = 300.0  # a member that failed a layer check is left out this long, re-registered or not
WRONG_RESULT_HOLD_S = 300.0  # ... one that returned wrong results to the host's own check: this long at first,
WRONG_RESULT_HOLD_MAX_S = 3600.0  # twice as long at each further strike, up to this
STRIKES_FORGOTTEN_S = 3600.0  # strikes this long after the latest are forgotten
REPROBES = 3  # a claim faster than the host measured is timed again this often, after 10, 20, 40 s
REPROBE_AFTER_S = 10.0
# A timing run takes the member's compute thread for a few 32-step runs: a member that serves is
# timed only once its stage has run no batch for PROBE_IDLE_S, looked at every PROBE_WAIT_S, for at
# most PROBE_WAIT_MAX_S; one that serves all the while is not timed again (its served figures,
# from the batches it runs, are what it claims, and it is planned never faster than the host timed it)
PROBE_IDLE_S = 5.0
PROBE_WAIT_S = 10.0
PROBE_WAIT_MAX_S = 600.0
RETRY_FIRST_S = 5.0  # a check that raised on the host's side is tried again after 5, 10, 20 ... s
RETRY_MAX_S = 300.0


@dataclass(frozen=True)
class CheckTimings:
    """How long the host waits between a trunk's failed checks, holds members out, and waits for a
    serving member's stage to go idle before timing it (tests shorten them)."""

    retry_first_s: float = RETRY_FIRST_S
    retry_max_s: float = RETRY_MAX_S
    failed_hold_s: float = FAILED_CHECK_HOLD_S
    wrong_hold_s: float = WRONG_RESULT_HOLD_S
    probe_wait_s: float = PROBE_WAIT_S
    probe_wait_max_s: float = PROBE_WAIT_MAX_S


class ClaimChecks:
    def __init__(self, gguf: GGUFFile, planning: PlanKeeper, *, timings: CheckTimings = CheckTimings(),
                 stage_check: Callable[[str, TrunkInfo, object], Awaitable[StageCheck]] | None = None,
                 serving: Callable[[TrunkInfo], Awaitable[bool]] | None = None) -> None:
        self.gguf = gguf  # the host's own copy of the layers: the answers are checked against it
        self.planning = planning
        self.retry_first_s, self.retry_max_s = timings.retry_first_s, timings.retry_max_s
        self.failed_hold_s, self.wrong_hold_s = timings.failed_hold_s, timings.wrong_hold_s
        # member → (clock.now() it may be planned again, what it failed): re-registering does not shorten it
        self.held_out: dict[str, tuple[float, str]] = {}
        self.strikes: dict[str, tuple[int, float]] = {}  # member → (wrong-result strikes, clock.now() of the latest)
        self.answers = StageAnswers()  # the stages' answers to the host's own steps (recheck.py)
        self.stage_check = stage_check or self._check_stage  # (tests pass a fake: no sockets, no kernels)
        self.serving = serving or self._serving  # whether a member's stage ran batches lately (tests pass a fake)
        self.probe_wait_s, self.probe_wait_max_s = timings.probe_wait_s, timings.probe_wait_max_s
        self._check_lock = asyncio.Lock()  # one re-check of a stage's results at a time
        self.measured_speeds: dict[str, float] = {}  # member → the fastest the host timed it (kept across rejoins)
        self._timing_lock = asyncio.Lock()  # one speed probe at a time
        # one challenge per trunk at a time: a trunk keeps one probe, and a second check's probe
        # replaced the first's mid-run ("no such probe run": a model-less trunk is checked on its
        # trial layers and, as an expert node, on its experts at once)
        self._challenging: dict[int, asyncio.Lock] = {}
        self._tasks: dict[asyncio.Task, None] = {}  # (cancelled in the order they began, on every run)
        self._rechecked: dict[str, float] = {}  # member → when an askers' report last made us check it

    @property
    def plan(self):
        return self.planning.plan

    def _current(self, name: str, trunk: TrunkInfo) -> bool:
        return self.planning.trunks.get(name) is trunk

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # --- when they happen ---

    def at_registration(self, name: str, trunk: TrunkInfo) -> None:
        """A member that failed a check lately stays out until its hold ends (then it is checked
        as here); one the host timed before keeps that figure; a claimed speed is timed before the
        trunk is planned at all."""
        until, what = self.held_out.get(name, (0.0, ""))
        left = until - clock.now()
        if left > 0:
            trunk.refused = f"{what}: left out for {left:.0f} s more"
            log.warning("trunk %s %s", name, trunk.refused)
            self._spawn(self._hold_ends(name, trunk, trunk.refused, left))
            return
        before = self.measured_speeds.get(name)
        if before is not None:
            trunk.measured_ms_per_layer = before
            if trunk.ms_per_layer_token is not None and trunk.ms_per_layer_token * SPEED_FACTOR <= before:
                self.reprobe(name, trunk)
            return
        trunk.unchecked = True
        if trunk.ms_per_layer_token is not None:  # it has the model file: time it now, plan it after
            trunk.checking = True
            self._spawn(self._retrying(name, trunk, lambda: self._check_registration(name, trunk),
                                       lambda: trunk.checking))

    def when_ready(self, name: str, trunk: TrunkInfo, version: int) -> None:
        """The trunk says it loaded its layers for plan ``version``: check it holds them (and time
        it if the host has not yet) before its stage counts as ready."""
        if trunk.trial is not None and version == trunk.trial[0] and trunk.proving != trunk.trial:
            key = trunk.proving = trunk.trial
            self._spawn(self._retrying(name, trunk, lambda: self._check_trial(name, trunk, key),
                                       lambda: trunk.proving == key and trunk.trial == key))
            return
        plan = self.planning.plan_of(version)  # the plan in use, or the one staged to follow it
        stage = (plan.stage_for(name) or plan.expert_for(name)) if plan is not None else None
        if stage is not None and not stage.ready and trunk.proving != (version, stage.start, stage.stop):
            key = trunk.proving = (version, stage.start, stage.stop)
            self._spawn(self._retrying(name, trunk, lambda: self._check_ready(name, trunk, key),
                                       lambda: trunk.proving == key and self.planning.plan_of(key[0]) is not None))

    def reprobe(self, name: str, trunk: TrunkInfo) -> None:
        """Time a trunk again later: it claims to be faster than the host saw it (another process
        may have had its cores then, or it got faster). At most ``REPROBES`` times, further apart."""
        if trunk.reprobes < REPROBES:
            self._spawn(self._probe_again(name, trunk, REPROBE_AFTER_S * 2 ** trunk.reprobes))
            trunk.reprobes += 1

    def recheck(self, name: str, trunk: TrunkInfo) -> bool:
        """An asker found ``name`` wrong stage by stage (with evidence: reports.py): the host checks
        its stage's results itself (recheck.py), at most once per RECHECK_EVERY_S and one member at
        a time; only rows that come back wrong take it out. Whether a check was started."""
        now = clock.now()
        if now - self._rechecked.get(name, -RECHECK_EVERY_S) < RECHECK_EVERY_S:
            return False
        self._rechecked[name] = now
        self._spawn(self._recheck(name, trunk))
        return True

    # --- the checks ---

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks[task] = None
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("checking a trunk failed: %r", task.exception())

    async def _retrying(self, name: str, trunk: TrunkInfo, check: Callable[[], Awaitable[None]],
                        wanted: Callable[[], bool]) -> None:
        """Run ``check``; where it raises (the host could not make the check, which says nothing
        about the trunk), note why on the trunk, for status, and try again later, for as long as
        the trunk is the one registered and ``wanted()`` says the check is still needed."""
        failures = 0
        while True:
            try:
                await check()
            except Exception as e:  # noqa: BLE001 - any failure of the host's own side is retried
                failures += 1
                delay = min(self.retry_max_s, self.retry_first_s * 2 ** (failures - 1))
                trunk.check_failed(f"{type(e).__name__}: {e}", failures, clock.now() + delay)
                log.warning("checking trunk %s's claims failed (%s, %d time%s): trying again in %.0f s", name,
                            trunk.check_error, failures, "" if failures == 1 else "s", delay)
                await asyncio.sleep(delay)
                if self._current(name, trunk) and not trunk.refused and wanted():
                    continue
                if trunk.proving is not None and not wanted():
                    trunk.proving = None
            trunk.check_error = ""
            return

    async def _challenge(self, trunk: TrunkInfo, layers: list[int], probe_layer: int | None,
                         experts: tuple[int, int] | None = None) -> layer_proof.Outcome:
        async with self._challenging.setdefault(id(trunk), asyncio.Lock()):
            return await layer_proof.challenge(trunk.conn, self.gguf, layers, probe_layer=probe_layer,
                                               claimed_ms=trunk.ms_per_layer_token, timing_lock=self._timing_lock,
                                               experts=experts)

    async def _check_registration(self, name: str, trunk: TrunkInfo) -> None:
        lo, hi = self.plan.trunk_range
        layer = lo + secrets.randbelow(hi - lo)
        outcome = await self._challenge(trunk, [layer], layer)
        if not self._current(name, trunk):
            return
        trunk.checking = False
        if outcome.problem:
            self._failed(name, trunk, outcome.problem)  # (it was not planned: nothing to re-plan)
            return
        if outcome.missing:  # e.g. a slice file only: timed on its own layers once it says ready
            log.info("trunk %s could not be timed yet (%s): planned with the others' figure", name, outcome.missing)
        else:
            self._took_measurement(name, trunk, outcome)
        self.planning.rebase(name)
        self.planning.replan()

    async def _check_ready(self, name: str, trunk: TrunkInfo, key: tuple[int, int, int]) -> None:
        version, start, stop = key
        plan = self.planning.plan_of(version) or self.plan
        expert = plan.expert_for(name) is not None
        # an expert node holds its experts of the MoE layers (maybe nothing else: a fetched file)
        layers = [il for il in range(*plan.trunk_range) if ModelSpec.from_gguf(self.gguf).is_moe_layer(il)] if expert \
            else list(range(start, stop))
        probe = layers[secrets.randbelow(len(layers))] if trunk.measured_ms_per_layer is None and not expert else None
        outcome = await self._challenge(trunk, layers, probe, (start, stop) if expert else None)
        if trunk.proving == key:
            trunk.proving = None
        if not self._current(name, trunk):
            return
        plan = self.planning.plan_of(version)  # (the staged plan may have been published or dropped meanwhile)
        current = (plan.stage_for(name) or plan.expert_for(name)) if plan is not None else None
        same = current is not None and (current.start, current.stop) == (start, stop)
        # A plan that moved meanwhile excuses "not held" (the trunk may have loaded other layers
        # since) and, once between two passed checks, a late answer; a wrong answer never.
        excused = not same and (outcome.missing or (outcome.timed_out and not trunk.excused))
        if excused:
            trunk.excused = trunk.excused or outcome.timed_out
        elif outcome.problem or outcome.missing:
            self._failed(name, trunk, outcome.problem or
                         f"said it was ready with layers it does not hold ({outcome.missing})")
            self.planning.replan()
            return
        if outcome.ms_per_layer is not None:
            self._took_measurement(name, trunk, outcome)
        if not same or excused:
            return  # the plan moved on: the trunk confirms the new one, and is checked again
        current.ready = True
        trunk.excused, trunk.passed_check = False, True
        log.info("trunk %s ready with %s [%d, %d)%s (layer check: %d bytes, %.1f ms)", name,
                 "experts" if expert else "layers", start, stop, " for staged plan v%d" % version if plan.staged else "",
                 outcome.bytes_read, outcome.proof_ms)
        self.planning.stage_ready()
        if outcome.ms_per_layer is not None:
            self._plan_speed(name, trunk)

    async def _check_trial(self, name: str, trunk: TrunkInfo, key: tuple[int, int, int]) -> None:
        """A trunk that proved nothing loaded the layers of its trial plan (planning.py): it must
        hold them and be timed on one before it is planned."""
        _, start, stop = key
        layers = list(range(start, stop))
        outcome = await self._challenge(trunk, layers, layers[secrets.randbelow(len(layers))])
        if trunk.proving == key:
            trunk.proving = None
        if not self._current(name, trunk) or trunk.trial != key:
            return
        trunk.trial = None
        if outcome.problem or outcome.missing or outcome.ms_per_layer is None:
            self._failed(name, trunk, outcome.problem or f"said it loaded its trial layers but does not hold "
                                                         f"them ({outcome.missing or 'not timed'})")
            return  # (it was never planned: nothing to re-plan)
        self._took_measurement(name, trunk, outcome)
        trunk.passed_check = True
        log.info("trunk %s proved its trial layers [%d, %d) (layer check: %d bytes, %.1f ms): planned from now on",
                 name, start, stop, outcome.bytes_read, outcome.proof_ms)
        self.planning.rebase(name)
        self.planning.replan(also_send_to=name)  # (the plan in use, also if it does not change)

    async def _recheck(self, name: str, trunk: TrunkInfo) -> None:
        async with self._check_lock:
            stage = self.plan.stage_for(name)
            if stage is None or not self._current(name, trunk) or trunk.refused:
                return
            outcome = await self.stage_check(name, trunk, stage)
        if not self._current(name, trunk) or trunk.refused:
            return
        if outcome.wrong:
            self._wrong_results(name, trunk, outcome.why)
        elif outcome.passed:
            self.strikes.pop(name, None)
            log.info("trunk %s passed the host's re-check of its stage [%d, %d) (%s): it stays", name,
                     stage.start, stage.stop, outcome.why)
        else:
            log.warning("the host could not re-check trunk %s's stage: %s (nothing changes)", name, outcome.why)

    async def _check_stage(self, name: str, trunk: TrunkInfo, stage) -> StageCheck:
        return await check_stage(self.gguf, self.answers, trunk.conn, self.plan, stage)

    async def _probe_again(self, name: str, trunk: TrunkInfo, delay: float) -> None:
        await asyncio.sleep(delay)
        waited = 0.0
        while self._current(name, trunk) and not trunk.refused and await self.serving(trunk):
            if waited >= self.probe_wait_max_s:
                log.info("trunk %s served throughout the last %.0f s: not timed again (it is planned from what "
                         "it serves, never faster than the host timed it)", name, waited)
                return
            await asyncio.sleep(self.probe_wait_s)
            waited += self.probe_wait_s
        if not self._current(name, trunk) or trunk.refused:
            return
        stage = self.plan.stage_for(name)
        lo, hi = (stage.start, stage.stop) if stage is not None else self.plan.trunk_range
        layer = lo + secrets.randbelow(hi - lo)
        outcome = await self._challenge(trunk, [layer], layer)
        if not self._current(name, trunk) or trunk.refused:
            return
        if outcome.problem and not outcome.timed_out:  # (a busy trunk may answer late; a wrong answer is a lie)
            self._failed(name, trunk, outcome.problem)
            self.planning.replan()
        elif outcome.ms_per_layer is not None:
            self._took_measurement(name, trunk, outcome)
            self._plan_speed(name, trunk)

    async def _serving(self, trunk: TrunkInfo) -> bool:
        """Whether the member's stage is serving: it ran a batch in the last PROBE_IDLE_S, or steps
        wait there (its own stats). One that cannot say counts as idle: the timing run finds out."""
        try:
            reply = await trunk.conn.request(m.encode(m.GetStats()), timeout=5.0)
            return stage_serving(m.decode(reply.body, m.Stats))
        except Exception as e:  # noqa: BLE001 - any failure to answer: the challenge itself will tell
            log.debug("asking a trunk whether it serves failed: %r", e)
            return False

    # --- what the checks found ---

    def _took_measurement(self, name: str, trunk: TrunkInfo, outcome: layer_proof.Outcome) -> None:
        figure = max(outcome.ms_per_layer, MS_PER_LAYER[0])
        if trunk.measured_ms_per_layer is None or figure < trunk.measured_ms_per_layer:
            trunk.measured_ms_per_layer = figure  # interference only adds time: the fastest is the machine's
        self.measured_speeds[name] = trunk.measured_ms_per_layer
        trunk.unchecked = False
        log.info("trunk %s timed by the host on layer %d: %.3f ms per layer (%d steps, runs %s ms, round trip "
                 "%.2f ms; it claims %s): planned with %.3f", name, outcome.layer, figure, outcome.steps,
                 "/".join(f"{ms:.1f}" for ms in outcome.runs_ms), outcome.rtt_ms or 0.0,
                 f"{trunk.ms_per_layer_token:.3f}" if trunk.ms_per_layer_token else "nothing", trunk.planning_speed)
        if trunk.ms_per_layer_token is not None and trunk.ms_per_layer_token * SPEED_FACTOR <= trunk.measured_ms_per_layer:
            self.reprobe(name, trunk)

    def _plan_speed(self, name: str, trunk: TrunkInfo) -> None:
        """A new planning figure from the host's own timing: adopted and re-planned on as a claimed
        one would be (plans/hysteresis.py)."""
        figure = trunk.planning_speed
        if figure is None or not self._current(name, trunk) or trunk.refused or trunk.checking:
            return
        self.planning.consider_speed(name, figure, " as timed")

    def _wrong_results(self, name: str, trunk: TrunkInfo, why: str) -> None:
        now = clock.now()
        strikes, latest = self.strikes.get(name, (0, now))
        strikes = 1 if now - latest > STRIKES_FORGOTTEN_S else strikes + 1
        self.strikes[name] = (strikes, now)
        hold = min(WRONG_RESULT_HOLD_MAX_S, self.wrong_hold_s * 2 ** (strikes - 1))
        self._failed(name, trunk, f"returned wrong results to the host's own re-check ({why})", hold,
                     what="returned wrong results to the host's own re-check")
        self.planning.replan()

    def _failed(self, name: str, trunk: TrunkInfo, problem: str, hold_s: float | None = None,
                what: str = "failed a layer check") -> None:
        """Leave ``name`` out of the plan for ``hold_s`` (FAILED_CHECK_HOLD_S unless said)."""
        hold_s = self.failed_hold_s if hold_s is None else hold_s
        trunk.refused = problem[:300]
        self.held_out[name] = (clock.now() + hold_s, what)
        log.warning("trunk %s %s: left out of the plan for %.0f s", name, trunk.refused, hold_s)
        self._spawn(self._hold_ends(name, trunk, trunk.refused, hold_s))

    async def _hold_ends(self, name: str, trunk: TrunkInfo, refusal: str, hold_s: float) -> None:
        await asyncio.sleep(hold_s)
        self.readmit(name, trunk, refusal)

    def readmit(self, name: str, trunk: TrunkInfo, refusal: str) -> None:
        """The hold of a refusal for a failed check is over: a trunk still connected and refused
        for that reason (not another since) is planned again; one that registered during the hold
        is checked first, as at registration. Its stage counts once it proves its layers again;
        should it still return wrong results, askers' reports bring the host's check back to it."""
        if not self._current(name, trunk) or trunk.refused != refusal:
            return
        until, _ = self.held_out.get(name, (0.0, ""))
        if until > clock.now():  # (refused again meanwhile: that hold's own task readmits it)
            return
        self.held_out.pop(name, None)
        trunk.refused = ""
        log.info("trunk %s: its hold is over; planned again%s", name,
                 "" if trunk.proven else ", once checked as at registration")
        if not trunk.proven:  # (re-registered during the hold: nothing was checked yet)
            self.at_registration(name, trunk)
        self.planning.rebase(name)
        self.planning.replan(also_send_to=name)


def stage_serving(stats: m.Stats, idle_s: float = PROBE_IDLE_S) -> bool:
    """A stage serves while steps wait at it or it began a batch within ``idle_s`` of its snapshot."""
    return stats.queue_depth > 0 or any(stats.time - batch[0] < idle_s for batch in stats.recent_batches)
